"""Lightning's own BoringModel, trained by Lightning's Trainer with undying's strategy.

Run by tests/integration/test_lightning.py under ``undying run -n 2``. The script sets up
logging as hydra does (a handler of its own on the root logger, here into ``--out``), and
leaves there what the test reads: each process's root log and its title
(``/proc/self/cmdline``).
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.demos.boring_classes import BoringModel

from undying.worker.lightning import UndyingStrategy

parser = argparse.ArgumentParser()
parser.add_argument("--out", type=Path, required=True)
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--batches", type=int, default=8)
args = parser.parse_args()
args.out.mkdir(parents=True, exist_ok=True)
me = f"{os.environ.get('RANK', '?')}-{os.getpid()}"
logging.basicConfig(level=logging.DEBUG, force=True, format="%(name)s: %(message)s",
                    handlers=[logging.FileHandler(args.out / f"root-{me}.log")])
(args.out / f"title-{me}").write_bytes(Path("/proc/self/cmdline").read_bytes())

pl.seed_everything(7)
trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=UndyingStrategy(),
                     max_epochs=args.epochs, limit_train_batches=args.batches,
                     limit_val_batches=0, num_sanity_val_steps=0, logger=False,
                     default_root_dir=args.out / "lightning", enable_progress_bar=False,
                     enable_model_summary=False)
trainer.fit(BoringModel())
