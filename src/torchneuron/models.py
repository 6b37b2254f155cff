"""Small reference models used by the demo, the tests and the benchmarks."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    vocab_size: int = 96
    block_size: int = 32
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.1


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.dropout = nn.Dropout(cfg.dropout)
        mask = torch.tril(torch.ones(cfg.block_size, cfg.block_size, dtype=torch.bool))
        self.register_buffer("mask", mask.view(1, 1, cfg.block_size, cfg.block_size))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(~self.mask[:, :, :t, :t], float("-inf"))
        att = self.dropout(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        return self.dropout(self.proj(y))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.n_embd, 4 * cfg.n_embd),
            nn.GELU(),
            nn.Linear(4 * cfg.n_embd, cfg.n_embd),
            nn.Dropout(cfg.dropout),
        )

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A minimal GPT: token and position embeddings, pre-norm blocks, tied head."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.head.weight = self.tok.weight
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx, targets=None):
        t = idx.size(1)
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok(idx) + self.pos(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


def char_dataset(text: str, block_size: int, batch: int, steps: int, seed: int = 0):
    """Deterministic (input, target) batches of byte tokens drawn from `text`."""
    data = torch.tensor(list(text.encode("ascii", "replace")), dtype=torch.long) % 96
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ix = torch.randint(len(data) - block_size - 1, (batch,), generator=g)
        x = torch.stack([data[i : i + block_size] for i in ix])
        y = torch.stack([data[i + 1 : i + 1 + block_size] for i in ix])
        yield x, y


def train_gpt(device: str, steps: int, seed: int = 0, cfg: GPTConfig | None = None, batch: int = 8,
              optimizer: str = "adamw", on_step=None, foreach: bool | None = None, on_ready=None,
              compile_backend: str | None = None, autocast: torch.dtype | None = None,
              grad_scaler: bool = False, scales: list | None = None, after_backward=None, wrap=None,
              shard: tuple | None = None, clip: bool = True) -> list:
    """Train a fresh GPT for `steps` steps on `device`; returns the losses.
    `compile_backend`: run the model under torch.compile with that backend
    ("neuron", "inductor"); the optimizer stays eager.
    `autocast`: run the forward pass under torch.autocast with that dtype;
    `grad_scaler`: scale the loss with torch.amp.GradScaler (its scale after
    each step is appended to `scales`); `after_backward(step, model)` runs
    between backward and the optimizer step (tests inject infs there).
    `wrap(model)`: the model to train (DDP, FSDP2's fully_shard), made before
    the optimizer; `shard=(rank, world)`: train on that rank's equal slice of
    each batch (data parallelism: with gradients averaged over the ranks, the
    same steps as the whole batch in one process). `clip`: clip the gradients'
    norm to 1 (PyTorch cannot when some parameters are DTensors and some not).

    `foreach` picks the optimizer and clipping implementation (None: PyTorch's
    choice for the device, which is the multi-tensor one on neuron and the
    per-tensor one on CPU)."""
    cfg = cfg or GPTConfig()
    torch.manual_seed(seed)
    model = GPT(cfg).to(device)
    if wrap is not None:
        model = wrap(model)
    step_model = torch.compile(model, backend=compile_backend) if compile_backend else model
    # Reseed after init: the CPU and neuron generators then start training from
    # the same state, so dropout masks (and losses) match across devices.
    torch.manual_seed(seed + 1)
    if callable(optimizer):  # optimizer(parameters): ZeroRedundancyOptimizer, ...
        opt = optimizer(model.parameters())
    elif optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, foreach=foreach)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=foreach)
    device_type = torch.device(device).type
    scaler = torch.amp.GradScaler(device_type, enabled=grad_scaler)
    if on_ready is not None:
        on_ready()  # the model and optimizer exist: training starts
    losses = []
    text = SAMPLE_TEXT * 4
    for step, (x, y) in enumerate(char_dataset(text, cfg.block_size, batch, steps, seed)):
        if shard is not None:
            rank, world = shard
            part = batch // world
            x, y = x[rank * part:(rank + 1) * part], y[rank * part:(rank + 1) * part]
        x, y = x.to(device), y.to(device)
        with torch.autocast(device_type, dtype=autocast, enabled=autocast is not None):
            _, loss = step_model(x, y)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        if after_backward is not None:
            after_backward(step, model)
        if clip:
            scaler.unscale_(opt)  # clip the true gradients
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=foreach)
        scaler.step(opt)
        scaler.update()
        if scales is not None:
            scales.append(scaler.get_scale())
        losses.append(loss.item())
        if on_step is not None:
            on_step(step, losses[-1])
    return losses


SAMPLE_TEXT = (
    "PyTorch users want to move existing code to a new accelerator with one line, "
    "and have everything keep working: eager mode for research and debugging, "
    "compiled graphs for production, autograd and optimizers, mixed precision, "
    "distributed training, streams and events, the profiler, and real models. "
)
