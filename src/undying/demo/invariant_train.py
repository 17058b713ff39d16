"""The demo job in invariant mode: V virtual ranks, the same losses on any number of physical ranks.

Run it with ``undying run -n 2 --virtual-ranks 4 invariant_train.py``. It is
``train.py``'s model (an MLP with dropout, SGD with momentum, a step LR
schedule), but each virtual rank reads its own slice of the data (a
``DistributedSampler`` of ``V`` replicas, built by the loader factory) and
draws its own dropout masks; each step logs the mean loss over the ``V``
virtual ranks. The per-step losses are bit-identical on 1, 2, 3 or 4 ranks,
and across a shrink or a grow.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import undying


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--features", type=int, default=32)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--step-seconds", type=float, default=0.0,
                   help="make every step last at least this long on every rank (a slow job, not a "
                   "hang)")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    job = undying.init()

    torch.manual_seed(1234)
    data = torch.Generator().manual_seed(99)
    x = torch.randn(args.samples, args.features, generator=data)
    w = torch.randn(args.features, 1, generator=data)
    y = torch.tanh(x @ w) + 0.1 * torch.randn(args.samples, 1, generator=data)
    dataset = TensorDataset(x, y)

    def loader(v: int, count: int) -> DataLoader:
        """Virtual rank v's slice of every global batch: what physical rank v of a V-rank job
        reads."""
        sampler: DistributedSampler[tuple[torch.Tensor, ...]] = DistributedSampler(
            dataset, num_replicas=count, rank=v, seed=7)
        return DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)

    model = nn.Sequential(nn.Linear(args.features, args.hidden), nn.ReLU(), nn.Dropout(0.1),
                          nn.Linear(args.hidden, args.hidden), nn.ReLU(), nn.Dropout(0.1),
                          nn.Linear(args.hidden, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.9)

    ddp = job.ddp(model)
    state = job.state(model=model, optimizer=optimizer, scheduler=scheduler, loader=loader)
    for step in job.steps(state, epochs=args.epochs):
        with step:
            started = time.monotonic()
            for v in step.virtual_ranks():
                inputs, targets = v.batch
                loss = F.mse_loss(ddp(inputs), targets)
                loss.backward()
                v.log(loss=loss)
            # the gradients are the mean over the V virtual ranks, folded in their order
            optimizer.step()
            scheduler.step()
            time.sleep(max(0.0, args.step_seconds - (time.monotonic() - started)))


if __name__ == "__main__":
    main()
