"""The seeded job behind ``undying demo`` (``train.py``), also used by tests and benchmarks.

With it, what runs and judges a demo: ``oracle`` (a run with a fault against
one without, from their event logs), ``cluster`` and ``hosts`` (a multi-host
job on network namespaces) and ``node_loss`` (the node-loss demo). This
package sits on top, beside ``cli``: it may use every role, no role uses it.
"""

from pathlib import Path

TRAIN_SCRIPT = Path(__file__).with_name("train.py")

__all__ = ["TRAIN_SCRIPT"]
