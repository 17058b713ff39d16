"""The same small GPT, adapted to undying. Run: undying run -n 2 gpt_undying.py"""

import math
import os
import random
import time

import numpy as np
import torch
import torch.nn as nn
from torch.distributed import destroy_process_group, init_process_group
from torch.nn import functional as F

import undying

# -----------------------------------------------------------------------------
data_dir = os.environ.get("GPT_DATA_DIR", "data-gpt")
max_iters = int(os.environ.get("GPT_MAX_ITERS", "40"))
eval_interval = 10
eval_iters = 4
log_interval = 5
gradient_accumulation_steps = 2
batch_size = 8
block_size = 32
n_layer, n_head, n_embd = 2, 2, 48
learning_rate, min_lr = 3e-3, 3e-4
warmup_iters, lr_decay_iters = 5, max_iters
grad_clip = 1.0
# -----------------------------------------------------------------------------


def prepare(data_dir: str) -> int:
    """Make a text file (no download) and tokenize it by characters into train.bin and val.bin; the vocab size."""
    words = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "wise",
             "owls", "watch", "quietly", "from", "old", "oak", "trees", "and", "river", "runs", "past", "green",
             "hills", "toward", "silver", "sea", "under", "bright", "morning", "light"]
    rng = random.Random(0)
    text = "\n".join(" ".join(rng.choice(words) for _ in range(rng.randint(6, 14))) + "." for _ in range(3000))
    chars = sorted(set(text))
    if not os.path.exists(os.path.join(data_dir, "val.bin")):
        os.makedirs(data_dir, exist_ok=True)
        with open(os.path.join(data_dir, "input.txt"), "w") as f:
            f.write(text)
        ids = np.array([chars.index(c) for c in text], dtype=np.uint16)
        n = int(0.9 * len(ids))
        for split, part in (("train", ids[:n]), ("val", ids[n:])):
            tmp = os.path.join(data_dir, f"{split}.bin.{os.getpid()}")
            part.tofile(tmp)
            os.replace(tmp, os.path.join(data_dir, f"{split}.bin"))  # every rank may prepare: atomic
    return len(chars)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.attn = nn.MultiheadAttention(n_embd, n_head, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln_1(x)
        mask = torch.triu(torch.ones(x.size(1), x.size(1), dtype=torch.bool), diagonal=1)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab_size, n_embd), nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block() for _ in range(n_layer))
        self.ln_f, self.lm_head = nn.LayerNorm(n_embd), nn.Linear(n_embd, vocab_size, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1)))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


ddp = int(os.environ.get("RANK", -1)) != -1
if ddp:
    init_process_group(backend="gloo")
    ddp_rank = int(os.environ["RANK"])
    master_process = ddp_rank == 0
    seed_offset = ddp_rank
else:
    master_process, seed_offset = True, 0
job = undying.init()
torch.manual_seed(1337 + seed_offset)
vocab_size = prepare(data_dir)


def get_batch(split: str) -> tuple[torch.Tensor, torch.Tensor]:
    data = np.memmap(os.path.join(data_dir, f"{split}.bin"), dtype=np.uint16, mode="r")
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([torch.from_numpy(data[i:i + block_size].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block_size].astype(np.int64)) for i in ix])
    return x, y


torch.manual_seed(1337)  # the same initial model on every rank
model = GPT(vocab_size)
torch.manual_seed(1337 + seed_offset)
optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, betas=(0.9, 0.95), weight_decay=0.1)
if ddp:
    model = job.ddp(model)
raw_model = model.module if ddp else model


@torch.no_grad()
def estimate_loss() -> dict[str, float]:
    out = {}
    raw_model.eval()
    for split in ("train", "val"):
        losses = torch.zeros(eval_iters)
        for k in range(eval_iters):
            X, Y = get_batch(split)
            losses[k] = raw_model(X, Y)[1].item()
        out[split] = losses.mean().item()
    raw_model.train()
    return out


def get_lr(it: int) -> float:
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * decay_ratio)) * (learning_rate - min_lr)


run = {"best_val_loss": 1e9}
t0 = time.time()
state = job.state(model=raw_model, optimizer=optimizer, run=run)
for step in job.steps(state, total=max_iters + 1):
    iter_num = step.index - 1
    with step:
        lr = get_lr(iter_num)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr
        if iter_num % eval_interval == 0 and master_process:
            losses = estimate_loss()
            print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
            run["best_val_loss"] = min(run["best_val_loss"], losses["val"])
        for micro_step in range(gradient_accumulation_steps):
            if ddp:
                model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1
            X, Y = get_batch("train")
            logits, loss = model(X, Y)
            loss = loss / gradient_accumulation_steps
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        lossf = loss.item() * gradient_accumulation_steps
        if master_process:
            step.log(loss=lossf)
        if iter_num % log_interval == 0 and master_process:
            print(f"iter {iter_num}: loss {lossf:.4f}, lr {lr:.2e}, {(time.time() - t0) * 1000:.0f}ms")
        t0 = time.time()

if master_process:
    print(f"best val loss {run['best_val_loss']:.4f}")
if ddp:
    destroy_process_group()
