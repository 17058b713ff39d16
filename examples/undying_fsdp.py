"""A sharded model (FSDP2 ``fully_shard``) under undying. Run: undying run -n 4 undying_fsdp.py

Every rank holds only its slices of the parameters and of the optimizer state
(DTensors). ``job.state(...)`` sees that and treats the state as sharded:

- checkpoints (``--save-every``/``--save-interval``, the dying gasp on
  SIGTERM) are written by every rank through torch.distributed.checkpoint, so
  the job resumes on any number of ranks (``undying run -n 2`` after ``-n 4``);
- with ``undying run --replicate ring`` each rank keeps a copy of its ring
  neighbour's shard in memory, so a lost rank's shard comes from a peer, not
  from disk; without it, a lost rank rolls the job back to the latest checkpoint.

The loop is the DDP one (examples/undying_ddp.py) with ``fully_shard`` in place
of ``job.ddp``. The model is called directly: FSDP follows the job's process
groups by itself.
"""

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import undying

p = argparse.ArgumentParser(description=__doc__)
p.add_argument("--epochs", type=int, default=3)
p.add_argument("--samples", type=int, default=2048)
p.add_argument("--features", type=int, default=32)
p.add_argument("--hidden", type=int, default=64)
p.add_argument("--layers", type=int, default=2)
p.add_argument("--batch-size", type=int, default=16)
p.add_argument("--step-seconds", type=float, default=0.0, help="make every step last at least this long")
args = p.parse_args()

job = undying.init()

torch.manual_seed(1234)  # the same initial model on every rank, before it is sharded
data = torch.Generator().manual_seed(99)
x = torch.randn(args.samples, args.features, generator=data)
y = torch.tanh(x @ torch.randn(args.features, 1, generator=data)) + 0.1 * torch.randn(args.samples, 1, generator=data)
dataset = TensorDataset(x, y)
loader = DataLoader(dataset, batch_size=args.batch_size, sampler=DistributedSampler(dataset, seed=7))

blocks: list[nn.Module] = []
width = args.features
for _ in range(args.layers):
    blocks.append(nn.Sequential(nn.Linear(width, args.hidden), nn.ReLU(), nn.Dropout(0.1)))
    width = args.hidden
model = nn.Sequential(*blocks, nn.Linear(width, 1))
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
for block in model:
    fully_shard(block, mesh=mesh)
fully_shard(model, mesh=mesh)

optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.9)

state = job.state(model=model, optimizer=optimizer, scheduler=scheduler, loader=loader)  # sharded: detected
for step in job.steps(state, epochs=args.epochs):
    with step:
        started = time.monotonic()
        inputs, targets = step.batch
        loss = F.mse_loss(model(inputs), targets)
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)  # every rank logs the job's mean loss
        step.log(loss=mean_loss / dist.get_world_size())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        time.sleep(max(0.0, args.step_seconds - (time.monotonic() - started)))
    if job.rank == 0 and step.index % len(loader) == 0:
        print(f"epoch {step.epoch} loss {float(mean_loss) / dist.get_world_size():.4f}", flush=True)
