"""Triton kernels for the GPU fast path, each next to the plain-PyTorch reference it replaces.

Every public function picks its path: Triton when `use_triton(x)` (a CUDA tensor and Triton
installed), otherwise the reference, which is the code the models and dispatchers run today.

  swiglu(gate_up)                         silu(gate) * up on [.., 2I] (gate then up)
  clamped_swiglu(gate_up, alpha, limit)   GPT-OSS: (clamp(up, +-limit) + 1) * g * sigmoid(alpha * g),
                                          g = min(gate, limit)
  permute(x, index)                       x[index]: token rows into the expert-grouped layout
  expand(x, order, topk)                  permute(x, order // topk), each row read once (LocalDispatch's)
  unpermute(y, index, num_rows)           zeros(num_rows, H).index_copy(0, index, y): back again
  weighted_combine(rows, index, weights, addend)  unpermute to [T, k, H], then the sum weighted by weights
                                          [T, k] (+ the residual)
  dispatch_plan(topk_ids, experts_per_rank, ep)
                                          AllToAllDispatch's send plan, with no host synchronisation
  expert_bias_add(x, bias, counts)        x + bias[expert of each row], rows grouped by expert
  cross_entropy_sum(logits, labels)       sum of token cross-entropies over labels != -100, fp32 math
                                          (grad_in_place: the gradient written over the logits)
  topk_ids(x, k)                          torch.topk(x, k).indices: the router's selection
  qk_norm_rope(qkv, wq, wk, cos, sin, ..) Qwen3's q and k per-head RMSNorm and RoPE on the stacked projection
  add_into(dst, src)                      dst += src for an fp32 dst and a bf16 src (gradient accumulation)
  wgrad_into(grad, x, dy, counts, assign) grad[e] += x_e^T dy_e, the add in the GEMM's epilogue
  muon_momentum(grad, buf, mu, out, halves)   Muon's momentum + Nesterov + cast into the NS batch, one pass
  muon_apply(weight, update, decay, step, halves)  weight decay + the scaled update, one pass

How it is built:
  - Each kernel launch is a torch.library.custom_op (opaque to torch.compile, with a fake that gives
    the output shapes); each differentiable op is a torch.autograd.Function over those launches.
  - No atomics on floating-point outputs: every program owns the outputs it writes, and sums over
    rows run in a fixed order in fp32, so gradients are bit-identical run to run.
  - Triton is optional (GPU only): it is imported, and each kernel jit-compiled, on the first launch.
    With TRITON_INTERPRET=1 set before Triton's import, the kernels run on CPU tensors (interpreter).
"""

from __future__ import annotations  # keeps the kernels' `tl.constexpr` annotations unevaluated

import functools
import importlib.util
import math
import os
from typing import NamedTuple

import torch
import torch.nn.functional as F

from pithtrain.ops import core

# PITHTRAIN_TRITON=0: the references on GPUs too (the debug-divergence skill's Triton-vs-reference bisection)
_TRITON_INSTALLED = importlib.util.find_spec("triton") is not None and os.environ.get("PITHTRAIN_TRITON") != "0"
tl = None  # triton.language; bound on the first kernel launch, where the kernels' bodies need it


def use_triton(x: torch.Tensor) -> bool:
    """True when the Triton kernels serve `x`: a CUDA tensor, with Triton installed."""
    return x.is_cuda and _TRITON_INSTALLED


class _Kernel:
    """A module-level Triton kernel, jit-compiled on its first launch: `_Kernel(fn)[grid](*args)`.
    (Triton reads TRITON_INTERPRET when it is imported: set it before, for the interpreter.)"""

    def __init__(self, fn):
        self.fn, self.jitted = fn, None

    def __getitem__(self, grid):
        if self.jitted is None:
            global tl
            import triton
            import triton.language

            tl = self.fn.__globals__["tl"] = triton.language  # the kernel's own module may be another (ops/fp8.py)
            self.jitted = triton.jit(self.fn)
        return self.jitted[grid]


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


# ---- 1-2. SwiGLU and GPT-OSS's clamped SwiGLU on [N, 2I] (gate then up); backward recomputes the activation ----


def clamped_swiglu_reference(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """GPT-OSS's activation on a [.., 2I] tensor holding gate then up (the model's CPU path)."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(alpha * gate))


@_Kernel
def _glu_fwd_kernel(x_ptr, out_ptr, rows, inter, alpha, limit,
                    CLAMPED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (r < rows)[:, None] & (c < inter)[None, :]
    gate_at = x_ptr + r.to(tl.int64)[:, None] * (2 * inter) + c[None, :]
    g = tl.load(gate_at, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gate_at + inter, mask=mask, other=0.0).to(tl.float32)
    if CLAMPED:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        out = (u + 1.0) * (g * tl.sigmoid(alpha * g))
    else:
        out = g * tl.sigmoid(g) * u
    out_at = out_ptr + r.to(tl.int64)[:, None] * inter + c[None, :]
    tl.store(out_at, out.to(out_ptr.dtype.element_ty), mask=mask)


@_Kernel
def _glu_bwd_kernel(x_ptr, dy_ptr, dx_ptr, q_ptr, s_ptr, rows, inter, alpha, limit,
                    CLAMPED: tl.constexpr, QUANT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """d gate_up from d act, recomputing the activation. QUANT (whole rows a program: BLOCK_C >= inter): also
    the row-wise FP8 of the stored d gate_up (q, s: fp8.quantize's, bit for bit), the FP8 gate/up GEMM's
    input gradient operand without a second read."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (r < rows)[:, None] & (c < inter)[None, :]
    gate_at = r.to(tl.int64)[:, None] * (2 * inter) + c[None, :]
    g = tl.load(x_ptr + gate_at, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + gate_at + inter, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + r.to(tl.int64)[:, None] * inter + c[None, :], mask=mask, other=0.0).to(tl.float32)
    if CLAMPED:
        gc = tl.minimum(g, limit)
        uc = tl.minimum(tl.maximum(u, -limit), limit)
        s = tl.sigmoid(alpha * gc)
        # d/dg [g * sigmoid(a g)] = s * (1 + a g (1 - s)); clamp passes gradient where it did not clip
        # (bounds included, as torch.clamp's backward does)
        dg = tl.where(g <= limit, dy * (uc + 1.0) * s * (1.0 + alpha * gc * (1.0 - s)), 0.0)
        du = tl.where((u >= -limit) & (u <= limit), dy * gc * s, 0.0)
    else:
        s = tl.sigmoid(g)
        dg = dy * u * s * (1.0 + g * (1.0 - s))
        du = dy * g * s
    dg = tl.where(mask, dg, 0.0).to(dx_ptr.dtype.element_ty)  # padding lanes stay out of the row maxima
    du = tl.where(mask, du, 0.0).to(dx_ptr.dtype.element_ty)
    tl.store(dx_ptr + gate_at, dg, mask=mask)
    tl.store(dx_ptr + gate_at + inter, du, mask=mask)
    if QUANT:  # what fp8.quantize would read back: the stored values
        dg, du = dg.to(tl.float32), du.to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(dg), 1), tl.max(tl.abs(du), 1))
        s = tl.math.div_rn(tl.maximum(amax, 1e-12), tl.full([BLOCK_R], 448.0, tl.float32))
        inv = tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s)[:, None]
        tl.store(q_ptr + gate_at, tl.clamp(dg * inv, -448.0, 448.0).to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(q_ptr + gate_at + inter, tl.clamp(du * inv, -448.0, 448.0).to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(s_ptr + r, s, mask=r < rows)


def _glu_grid(rows: int, inter: int):
    block_c = min(256, _pow2(inter))
    block_r = max(1, 2048 // block_c)
    return (_cdiv(rows, block_r), _cdiv(inter, block_c)), block_r, block_c


@torch.library.custom_op("pithtrain::glu_fwd", mutates_args=())
def _glu_fwd(x: torch.Tensor, alpha: float, limit: float, clamped: bool) -> torch.Tensor:
    rows, inter = x.shape[0], x.shape[1] // 2
    out = x.new_empty(rows, inter)
    if out.numel():
        grid, block_r, block_c = _glu_grid(rows, inter)
        _glu_fwd_kernel[grid](x, out, rows, inter, alpha, limit, CLAMPED=clamped, BLOCK_R=block_r, BLOCK_C=block_c)
    return out


@_glu_fwd.register_fake
def _(x, alpha, limit, clamped):
    return x.new_empty(x.shape[0], x.shape[1] // 2)


@torch.library.custom_op("pithtrain::glu_bwd", mutates_args=())
def _glu_bwd(x: torch.Tensor, grad: torch.Tensor, alpha: float, limit: float, clamped: bool) -> torch.Tensor:
    rows, inter = x.shape[0], x.shape[1] // 2
    dx = torch.empty_like(x)
    if dx.numel():
        grid, block_r, block_c = _glu_grid(rows, inter)
        _glu_bwd_kernel[grid](x, grad, dx, dx, dx, rows, inter, alpha, limit, CLAMPED=clamped, QUANT=False,
                              BLOCK_R=block_r, BLOCK_C=block_c)
    return dx


@_glu_bwd.register_fake
def _(x, grad, alpha, limit, clamped):
    return torch.empty_like(x)


# Whole rows a program, up to `values`: benchmarks/fp8.py --glu at Qwen3 width on an H200, 0.319 ms against 0.362 at
# 2048 / 4 warps (line 145; the bf16 backward without the copy takes 0.329)
GLU_BWD_QUANT_TILE = dict(values=1024, num_warps=2)


def glu_bwd_quantized(x: torch.Tensor, grad: torch.Tensor, alpha: float, limit: float, clamped: bool,
                      q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """_glu_bwd and the row-wise FP8 of its result, written into q (FP8, x's shape): (dx, s). Eager only."""
    rows, inter = x.shape[0], x.shape[1] // 2
    dx, s = torch.empty_like(x), x.new_empty(rows, dtype=torch.float32)
    if dx.numel():
        block_c = _pow2(inter)
        block_r = max(1, min(16, GLU_BWD_QUANT_TILE["values"] // block_c))
        _glu_bwd_kernel[(_cdiv(rows, block_r), 1)](x, grad, dx, q, s, rows, inter, alpha, limit, CLAMPED=clamped,
                                                   QUANT=True, BLOCK_R=block_r, BLOCK_C=block_c,
                                                   num_warps=8 if block_c >= 2048 else GLU_BWD_QUANT_TILE["num_warps"])
    return dx, s


class _GLU(torch.autograd.Function):
    """Saves only the input: the backward recomputes the activation from it."""

    @staticmethod
    def forward(ctx, gate_up, alpha: float, limit: float, clamped: bool):
        x = gate_up.reshape(-1, gate_up.shape[-1]).contiguous()
        ctx.save_for_backward(x)
        ctx.args, ctx.shape = (alpha, limit, clamped), gate_up.shape
        return _glu_fwd(x, alpha, limit, clamped).view(*gate_up.shape[:-1], gate_up.shape[-1] // 2)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        dx = _glu_bwd(x, grad.reshape(x.shape[0], x.shape[1] // 2).contiguous(), *ctx.args)
        return dx.view(ctx.shape), None, None, None


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for a [.., 2I] tensor holding gate then up."""
    return _GLU.apply(gate_up, 1.0, 0.0, False) if use_triton(gate_up) else core.swiglu(gate_up)


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """GPT-OSS activation on a [.., 2I] tensor holding gate then up."""
    if use_triton(gate_up):
        return _GLU.apply(gate_up, float(alpha), float(limit), True)
    return clamped_swiglu_reference(gate_up, alpha, limit)


# ---- 3. Token permutation: gather rows into the expert-grouped layout, scatter them back ----


def permute_reference(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return x.index_select(0, index)  # expand's reference with index = order // topk


def unpermute_reference(y: torch.Tensor, index: torch.Tensor, num_rows: int) -> torch.Tensor:
    return y.new_zeros((num_rows, y.shape[1])).index_copy(0, index, y)  # LocalDispatch.combine


@_Kernel
def _move_rows_kernel(src_ptr, index_ptr, out_ptr, rows, hidden,
                      SCATTER: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    """Gather out[i] = src[index[i]], or (SCATTER) out[index[i]] = src[i]; i < rows."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = (r < rows)[:, None] & (c < hidden)[None, :]
    indexed = tl.load(index_ptr + r, mask=r < rows, other=0).to(tl.int64)
    if SCATTER:
        src_row, out_row = r.to(tl.int64), indexed
    else:
        src_row, out_row = indexed, r.to(tl.int64)
    vals = tl.load(src_ptr + src_row[:, None] * hidden + c[None, :], mask=mask)
    tl.store(out_ptr + out_row[:, None] * hidden + c[None, :], vals, mask=mask)


@_Kernel
def _segment_sum_kernel(src_ptr, perm_ptr, ends_ptr, w_ptr, add_ptr, out_ptr, hidden, WEIGHTED: tl.constexpr,
                        ADD: tl.constexpr, BLOCK_H: tl.constexpr):
    """out[t] = sum of src[perm[j]] (times w[j] when WEIGHTED) over j in [ends[t-1], ends[t]), in fp32
    and in that order, from add[t] when ADD (the residual: one rounding, no pass of its own)."""
    t = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    start = tl.load(ends_ptr + t - 1, mask=t > 0, other=0)
    end = tl.load(ends_ptr + t)
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    if ADD:
        acc += tl.load(add_ptr + t.to(tl.int64) * hidden + c, mask=c < hidden, other=0.0).to(tl.float32)
    for j in range(start, end):
        row = tl.load(perm_ptr + j).to(tl.int64)
        x = tl.load(src_ptr + row * hidden + c, mask=c < hidden, other=0.0).to(tl.float32)
        if WEIGHTED:
            x *= tl.load(w_ptr + j).to(tl.float32)
        acc += x
    tl.store(out_ptr + t.to(tl.int64) * hidden + c, acc.to(out_ptr.dtype.element_ty), mask=c < hidden)


@_Kernel
def _expand_rows_kernel(src_ptr, dest_ptr, out_ptr, hidden, TOPK: tl.constexpr, BLOCK_H: tl.constexpr):
    """out[dest[t * TOPK + j]] = src[t] for j < TOPK: each source row read once, stored at its TOPK places."""
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    vals = tl.load(src_ptr + t * hidden + c, mask=c < hidden)
    for j in tl.static_range(TOPK):
        row = tl.load(dest_ptr + t * TOPK + j).to(tl.int64)
        tl.store(out_ptr + row * hidden + c, vals, mask=c < hidden)


def _move_rows(src, index, out, scatter: bool):
    rows, hidden = index.shape[0], src.shape[1]
    if rows and hidden:
        block_h = min(512, _pow2(hidden))
        block_r = max(1, 4096 // block_h)
        grid = (_cdiv(rows, block_r), _cdiv(hidden, block_h))
        _move_rows_kernel[grid](src, index, out, rows, hidden, SCATTER=scatter, BLOCK_R=block_r, BLOCK_H=block_h)
    return out


@torch.library.custom_op("pithtrain::gather_rows", mutates_args=())
def _gather_rows(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return _move_rows(src, index, src.new_empty(index.shape[0], src.shape[1]), scatter=False)


@_gather_rows.register_fake
def _(src, index):
    return src.new_empty(index.shape[0], src.shape[1])


@torch.library.custom_op("pithtrain::scatter_rows", mutates_args=())
def _scatter_rows(src: torch.Tensor, index: torch.Tensor, num_rows: int) -> torch.Tensor:
    # index is a permutation (injective): when it covers every output row nothing needs zeroing
    out = (src.new_empty if num_rows == index.shape[0] else src.new_zeros)(num_rows, src.shape[1])
    return _move_rows(src, index, out, scatter=True)


@_scatter_rows.register_fake
def _(src, index, num_rows):
    return src.new_empty(num_rows, src.shape[1])


@torch.library.custom_op("pithtrain::segment_sum", mutates_args=())
def _segment_sum(src: torch.Tensor, perm: torch.Tensor, ends: torch.Tensor,
                 weights: torch.Tensor | None = None, addend: torch.Tensor | None = None) -> torch.Tensor:
    out = src.new_empty(ends.shape[0], src.shape[1]) if addend is None else torch.empty_like(addend)
    if out.numel():
        block_h = min(1024, _pow2(src.shape[1]))
        _segment_sum_kernel[(ends.shape[0], _cdiv(src.shape[1], block_h))](
            src, perm, ends, perm if weights is None else weights, out if addend is None else addend, out,
            src.shape[1], WEIGHTED=weights is not None, ADD=addend is not None, BLOCK_H=block_h)
    return out


@_segment_sum.register_fake
def _(src, perm, ends, weights=None, addend=None):
    return src.new_empty(ends.shape[0], src.shape[1]) if addend is None else torch.empty_like(addend)


@torch.library.custom_op("pithtrain::expand_rows", mutates_args=())
def _expand_rows(src: torch.Tensor, dest: torch.Tensor) -> torch.Tensor:
    out = src.new_empty(dest.shape[0], src.shape[1])
    if out.numel():
        block_h = min(1024, _pow2(src.shape[1]))
        _expand_rows_kernel[(src.shape[0], _cdiv(src.shape[1], block_h))](
            src, dest, out, src.shape[1], TOPK=dest.shape[0] // src.shape[0], BLOCK_H=block_h)
    return out


@_expand_rows.register_fake
def _(src, dest):
    return src.new_empty(dest.shape[0], src.shape[1])


class _Expand(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dest):
        ctx.save_for_backward(dest)
        ctx.num_rows = x.shape[0]
        return _expand_rows(x.contiguous(), dest)

    @staticmethod
    def backward(ctx, grad):
        # Row t's gradient sums its copies at dest[t*k : (t+1)*k], in fp32 and in slot order: no sort needed
        (dest,) = ctx.saved_tensors
        topk = dest.shape[0] // max(1, ctx.num_rows)
        ends = torch.arange(1, ctx.num_rows + 1, dtype=torch.int32, device=dest.device) * topk
        return _segment_sum(grad.contiguous(), dest, ends), None


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, index):
        ctx.save_for_backward(index)
        ctx.num_rows = x.shape[0]
        return _gather_rows(x.contiguous(), index)

    @staticmethod
    def backward(ctx, grad):
        (index,) = ctx.saved_tensors
        # Each row of x gets the sum of its copies' gradients: group the copies by source row (a
        # stable sort fixes the summation order) and sum each group in fp32, without atomics.
        perm = core.stable_argsort_ids(index, ctx.num_rows)
        ends = torch.searchsorted(index[perm], torch.arange(ctx.num_rows, device=index.device), right=True,
                                  out_int32=True)
        return _segment_sum(grad.contiguous(), perm, ends), None


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, index, num_rows: int):
        ctx.save_for_backward(index)
        return _scatter_rows(y.contiguous(), index, num_rows)

    @staticmethod
    def backward(ctx, grad):
        (index,) = ctx.saved_tensors
        return _gather_rows(grad.contiguous(), index), None, None


def permute(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [T, H] -> x[index] [N, H] (an expert-parallel receiver's rows, one to k copies each; LocalDispatch's
    expert-grouped rows are `expand`). The backward sums each row's copies in fp32."""
    return _Permute.apply(x, index) if use_triton(x) else permute_reference(x, index)


def expand(x: torch.Tensor, order: torch.Tensor, topk: int) -> torch.Tensor:
    """permute(x, order // topk) for `order` a permutation of T*topk (LocalDispatch's: the (token, slot) pairs in
    expert order), by a kernel that reads each row of x once and stores it at its topk places (order's inverse):
    a gather reads each row topk times, mostly from memory at a micro-batch's size; the backward sums each
    row's copies in slot order without sorting."""
    return _Expand.apply(x, _inverse(order)) if use_triton(x) else permute_reference(x, order // topk)


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    """The inverse of a permutation of 0..N-1: out[perm[i]] = i."""
    return torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.shape[0], dtype=perm.dtype, device=perm.device))


def unpermute(y: torch.Tensor, index: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Row i of y [N, H] goes to row index[i] of a [num_rows, H] result (zeros elsewhere); `index`
    must not repeat. With index = order this is LocalDispatch.combine (before its view to [T, k, H])."""
    return _Unpermute.apply(y, index, num_rows) if use_triton(y) else unpermute_reference(y, index, num_rows)


def weighted_combine_reference(rows: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    num_tokens, topk = weights.shape
    combined = unpermute_reference(rows, index, num_tokens * topk).view(num_tokens, topk, rows.shape[1])
    return (combined * weights.unsqueeze(-1)).sum(1)


@_Kernel
def _weighted_combine_bwd_kernel(rows_ptr, source_ptr, w_ptr, dout_ptr, drows_ptr, dw_ptr, q_ptr, s_ptr, hidden,
                                 TOPK: tl.constexpr, BLOCK_H: tl.constexpr, FP8: tl.constexpr = False):
    """Token t's pair p = t * TOPK + j is row i = source[p]: drows[i] = w[p] * dout[t] and dw[p] = <rows[i],
    dout[t]> (fp32, over column blocks in order). A program a token: dout's row comes from memory once and
    from the cache for its other pairs (a program a row read it TOPK times, mostly from memory).
    FP8: also drows' row-wise FP8 copy, fp8.quantize's of the stored drows bit for bit, into q and s: the row's
    largest stored value is |w| times dout's largest, rounded as drows is (rounding is monotonic), so the
    scale is known before the row is written."""
    t = tl.program_id(0).to(tl.int64)
    if FP8:
        peak = tl.zeros([BLOCK_H], dtype=tl.float32)
        for start in range(0, hidden, BLOCK_H):
            c = start + tl.arange(0, BLOCK_H)
            peak = tl.maximum(peak, tl.abs(tl.load(dout_ptr + t * hidden + c, mask=c < hidden, other=0.0).to(tl.float32)))
        gmax = tl.max(peak, axis=0)
    for j in tl.static_range(TOPK):
        p = t * TOPK + j
        i = tl.load(source_ptr + p).to(tl.int64)
        w = tl.load(w_ptr + p).to(tl.float32)
        if FP8:
            top = (tl.abs(w) * gmax).to(drows_ptr.dtype.element_ty).to(tl.float32)
            scale = tl.math.div_rn(tl.maximum(top, 1e-12), 448.0)
            inv = tl.math.div_rn(1.0, scale)
            tl.store(s_ptr + i, scale)
        dot = tl.zeros([BLOCK_H], dtype=tl.float32)
        for start in range(0, hidden, BLOCK_H):
            c = start + tl.arange(0, BLOCK_H)
            g = tl.load(dout_ptr + t * hidden + c, mask=c < hidden, other=0.0).to(tl.float32)
            y = tl.load(rows_ptr + i * hidden + c, mask=c < hidden, other=0.0).to(tl.float32)
            d = (w * g).to(drows_ptr.dtype.element_ty)
            tl.store(drows_ptr + i * hidden + c, d, mask=c < hidden)
            if FP8:
                q = tl.clamp(d.to(tl.float32) * inv, -448.0, 448.0)
                tl.store(q_ptr + i * hidden + c, q.to(q_ptr.dtype.element_ty), mask=c < hidden)
            dot += y * g
        tl.store(dw_ptr + p, tl.sum(dot, axis=0))


def _launch_combine_bwd(rows, source, weights, dout, fp8_out=None):
    """(drows, dw); fp8_out: (q, s) for drows' FP8 copy too."""
    drows = torch.empty_like(rows)
    dw = torch.empty(weights.shape, dtype=torch.float32, device=weights.device)  # every pair is some row's
    if weights.numel():
        q, s = fp8_out or (drows, dw)
        _weighted_combine_bwd_kernel[(weights.shape[0],)](rows, source, weights, dout, drows, dw, q, s, rows.shape[1],
                                                          TOPK=weights.shape[1], BLOCK_H=min(1024, _pow2(rows.shape[1])),
                                                          FP8=fp8_out is not None)
    return drows, dw


@torch.library.custom_op("pithtrain::weighted_combine_bwd", mutates_args=())
def _weighted_combine_bwd(rows: torch.Tensor, source: torch.Tensor, weights: torch.Tensor,
                          dout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch_combine_bwd(rows, source, weights, dout)


@_weighted_combine_bwd.register_fake
def _(rows, index, weights, dout):
    return torch.empty_like(rows), weights.new_empty(weights.shape, dtype=torch.float32)


# FP8 experts: the combine's backward writes the FP8 copy of the down projection's output gradient for its input
# gradient, where the down GEMM's backward would quantize it again (13.3 ms a step at 9 Qwen3 layers, 4 x 8
# micro-batches, results.jsonl line 140): train_throughput.py --ab combine-fp8-grad. The copy goes through a Python
# slot, which a compiled graph cannot fill, so with it FP8 experts run stage 5 eagerly (fp8.enable_fp8; Qwen3's stage
# 5 is this one autograd function, its kernels the same either way).
COMBINE_FP8_GRAD = True


class _WeightedCombine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, index, weights, addend, dgrad_slot=None):
        # the row holding each (token, slot) pair: every pair comes back exactly once (both dispatchers);
        # then token t's k pairs are one segment of the weighted segment sum (permute's backward's kernel)
        index = index.contiguous()
        source = _inverse(index)
        num_tokens, topk = weights.shape
        ends = torch.arange(1, num_tokens + 1, dtype=torch.int32, device=index.device) * topk
        ctx.save_for_backward(rows, source, weights)
        ctx.addend, ctx.slot = addend is not None, dgrad_slot
        added = None if addend is None else addend.reshape(num_tokens, rows.shape[1]).contiguous()
        out = _segment_sum(rows.contiguous(), source, ends, weights.contiguous(), added)
        return out if addend is None else out.view(addend.shape)

    @staticmethod
    def backward(ctx, dout):
        rows, source, weights = ctx.saved_tensors
        args = rows.contiguous(), source, weights.contiguous(), dout.reshape(weights.shape[0], rows.shape[1]).contiguous()
        if ctx.slot is None:
            drows, dw = _weighted_combine_bwd(*args)
        else:  # eager (stage 5 uncompiled): drows' FP8 copy for the down GEMM's input gradient, through its slot
            q = torch.empty(rows.shape, dtype=torch.float8_e4m3fn, device=rows.device)
            s = torch.empty(rows.shape[0], dtype=torch.float32, device=rows.device)
            drows, dw = _launch_combine_bwd(*args, (q, s))
            ctx.slot.update(q=q, s=s, ptr=drows.data_ptr())
        return drows, None, dw.to(weights.dtype), dout if ctx.addend else None, None


def weighted_combine(rows: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
                     addend: torch.Tensor | None = None) -> torch.Tensor:
    """Stages 4 and 5 fused: row i of `rows` [T*k, H] is the expert output of (token, slot) pair
    index[i] (int64, a permutation of T*k); returns sum_j weights[t, j] * (pair (t, j)'s row) [T, H], without
    the [T, k, H] layout in between (forward and backward). weights [T, k] are cast to rows' dtype first.
    With `addend` (the residual, T*H elements in any shape): addend + that sum, in addend's shape and dtype,
    added in the kernel's fp32 sum on GPUs (the reference rounds the sum to rows' dtype first)."""
    weights = weights.to(rows.dtype)
    if use_triton(rows):
        slot = None if torch.compiler.is_compiling() or not COMBINE_FP8_GRAD else getattr(rows, "_fp8_dgrad", None)
        return _WeightedCombine.apply(rows, index, weights, addend, slot)
    out = weighted_combine_reference(rows, index, weights)
    return out if addend is None else addend + out.view_as(addend).to(addend.dtype)


# ---- 4. The deduplicated dispatch plan of AllToAllDispatch ----


class DispatchPlan(NamedTuple):
    """Send rows are ordered by (destination rank, token). The first `send_counts[:, 0].sum()` rows are
    real; the rest (up to T*min(k, ep), a bound known without a host sync) are padding with rank ep,
    token 0 and meta -1: slice them off once the counts are on the host."""

    send_rank: torch.Tensor  # [R] destination rank of each send row
    send_token: torch.Tensor  # [R] the token the row carries
    slot_meta: torch.Tensor  # [R, k] each slot's local expert id on that rank, -1 where it lives elsewhere
    send_counts: torch.Tensor  # [ep, 2] rows and (token, expert) pairs sent to each rank
    home_index: torch.Tensor  # [T*k] where each returning pair lands in the (token, slot) layout


def dispatch_plan_reference(topk_ids: torch.Tensor, experts_per_rank: int, ep: int) -> DispatchPlan:
    """The torch code of AllToAllDispatch.dispatch, plus the padding."""
    num_tokens, topk = topk_ids.shape
    dest = topk_ids // experts_per_rank  # [T, k] rank of each chosen expert
    on_rank = torch.zeros(num_tokens, ep, dtype=torch.bool, device=topk_ids.device)
    on_rank.scatter_(1, dest, True)  # [T, ep] token goes to rank r at most once
    send_rank, send_token = on_rank.T.nonzero(as_tuple=True)
    here = dest[send_token] == send_rank[:, None]
    slot_meta = torch.where(here, topk_ids[send_token] % experts_per_rank, -1)
    send_counts = torch.stack([on_rank.sum(0), core.count_ids(dest, ep)], 1)
    home_slot = here.nonzero(as_tuple=True)
    home_index = send_token[home_slot[0]] * topk + home_slot[1]
    pad = num_tokens * min(topk, ep) - send_rank.shape[0]
    return DispatchPlan(F.pad(send_rank, (0, pad), value=ep), F.pad(send_token, (0, pad)),
                        F.pad(slot_meta, (0, 0, 0, pad), value=-1), send_counts, home_index)


@_Kernel
def _plan_kernel(ids_ptr, counts_ptr, starts_ptr, send_rank_ptr, send_token_ptr, slot_meta_ptr, home_ptr,
                 tokens, topk, experts_per_rank, ep, blocks,
                 WRITE: tl.constexpr, BLOCK_T: tl.constexpr, K: tl.constexpr, EP: tl.constexpr):
    """Two passes over blocks of tokens. Count (WRITE false): per (rank, block), the tokens sent
    (rows) and the (token, expert) pairs, into counts [2, ep, blocks]. Write: starts [2, ep,
    blocks] holds where each (rank, block) begins among the send rows and among the returning
    pairs; within a block, prefix sums over tokens (and slots) place the rest of the plan."""
    block = tl.program_id(0)
    t = block * BLOCK_T + tl.arange(0, BLOCK_T)
    s = tl.arange(0, K)
    r = tl.arange(0, EP)
    valid = (t < tokens)[:, None] & (s < topk)[None, :]
    ids = tl.load(ids_ptr + t.to(tl.int64)[:, None] * topk + s[None, :], mask=valid, other=0)
    hit = ((ids // experts_per_rank)[:, None, :] == r[None, :, None]) & valid[:, None, :]  # [BLOCK_T, EP, K]
    hits = hit.to(tl.int32)
    pairs = tl.sum(hits, axis=2)
    rows = (pairs > 0).to(tl.int32)
    if not WRITE:
        out = counts_ptr + r * blocks + block
        tl.store(out, tl.sum(rows, axis=0), mask=r < ep)
        tl.store(out + ep * blocks, tl.sum(pairs, axis=0), mask=r < ep)
    else:
        start = starts_ptr + r * blocks + block
        row_start = tl.load(start, mask=r < ep, other=0)
        pair_start = tl.load(start + ep * blocks, mask=r < ep, other=0)
        row_at = row_start[None, :] + tl.cumsum(rows, axis=0) - rows  # [BLOCK_T, EP] send row of (token, rank)
        pair_at = pair_start[None, :] + tl.cumsum(pairs, axis=0) - pairs  # its first returning pair
        sent = rows > 0
        tl.store(send_rank_ptr + row_at, (r[None, :] + 0 * row_at).to(tl.int64), mask=sent)
        tl.store(send_token_ptr + row_at, (t[:, None] + 0 * row_at).to(tl.int64), mask=sent)
        meta = tl.where(hit, (ids % experts_per_rank)[:, None, :], -1)
        meta_at = slot_meta_ptr + row_at[:, :, None] * topk + s[None, None, :]
        tl.store(meta_at, meta.to(tl.int64), mask=sent[:, :, None] & (s < topk)[None, None, :])
        pair_slot = pair_at[:, :, None] + tl.cumsum(hits, axis=2) - hits
        home = t.to(tl.int64)[:, None, None] * topk + s[None, None, :] + 0 * pair_slot
        tl.store(home_ptr + pair_slot, home, mask=hit)


@torch.library.custom_op("pithtrain::dispatch_plan", mutates_args=())
def _dispatch_plan(topk_ids: torch.Tensor, experts_per_rank: int, ep: int) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    num_tokens, topk = topk_ids.shape
    k_pow2, ep_pow2 = _pow2(topk), _pow2(ep)
    block_t = max(1, min(_pow2(num_tokens), 4096 // (k_pow2 * ep_pow2)))
    blocks = _cdiv(num_tokens, block_t)
    long = dict(dtype=torch.long, device=topk_ids.device)
    send_rows = num_tokens * min(topk, ep)
    send_rank, send_token = torch.full((send_rows,), ep, **long), torch.zeros(send_rows, **long)
    slot_meta, home_index = torch.full((send_rows, topk), -1, **long), torch.empty(num_tokens * topk, **long)
    if not blocks:
        return send_rank, send_token, slot_meta, torch.zeros(ep, 2, **long), home_index
    out = (send_rank, send_token, slot_meta, home_index)
    args = (num_tokens, topk, experts_per_rank, ep, blocks)
    consts = dict(BLOCK_T=block_t, K=k_pow2, EP=ep_pow2)
    counts = torch.empty(2, ep, blocks, dtype=torch.int32, device=topk_ids.device)
    _plan_kernel[(blocks,)](topk_ids, counts, counts, *out, *args, WRITE=False, **consts)  # counts also as unused `starts`
    flat = counts.view(2, -1)
    starts = flat.cumsum(1) - flat  # rank-major exclusive prefix: where each (rank, block) starts
    _plan_kernel[(blocks,)](topk_ids, counts, starts, *out, *args, WRITE=True, **consts)
    return send_rank, send_token, slot_meta, counts.sum(2).T.contiguous(), home_index


@_dispatch_plan.register_fake
def _(topk_ids, experts_per_rank, ep):
    num_tokens, topk = topk_ids.shape
    send_rows = num_tokens * min(topk, ep)
    new = topk_ids.new_empty
    return new(send_rows), new(send_rows), new(send_rows, topk), new(ep, 2), new(num_tokens * topk)


def dispatch_plan(topk_ids: torch.Tensor, experts_per_rank: int, ep: int) -> DispatchPlan:
    """What AllToAllDispatch.dispatch computes from the routing (topk_ids [T, k], int64) before its first
    exchange: exchange `send_counts`, take them to the host (its one sync), then use the first
    sum(send_counts[:, 0]) rows of send_token / slot_meta. The Triton path syncs nowhere else."""
    if use_triton(topk_ids):
        return DispatchPlan(*_dispatch_plan(topk_ids.contiguous(), experts_per_rank, ep))
    return dispatch_plan_reference(topk_ids, experts_per_rank, ep)


# ---- 5. Per-expert bias on rows grouped by expert ----


def expert_bias_add_reference(x: torch.Tensor, bias: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """GPT-OSS experts' bias add on the CPU; output_size avoids a device->host sync."""
    experts = torch.arange(counts.numel(), device=counts.device)
    row_expert = torch.repeat_interleave(experts, counts, output_size=x.shape[0])
    return x + bias.to(x.dtype)[row_expert]


@_Kernel
def _bias_add_kernel(x_ptr, bias_ptr, ends_ptr, out_ptr, rows, dim, experts,
                     SEARCH_STEPS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    # Each row's expert is the first e with ends[e] > row: a binary search over the group ends.
    lo = tl.zeros([BLOCK_R], dtype=tl.int32)
    hi = lo + experts
    for _ in tl.static_range(SEARCH_STEPS):
        active = lo < hi
        mid = (lo + hi) // 2
        end = tl.load(ends_ptr + mid, mask=active, other=0)
        lo = tl.where(active & (end <= r), mid + 1, lo)
        hi = tl.where(active & (end > r), mid, hi)
    mask = (r < rows)[:, None] & (c < dim)[None, :]
    at = r.to(tl.int64)[:, None] * dim + c[None, :]
    x = tl.load(x_ptr + at, mask=mask, other=0.0).to(tl.float32)
    # bias rounded to x's dtype first, as the reference's bias.to(x.dtype)
    b = tl.load(bias_ptr + lo.to(tl.int64)[:, None] * dim + c[None, :], mask=mask & (lo < experts)[:, None], other=0.0)
    tl.store(out_ptr + at, (x + b.to(out_ptr.dtype.element_ty).to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mask)


@_Kernel
def _bias_grad_kernel(dy_ptr, ends_ptr, dbias_ptr, dim, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """dbias[e] = sum of dy over expert e's rows, in fp32 and a fixed order (one program per (e, columns))."""
    e = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    start = tl.load(ends_ptr + e - 1, mask=e > 0, other=0)
    end = tl.load(ends_ptr + e)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    for r0 in range(start, end, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        mask = (r < end)[:, None] & (c < dim)[None, :]
        acc += tl.load(dy_ptr + r.to(tl.int64)[:, None] * dim + c[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(dbias_ptr + e * dim + c, tl.sum(acc, axis=0).to(dbias_ptr.dtype.element_ty), mask=c < dim)


@torch.library.custom_op("pithtrain::expert_bias_add", mutates_args=())
def _expert_bias_add(x: torch.Tensor, bias: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)
    rows, dim = x.shape
    if out.numel():
        block_d = min(256, _pow2(dim))
        block_r = max(1, 2048 // block_d)
        experts = bias.shape[0]
        _bias_add_kernel[(_cdiv(rows, block_r), _cdiv(dim, block_d))](
            x, bias, ends, out, rows, dim, experts, SEARCH_STEPS=experts.bit_length(), BLOCK_R=block_r, BLOCK_D=block_d)
    return out


@_expert_bias_add.register_fake
def _(x, bias, ends):
    return torch.empty_like(x)


@torch.library.custom_op("pithtrain::expert_bias_grad", mutates_args=())
def _expert_bias_grad(grad: torch.Tensor, ends: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    experts, dim = ends.shape[0], grad.shape[1]
    dbias = grad.new_empty(experts, dim, dtype=dtype)
    if dbias.numel():
        block_d = min(128, _pow2(dim))
        _bias_grad_kernel[(experts, _cdiv(dim, block_d))](grad, ends, dbias, dim, BLOCK_R=32, BLOCK_D=block_d)
    return dbias


@_expert_bias_grad.register_fake
def _(grad, ends, dtype):
    return grad.new_empty(ends.shape[0], grad.shape[1], dtype=dtype)


class _ExpertBiasAdd(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, counts):
        ends = counts.cumsum(0).to(torch.int32)
        ctx.save_for_backward(ends)
        ctx.bias_dtype = bias.dtype
        return _expert_bias_add(x.contiguous(), bias.contiguous(), ends)

    @staticmethod
    def backward(ctx, grad):
        (ends,) = ctx.saved_tensors
        return grad, _expert_bias_grad(grad.contiguous(), ends, ctx.bias_dtype), None


def expert_bias_add(x: torch.Tensor, bias: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """x [N, D] rows grouped by expert (counts [E], summing to N) plus their expert's row of bias [E, D],
    in x's dtype. The bias gradient is each expert's row sum (fp32 on the Triton path). x's gradient is the
    output's, passed through, and so is x's FP8 gradient slot (fp8.glu_quantized's)."""
    out = _ExpertBiasAdd.apply(x, bias, counts) if use_triton(x) else expert_bias_add_reference(x, bias, counts)
    if hasattr(x, "_fp8_dgrad"):
        out._fp8_dgrad = x._fp8_dgrad
    return out


# ---- 6. Cross-entropy summed over label tokens, race-free ----


@_Kernel
def _ce_fwd_kernel(logits_ptr, labels_ptr, loss_ptr, lse_ptr, amax_ptr, vocab, row_stride,
                   AMAX: tl.constexpr, BLOCK_V: tl.constexpr):
    """One program per row: log-sum-exp over the vocabulary in chunks, in fp32, with online max rescaling
    (the chunk's max and sum each iteration; the max shifted by 0 while it is -inf, a chunk of -inf logits,
    where exp(-inf - -inf) would be NaN). AMAX: also the row's largest |softmax - onehot(label)| (0 on an
    ignored row), the backward's row scale for an FP8 copy of d logits, known before any of it is written, from
    the row's max m alone: 1 - p_label where the label's logit is m (every other p is at most the rest of the
    mass, 1 - p_label), else max(exp(m - lse), 1 - p_label). No second running max over the chunks: that one
    slowed this memory-bound kernel by 60% on an H200."""
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * row_stride
    cols = tl.arange(0, BLOCK_V)
    label = tl.load(labels_ptr + row)
    x = tl.load(base + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
    m = tl.max(x, axis=0)
    total = tl.sum(tl.exp(x - tl.where(m == float("-inf"), 0.0, m)), axis=0)
    for v0 in range(BLOCK_V, vocab, BLOCK_V):
        x = tl.load(base + v0 + cols, mask=v0 + cols < vocab, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        total = total * tl.exp(m - shift) + tl.sum(tl.exp(x - shift), axis=0)
        m = m_new
    lse = m + tl.log(total)
    valid = label != -100
    target = tl.load(base + label, mask=valid, other=0.0).to(tl.float32)
    tl.store(loss_ptr + row, tl.where(valid, lse - target, 0.0))
    tl.store(lse_ptr + row, lse)
    if AMAX:  # the backward's exp(x - lse) and exp(target - lse) - 1, so its |d| peaks at exactly this (times |grad|)
        rest = 1.0 - tl.exp(target - lse)
        peak = tl.where(target == m, rest, tl.maximum(tl.exp(m - lse), rest))
        tl.store(amax_ptr + row, tl.where(valid, peak, 0.0))


@_Kernel
def _ce_bwd_kernel(logits_ptr, labels_ptr, lse_ptr, grad_ptr, dlogits_ptr, amax_ptr, q_ptr, s_ptr, vocab, row_stride,
                   FP8: tl.constexpr, BLOCK_V: tl.constexpr):
    """d logits = grad * (softmax - onehot(label)), zero on ignored rows; each program owns its chunk.
    FP8: also d's row-wise FP8 copy (fp8.quantize_reference of the fp32 d: the row's amax from the forward,
    amax_ptr, times |grad|), q [rows, vocab] and s [rows], so no pass reads d logits back to quantize them."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    label = tl.load(labels_ptr + row)
    scale = tl.where(label != -100, tl.load(grad_ptr), 0.0)
    x = tl.load(logits_ptr + row.to(tl.int64) * row_stride + cols, mask=cols < vocab, other=0.0).to(tl.float32)
    d = (tl.exp(x - tl.load(lse_ptr + row)) - tl.where(cols == label, 1.0, 0.0)) * scale
    tl.store(dlogits_ptr + row.to(tl.int64) * vocab + cols, d.to(dlogits_ptr.dtype.element_ty), mask=cols < vocab)
    if FP8:
        s = tl.math.div_rn(tl.maximum(tl.load(amax_ptr + row) * tl.abs(scale), 1e-12), 448.0)
        inv = tl.math.div_rn(1.0, s)
        tl.store(q_ptr + row.to(tl.int64) * vocab + cols, tl.clamp(d * inv, -448.0, 448.0).to(q_ptr.dtype.element_ty),
                 mask=cols < vocab)
        tl.store(s_ptr + row, s, mask=tl.program_id(1) == 0)


def _launch_ce_fwd(logits, labels, amax=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(losses, lse) a row; with `amax` (fp32 [rows]) each row's largest |softmax - onehot| there too."""
    rows, vocab = logits.shape
    losses = logits.new_empty(rows, dtype=torch.float32)
    lse = torch.empty_like(losses)
    if rows:
        _ce_fwd_kernel[(rows,)](logits, labels, losses, lse, lse if amax is None else amax, vocab, logits.stride(0),
                                AMAX=amax is not None, BLOCK_V=min(4096, _pow2(vocab)), num_warps=8)
    return losses, lse


@torch.library.custom_op("pithtrain::cross_entropy_fwd", mutates_args=())
def _ce_fwd(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch_ce_fwd(logits, labels)


@_ce_fwd.register_fake
def _(logits, labels):
    losses = logits.new_empty(logits.shape[0], dtype=torch.float32)
    return losses, torch.empty_like(losses)


CE_BWD_TILES = dict(BLOCK_V=2048, num_warps=8)  # the backward's chunk a program (kernels.py sweeps others)


def _launch_ce_bwd(logits, labels, lse, grad, dlogits, fp8_out=None) -> None:
    """fp8_out: (row amax from the forward, q, s) for the FP8 copy of d logits too."""
    rows, vocab = logits.shape
    if logits.numel():
        block_v = min(CE_BWD_TILES["BLOCK_V"], _pow2(vocab))
        amax, q, s = fp8_out or (lse, lse, lse)
        _ce_bwd_kernel[(rows, _cdiv(vocab, block_v))](logits, labels, lse, grad, dlogits, amax, q, s, vocab,
                                                      logits.stride(0), FP8=fp8_out is not None, BLOCK_V=block_v,
                                                      num_warps=CE_BWD_TILES["num_warps"])


@torch.library.custom_op("pithtrain::cross_entropy_bwd", mutates_args=())
def _ce_bwd(logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    dlogits = logits.new_empty(logits.shape)
    _launch_ce_bwd(logits, labels, lse, grad, dlogits)
    return dlogits


@_ce_bwd.register_fake
def _(logits, labels, lse, grad):
    return logits.new_empty(logits.shape)


@torch.library.custom_op("pithtrain::cross_entropy_bwd_in_place", mutates_args=("logits",))
def _ce_bwd_in_place(logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, grad: torch.Tensor) -> None:
    """_ce_bwd writing d logits over the logits (each program reads its chunk, then writes it)."""
    _launch_ce_bwd(logits, labels, lse, grad, logits)


# The FP8 head's dy copy written by the cross-entropy backward (2.5 GB more at the memory peak at 16k tokens of
# Qwen3's vocabulary), not quantized from d logits by two more reads: train_throughput.py --ab ce-fp8-grad. With
# the forward's amax taken from a second running max, off was 0.7% faster on an H200 (Qwen3 width, 9 layers, FP8 +
# FP8 head, results.jsonl line 142): that max slowed the forward from 12.7 to 20.5 ms a step. The amax now comes
# from the row's max alone (_ce_fwd_kernel).
CE_FP8_GRAD = True


def _ce_fwd_amax(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """_ce_fwd and each row's amax of |softmax - onehot| (eager: the FP8 head's path, never compiled)."""
    amax = x.new_empty(x.shape[0], dtype=torch.float32)
    return (*_launch_ce_fwd(x, y, amax), amax)


class _CrossEntropySum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, grad_in_place=False, fp8_grad=None):
        x = logits.flatten(0, -2)
        dense = x.stride(-1) == 1 and (not grad_in_place or x.stride(0) == x.shape[-1])  # in place: d logits' layout
        x = x if dense else x.contiguous()
        y = labels.flatten().contiguous()
        ctx.fp8_grad = fp8_grad if grad_in_place and dense else None
        if ctx.fp8_grad is None:
            losses, lse = _ce_fwd(x, y)
            ctx.save_for_backward(x, y, lse)
        else:
            losses, lse, amax = _ce_fwd_amax(x, y)
            ctx.save_for_backward(x, y, lse, amax)
        ctx.shape, ctx.in_place = logits.shape, grad_in_place
        return losses.sum()  # a fixed-shape reduction: deterministic

    @staticmethod
    def backward(ctx, grad):
        x, y, lse, *amax = ctx.saved_tensors
        if not ctx.in_place:
            return _ce_bwd(x, y, lse, grad.float().reshape(1)).view(ctx.shape), None, None, None
        if ctx.fp8_grad is None:
            _ce_bwd_in_place(x, y, lse, grad.float().reshape(1))
        else:  # d logits in place and their FP8 copy, handed to the FP8 head's backward through its slot
            q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
            s = x.new_empty(x.shape[0], dtype=torch.float32)
            _launch_ce_bwd(x, y, lse, grad.float().reshape(1), x, (amax[0], q, s))
            ctx.fp8_grad.update(q=q, s=s, ptr=x.data_ptr())
        return x.view(ctx.shape), None, None, None


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor, grad_in_place: bool = False) -> torch.Tensor:
    """Sum of next-token cross-entropy over labels != -100, in fp32 (logits [.., V] bf16 or fp32).
    grad_in_place (Triton path): the backward writes d logits over the logits' own memory rather than a
    new tensor of their size, for a caller that never reads the logits after the backward (the training
    loop: at the LM head the step's memory peak is logits plus their gradient, 5 GB each at 16k tokens
    of Qwen3's vocabulary). Logits from the FP8 head (grouped_gemm.head_logits, train.fp8_head) carry a
    slot, `_fp8_dgrad`: the backward also writes d logits' row-wise FP8 copy into it for the head's input
    gradient, which would otherwise read d logits twice more to quantize them."""
    if use_triton(logits):
        slot = getattr(logits, "_fp8_dgrad", None) if CE_FP8_GRAD else None
        return _CrossEntropySum.apply(logits, labels, grad_in_place, slot)
    return core.cross_entropy_sum(logits, labels)


# ---- Attention inputs (Qwen3): q and k RMS-normed per head then rotated, v split off, one pass each way ----

# Off: the reference's norm, RoPE and split, which Inductor compiled into five passes forward and back
# (the A/B of benchmarks/train_throughput.py --ab qk-norm-rope).
FUSED_QK_NORM_ROPE = True


def qk_norm_rope_reference(q, k, v, q_weight, k_weight, cos, sin, eps: float):
    """q [B, S, Hq*D], k and v [B, S, Hkv*D] -> q, k, v [B, heads, S, D]: q and k RMS-normed per head (core.rms_norm)
    then rotated (core.apply_rope, cos/sin [B, S, D])."""
    b, s, d = *q.shape[:2], q_weight.shape[0]
    q = core.rms_norm(q.view(b, s, -1, d), q_weight, eps).transpose(1, 2)
    k = core.rms_norm(k.view(b, s, -1, d), k_weight, eps).transpose(1, 2)
    return core.apply_rope(q, cos, sin), core.apply_rope(k, cos, sin), v.view(b, s, -1, d).transpose(1, 2)


@_Kernel
def _qk_norm_rope_fwd_kernel(qkv_ptr, wq_ptr, wk_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, rows, heads, kv_heads,
                             eps, HALF: tl.constexpr, BLOCK_T: tl.constexpr):
    """Program (token block, head of q, k or v): a [BLOCK_T, D] tile in two halves (RoPE's rotate-half pairs)."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1)
    d = tl.arange(0, HALF)[None, :]
    m = (t < rows)[:, None]
    t64 = t[:, None].to(tl.int64)
    src = qkv_ptr + t64 * ((heads + 2 * kv_heads) * 2 * HALF) + h * 2 * HALF + d
    x1 = tl.load(src, mask=m, other=0.0)
    x2 = tl.load(src + HALF, mask=m, other=0.0)
    if h >= heads + kv_heads:
        dst = v_ptr + t64 * (kv_heads * 2 * HALF) + (h - heads - kv_heads) * 2 * HALF + d
        tl.store(dst, x1, mask=m)
        tl.store(dst + HALF, x2, mask=m)
    else:
        if h < heads:
            w_ptr, dst = wq_ptr, q_ptr + t64 * (heads * 2 * HALF) + h * 2 * HALF + d
        else:
            w_ptr, dst = wk_ptr, k_ptr + t64 * (kv_heads * 2 * HALF) + (h - heads) * 2 * HALF + d
        a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
        r = tl.rsqrt((tl.sum(a1 * a1, 1) + tl.sum(a2 * a2, 1)) / (2 * HALF) + eps)[:, None]
        w1, w2 = tl.load(w_ptr + d).to(tl.float32), tl.load(w_ptr + HALF + d).to(tl.float32)
        y1 = (a1 * r).to(x1.dtype).to(tl.float32) * w1
        y2 = (a2 * r).to(x1.dtype).to(tl.float32) * w2
        rope = t64 * (2 * HALF) + d
        c1, c2 = tl.load(cos_ptr + rope, mask=m).to(tl.float32), tl.load(cos_ptr + rope + HALF, mask=m).to(tl.float32)
        s1, s2 = tl.load(sin_ptr + rope, mask=m).to(tl.float32), tl.load(sin_ptr + rope + HALF, mask=m).to(tl.float32)
        tl.store(dst, (y1 * c1 - y2 * s1).to(x1.dtype), mask=m)
        tl.store(dst + HALF, (y2 * c2 + y1 * s2).to(x1.dtype), mask=m)


@_Kernel
def _qk_norm_rope_bwd_kernel(qkv_ptr, wq_ptr, wk_ptr, cos_ptr, sin_ptr, dq_ptr, dk_ptr, dv_ptr, dqkv_ptr, dw_ptr,
                             rows, seq, heads, kv_heads, eps, dq_b, dq_h, dq_s, dk_b, dk_h, dk_s, dv_b, dv_h, dv_s,
                             HALF: tl.constexpr, BLOCK_T: tl.constexpr):
    """The forward's tile: dy = RoPE^T(dout), the weight's partial sum over the tile's rows (dy * the normed x) into
    dw [token blocks, heads + kv_heads, D], and dx = r * (dy w - x^ mean(dy w x^)) into the stacked gradient."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1)
    d = tl.arange(0, HALF)[None, :]
    m = (t < rows)[:, None]
    t64 = t[:, None].to(tl.int64)
    bi, si = t64 // seq, t64 % seq
    out = dqkv_ptr + t64 * ((heads + 2 * kv_heads) * 2 * HALF) + h * 2 * HALF + d
    if h >= heads + kv_heads:
        src = dv_ptr + bi * dv_b + (h - heads - kv_heads) * dv_h + si * dv_s + d
        tl.store(out, tl.load(src, mask=m, other=0.0), mask=m)
        tl.store(out + HALF, tl.load(src + HALF, mask=m, other=0.0), mask=m)
    else:
        if h < heads:
            w_ptr, src = wq_ptr, dq_ptr + bi * dq_b + h * dq_h + si * dq_s + d
        else:
            w_ptr, src = wk_ptr, dk_ptr + bi * dk_b + (h - heads) * dk_h + si * dk_s + d
        g1, g2 = tl.load(src, mask=m, other=0.0).to(tl.float32), tl.load(src + HALF, mask=m, other=0.0).to(tl.float32)
        x_in = qkv_ptr + t64 * ((heads + 2 * kv_heads) * 2 * HALF) + h * 2 * HALF + d
        x1, x2 = tl.load(x_in, mask=m, other=0.0), tl.load(x_in + HALF, mask=m, other=0.0)
        a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
        r = tl.rsqrt((tl.sum(a1 * a1, 1) + tl.sum(a2 * a2, 1)) / (2 * HALF) + eps)[:, None]
        rope = t64 * (2 * HALF) + d
        c1, c2 = tl.load(cos_ptr + rope, mask=m).to(tl.float32), tl.load(cos_ptr + rope + HALF, mask=m).to(tl.float32)
        s1, s2 = tl.load(sin_ptr + rope, mask=m).to(tl.float32), tl.load(sin_ptr + rope + HALF, mask=m).to(tl.float32)
        dy1, dy2 = g1 * c1 + g2 * s2, g2 * c2 - g1 * s1
        xh1, xh2 = a1 * r, a2 * r
        part = dw_ptr + (tl.program_id(0) * (heads + kv_heads) + h) * (2 * HALF) + tl.arange(0, HALF)
        tl.store(part, tl.sum(dy1 * xh1.to(x1.dtype).to(tl.float32), 0))
        tl.store(part + HALF, tl.sum(dy2 * xh2.to(x1.dtype).to(tl.float32), 0))
        w1, w2 = tl.load(w_ptr + d).to(tl.float32), tl.load(w_ptr + HALF + d).to(tl.float32)
        dn1, dn2 = dy1 * w1, dy2 * w2
        dot = ((tl.sum(dn1 * xh1, 1) + tl.sum(dn2 * xh2, 1)) / (2 * HALF))[:, None]
        tl.store(out, (r * (dn1 - xh1 * dot)).to(x1.dtype), mask=m)
        tl.store(out + HALF, (r * (dn2 - xh2 * dot)).to(x1.dtype), mask=m)


# rows a program. The backward at 128 rows / 8 warps led kernels.py's sweep on an H100 (fwd+bwd less fwd: 0.29 ms
# against 0.44, line 133), but in training on an H200 its kernel took 19.0-19.5 ms a step against 15.6 at 32 / 4
# (Qwen3 9 layers, profiles of results.jsonl lines 139-140 against 127): 32 / 4 again.
QK_NORM_ROPE_TILES = {"fwd": dict(BLOCK_T=32, num_warps=4), "bwd": dict(BLOCK_T=32, num_warps=4)}


@torch.library.custom_op("pithtrain::qk_norm_rope_fwd", mutates_args=())
def _qk_norm_rope_fwd(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor, heads: int, kv_heads: int, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows, d = qkv.shape[0], q_weight.shape[0]
    q, k, v = qkv.new_empty(rows, heads * d), qkv.new_empty(rows, kv_heads * d), qkv.new_empty(rows, kv_heads * d)
    if rows:
        tiles = QK_NORM_ROPE_TILES["fwd"]
        _qk_norm_rope_fwd_kernel[(_cdiv(rows, tiles["BLOCK_T"]), heads + 2 * kv_heads)](
            qkv, q_weight, k_weight, cos, sin, q, k, v, rows, heads, kv_heads, eps, HALF=d // 2, **tiles)
    return q, k, v


@_qk_norm_rope_fwd.register_fake
def _(qkv, q_weight, k_weight, cos, sin, heads, kv_heads, eps):
    rows, d = qkv.shape[0], q_weight.shape[0]
    return qkv.new_empty(rows, heads * d), qkv.new_empty(rows, kv_heads * d), qkv.new_empty(rows, kv_heads * d)


@torch.library.custom_op("pithtrain::qk_norm_rope_bwd", mutates_args=())
def _qk_norm_rope_bwd(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, eps: float
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq [B, heads, S, D], dk and dv [B, kv_heads, S, D] in any strides with unit stride along D. Returns the
    gradients of qkv and of both weights (fp32; the tiles' partial sums summed here, so no output's shape
    depends on the tiles, which a compiled graph's cached fake shapes would not follow)."""
    rows, d, heads, kv_heads, seq = qkv.shape[0], q_weight.shape[0], dq.shape[1], dk.shape[1], dq.shape[2]
    dqkv = torch.empty_like(qkv)
    tiles = QK_NORM_ROPE_TILES["bwd"]
    dw = qkv.new_empty(_cdiv(rows, tiles["BLOCK_T"]), heads + kv_heads, d, dtype=torch.float32)
    if rows:
        _qk_norm_rope_bwd_kernel[(_cdiv(rows, tiles["BLOCK_T"]), heads + 2 * kv_heads)](
            qkv, q_weight, k_weight, cos, sin, dq, dk, dv, dqkv, dw, rows, seq, heads, kv_heads, eps,
            dq.stride(0), dq.stride(1), dq.stride(2), dk.stride(0), dk.stride(1), dk.stride(2),
            dv.stride(0), dv.stride(1), dv.stride(2), HALF=d // 2, **tiles)
    return dqkv, dw[:, :heads].sum((0, 1)), dw[:, heads:].sum((0, 1))


@_qk_norm_rope_bwd.register_fake
def _(qkv, q_weight, k_weight, cos, sin, dq, dk, dv, eps):
    d = q_weight.shape[0]
    return torch.empty_like(qkv), qkv.new_empty(d, dtype=torch.float32), qkv.new_empty(d, dtype=torch.float32)


class _QKNormRope(torch.autograd.Function):
    """Saves the stacked projection output (the norms' input); the backward recomputes the norms from it and
    writes the gradient of all three parts into one stacked tensor: no concatenation."""

    @staticmethod
    def forward(ctx, qkv, q_weight, k_weight, cos, sin, heads: int, kv_heads: int, eps: float):
        b, s, width = qkv.shape
        d = q_weight.shape[0]
        x = qkv.reshape(b * s, width).contiguous()
        cos, sin = cos.expand(b, s, d).contiguous(), sin.expand(b, s, d).contiguous()
        q, k, v = _qk_norm_rope_fwd(x, q_weight, k_weight, cos, sin, heads, kv_heads, eps)
        ctx.save_for_backward(x, q_weight, k_weight, cos, sin)
        ctx.eps, ctx.shape = eps, qkv.shape
        return (q.view(b, s, heads, d).transpose(1, 2), k.view(b, s, kv_heads, d).transpose(1, 2),
                v.view(b, s, kv_heads, d).transpose(1, 2))

    @staticmethod
    def backward(ctx, dq, dk, dv):
        x, q_weight, k_weight, cos, sin = ctx.saved_tensors
        dq, dk, dv = (g if g.stride(-1) == 1 else g.contiguous() for g in (dq, dk, dv))
        dqkv, dwq, dwk = _qk_norm_rope_bwd(x, q_weight, k_weight, cos, sin, dq, dk, dv, ctx.eps)
        return dqkv.view(ctx.shape), dwq.to(q_weight.dtype), dwk.to(k_weight.dtype), None, None, None, None, None


def qk_norm_rope(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, heads: int, kv_heads: int, eps: float):
    """qk_norm_rope_reference on the stacked projection output qkv [B, S, (heads + 2 kv_heads) * D] (q, k, v):
    on GPUs one Triton pass forward, writing q, k and v [B, S, heads, D] (returned as [B, heads, S, D] views),
    and one backward, writing qkv's whole gradient. Its math in fp32 from the fp32 weights (the reference rounds
    them to bf16 under core.ACTIVATIONS_IN_COMPUTE_DTYPE: within the bf16 output's rounding)."""
    d = q_weight.shape[0]
    if FUSED_QK_NORM_ROPE and use_triton(qkv) and _pow2(d) == d >= 2 and qkv.dtype != torch.float64:
        return _QKNormRope.apply(qkv, q_weight, k_weight, cos, sin, heads, kv_heads, float(eps))
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    return qk_norm_rope_reference(q, k, v, q_weight, k_weight, cos, sin, eps)


# ---- Router selection: each row's k largest scores' ids (torch.topk's sort of 128 experts: 120 us a call) ----


@_Kernel
def _topk_ids_kernel(x_ptr, ids_ptr, rows, cols, K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """k rounds of a row-wise max; `alive` (not a -inf mark) keeps a taken or padded column out of later rounds,
    so rows with -inf scores (DeepSeek's masked groups) never repeat an id. NaN ranks first, as in torch.topk."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.arange(0, BLOCK_C)
    alive = (r[:, None] < rows) & (c[None, :] < cols)
    x = tl.load(x_ptr + r[:, None].to(tl.int64) * cols + c[None, :], mask=alive, other=0.0).to(tl.float32)
    x = tl.where(x != x, float("inf"), x)
    for j in tl.static_range(K):
        best = tl.max(tl.where(alive, x, float("-inf")), axis=1)
        idx = tl.min(tl.where(alive & (x == best[:, None]), c[None, :], BLOCK_C), axis=1)
        tl.store(ids_ptr + r.to(tl.int64) * K + j, idx.to(tl.int64), mask=r < rows)
        alive = alive & (c[None, :] != idx[:, None])


@torch.library.custom_op("pithtrain::topk_ids", mutates_args=())
def _topk_ids(x: torch.Tensor, k: int) -> torch.Tensor:
    rows, cols = x.shape
    ids = x.new_empty(rows, k, dtype=torch.int64)
    if ids.numel():
        block_c = _pow2(cols)
        block_r = max(1, 2048 // block_c)
        _topk_ids_kernel[(_cdiv(rows, block_r),)](x, ids, rows, cols, K=k, BLOCK_R=block_r, BLOCK_C=block_c)
    return ids


@_topk_ids.register_fake
def _(x, k):
    return x.new_empty(x.shape[0], k, dtype=torch.int64)


def topk_ids(x: torch.Tensor, k: int) -> torch.Tensor:
    """torch.topk(x, k, dim=-1).indices for a 2-D x of up to 1024 columns: largest first, ties to the lower id.
    The selection only (no gradient): a caller gathers its weights from x, where autograd sees them."""
    if use_triton(x) and x.dim() == 2 and 0 < k <= x.shape[1] <= 1024:
        return _topk_ids(x.detach().contiguous(), k)
    return torch.topk(x, k, dim=-1).indices


# ---- Gradient accumulation: an fp32 gradient += a bf16 weight gradient ----


@_Kernel
def _add_into_kernel(dst_ptr, src_ptr, n, ASSIGN: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(src_ptr + offs, mask=mask).to(tl.float32)
    if not ASSIGN:
        x += tl.load(dst_ptr + offs, mask=mask)
    tl.store(dst_ptr + offs, x, mask=mask)


def add_into(dst: torch.Tensor, src: torch.Tensor, assign: bool = False) -> torch.Tensor:
    """dst += src (dst = src with `assign`) in place, for an fp32 dst. On CUDA one vectorised pass:
    PyTorch's own mixed-dtype add (fp32 += bf16) takes its slow dynamic-casting loop, measured at
    a third of the stage-3 backward of a Qwen3-width layer on the H200 (the experts' weight
    gradients, added once per micro-batch)."""
    if (use_triton(dst) and dst.dtype == torch.float32 and src.dtype != torch.float32 and dst.shape == src.shape
            and dst.is_contiguous() and src.is_contiguous() and dst.numel()):
        block = 4096
        _add_into_kernel[(_cdiv(dst.numel(), block),)](dst, src, dst.numel(), ASSIGN=assign, BLOCK=block, num_warps=8)
    elif assign:
        dst.copy_(src)
    else:
        dst.add_(src)
    return dst


@_Kernel
def _wgrad_into_kernel(x_ptr, dy_ptr, ends_ptr, grad_ptr, x_td, dy_td, g_td, experts, k_dim, m_dim, x_stride,
                       dy_stride, ASSIGN: tl.constexpr, TMA: tl.constexpr, HOST: tl.constexpr, REDUCE: tl.constexpr,
                       BK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """grad[e] (+)= x[rows of e]^T @ dy[rows of e] in fp32, a program per (K block, M block) of expert e: its
    rows in order, the add in the epilogue. TMA (Hopper): x and dy tiles through tensor descriptors bounded to
    the expert's rows (zero-filled past them), x transposed in shared memory; else pointer loads. HOST (with
    TMA): descriptors made on the host over all rows, so the expert's partial tile is read as the BN rows
    ending at its end, the ones before it masked out of dy. REDUCE (Hopper): the tile leaves through a
    descriptor of grad, added in L2 by a bulk reduce (cp.reduce.async.bulk) without waiting for the old
    values; one add an element a launch: the load-add-store's sums, bit for bit. (Persistent programs
    looping over the items measured slower: docs/performance.md, Kernels.)"""
    tile, e = tl.program_id(0), tl.program_id(1)
    m_tiles = tl.cdiv(m_dim, BM)
    k0 = tile // m_tiles * BK
    m0 = tile % m_tiles * BM
    rk = k0 + tl.arange(0, BK)
    rm = m0 + tl.arange(0, BM)
    start = tl.load(ends_ptr + e - 1, mask=e > 0, other=0)
    end = tl.load(ends_ptr + e)
    acc = tl.zeros([BK, BM], dtype=tl.float32)
    if HOST:
        whole = start + (end - start) // BN * BN
        for r0 in range(start, whole, BN):
            acc = tl.dot(x_td.load([r0, k0]).T, dy_td.load([r0, m0]), acc)
        if whole < end:  # the BN rows ending at `end`; dy zeroed before `whole` (counted, or another expert's)
            r0 = end - BN
            keep = (r0 + tl.arange(0, BN)) >= whole
            acc = tl.dot(x_td.load([r0, k0]).T, tl.where(keep[:, None], dy_td.load([r0, m0]), 0.0), acc)
    elif TMA:
        rows = tl.maximum(end - start, 1)  # a descriptor needs a row; an empty expert's loop never reads it
        x_desc = tl.make_tensor_descriptor(x_ptr + start.to(tl.int64) * x_stride, shape=[rows, k_dim],
                                           strides=[x_stride, 1], block_shape=[BN, BK])
        dy_desc = tl.make_tensor_descriptor(dy_ptr + start.to(tl.int64) * dy_stride, shape=[rows, m_dim],
                                            strides=[dy_stride, 1], block_shape=[BN, BM])
        for r0 in range(0, end - start, BN):
            acc = tl.dot(x_desc.load([r0, k0]).T, dy_desc.load([r0, m0]), acc)
    else:
        for r0 in range(start, end, BN):
            r = r0 + tl.arange(0, BN)
            x = tl.load(x_ptr + r.to(tl.int64)[None, :] * x_stride + rk[:, None],
                        mask=(r < end)[None, :] & (rk < k_dim)[:, None], other=0.0)
            dy = tl.load(dy_ptr + r.to(tl.int64)[:, None] * dy_stride + rm[None, :],
                         mask=(r < end)[:, None] & (rm < m_dim)[None, :], other=0.0)
            acc = tl.dot(x, dy, acc)
    if REDUCE:
        if HOST:
            g_desc = g_td
        else:
            g_desc = tl.make_tensor_descriptor(grad_ptr, shape=[experts, k_dim, m_dim],
                                               strides=[k_dim * m_dim, m_dim, 1], block_shape=[1, BK, BM])
        if ASSIGN:
            g_desc.store([e, k0, m0], tl.reshape(acc, [1, BK, BM]))
        else:
            g_desc.atomic_add([e, k0, m0], tl.reshape(acc, [1, BK, BM]))
    else:
        offs = e.to(tl.int64) * k_dim * m_dim + rk.to(tl.int64)[:, None] * m_dim + rm[None, :]
        mask = (rk < k_dim)[:, None] & (rm < m_dim)[None, :]
        if not ASSIGN:
            acc += tl.load(grad_ptr + offs, mask=mask, other=0.0)
        tl.store(grad_ptr + offs, acc, mask=mask)


# Tiles of grad (BK x BM) and rows a step (BN): 1-7% ahead of BN=64 / 3 stages in interleaved sweeps
# (benchmarks/grouped_gemm.py --wgrad --sweep), +0.46% in training (docs/performance.md, Kernels).
WGRAD_INTO_CONFIG = dict(BK=128, BM=128, BN=32, num_warps=4, num_stages=4)
# The descriptors made once a launch on the host, not by each of ~25k programs (written to global memory and
# fenced before their first load): 2.02 against 2.11 ms (gate_up) and 1.11 against 1.16 (down) at Qwen3 width on
# an H100 (benchmarks/grouped_gemm.py --wgrad, 2026-12-05); train_throughput.py --ab wgrad-host.
WGRAD_HOST_DESCRIPTORS = True


def _scratch(size: int, alignment: int, stream) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _tma_ok(*tensors: torch.Tensor) -> bool:
    """Tensor descriptors need Hopper or later, a Triton that makes them on the device (3.4+), and
    16-byte aligned bases and row strides."""
    return (tensors[0].is_cuda and _device_descriptors(tensors[0].device)
            and all(t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0 for t in tensors))


@functools.cache
def _device_descriptors(device: torch.device) -> bool:
    import triton.language  # binds `triton` too

    return (torch.cuda.get_device_capability(device)[0] >= 9 and hasattr(triton, "set_allocator")
            and hasattr(triton.language, "make_tensor_descriptor")
            and hasattr(triton.language.tensor_descriptor, "atomic_add"))


def wgrad_into(grad: torch.Tensor, x: torch.Tensor, dy: torch.Tensor, counts: torch.Tensor, assign: bool,
               cfg: dict | None = None, tma: bool | None = None, reduce: bool | None = None,
               host: bool | None = None) -> torch.Tensor:
    """grad[e] += x_e^T @ dy_e (= with `assign`) in place, for fp32 grad [E, K, M] contiguous and x [N, K],
    dy [N, M] rows grouped by expert (counts [E]): the Triton launch (CUDA, or the interpreter). The
    row offsets are a cumsum on the device (no host sync); an expert with no rows gets zeros (assign).
    `tma`: the tensor-descriptor loads; `reduce`: the epilogue through a descriptor of grad (defaults:
    where the GPU and the alignment allow them; the interpreter has no bulk reduce); `host` (with tma):
    those descriptors made on the host (default WGRAD_HOST_DESCRIPTORS)."""
    x, dy = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, dy))
    cfg = cfg or WGRAD_INTO_CONFIG
    tma = _tma_ok(x, dy) if tma is None else tma
    reduce = (tma and _tma_ok(grad.view(-1, grad.shape[-1]))) if reduce is None else reduce
    host = tma and x.shape[0] > 0 and (WGRAD_HOST_DESCRIPTORS if host is None else host)
    tds = (None, None, None)
    if host:
        from triton.tools.tensor_descriptor import TensorDescriptor

        bk, bm, bn = cfg["BK"], cfg["BM"], cfg["BN"]
        tds = (TensorDescriptor.from_tensor(x, [bn, bk]), TensorDescriptor.from_tensor(dy, [bn, bm]),
               TensorDescriptor.from_tensor(grad, [1, bk, bm]) if reduce else None)
    elif tma or reduce:  # device-side descriptors live in a scratch buffer Triton asks for. Its allocator is a
        import triton  # context variable, so per thread (the backward runs on autograd's): set at every launch

        triton.set_allocator(_scratch)
    experts, k_dim, m_dim = grad.shape
    if grad.numel():
        grid = (_cdiv(k_dim, cfg["BK"]) * _cdiv(m_dim, cfg["BM"]), experts)
        _wgrad_into_kernel[grid](x, dy, counts.cumsum(0).to(x.device, torch.int32), grad, *tds, experts, k_dim,
                                 m_dim, x.stride(0), dy.stride(0), ASSIGN=assign, TMA=tma, HOST=host, REDUCE=reduce, **cfg)
    return grad


# ---- Muon's elementwise passes (train/optim.Muon): one read of each fp32 state per step ----
# A Muon parameter is viewed as [rows, halves * inner] (rows = E * per_half for an expert stack
# [E, per_half, halves * inner]); its update lives in the Newton-Schulz batch as E * halves contiguous
# [per_half, inner] matrices (an expert's gate and up apart). Launched eagerly (the optimizer is not
# compiled), so no custom_op wrappers.


def _muon_shape(p: torch.Tensor, halves: int) -> tuple[int, int, int]:
    return p.numel() // p.shape[-1], p.shape[-2], p.shape[-1] // halves  # rows, per_half, inner


def muon_momentum_reference(grad, buf, mu: float, out, halves: int) -> None:
    rows, per_half, inner = _muon_shape(grad, halves)
    buf.mul_(mu).add_(grad)
    update = grad.add(buf, alpha=mu)  # Nesterov
    out.view(-1, halves, per_half, inner).copy_(update.view(-1, per_half, halves, inner).transpose(1, 2))


def muon_apply_reference(weight, update, decay: float, step: float, halves: int) -> None:
    rows, per_half, inner = _muon_shape(weight, halves)
    weight.view(-1, per_half, halves, inner).mul_(decay).add_(update.view(-1, halves, per_half, inner).transpose(1, 2),
                                                              alpha=-step)


@_Kernel
def _muon_kernel(src_ptr, state_ptr, dst_ptr, rows, per_half, inner, halves, mu, decay, step,
                 MOMENTUM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """MOMENTUM: state (the momentum) <- mu state + src (the gradient); dst <- src + mu state, in dst's
    dtype. Otherwise: state (the weight) <- decay state - step src (the update, in the batch layout)."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    k = tl.program_id(2)  # which half
    mask = (r < rows)[:, None] & (c < inner)[None, :]
    flat = r.to(tl.int64)[:, None] * (halves * inner) + k * inner + c[None, :]
    batch = ((r // per_half * halves + k).to(tl.int64) * per_half + r % per_half)[:, None] * inner + c[None, :]
    if MOMENTUM:
        g = tl.load(src_ptr + flat, mask=mask).to(tl.float32)
        b = tl.load(state_ptr + flat, mask=mask).to(tl.float32) * mu + g
        tl.store(state_ptr + flat, b.to(state_ptr.dtype.element_ty), mask=mask)
        tl.store(dst_ptr + batch, (g + mu * b).to(dst_ptr.dtype.element_ty), mask=mask)
    else:
        u = tl.load(src_ptr + batch, mask=mask).to(tl.float32)
        w = tl.load(state_ptr + flat, mask=mask).to(tl.float32)
        tl.store(state_ptr + flat, (w * decay - step * u).to(state_ptr.dtype.element_ty), mask=mask)


def _muon_launch(src, state, dst, halves, mu=0.0, decay=1.0, step=0.0):
    rows, per_half, inner = _muon_shape(state, halves)
    momentum = dst is not None
    if rows * inner:
        block_c = min(256, _pow2(inner))
        block_r = max(1, 4096 // block_c)
        grid = (_cdiv(rows, block_r), _cdiv(inner, block_c), halves)
        _muon_kernel[grid](src, state, dst if momentum else src, rows, per_half, inner, halves, mu, decay, step,
                           MOMENTUM=momentum, BLOCK_R=block_r, BLOCK_C=block_c)


def muon_momentum(grad: torch.Tensor, buf: torch.Tensor, mu: float, out: torch.Tensor, halves: int = 1) -> None:
    """buf <- mu buf + grad; out <- grad + mu buf (Nesterov), cast to out's dtype, written as the
    E * halves matrices [.., rows, cols / halves] of a Newton-Schulz batch (out: contiguous)."""
    if use_triton(grad) and grad.is_contiguous() and buf.is_contiguous() and out.is_contiguous():
        _muon_launch(grad, buf, out, halves, mu=mu)
    else:
        muon_momentum_reference(grad, buf, mu, out, halves)


def muon_apply(weight: torch.Tensor, update: torch.Tensor, decay: float, step: float, halves: int = 1) -> None:
    """weight <- decay weight - step update: decoupled weight decay and the scaled update in one pass
    (update in muon_momentum's batch layout, any float dtype; weight contiguous on the Triton path)."""
    if use_triton(weight) and weight.is_contiguous() and update.is_contiguous():
        _muon_launch(update, weight, None, halves, decay=decay, step=step)
    else:
        muon_apply_reference(weight, update, decay, step, halves)


# ---- AdamW as one pass a parameter (train/optim.TRITON_ADAMW): the clip coefficient applied as the gradient is
# read, and the compute-dtype copy the experts' GEMMs read written with the new weight ----


def adamw_reference(p, g, m, v, copy, lr: float, beta1: float, beta2: float, eps: float, decay: float, step: int,
                    scale: float, amax=None) -> None:
    """torch's AdamW update in place (decoupled decay lr * decay; bias corrections of `step`, 1-based) on the
    gradient times `scale`; `copy` (or None) <- the new p in its dtype; `amax` (or None) <- the new |p|'s maxima
    per row of p viewed as [B, R, C], then per column ([B * R] then [B * C], ops/fp8.quantize_both's order)."""
    g = g * scale
    p.mul_(1 - lr * decay)
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    denom = (v.sqrt() / math.sqrt(1 - beta2**step)).add_(eps)
    p.addcdiv_(m, denom, value=-lr / (1 - beta1**step))
    if copy is not None:
        copy.copy_(p)
    if amax is not None:
        a = p.detach().abs().reshape(-1, *p.shape[-2:])
        amax.copy_(torch.cat([a.amax(-1).flatten(), a.amax(-2).flatten()]))


@_Kernel
def _adamw_kernel(p_ptr, g_ptr, m_ptr, v_ptr, copy_ptr, amax_ptr, batch, rows, cols, lr, beta1, beta2, eps, keep,
                  step_size, bc2_sqrt, scale, COPY: tl.constexpr, AMAX: tl.constexpr, BR: tl.constexpr,
                  BC: tl.constexpr, STEPS: tl.constexpr):
    """A [STEPS * BR, BC] tile of p viewed as [batch, rows, cols] a program (a flat p: [1, 1, n], BR = 1). AMAX: also
    the new |p|'s maxima per row into amax[:batch * rows] and per column into amax[batch * rows:] (atomic max of
    non-negative floats: order-independent), which ops/fp8.quantize_both would otherwise read p again for."""
    b, n_c = tl.program_id(1), tl.cdiv(cols, BC)
    c = (tl.program_id(0) % n_c).to(tl.int64) * BC + tl.arange(0, BC)  # a flat p's columns pass 2^31 values
    col_max = tl.zeros([BC], dtype=tl.float32)
    for i in range(STEPS):
        r = ((tl.program_id(0) // n_c) * STEPS + i) * BR + tl.arange(0, BR)
        mask = (r < rows)[:, None] & (c < cols)[None, :]
        offs = b.to(tl.int64) * rows * cols + r.to(tl.int64)[:, None] * cols + c[None, :]
        g = tl.load(g_ptr + offs, mask=mask).to(tl.float32) * scale
        p = tl.load(p_ptr + offs, mask=mask) * keep
        m = beta1 * tl.load(m_ptr + offs, mask=mask) + (1 - beta1) * g
        v = beta2 * tl.load(v_ptr + offs, mask=mask) + (1 - beta2) * g * g
        p -= step_size * m / (tl.sqrt(v) / bc2_sqrt + eps)
        tl.store(p_ptr + offs, p, mask=mask)
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)
        if COPY:
            tl.store(copy_ptr + offs, p.to(copy_ptr.dtype.element_ty), mask=mask)
        if AMAX:
            a = tl.where(mask, tl.abs(p), 0.0)
            tl.atomic_max(amax_ptr + b * rows + r, tl.max(a, 1), mask=r < rows)
            col_max = tl.maximum(col_max, tl.max(a, 0))
    if AMAX:
        tl.atomic_max(amax_ptr + batch * rows + b * cols + c, col_max, mask=c < cols)


ADAMW_AMAX_TILE = dict(BR=16, BC=128, STEPS=8)  # 128 x 128 values a program: as many atomics a value as quantize_both's


def adamw(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, copy: torch.Tensor | None, lr: float,
          beta1: float, beta2: float, eps: float, decay: float, step: int, scale: float = 1.0,
          amax: torch.Tensor | None = None) -> None:
    """adamw_reference in one pass over fp32 p, m, v (contiguous) and g: 28 bytes a value, plus the copy's; `amax`
    (an FP8 weight's, p at least 2-D) costs no extra read."""
    if not (use_triton(p) and all(t.is_contiguous() for t in (p, g, m, v)) and p.dtype == m.dtype == v.dtype == torch.float32):
        adamw_reference(p, g, m, v, copy, lr, beta1, beta2, eps, decay, step, scale, amax)
        return
    if not p.numel():
        return
    if amax is not None:
        rows, cols = p.shape[-2:]
        batch, tile = p.numel() // (rows * cols), ADAMW_AMAX_TILE
        grid = (_cdiv(rows, tile["BR"] * tile["STEPS"]) * _cdiv(cols, tile["BC"]), batch)
        amax.zero_()
    else:
        batch, rows, cols, tile = 1, 1, p.numel(), dict(BR=1, BC=2048, STEPS=1)
        grid = (_cdiv(cols, 2048), 1)
    _adamw_kernel[grid](p, g, m, v, p if copy is None else copy, p if amax is None else amax, batch, rows, cols, lr,
                        beta1, beta2, eps, 1 - lr * decay, lr / (1 - beta1**step), math.sqrt(1 - beta2**step), scale,
                        COPY=copy is not None, AMAX=amax is not None, **tile)
