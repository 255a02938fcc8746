"""AdamW with decay/no-decay parameter groups, and the learning-rate schedules (warmup + cosine, WSD, constant)."""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor

from pithtrain.config import OptimConfig


def build_optimizer(params: list[tuple[str, torch.nn.Parameter]], cfg: OptimConfig, device_type: str):
    """Weight decay skips norms, biases and embeddings (1-D tensors and the embedding table).
    FSDP-sharded (DTensor) and plain local parameters (experts that FSDP leaves alone) go to
    separate groups: one fused kernel call cannot mix the two."""
    groups = {}
    for name, p in params:
        decay = not (p.ndim < 2 or "embed" in name or "norm" in name)
        groups.setdefault((decay, isinstance(p, DTensor)), []).append(p)
    groups = [{"params": ps, "weight_decay": cfg.weight_decay if decay else 0.0} for (decay, _), ps in groups.items()]
    fused = device_type == "cuda"  # the fused kernel is the fastest on GPUs; foreach on the CPU
    return torch.optim.AdamW(
        groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=fused or None, foreach=None if fused else True
    )


def optimizer_step(optimizer: torch.optim.Optimizer, params) -> None:
    """optimizer.step(), then mark every parameter as modified: the fused AdamW kernel updates the
    weights in place without bumping their version counters, and the per-update cache of expert
    weights cast to bf16 (ops/grouped_gemm.compute_weight) is keyed by those counters."""
    optimizer.step()
    torch.autograd.graph.increment_version(params)


def lr_at(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Learning rate for optimizer step `step` (0-based)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    min_lr = cfg.lr * cfg.min_lr_ratio
    if cfg.schedule == "constant":
        return cfg.lr
    if cfg.schedule == "cosine":
        span = max(1, total_steps - cfg.warmup_steps - 1)
        progress = min(1.0, (step - cfg.warmup_steps) / span)
        return min_lr + (cfg.lr - min_lr) * 0.5 * (1 + math.cos(math.pi * progress))
    # wsd: warmup, stable at lr, then a linear decay to min_lr over the last decay_fraction of the steps
    decay_steps = max(1, round(cfg.decay_fraction * total_steps))
    decay_start = total_steps - decay_steps
    if step < decay_start:
        return cfg.lr
    progress = min(1.0, (step - decay_start + 1) / decay_steps)
    return cfg.lr + (min_lr - cfg.lr) * progress
