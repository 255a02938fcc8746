"""Plain-PyTorch operators shared by the model files: RMSNorm, RoPE, attention, SwiGLU, cross-entropy.

These are the reference implementations: they run on the CPU and are the oracle that GPU kernels
are tested against. Each is written so that torch.compile(fullgraph=True) can trace it."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


# One process under autocast (fp32 master weights, no FSDP): the token embedding's rows, and so the residual
# stream and the norms' outputs, in the compute dtype, as FSDP's bf16 weight copies give them on a mesh; False:
# fp32 (the fp32 master rows), which doubles the bytes every norm, residual add and their gradients move
# (docs/performance.md: 1.3% of a 9-layer Qwen3 step, the A/B `bf16-activations`).
ACTIVATIONS_IN_COMPUTE_DTYPE = True


def autocast_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype autocast runs x's matmuls in (x's own dtype outside autocast)."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


def expert_tokens(normed: torch.Tensor) -> torch.Tensor:
    """A layer's normed hidden states [B, S, H] as the experts' input rows [B*S, H], cast now to the
    experts' matmul dtype: the cast fuses into the compiled norm, and the dispatch then permutes
    (and sends) half the bytes, instead of stage 3 casting top-k times as many rows after it."""
    return normed.flatten(0, 1).to(autocast_dtype(normed))


def count_ids(ids: torch.Tensor, n: int) -> torch.Tensor:
    """How often each of 0..n-1 occurs in `ids` (int64 [n]). Unlike torch.bincount, which reads
    the maximum back to the host on CUDA, this never synchronises with the device."""
    flat = ids.flatten()
    return torch.zeros(n, dtype=torch.int64, device=ids.device).scatter_add_(0, flat.long(), torch.ones_like(flat, dtype=torch.int64))


def stable_argsort_ids(ids: torch.Tensor, bound: int) -> torch.Tensor:
    """torch.argsort(ids, stable=True) for ids in [0, bound), sorted as the narrowest integer type that holds them:
    on CUDA the sort is a radix sort of one pass per key byte, so 128 experts' ids as uint8 take one pass, not 8."""
    dtype = next((t for t, top in ((torch.uint8, 2**8), (torch.int16, 2**15), (torch.int32, 2**31)) if bound <= top),
                 torch.int64)
    return torch.argsort(ids.to(dtype), stable=True)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in fp32 and cast back before the weight, as the HF reference does; the weight in x's dtype
    # too under ACTIVATIONS_IN_COMPUTE_DTYPE (an fp32 master weight times bf16 x would give fp32).
    dtype, x32 = x.dtype, x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.to(dtype) if ACTIVATIONS_IN_COMPUTE_DTYPE else weight) * x32.to(dtype)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_inv_freq(base: float, dim: int, yarn: dict | None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [dim/2] fp32, the factor cos/sin are scaled by), YaRN when `yarn` is given.

    YaRN (arXiv 2309.00071): frequencies with fewer than beta_slow rotations over the original context are interpolated
    (divided by `factor`), those with more than beta_fast kept, a linear ramp between; cos/sin scale by mscale(mscale) /
    mscale(mscale_all_dim) unless attention_factor is given. fp32 in HF's order, so the tables match HF's bit for bit.
    """
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if yarn is None:
        return 1.0 / pos_freqs, 1.0
    factor, original = yarn["factor"], yarn["original_max_position_embeddings"]
    scale, m, m_all = yarn.get("attention_factor"), yarn.get("mscale"), yarn.get("mscale_all_dim")
    if scale is None:
        scale = yarn_mscale(factor, m) / yarn_mscale(factor, m_all) if m and m_all else yarn_mscale(factor)

    def dim_with_rotations(rotations):  # the frequency index that turns `rotations` times over the original context
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_with_rotations(yarn.get("beta_fast") or 32), dim_with_rotations(yarn.get("beta_slow") or 1)
    if yarn.get("truncate", True):  # HF's default when the key is absent
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    keep = 1 - ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # extrapolated share
    return (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep, float(scale)


def rope_cos_sin(position_ids: torch.Tensor, inv_freq: torch.Tensor, scale: float = 1.0, dtype=None):
    """cos/sin tables [B, S, D] for the rotate-half RoPE layout (frequencies repeated twice)."""
    freqs = position_ids[..., None].float() * inv_freq.float()
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos() * scale, emb.sin() * scale
    return (cos, sin) if dtype is None else (cos.to(dtype), sin.to(dtype))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, S, D]; cos/sin: [B, S, D]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def attention_mask(doc_ids: torch.Tensor | None, seq_len: int, device, sliding_window: int | None = None):
    """Boolean mask [B or 1, 1, S, S] (True = attend) or None when plain causal attention suffices."""
    if doc_ids is None and sliding_window is None:
        return None
    pos = torch.arange(seq_len, device=device)
    mask = pos[None, :] <= pos[:, None]
    if sliding_window is not None:
        mask = mask & (pos[:, None] - pos[None, :] < sliding_window)
    mask = mask[None, None]
    if doc_ids is not None:
        mask = mask & (doc_ids[:, None, :, None] == doc_ids[:, None, None, :])
    return mask


def attention(q, k, v, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Causal GQA attention. q: [B, Hq, S, D], k/v: [B, Hkv, S, D]; returns [B, S, Hq*Dv]."""
    gqa = q.shape[1] != k.shape[1]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=gqa)
    return out.transpose(1, 2).flatten(2)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for a [.., 2I] tensor holding gate then up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropy over labels != -100, computed in fp32."""
    return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), ignore_index=-100, reduction="sum")
