"""A plain HF accelerate loop. Run: accelerate launch --cpu --num_processes 2 accelerate_plain.py"""

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

accelerator = Accelerator(cpu=True)

torch.manual_seed(0)
x = torch.randn(1024, 32)
y = torch.tanh(x.sum(dim=1, keepdim=True))
loader = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)

model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

for epoch in range(3):
    for inputs, targets in loader:
        loss = F.mse_loss(model(inputs), targets)
        optimizer.zero_grad()
        accelerator.backward(loss)
        optimizer.step()
    accelerator.print(f"epoch {epoch} loss {loss.item():.4f}")

accelerator.end_training()
