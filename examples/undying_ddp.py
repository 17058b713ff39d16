"""The same script, adapted to undying. Run: undying run -n 4 undying_ddp.py"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import undying

job = undying.init()
rank = dist.get_rank()

torch.manual_seed(0)
x = torch.randn(2048, 32)
y = torch.tanh(x.sum(dim=1, keepdim=True))
dataset = TensorDataset(x, y)
sampler = DistributedSampler(dataset)
loader = DataLoader(dataset, batch_size=32, sampler=sampler)

model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Dropout(0.1), nn.Linear(128, 1))
ddp = job.ddp(model)
optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=100)

state = job.state(model=model, optimizer=optimizer, scheduler=scheduler, loader=loader)
for step in job.steps(state, epochs=5):
    with step:
        inputs, targets = step.batch
        loss = F.mse_loss(ddp(inputs), targets)
        step.log(loss=loss)  # this rank's loss: the summary, `undying status` and the page show it
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
    if rank == 0 and step.index % len(loader) == 0:
        print(f"epoch {step.epoch} loss {loss.item():.4f}")

dist.destroy_process_group()
