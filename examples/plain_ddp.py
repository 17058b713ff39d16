"""A plain DDP training script, as found in the wild. Run: torchrun --nproc-per-node 4 plain_ddp.py"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

dist.init_process_group("gloo")
rank = dist.get_rank()

torch.manual_seed(0)
x = torch.randn(2048, 32)
y = torch.tanh(x.sum(dim=1, keepdim=True))
dataset = TensorDataset(x, y)
sampler = DistributedSampler(dataset)
loader = DataLoader(dataset, batch_size=32, sampler=sampler)

model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Dropout(0.1), nn.Linear(128, 1))
ddp = DistributedDataParallel(model)
optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=100)

for epoch in range(5):
    sampler.set_epoch(epoch)
    for inputs, targets in loader:
        loss = F.mse_loss(ddp(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
    if rank == 0:
        print(f"epoch {epoch} loss {loss.item():.4f}")

dist.destroy_process_group()
