"""The loops people write, in one small script: flags pick each habit (the test runs it under undying).

A next-token model over a token corpus, 2 ranks on CPU. ``--batches loader``
takes batches from a DataLoader with a DistributedSampler (``step.batch``);
``--batches draw`` draws them itself, nanoGPT style, from an ``np.memmap``
token file (``get_batch``) with torch's random state, which undying derives
from the step. Around that: gradient accumulation with ``no_sync`` on all
but the last micro-batch, ``torch.autocast`` (bfloat16) with a GradScaler
(whose state is in job.state; ``--inf-at`` makes one step's gradients inf,
a step the scaler skips), the learning rate computed from the step, gradient
clipping, an EMA copy of the model, evaluation every N steps outside the step
(not a training step), logging on rank 0 only, and plain variables kept in a
dict in job.state. Two habits break identical recovery, on purpose, for the
test that shows they are detected: ``--data unseeded`` (a dataset from an
unseeded generator) and ``--fetch prefetch`` (the next batch fetched at the
end of a step); and ``--lossy-load``, a layer whose ``load_state_dict``
restores nothing, breaks the state a replacement receives.
"""

import argparse
import contextlib
import copy
import math

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import undying

p = argparse.ArgumentParser()
p.add_argument("--data", choices=("seeded", "unseeded"), default="seeded")
p.add_argument("--batches", choices=("loader", "draw"), default="draw")
p.add_argument("--fetch", choices=("inside", "prefetch"), default="inside")
p.add_argument("--tokens", default="", help="the np.memmap token file (uint16) for --batches draw")
p.add_argument("--steps", type=int, default=12)
p.add_argument("--accum", type=int, default=1)
p.add_argument("--amp", action="store_true")
p.add_argument("--inf-at", type=int, default=0, help="make this step's gradients inf (the scaler skips it)")
p.add_argument("--eval-every", type=int, default=0)
p.add_argument("--compile", action="store_true")
p.add_argument("--lossy-load", action="store_true", help="a layer whose load_state_dict restores nothing")
args = p.parse_args()

VOCAB, BLOCK, BATCH = 64, 8, 4
job = undying.init()
rank, world = job.rank, job.world_size

if args.batches == "loader":
    if args.data == "unseeded":
        corpus = torch.from_numpy(np.random.default_rng().integers(0, VOCAB, 2048))  # OS entropy: each process its own
    else:
        corpus = torch.randint(0, VOCAB, (2048,))  # undying.init() seeded torch: every process the same
    windows = corpus[: 2048 - 2048 % (BLOCK + 1)].view(-1, BLOCK + 1)
    dataset = TensorDataset(windows[:, :-1].contiguous(), windows[:, 1:].contiguous())
    loader = DataLoader(dataset, batch_size=BATCH, sampler=DistributedSampler(dataset))
else:
    loader = None
    tokens = np.memmap(args.tokens, dtype=np.uint16, mode="r")


def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
    ix = torch.randint(len(tokens) - BLOCK - 1, (BATCH,))
    x = torch.stack([torch.from_numpy(tokens[i:i + BLOCK].astype(np.int64)) for i in ix.tolist()])
    y = torch.stack([torch.from_numpy(tokens[i + 1:i + 1 + BLOCK].astype(np.int64)) for i in ix.tolist()])
    return x, y


class Forgetful(nn.Linear):
    """A layer whose load_state_dict keeps what it has: a state that does not survive a transfer."""

    def _load_from_state_dict(self, *args: object, **kwargs: object) -> None:
        pass


hidden = Forgetful(32, 32) if args.lossy_load else nn.Linear(32, 32)
model = nn.Sequential(nn.Embedding(VOCAB, 32), hidden, nn.GELU(), nn.Linear(32, VOCAB))
ema = copy.deepcopy(model)
ddp = job.ddp(torch.compile(model) if args.compile else model)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
scaler = torch.amp.GradScaler("cpu", enabled=args.amp)
run = {"iter_num": 0, "best_val": 1e9, "tokens_seen": 0}
val = torch.Generator().manual_seed(1)
val_x, val_y = torch.randint(0, VOCAB, (8, BLOCK), generator=val), torch.randint(0, VOCAB, (8, BLOCK), generator=val)


def get_lr(it: int) -> float:
    warmup = 3
    if it < warmup:
        return 1e-2 * (it + 1) / warmup
    return 1e-3 + 0.5 * (1e-2 - 1e-3) * (1 + math.cos(math.pi * min(1.0, (it - warmup) / args.steps)))


state = job.state(model=model, optimizer=optimizer, loader=loader, scaler=scaler, ema=ema, run=run)
if args.fetch == "prefetch":
    X, Y = get_batch()
for step in job.steps(state, total=args.steps):
    with step:
        for group in optimizer.param_groups:
            group["lr"] = get_lr(step.index)
        total = 0.0
        for micro in range(args.accum):
            if args.batches == "loader":
                X, Y = step.batch
            elif args.fetch == "inside":
                X, Y = get_batch()
            step.uses(X, Y)
            sync = contextlib.nullcontext() if micro == args.accum - 1 else ddp.no_sync()
            with sync:
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.amp):
                    loss = F.cross_entropy(ddp(X).float().view(-1, VOCAB), Y.view(-1)) / args.accum
                if step.index == args.inf_at:
                    loss = loss * math.inf
                scaler.scale(loss).backward()
            total += loss.item()
            if args.fetch == "prefetch":
                X, Y = get_batch()  # the next batch, drawn now: at the end of this step's random stream
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for e, q in zip(ema.parameters(), model.parameters(), strict=True):
                e.mul_(0.9).add_(q, alpha=0.1)
        run["iter_num"] = step.index
        run["tokens_seen"] += X.numel() * args.accum * world
        mean = torch.tensor([total])
        dist.all_reduce(mean)
        if rank == 0:
            step.log(loss=mean / world, scale=scaler.get_scale() if args.amp else 1.0, best_val=run["best_val"],
                     tokens=run["tokens_seen"])
    if step.committed and args.eval_every and step.index % args.eval_every == 0:
        model.eval()
        with torch.no_grad():
            val_loss = F.cross_entropy(ema(val_x).view(-1, VOCAB), val_y.view(-1)).item()
        model.train()
        run["best_val"] = min(run["best_val"], val_loss)
        if rank == 0:
            print(f"step {step.index}: val {val_loss:.4f} (best {run['best_val']:.4f})", flush=True)
