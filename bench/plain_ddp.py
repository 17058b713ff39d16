"""The recovery benchmark's baseline: the demo job as a plain DDP script for ``torchrun``.

Same model, data, optimizer, schedule and step body as ``undying/demo/train.py``
(a seeded regression MLP with dropout, SGD with momentum, StepLR, the job-wide
mean loss all-reduced every step), with no undying import. Fault tolerance is
the classic kind: rank 0 saves a checkpoint every ``--checkpoint-every`` steps
(written to a temporary file, fsynced, then renamed, so a reader never sees a
partial one), and every rank resumes from the latest checkpoint when it starts.
Run it with::

    torchrun --standalone --nproc-per-node 4 --max-restarts 3 bench/plain_ddp.py --run-dir DIR

It writes to ``DIR``, one JSON object per line:

* ``steps.rank<R>.jsonl``: ``{"event": "start", "attempt", "pid", "t"}`` once Python
  and torch are loaded, ``{"event": "ready", "attempt", "resumed_from", "t"}`` once the
  process group is up and the checkpoint loaded, then ``{"event": "step", "attempt",
  "step", "t", "loss"}`` for every completed step (``t``: ``time.time()`` after the
  optimizer step);
* ``kill.json``: ``{"rank", "step", "attempt", "t"}``, written just before the
  process SIGKILLs itself at the start of step ``--kill-at-step`` on rank
  ``--kill-rank``, in the first attempt only (``TORCHELASTIC_RESTART_COUNT`` == 0).

``--faults FILE`` (bench/goodput.py) replays a schedule instead: a JSON list of
``{"kind", "rank", "step"}``, each fault done once (a file ``fired-<i>-r<R>``,
created exclusively, says it was), at the start of its step on its rank, and
logged first in ``faults.rank<R>.jsonl`` (``{"i", "kind", "step", "attempt", "t"}``):

* ``crash-hw``, ``crash-sw``: SIGKILL of the process;
* ``comm-error``: the collective fails (a ``RuntimeError``, as gloo raises on a
  broken connection): the process exits 1;
* ``hang``: the process sleeps for ever; its peers' next collective times out
  after ``--collective-timeout`` seconds and fails them;
* ``bitflip``: the top mantissa bit of the largest value of the rank's local
  gradient of the last layer's weight flipped in that step's backward, before
  DDP's all-reduce (the job goes on, silently wrong: nothing here checks it);
* ``preempt`` (every rank): rank 0 saves a checkpoint of the steps done, every
  rank meets at a barrier and exits 0, so torchrun exits 0 and the driver
  launches the job again (a planned stop with notice, at a step boundary).

``BENCH_LAUNCH`` (the driver's launch number, from 0) makes the attempt
``100 x launch + TORCHELASTIC_RESTART_COUNT``. Rank 0 writes ``done.json`` once
the last step is done.

Steps are numbered from 1, as undying numbers them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

CHECKPOINT = "checkpoint.pt"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="plain DDP + periodic checkpoints (recovery benchmark)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--samples", type=int, default=1024)
    p.add_argument("--features", type=int, default=32)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--run-dir", type=Path, required=True, help="records and checkpoints go here")
    p.add_argument("--checkpoint-every", type=int, default=10,
                   help="steps between checkpoints (0: never)")
    p.add_argument("--kill-at-step", type=int, default=0,
                   help="SIGKILL a rank at the start of this step (0: never)")
    p.add_argument("--kill-rank", type=int, default=2, help="the rank that --kill-at-step kills")
    p.add_argument("--step-seconds", type=float, default=0.0,
                   help="a step lasts at least this (a sleep after its work), as the demo's")
    p.add_argument("--faults", type=Path, default=None,
                   help="a schedule of faults to replay (JSON list of {kind, rank, step})")
    p.add_argument("--collective-timeout", type=float, default=1800.0,
                   help="seconds before a collective waiting on a peer fails (gloo's default)")
    return p.parse_args()


def build_data(args: argparse.Namespace) -> TensorDataset:
    """The demo's data: a seeded noisy tanh regression."""
    data = torch.Generator().manual_seed(99)
    x = torch.randn(args.samples, args.features, generator=data)
    w = torch.randn(args.features, 1, generator=data)
    y = torch.tanh(x @ w) + 0.1 * torch.randn(args.samples, 1, generator=data)
    return TensorDataset(x, y)


def build_model(args: argparse.Namespace) -> nn.Module:
    """The demo's model: ``--layers`` x (Linear, ReLU, Dropout(0.1)), then Linear to 1."""
    layers: list[nn.Module] = []
    width = args.features
    for _ in range(args.layers):
        layers += [nn.Linear(width, args.hidden), nn.ReLU(), nn.Dropout(0.1)]
        width = args.hidden
    return nn.Sequential(*layers, nn.Linear(width, 1))


def save_checkpoint(path: Path, step: int, model: nn.Module, optimizer: Any,
                    scheduler: Any) -> None:
    """Write atomically: a temporary file, fsynced, renamed over the previous checkpoint."""
    tmp = path.with_suffix(".tmp")
    state = {"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
             "scheduler": scheduler.state_dict()}
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_checkpoint(path: Path, model: nn.Module, optimizer: Any, scheduler: Any) -> int:
    """Restore the latest checkpoint if there is one; returns the step it holds (0: none)."""
    if not path.exists():
        return 0
    state = torch.load(path, map_location="cpu")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    return int(state["step"])


def record(log: IO[str], **fields: Any) -> None:
    """Append one JSON line and hand it to the kernel (a SIGKILL after this cannot lose it)."""
    log.write(json.dumps(fields) + "\n")
    log.flush()


def kill_self(run_dir: Path, rank: int, step: int, attempt: int) -> None:
    """Log the kill time, then SIGKILL this process: the fault the benchmark injects."""
    with open(run_dir / "kill.json", "w") as f:
        json.dump({"rank": rank, "step": step, "attempt": attempt, "t": time.time()}, f)
        f.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def take(run_dir: Path, index: int, rank: int) -> bool:
    """True once per (fault, rank): the marker file is created exclusively."""
    try:
        os.close(os.open(run_dir / f"fired-{index}-r{rank}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def flip_hook(grad: torch.Tensor) -> torch.Tensor:
    """The top mantissa bit of the largest value flipped: finite, no spike, silently wrong."""
    flipped = grad.clone()
    flat = flipped.view(-1)
    at = int(flat.abs().argmax())
    bits = flat[at:at + 1].view(torch.int32)
    bits ^= 1 << 22
    return flipped


def arm_flip(model: nn.Module) -> None:
    """Flip (``flip_hook``) the next local gradient of the last layer's weight, once, before
    DDP's all-reduce sees it (a tensor hook runs before the gradient is accumulated)."""
    last = [m for m in model.modules() if isinstance(m, nn.Linear)][-1]
    handles: list[torch.utils.hooks.RemovableHandle] = []

    def once(grad: torch.Tensor) -> torch.Tensor:
        handles.pop().remove()
        return flip_hook(grad)
    handles.append(last.weight.register_hook(once))


def fire(faults: list[dict[str, Any]], step: int, rank: int, attempt: int, run_dir: Path,
         model: nn.Module, optimizer: Any, scheduler: Any) -> None:
    """Do the schedule's faults due at the start of ``step`` on this rank (module doc)."""
    for index, fault in enumerate(faults):
        kind = fault["kind"]
        if fault["step"] != step or (kind != "preempt" and fault["rank"] != rank):
            continue
        if not take(run_dir, index, rank):
            continue
        with open(run_dir / f"faults.rank{rank}.jsonl", "a") as f:
            f.write(json.dumps({"i": index, "kind": kind, "step": step, "attempt": attempt,
                                "t": time.time()}) + "\n")
        if kind in ("crash-hw", "crash-sw"):
            os.kill(os.getpid(), signal.SIGKILL)
        elif kind == "comm-error":
            raise RuntimeError(f"injected communication error on rank {rank} at step {step}")
        elif kind == "hang":
            while True:
                time.sleep(3600)
        elif kind == "bitflip":
            arm_flip(model)
        elif kind == "preempt":
            if rank == 0 and step > 1:
                save_checkpoint(run_dir / CHECKPOINT, step - 1, model, optimizer, scheduler)
            dist.barrier()
            dist.destroy_process_group()
            sys.exit(0)


def main() -> None:
    args = parse_args()
    rank = int(os.environ["RANK"])
    attempt = (100 * int(os.environ.get("BENCH_LAUNCH", "0"))
               + int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
    faults = json.loads(args.faults.read_text()) if args.faults is not None else []
    args.run_dir.mkdir(parents=True, exist_ok=True)
    log = open(args.run_dir / f"steps.rank{rank}.jsonl", "a")  # noqa: SIM115 (open for the whole run)
    record(log, event="start", attempt=attempt, pid=os.getpid(), t=time.time())
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.collective_timeout))
    world_size = dist.get_world_size()

    torch.manual_seed(1234)
    dataset = build_data(args)
    sampler: DistributedSampler[Any] = DistributedSampler(dataset, seed=7)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
    model = build_model(args)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.9)
    checkpoint = args.run_dir / CHECKPOINT
    resumed = load_checkpoint(checkpoint, model, optimizer, scheduler)
    ddp = DistributedDataParallel(model)  # a collective: every rank is up and restored
    record(log, event="ready", attempt=attempt, resumed_from=resumed, t=time.time())

    steps_per_epoch = len(loader)
    step = resumed
    for epoch in range(resumed // steps_per_epoch, args.epochs):
        sampler.set_epoch(epoch)
        for index, (inputs, targets) in enumerate(loader):
            if epoch * steps_per_epoch + index < resumed:
                continue  # batches the checkpoint already trained on
            step += 1
            if step == args.kill_at_step and rank == args.kill_rank and attempt == 0:
                kill_self(args.run_dir, rank, step, attempt)
            if faults:
                fire(faults, step, rank, attempt, args.run_dir, model, optimizer, scheduler)
            started = time.monotonic()
            loss = F.mse_loss(ddp(inputs), targets)
            mean_loss = loss.detach().clone()
            dist.all_reduce(mean_loss)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            time.sleep(max(0.0, args.step_seconds - (time.monotonic() - started)))
            record(log, event="step", attempt=attempt, step=step, t=time.time(),
                   loss=(mean_loss / world_size).item())
            if rank == 0 and args.checkpoint_every > 0 and step % args.checkpoint_every == 0:
                save_checkpoint(checkpoint, step, model, optimizer, scheduler)
    log.close()
    if rank == 0:
        (args.run_dir / "done.json").write_text(json.dumps({"step": step, "t": time.time()}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
