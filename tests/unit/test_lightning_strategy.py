"""UndyingStrategy outside ``undying run`` (undying.worker.lightning), with the real Lightning.

In one process of its own (Lightning makes a process group of one): a BoringModel trains to its
end, unmanaged, as under plain ``python``; and each loop the step transaction cannot cover is
refused as ``fit`` starts, in one line that names what to change. The recovery itself is
tests/integration/test_lightning.py.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("lightning")

SCRIPT = textwrap.dedent("""
    import torch
    import lightning.pytorch as pl
    from lightning.pytorch.demos.boring_classes import BoringModel
    from undying.errors import UsageError
    from undying.worker.lightning import UndyingStrategy

    class Manual(BoringModel):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

    class Lbfgs(BoringModel):
        def configure_optimizers(self):
            return torch.optim.LBFGS(self.parameters())

    cases = [("plain", BoringModel, {}), ("accumulate", BoringModel, {"accumulate_grad_batches": 2}),
             ("manual", Manual, {}), ("lbfgs", Lbfgs, {}), ("endless", BoringModel, {"max_epochs": -1})]
    for name, model, extra in cases:
        options = dict(accelerator="cpu", devices=1, strategy=UndyingStrategy(), max_epochs=1,
                       limit_train_batches=3, limit_val_batches=0, logger=False,
                       enable_checkpointing=False, enable_progress_bar=False,
                       enable_model_summary=False)
        options.update(extra)
        trainer = pl.Trainer(**options)
        try:
            trainer.fit(model())
        except UsageError as e:
            print(name, "refused:", e, flush=True)
        else:
            print(name, "trained:", trainer.global_step, flush=True)
""")


def test_it_trains_unmanaged_and_refuses_what_its_transaction_cannot_cover() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=300)
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    assert lines.get("plain") == "trained: 3", done.stdout + done.stderr[-3000:]
    assert lines["accumulate"] == ("refused: UndyingStrategy needs accumulate_grad_batches=1 (got 2): "
                                   "the batches accumulated before a fault would be lost")
    assert lines["manual"].startswith("refused: UndyingStrategy needs automatic optimization")
    assert lines["lbfgs"].startswith("refused: UndyingStrategy runs the closure once per step")
    assert lines["endless"] == ("refused: UndyingStrategy needs a run of known length (max_epochs or "
                                "max_steps); the Trainer plans inf steps")
