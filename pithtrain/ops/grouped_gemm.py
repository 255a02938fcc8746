"""Grouped GEMM for the experts: rows of `x` grouped by expert, times one weight matrix per expert.

Uses `torch._grouped_mm` where it applies (CPU fp32/bf16; CUDA bf16 on Hopper and newer, with
16-byte aligned row strides) and a per-expert loop elsewhere. Both give the same numbers.
"""

from __future__ import annotations

import torch


def _grouped_mm_applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    if x.device.type == "cuda":
        if x.dtype != torch.bfloat16 or torch.cuda.get_device_capability(x.device)[0] < 9:
            return False
    elif x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
        return False
    item = x.element_size()
    return (x.shape[-1] * item) % 16 == 0 and (w.shape[-1] * item) % 16 == 0 and x.dtype == w.dtype


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """x: [N, K] rows grouped by expert; w: [E, K, M]; counts: [E] rows per expert (sum N). Returns [N, M]."""
    if _grouped_mm_applies(x, w):
        offs = torch.cumsum(counts, 0).to(device=x.device, dtype=torch.int32)
        return torch._grouped_mm(x, w, offs=offs)
    # Fallback: one matmul per expert (a host sync for the split sizes).
    chunks = x.split(counts.tolist())
    outs = [chunk @ w[e] for e, chunk in enumerate(chunks)]
    return torch.cat(outs) if outs else x.new_zeros(0, w.shape[-1])
