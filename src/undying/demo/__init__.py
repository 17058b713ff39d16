"""The seeded job behind ``undying demo`` (``train.py``), also used by tests and benchmarks."""

from pathlib import Path

TRAIN_SCRIPT = Path(__file__).with_name("train.py")

__all__ = ["TRAIN_SCRIPT"]
