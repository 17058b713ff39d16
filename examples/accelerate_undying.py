"""The accelerate loop, adapted to undying. Run: undying run -n 2 accelerate_undying.py"""

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import undying

job = undying.init()
accelerator = Accelerator(cpu=True)

torch.manual_seed(0)
x = torch.randn(1024, 32)
y = torch.tanh(x.sum(dim=1, keepdim=True))
loader = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)

model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
ddp = job.ddp(model)
optimizer, loader = accelerator.prepare(optimizer, loader)

state = job.state(model=model, optimizer=optimizer, loader=loader)
for step in job.steps(state, epochs=3):
    with step:
        inputs, targets = step.batch
        loss = F.mse_loss(ddp(inputs), targets)
        optimizer.zero_grad()
        accelerator.backward(loss)
        optimizer.step()
        if accelerator.is_main_process:
            step.log(loss=loss.item())
    if step.index % len(loader) == 0:
        accelerator.print(f"epoch {step.epoch} loss {loss.item():.4f}")

accelerator.end_training()
