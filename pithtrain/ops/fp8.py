"""FP8 training numerics (`train.fp8`): e4m3 GEMMs with fp32 scales per row, and cached weights.

The recipe. Every GEMM operand is quantized along its contraction dimension with one fp32 scale
per row (`q = x / s`, `s = amax(|row|) / 448`), so a scale factors out of the dot product and is
applied to the fp32 accumulator at the end. For Y = X W (X: tokens x K):

  forward   Y  = X  W     X row-wise (a scale per token), W per output column  (along K)
  dgrad     dX = dY W^T   dY row-wise (per token), W per input row              (along M)
  wgrad     dW = X^T dY   X and dY per column along the tokens: transposed copies
                          (experts: one scale per expert and column, so the scales only span the
                          expert's own rows). Recipe `rowwise_bf16_wgrad`: this GEMM in bf16 on
                          the saved bf16 X instead (no transposed copies to make)

Weights are quantized once per weight update into both layouts (forward and dgrad; on CUDA by one
kernel, `quantize_both`, without a transposed fp32 copy) and reused by every micro-batch, pipeline
chunk and backward: `cached_weight` keys them by the parameter's version counter, which every
in-place update bumps (`optim.optimizer_step`, checkpoint loads; FSDP's all-gather writes the
unsharded weight in place, keeping its version: the key holds the optimizer step too).
`rowwise` saves activations for the weight gradient as their transposed FP8 copies (1 byte a value).

Paths: on CUDA, Triton kernels for quantization and the expert grouped GEMMs, and
`torch._scaled_mm` for dense projections; elsewhere (`train.fp8_emulate` on the CPU) the same
quantization in plain PyTorch and the GEMMs emulated on the dequantized values in fp32. The
plain path is the reference the GPU path is tested against (tests/gpu/test_fp8_gpu.py).
The experts' FP8 autograd function (`fp8_expert_mm`) lives in ops/grouped_gemm.py, beside the bf16
one whose weight-gradient helpers it shares.
"""

from __future__ import annotations  # keeps the kernels' `tl.constexpr` annotations unevaluated

import torch
import torch.nn.functional as F
from torch import nn

from pithtrain.config import ConfigError
from pithtrain.ops import core, kernels
from pithtrain.ops.kernels import _cdiv, _glu_bwd, _Kernel, _pow2, use_triton
from pithtrain.protocol import all_layers

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
_TINY = 1e-12  # scale floor: an all-zero row quantizes to zeros


# ---- References (the CPU path and the oracle of the GPU tests) ----


def quantize_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (last dimension) scaled e4m3: returns q (FP8, x's shape) and s (fp32, x.shape[:-1])
    with x ~= q * s."""
    xf = x.float()
    s = xf.abs().amax(-1).clamp(min=_TINY) / FP8_MAX
    inv = 1.0 / s  # one division a row, then products: what the kernels do, bit for bit
    q = (xf * inv.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, s


def dequantize(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return q.float() * s.unsqueeze(-1)


SEGMENT_ALIGN = 128  # transposed copies start each expert's rows at a multiple of this (zero padded)


def t_width(rows: int, groups: int) -> int:
    """Columns of a transposed copy: every segment padded to SEGMENT_ALIGN fits (no host sync needed)."""
    return SEGMENT_ALIGN * (_cdiv(rows, SEGMENT_ALIGN) + groups - 1)


def quantize_t_reference(x: torch.Tensor, counts: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, K] -> its transpose [K, t_width] in FP8, scaled per column of x within each segment of
    rows (`counts` rows per expert; None: one segment). Segment g starts at column
    SEGMENT_ALIGN * sum_{j<g} ceil(counts[j] / SEGMENT_ALIGN); the rest is zeros, so the weight
    gradient's loop needs no masks. Returns (qt, s) with s [E, K] (E = 1 without counts)."""
    n, k = x.shape
    if counts is None:  # one segment, no host loop (compiles): zero columns quantize to zeros
        q, s = quantize_reference(F.pad(x.t(), (0, t_width(n, 1) - n)))
        return q.contiguous(), s.unsqueeze(0)  # contiguous: _scaled_mm reads its transpose as column-major
    counts = counts.cpu()
    qt = torch.zeros(k, t_width(n, len(counts)), dtype=torch.uint8, device=x.device)
    scales, col = [], 0
    for seg in x.split(counts.tolist()):
        if seg.shape[0] == 0:  # an expert with no rows: the kernels' scale for it
            scales.append(torch.full((k,), _TINY / FP8_MAX, device=x.device))
            continue
        q, s = quantize_reference(seg.t())
        qt[:, col : col + seg.shape[0]] = q.view(torch.uint8)
        scales.append(s)
        col += _cdiv(seg.shape[0], SEGMENT_ALIGN) * SEGMENT_ALIGN
    return qt.view(FP8), torch.stack(scales)


def scaled_mm_reference(a, sa, b, sb, out_dtype) -> torch.Tensor:
    """(a * sa) @ (b * sb)^T from FP8 operands [M, K] and [N, K], accumulated in fp32."""
    return (dequantize(a, sa) @ dequantize(b, sb).t()).to(out_dtype)


def grouped_mm_reference(a, sa, b, sb, counts, out_dtype) -> torch.Tensor:
    """Row group g of a [N, K] times b[g]^T ([E, M, K]), scales sa [N] and sb [E, M]."""
    out, start = [], 0
    for g, c in enumerate(counts.tolist()):
        out.append(scaled_mm_reference(a[start : start + c], sa[start : start + c], b[g], sb[g], out_dtype))
        start += c
    return torch.cat(out) if out else a.new_zeros(0, b.shape[1], dtype=out_dtype)


def grouped_wgrad_reference(xt, sx, dyt, sdy, counts) -> torch.Tensor:
    """dW[g] = x_g^T dy_g from the transposed copies xt [K, W], dyt [M, W] (quantize_t's layout,
    scales [E, K], [E, M]): [E, K, M] in fp32."""
    out, col = [], 0
    for g, c in enumerate(counts.tolist()):
        seg = slice(col, col + c)
        out.append(dequantize(xt[:, seg], sx[g]) @ dequantize(dyt[:, seg], sdy[g]).t())
        col += _cdiv(c, SEGMENT_ALIGN) * SEGMENT_ALIGN
    return torch.stack(out)


# ---- Triton kernels (CUDA) ----


@_Kernel
def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, rows, cols, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Row-wise scaled e4m3 of BLOCK_R whole rows (cols <= BLOCK_C)."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.arange(0, BLOCK_C)
    mask = (r < rows)[:, None] & (c < cols)[None, :]
    offs = r.to(tl.int64)[:, None] * cols + c[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), 1), 1e-12), tl.full([BLOCK_R], 448.0, tl.float32))
    inv = tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s)  # exact, once a row; products after
    q = tl.clamp(x * inv[:, None], -448.0, 448.0)
    tl.store(q_ptr + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + r, s, mask=r < rows)


@_Kernel
def _glu_quant_kernel(x_ptr, out_ptr, q_ptr, s_ptr, rows, inter, alpha, limit,
                      CLAMPED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """The experts' (clamped) SwiGLU of BLOCK_R whole rows of gate_up [N, 2I] (kernels._glu_fwd_kernel's
    math) and the row-wise FP8 of the stored result (_quant_rows_kernel's, bit for bit): the down
    projection's FP8 input without a second read of the activation."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.arange(0, BLOCK_C)
    mask = (r < rows)[:, None] & (c < inter)[None, :]
    gate_at = x_ptr + r.to(tl.int64)[:, None] * (2 * inter) + c[None, :]
    g = tl.load(gate_at, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gate_at + inter, mask=mask, other=0.0).to(tl.float32)
    if CLAMPED:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        a = (u + 1.0) * (g * tl.sigmoid(alpha * g))
    else:
        a = g * tl.sigmoid(g) * u
    a = tl.where(mask, a, 0.0).to(out_ptr.dtype.element_ty)  # padding lanes stay out of the row maxima
    offs = r.to(tl.int64)[:, None] * inter + c[None, :]
    tl.store(out_ptr + offs, a, mask=mask)
    x = a.to(tl.float32)  # what quantize() would read back
    s = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), 1), 1e-12), tl.full([BLOCK_R], 448.0, tl.float32))
    inv = tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s)
    tl.store(q_ptr + offs, tl.clamp(x * inv[:, None], -448.0, 448.0).to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + r, s, mask=r < rows)


@_Kernel
def _quant_expand_kernel(x_ptr, dest_ptr, q_ptr, s_ptr, cols, TOPK: tl.constexpr, BLOCK_C: tl.constexpr):
    """Token row t of x quantized (_quant_rows_kernel's math, bit for bit) and stored, with its scale, at its TOPK
    expanded rows dest[t * TOPK + j] (kernels._expand_rows_kernel's placement): each token read once."""
    t = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    x = tl.load(x_ptr + t * cols + c, mask=c < cols, other=0.0).to(tl.float32)
    s = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), 0), 1e-12), 448.0)
    inv = tl.math.div_rn(1.0, s)
    q = tl.clamp(x * inv, -448.0, 448.0).to(q_ptr.dtype.element_ty)
    for j in tl.static_range(TOPK):
        row = tl.load(dest_ptr + t * TOPK + j).to(tl.int64)
        tl.store(q_ptr + row * cols + c, q, mask=c < cols)
        tl.store(s_ptr + row, s)


@_Kernel
def _quant_wide_rows_kernel(x_ptr, q_ptr, s_ptr, cols, BLOCK_C: tl.constexpr):
    """_quant_rows_kernel for one row wider than a program holds (the LM head's gradient: a row per
    token over the vocabulary): its amax over blocks of BLOCK_C, then the blocks again (from L2)."""
    row = tl.program_id(0).to(tl.int64) * cols
    c = tl.arange(0, BLOCK_C)
    amax = tl.zeros([BLOCK_C], tl.float32)
    for start in range(0, cols, BLOCK_C):
        x = tl.load(x_ptr + row + start + c, mask=start + c < cols, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    s = tl.math.div_rn(tl.maximum(tl.max(amax, 0), 1e-12), 448.0)
    inv = tl.math.div_rn(1.0, s)
    for start in range(0, cols, BLOCK_C):
        mask = start + c < cols
        x = tl.load(x_ptr + row + start + c, mask=mask, other=0.0).to(tl.float32)
        tl.store(q_ptr + row + start + c, tl.clamp(x * inv, -448.0, 448.0).to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + tl.program_id(0), s)


@_Kernel
def _segment_colmax_kernel(x_ptr, counts_ptr, amax_ptr, cols, num_seg, splits,
                           SEG_P2: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """amax[g, c] = max |x[r, c]| over the rows r of segment g; `splits` programs share a segment
    (atomic max of non-negative floats: order-independent, so deterministic)."""
    g = tl.program_id(0)
    split = tl.program_id(2)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    idx = tl.arange(0, SEG_P2)
    counts = tl.load(counts_ptr + idx, mask=idx < num_seg, other=0)
    ends = tl.cumsum(counts, 0)
    end = tl.sum(tl.where(idx == g, ends, 0), 0)
    start = end - tl.sum(tl.where(idx == g, counts, 0), 0)
    per = tl.cdiv(tl.cdiv(end - start, splits), BLOCK_R) * BLOCK_R
    lo = start + split * per
    hi = tl.minimum(lo + per, end)
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    for r0 in range(lo, hi, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        x = tl.load(x_ptr + r.to(tl.int64)[:, None] * cols + c[None, :],
                    mask=(r < hi)[:, None] & (c < cols)[None, :], other=0.0)
        acc = tl.maximum(acc, tl.max(tl.abs(x.to(tl.float32)), 0))
    tl.atomic_max(amax_ptr + g * cols + c, acc, mask=c < cols)


@_Kernel
def _quant_t_kernel(x_ptr, counts_ptr, s_ptr, qt_ptr, cols, width, num_seg, splits,
                    SEG_P2: tl.constexpr, ALIGN: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """qt[c, p + i] = x[start + i, c] / s[g, c] in e4m3 for the rows of segment g, p its padded start
    (quantize_t_reference's layout); zeros up to the segment's padded end."""
    g = tl.program_id(0)
    split = tl.program_id(2)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    idx = tl.arange(0, SEG_P2)
    counts = tl.load(counts_ptr + idx, mask=idx < num_seg, other=0)
    padded = (counts + ALIGN - 1) // ALIGN * ALIGN
    sel = idx == g
    end = tl.sum(tl.where(sel, tl.cumsum(counts, 0), 0), 0)
    start = end - tl.sum(tl.where(sel, counts, 0), 0)
    length = tl.sum(tl.where(sel, padded, 0), 0)
    pstart = tl.sum(tl.where(sel, tl.cumsum(padded, 0), 0), 0) - length
    per = tl.cdiv(tl.cdiv(length, splits), BLOCK_R) * BLOCK_R
    lo = split * per
    hi = tl.minimum(lo + per, length)
    s = tl.load(s_ptr + g * cols + c, mask=c < cols, other=1.0)
    inv = tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s)
    for i0 in range(lo, hi, BLOCK_R):
        i = i0 + tl.arange(0, BLOCK_R)
        r = start + i
        x = tl.load(x_ptr + r.to(tl.int64)[:, None] * cols + c[None, :],
                    mask=(r < end)[:, None] & (c < cols)[None, :], other=0.0).to(tl.float32)
        q = tl.clamp(x * inv[None, :], -448.0, 448.0).to(qt_ptr.dtype.element_ty)
        tl.store(qt_ptr + c.to(tl.int64)[None, :] * width + (pstart + i)[:, None], q, mask=(c < cols)[None, :])


@_Kernel
def _quant_both_kernel(x_ptr, row_ptr, col_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, rows, cols,
                       BR: tl.constexpr, BC: tl.constexpr, AMAX: tl.constexpr):
    """A tile of x[b] ([B, rows, cols]) a program. AMAX: the maxima of |x| per row into row_ptr [B, rows]
    and per column into col_ptr [B, cols] (atomic max of non-negative floats: order-independent).
    Then: the tile, read once, quantized with both scales into q[b] (x's layout, a scale per row) and
    qt[b] ([cols, rows], a scale per column of x), stored as the tile is laid out (transposing it in registers
    measured the same: 1.346 against 1.338 ms at [128, 2048, 1536], benchmarks/fp8.py --wquant, line 150)."""
    b, n_c = tl.program_id(1), tl.cdiv(cols, BC)
    pid_r, pid_c = tl.program_id(0) // n_c, tl.program_id(0) % n_c
    r, c = pid_r * BR + tl.arange(0, BR), pid_c * BC + tl.arange(0, BC)
    rm, cm = r < rows, c < cols
    base = b.to(tl.int64) * rows * cols
    x = tl.load(x_ptr + base + r[:, None] * cols + c[None, :], mask=rm[:, None] & cm[None, :], other=0.0)
    x = x.to(tl.float32)
    if AMAX:
        tl.atomic_max(row_ptr + b * rows + r, tl.max(tl.abs(x), 1), mask=rm)
        tl.atomic_max(col_ptr + b * cols + c, tl.max(tl.abs(x), 0), mask=cm)
    else:  # quantize_reference's scales and products, bit for bit
        sr = tl.maximum(tl.load(row_ptr + b * rows + r, mask=rm, other=0.0), 1e-12)
        sc = tl.maximum(tl.load(col_ptr + b * cols + c, mask=cm, other=0.0), 1e-12)
        sr = tl.math.div_rn(sr, tl.full([BR], 448.0, tl.float32))
        sc = tl.math.div_rn(sc, tl.full([BC], 448.0, tl.float32))
        inv_r = tl.math.div_rn(tl.full([BR], 1.0, tl.float32), sr)
        inv_c = tl.math.div_rn(tl.full([BC], 1.0, tl.float32), sc)
        q = tl.clamp(x * inv_r[:, None], -448.0, 448.0).to(q_ptr.dtype.element_ty)
        tl.store(q_ptr + base + r[:, None] * cols + c[None, :], q, mask=rm[:, None] & cm[None, :])
        qt = tl.clamp(x * inv_c[None, :], -448.0, 448.0).to(qt_ptr.dtype.element_ty)
        tl.store(qt_ptr + base + c[None, :] * rows + r[:, None], qt, mask=rm[:, None] & cm[None, :])
        if pid_c == 0:
            tl.store(s_ptr + b * rows + r, sr, mask=rm)
        if pid_r == 0:
            tl.store(st_ptr + b * cols + c, sc, mask=cm)


@_Kernel
def _grouped_mm_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, counts_ptr, c_ptr, rows, n_out, k_dim, num_groups,
                       GROUPS_P2: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                       EVEN_K: tl.constexpr, PERSISTENT: tl.constexpr = False):
    """c[rows of g] = (a[rows of g] * sa) @ (b[g] * sb[g])^T; a [rows, K], b [G, n_out, K] (both
    K-contiguous FP8), rows grouped by g. An output tile's group and row block come from the per-group
    tile counts, so no host knows the counts (no sync). A program owns one tile (the grid: an upper bound
    of their number); PERSISTENT: the grid is a few programs an SM, each taking every grid-th tile in one
    flattened loop, so the next tile's loads overlap this one's epilogue (few K steps to hide it in)."""
    n_tiles = tl.cdiv(n_out, BN)
    idx = tl.arange(0, GROUPS_P2)
    counts = tl.load(counts_ptr + idx, mask=idx < num_groups, other=0)
    ends = tl.cumsum(counts, 0)
    tiles = (counts + BM - 1) // BM
    tile_ends = tl.cumsum(tiles, 0)
    total = tl.sum(tiles, 0) * n_tiles
    if PERSISTENT:
        first, last, step = tl.program_id(0), total, tl.num_programs(0)
    else:
        first, last, step = tl.program_id(0), tl.minimum(tl.program_id(0) + 1, total), 1
    rk = tl.arange(0, BK)
    for pid in tl.range(first, last, step, flatten=PERSISTENT):
        pid_m, pid_n = pid // n_tiles, pid % n_tiles
        g = tl.sum((tile_ends <= pid_m).to(tl.int32), 0)
        sel = idx == g
        row_end = tl.sum(tl.where(sel, ends, 0), 0)
        row_start = row_end - tl.sum(tl.where(sel, counts, 0), 0)
        first_tile = tl.sum(tl.where(sel, tile_ends - tiles, 0), 0)
        rm = row_start + (pid_m - first_tile) * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        a_ptrs = a_ptr + rm.to(tl.int64)[:, None] * k_dim + rk[None, :]
        b_ptrs = b_ptr + g.to(tl.int64) * n_out * k_dim + rn.to(tl.int64)[None, :] * k_dim + rk[:, None]
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k in range(0, tl.cdiv(k_dim, BK)):
            # rows past the group's end belong to the next group: computed, never stored
            if EVEN_K:
                a = tl.load(a_ptrs, mask=(rm < rows)[:, None], other=0.0)
                b = tl.load(b_ptrs, mask=(rn < n_out)[None, :], other=0.0)
            else:
                kk = k * BK + rk
                a = tl.load(a_ptrs, mask=(rm < rows)[:, None] & (kk < k_dim)[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=(rn < n_out)[None, :] & (kk < k_dim)[:, None], other=0.0)
            acc = tl.dot(a, b, acc)
            a_ptrs += BK
            b_ptrs += BK
        sa = tl.load(sa_ptr + rm, mask=rm < row_end, other=0.0)
        sb = tl.load(sb_ptr + g * n_out + rn, mask=rn < n_out, other=0.0)
        out = acc * sa[:, None] * sb[None, :]
        mask = (rm < row_end)[:, None] & (rn < n_out)[None, :]
        tl.store(c_ptr + rm.to(tl.int64)[:, None] * n_out + rn[None, :], out.to(c_ptr.dtype.element_ty), mask=mask)


@_Kernel
def _grouped_wgrad_kernel(xt_ptr, sx_ptr, dyt_ptr, sdy_ptr, counts_ptr, out_ptr, k_dim, n_out, width, num_groups,
                          GROUPS_P2: tl.constexpr, ALIGN: tl.constexpr,
                          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """out[g] = (xt[:, rows of g] * sx[g]) @ (dyt[:, rows of g] * sdy[g])^T in fp32: [G, K, n_out].
    The transposed copies hold segment g zero-padded to ALIGN columns from an ALIGN-aligned start:
    the loop reads whole aligned blocks without masks."""
    g = tl.program_id(1)
    n_tiles = tl.cdiv(n_out, BN)
    pid_k, pid_n = tl.program_id(0) // n_tiles, tl.program_id(0) % n_tiles
    idx = tl.arange(0, GROUPS_P2)
    counts = tl.load(counts_ptr + idx, mask=idx < num_groups, other=0)
    padded = (counts + ALIGN - 1) // ALIGN * ALIGN
    sel = idx == g
    length = tl.sum(tl.where(sel, padded, 0), 0)
    pstart = tl.multiple_of(tl.sum(tl.where(sel, tl.cumsum(padded, 0), 0), 0) - length, ALIGN)
    rk = pid_k * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rr = tl.arange(0, BK)
    x_ptrs = xt_ptr + rk.to(tl.int64)[:, None] * width + pstart + rr[None, :]
    dy_ptrs = dyt_ptr + rn.to(tl.int64)[None, :] * width + pstart + rr[:, None]
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for _ in range(0, length, BK):
        x = tl.load(x_ptrs, mask=(rk < k_dim)[:, None], other=0.0)
        dy = tl.load(dy_ptrs, mask=(rn < n_out)[None, :], other=0.0)
        acc = tl.dot(x, dy, acc)
        x_ptrs += BK
        dy_ptrs += BK
    sx = tl.load(sx_ptr + g * k_dim + rk, mask=rk < k_dim, other=0.0)
    sdy = tl.load(sdy_ptr + g * n_out + rn, mask=rn < n_out, other=0.0)
    acc = acc * sx[:, None] * sdy[None, :]
    offs = g.to(tl.int64) * k_dim * n_out + rk.to(tl.int64)[:, None] * n_out + rn[None, :]
    tl.store(out_ptr + offs, acc, mask=(rk < k_dim)[:, None] & (rn < n_out)[None, :])


def _groups_p2(n: int) -> int:
    return max(16, _pow2(n))


WIDE_ROW = 16384  # wider rows: a program a row, looping over its columns (_quant_wide_rows_kernel)


@torch.library.custom_op("pithtrain::fp8_quantize", mutates_args=())
def _quantize_cuda(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = x.shape
    q = torch.empty(rows, cols, dtype=FP8, device=x.device)
    s = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows and cols > WIDE_ROW:
        _quant_wide_rows_kernel[(rows,)](x, q, s, cols, BLOCK_C=4096, num_warps=8)
    elif rows:
        block_c = _pow2(cols)
        block_r = max(1, min(16, 8192 // block_c))  # measured faster than 16k values a program (benchmarks/fp8.py)
        _quant_rows_kernel[(_cdiv(rows, block_r),)](x, q, s, rows, cols, BLOCK_R=block_r, BLOCK_C=block_c,
                                                    num_warps=8 if block_c >= 4096 else 4)
    return q, s


@_quantize_cuda.register_fake
def _(x):
    return x.new_empty(x.shape, dtype=FP8), x.new_empty(x.shape[0], dtype=torch.float32)


@torch.library.custom_op("pithtrain::fp8_quantize_t", mutates_args=())
def _quantize_t_cuda(x: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = x.shape
    groups = counts.shape[0]
    width = t_width(rows, groups)
    qt = torch.empty(cols, width, dtype=FP8, device=x.device)  # columns past the last segment are never read
    amax = torch.zeros(groups, cols, dtype=torch.float32, device=x.device)
    block_c = min(128, _pow2(cols))
    splits = max(1, 512 // groups)  # enough programs to fill the GPU when there are few segments
    grid = (groups, _cdiv(cols, block_c), splits)
    if rows:
        _segment_colmax_kernel[grid](x, counts, amax, cols, groups, splits, SEG_P2=_groups_p2(groups),
                                     BLOCK_R=64, BLOCK_C=block_c)
    # a tensor divisor: PyTorch divides by a Python scalar as a product with its (rounded) reciprocal,
    # one ulp off the reference's scale now and then, which moves exact ties of x / s to the other side
    s = amax.clamp_(min=_TINY).div_(torch.full((), FP8_MAX, device=amax.device))
    if rows:
        _quant_t_kernel[grid](x, counts, s, qt, cols, width, groups, splits, SEG_P2=_groups_p2(groups),
                              ALIGN=SEGMENT_ALIGN, BLOCK_R=64, BLOCK_C=block_c)
    return qt, s


@_quantize_t_cuda.register_fake
def _(x, counts):
    width = t_width(x.shape[0], counts.shape[0])
    return x.new_empty(x.shape[1], width, dtype=FP8), x.new_empty(counts.shape[0], x.shape[1], dtype=torch.float32)


GLU_QUANT_TILE = dict(values=2048, num_warps=4)  # whole rows a program, up to `values`: benchmarks/fp8.py --glu (line 145)


@torch.library.custom_op("pithtrain::fp8_glu_quantize", mutates_args=())
def _glu_quantize_cuda(x: torch.Tensor, alpha: float, limit: float, clamped: bool) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor]:
    rows, inter = x.shape[0], x.shape[1] // 2
    out = x.new_empty(rows, inter)
    q = torch.empty(rows, inter, dtype=FP8, device=x.device)
    s = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows and inter:
        block_c = _pow2(inter)
        block_r = max(1, min(16, GLU_QUANT_TILE["values"] // block_c))
        _glu_quant_kernel[(_cdiv(rows, block_r),)](x, out, q, s, rows, inter, alpha, limit, CLAMPED=clamped,
                                                   BLOCK_R=block_r, BLOCK_C=block_c,
                                                   num_warps=8 if block_c >= 4096 else GLU_QUANT_TILE["num_warps"])
    return out, q, s


@_glu_quantize_cuda.register_fake
def _(x, alpha, limit, clamped):
    out = x.new_empty(x.shape[0], x.shape[1] // 2)
    return out, out.new_empty(out.shape, dtype=FP8), out.new_empty(out.shape[0], dtype=torch.float32)


@torch.library.custom_op("pithtrain::fp8_quantize_expand", mutates_args=())
def _quant_expand_cuda(x: torch.Tensor, dest: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = dest.shape[0], x.shape[1]
    q = torch.empty(rows, cols, dtype=FP8, device=x.device)
    s = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows and cols:
        block_c = _pow2(cols)
        _quant_expand_kernel[(x.shape[0],)](x, dest, q, s, cols, TOPK=rows // x.shape[0], BLOCK_C=block_c,
                                            num_warps=8 if block_c >= 4096 else 4)
    return q, s


@_quant_expand_cuda.register_fake
def _(x, dest):
    return x.new_empty(dest.shape[0], x.shape[1], dtype=FP8), x.new_empty(dest.shape[0], dtype=torch.float32)


_AMAX_CONFIG = dict(BR=128, BC=128, num_warps=8)  # both: benchmarks/fp8.py --wquant --sweep
_QUANT_BOTH_CONFIG = dict(BR=64, BC=128, num_warps=4)


@torch.library.custom_op("pithtrain::fp8_quantize_both", mutates_args=("q", "s", "qt", "st"))
def _quantize_both_cuda(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, qt: torch.Tensor, st: torch.Tensor,
                        amax: torch.Tensor | None = None) -> None:
    rows, cols = x.shape[-2:]
    batch = x.numel() // max(1, rows * cols)
    passes = ((_QUANT_BOTH_CONFIG, False),)
    if amax is None:  # not taken by the optimizer: a pass of its own first
        amax = torch.zeros(batch * (rows + cols), dtype=torch.float32, device=x.device)
        passes = ((_AMAX_CONFIG, True),) + passes
    for cfg, amax_pass in passes:
        if x.numel():
            grid = (_cdiv(rows, cfg["BR"]) * _cdiv(cols, cfg["BC"]), batch)
            _quant_both_kernel[grid](x, amax, amax[batch * rows:], q, s, qt, st, rows, cols, AMAX=amax_pass, **cfg)


_GMM_CONFIG = dict(BM=128, BN=256, BK=128, num_warps=8, num_stages=3)  # the best of benchmarks/fp8.py --sweep (H200)
# One tile for every shape: the sweep's best for Qwen3's down input gradient (768 wide outputs), BM=256 / BN=128 at
# 897 TFLOP/s against 789 with equal loads (line 143), made stage 3's backward GEMMs slower in training (102.5 against
# 95.5-99.7 ms a step, line 146): a 256-row tile pads each expert's last rows twice as far.
# Persistent grouped GEMMs: programs an SM (0: one program a tile). At Qwen3's expert shapes (one H200, 7f163a2,
# benchmarks/fp8.py): gate_up forward 969 -> 1025 TFLOP/s, its input gradient 793 -> 983, down's 600 -> 674 (K = 768:
# the epilogue has six K steps to hide in) and 821 -> 849; 2 an SM: 1016, 930, 654, 868.
GMM_PERSISTENT = 1
_WGRAD_CONFIG = dict(BM=128, BN=128, BK=128, num_warps=8, num_stages=4)  # the sweep's best weight-gradient tiles


@torch.library.custom_op("pithtrain::fp8_grouped_mm", mutates_args=())
def _grouped_mm_cuda(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, counts: torch.Tensor,
                     out_dtype: torch.dtype) -> torch.Tensor:
    rows, k_dim = a.shape
    groups, n_out = b.shape[0], b.shape[1]
    out = torch.empty(rows, n_out, dtype=out_dtype, device=a.device)
    cfg = _GMM_CONFIG
    programs = (_cdiv(rows, cfg["BM"]) + groups) * _cdiv(n_out, cfg["BN"])
    persistent = GMM_PERSISTENT if out.element_size() <= 2 else 0  # fp32 tiles: past the shared memory, flattened
    if rows:
        grid = (min(programs, persistent * _sm_count(a.device)) if persistent else programs,)
        _grouped_mm_kernel[grid](a, sa, b, sb, counts, out, rows, n_out, k_dim, groups, GROUPS_P2=_groups_p2(groups),
                                 EVEN_K=k_dim % cfg["BK"] == 0, PERSISTENT=persistent > 0, **cfg)
    return out


def _sm_count(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


@_grouped_mm_cuda.register_fake
def _(a, sa, b, sb, counts, out_dtype):
    return a.new_empty(a.shape[0], b.shape[1], dtype=out_dtype)


@torch.library.custom_op("pithtrain::fp8_grouped_wgrad", mutates_args=("out",))
def _grouped_wgrad_cuda(xt: torch.Tensor, sx: torch.Tensor, dyt: torch.Tensor, sdy: torch.Tensor,
                        counts: torch.Tensor, out: torch.Tensor) -> None:
    groups, k_dim, n_out = out.shape
    cfg = _WGRAD_CONFIG
    grid = (_cdiv(k_dim, cfg["BM"]) * _cdiv(n_out, cfg["BN"]), groups)
    _grouped_wgrad_kernel[grid](xt, sx, dyt, sdy, counts, out, k_dim, n_out, xt.shape[1], groups,
                                GROUPS_P2=_groups_p2(groups), ALIGN=SEGMENT_ALIGN, **cfg)


# ---- Path selection: Triton / torch._scaled_mm on CUDA, the references elsewhere ----


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise FP8 of a 2-D tensor: (q, s). In a compiled graph the plain-PyTorch one, which inductor
    fuses into the kernel that produces x (the norm before a projection; in the backward, dy's
    producer), so no separate pass reads x again; the custom op would be a wall between them."""
    if use_triton(x) and not torch.compiler.is_compiling():
        return _quantize_cuda(x.contiguous())
    return quantize_reference(x)


class _GLUQuantized(torch.autograd.Function):
    """kernels._GLU with the activation's FP8 copy as two more outputs (not differentiable). `dgrad_slot`
    (gate_up's, from grouped_gemm.fp8_expert_mm): the backward also writes d gate_up's row-wise FP8 copy
    there, made as d gate_up is stored, for the gate/up GEMM's input gradient."""

    @staticmethod
    def forward(ctx, gate_up, alpha: float, limit: float, clamped: bool, dgrad_slot=None):
        x = gate_up.reshape(-1, gate_up.shape[-1]).contiguous()
        out, q, s = _glu_quantize_cuda(x, alpha, limit, clamped)
        ctx.save_for_backward(x)
        ctx.args, ctx.slot = (alpha, limit, clamped), dgrad_slot
        ctx.mark_non_differentiable(q, s)
        ctx.set_materialize_grads(False)  # no zero "gradients" of q and s made for the backward (2.2 ms a step)
        return out, q, s

    @staticmethod
    def backward(ctx, grad, _grad_q, _grad_s):
        if grad is None:
            return None, None, None, None, None
        (x,) = ctx.saved_tensors
        grad = grad.reshape(x.shape[0], x.shape[1] // 2).contiguous()
        if ctx.slot is None:
            return _glu_bwd(x, grad, *ctx.args), None, None, None, None
        q = torch.empty(x.shape, dtype=FP8, device=x.device)
        dx, s = kernels.glu_bwd_quantized(x, grad, *ctx.args, q)
        ctx.slot.update(q=q, s=s, ptr=dx.data_ptr())
        return dx, None, None, None, None


GLU_FP8_GRAD = True  # d gate_up's FP8 copy from the activation's backward, not a quantize pass (--ab glu-fp8-grad)


def glu_quantized(gate_up: torch.Tensor, alpha: float = 1.0, limit: float = 0.0, clamped: bool = False):
    """The experts' SwiGLU on gate_up [N, 2I] (with `clamped`, GPT-OSS's, kernels.clamped_swiglu) and
    its row-wise FP8 copy: (a [N, I], q, s) with (q, s) = quantize(a). On CUDA one kernel makes both, and
    for gate_up straight from grouped_gemm.fp8_expert_mm the backward's kernel also quantizes d gate_up."""
    if use_triton(gate_up) and gate_up.dim() == 2:
        slot = getattr(gate_up, "_fp8_dgrad", None) if GLU_FP8_GRAD else None
        return _GLUQuantized.apply(gate_up, float(alpha), float(limit), clamped, slot)
    a = kernels.clamped_swiglu(gate_up, alpha, limit) if clamped else kernels.swiglu(gate_up)
    return (a, *quantize(a.detach().reshape(-1, a.shape[-1])))


def expand_quantized(x: torch.Tensor, order: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize(kernels.expand(x, order, topk)) from the T rows of x rather than the T*k expanded ones: each
    expanded row is a copy of a token's row, so its FP8 copy and scale are the token's (bit for bit). On CUDA
    one kernel quantizes each token and stores it at its k rows (a quantize, then a gather of the T*k rows,
    took 11.5 ms a step at 9 Qwen3 layers, 4 x 8 micro-batches, results.jsonl line 140)."""
    x2 = x.detach().reshape(-1, x.shape[-1])
    if use_triton(x2) and not torch.compiler.is_compiling():
        return _quant_expand_cuda(x2.contiguous(), kernels._inverse(order))
    q, s = quantize(x2)
    src = order // topk
    return q.view(torch.uint8)[src].view(FP8), s[src]


def _quantize_nd(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise FP8 along the last dimension of any contiguous tensor (a weight, once per update)."""
    q, s = quantize(w.reshape(-1, w.shape[-1]))
    return q.view(w.shape), s.view(w.shape[:-1])


def quantize_both(w: torch.Tensor, out=None, amax: torch.Tensor | None = None):
    """Row-wise FP8 of w [..., R, C] along C and of its transpose [..., C, R] along R (quantize_reference's
    values): ((q, s), (qt, st)), written into `out` (same structure) if given. On CUDA two reads of w
    (the amaxes, then both layouts at once) and no transposed fp32 copy; one where `amax` (w's |.| maxima per
    row, then per column, as the Triton AdamW leaves them: optimizer_amax) is given."""
    if not use_triton(w):
        new = (*_quantize_nd(w), *_quantize_nd(w.transpose(-1, -2).contiguous()))
        for old, value in zip((*out[0], *out[1]) if out else (), new):
            old.copy_(value)
        return out or (new[:2], new[2:])
    t_shape = (*w.shape[:-2], w.shape[-1], w.shape[-2])
    out = out or ((w.new_empty(w.shape, dtype=FP8), w.new_empty(w.shape[:-1], dtype=torch.float32)),
                  (w.new_empty(t_shape, dtype=FP8), w.new_empty(t_shape[:-1], dtype=torch.float32)))
    _quantize_both_cuda(w.contiguous(), *out[0], *out[1], amax)
    return out


def optimizer_amax(param: torch.Tensor) -> torch.Tensor | None:
    """The maxima of |param| per row and per column that the Triton AdamW took in its pass (train/optim), if they
    are of the parameter's current version; None otherwise (another update, a load, FSDP's all-gather)."""
    made = param.__dict__.get("_fp8_amax")
    return made[1] if made is not None and made[0] == param._version else None


def _ask_optimizer_for_amax(param: torch.Tensor, w: torch.Tensor) -> None:
    """Leave a buffer on a plain fp32 CUDA parameter for the Triton AdamW to fill with the new weight's maxima
    (train/optim._triton_adamw_step): the next quantize_both then reads the weight once, not twice."""
    if "_fp8_amax" not in param.__dict__ and use_triton(w) and w.dtype == torch.float32 and w.dim() >= 2 \
            and type(param) is nn.Parameter:
        rows, cols = w.shape[-2:]
        param.__dict__["_fp8_amax"] = [None, w.new_empty(w.numel() // (rows * cols) * (rows + cols))]


def quantize_t(x: torch.Tensor, counts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Transposed FP8 copy of x [N, K] for a weight gradient, scaled per column within each segment."""
    if use_triton(x) and not torch.compiler.is_compiling():
        if counts is None:
            counts = torch.full((1,), x.shape[0], dtype=torch.int32, device=x.device)
        return _quantize_t_cuda(x.contiguous(), counts.to(torch.int32))
    return quantize_t_reference(x, counts)


def scaled_mm(a, sa, b, sb, out_dtype) -> torch.Tensor:
    """(a * sa) @ (b * sb)^T for FP8 a [M, K], b [N, K] with row scales; K a multiple of 16 on CUDA."""
    if a.is_cuda:  # row-wise scaling writes bf16 only
        out = torch._scaled_mm(a, b.t(), scale_a=sa.unsqueeze(1), scale_b=sb.unsqueeze(0), out_dtype=torch.bfloat16)
        return out if out_dtype == torch.bfloat16 else out.to(out_dtype)
    return scaled_mm_reference(a, sa, b, sb, out_dtype)


def grouped_mm(a, sa, b, sb, counts, out_dtype) -> torch.Tensor:
    if use_triton(a):
        return _grouped_mm_cuda(a, sa, b, sb, counts.to(torch.int32), out_dtype)
    return grouped_mm_reference(a, sa, b, sb, counts, out_dtype)


def grouped_wgrad(xt, sx, dyt, sdy, counts) -> torch.Tensor:
    """dW [E, K, M] in fp32 from the transposed FP8 copies of x and dy."""
    if use_triton(xt):
        out = torch.empty(sx.shape[0], sx.shape[1], sdy.shape[1], device=xt.device)
        _grouped_wgrad_cuda(xt, sx, dyt, sdy, counts.to(torch.int32), out)
        return out
    return grouped_wgrad_reference(xt, sx, dyt, sdy, counts)


# ---- Cached quantized weights ----


class FP8Weight:
    """A weight's two FP8 layouts, both contraction-contiguous: `fwd` (q, s) for the forward GEMM and
    `bwd` (q, s) for the input gradient's. Refreshed in place (same tensors), so a compiled graph
    that reads them is not recompiled."""

    def __init__(self, fwd, bwd, key):
        self.fwd, self.bwd, self.key = fwd, bwd, key


@torch.no_grad()
def cached_weight(module: nn.Module, name: str, contraction_last: bool) -> FP8Weight:
    """The FP8 layouts of module.<name>, remade only when the parameter changed (its version counter,
    identity and storage). contraction_last: the forward contracts the last dimension (nn.Linear's
    [out, in]); otherwise the one before it (the experts' [E, K, M])."""
    return _cached(module.__dict__.setdefault("_fp8_cache", {}), name, getattr(module, name), contraction_last)


@torch.no_grad()
def cached_param(param: torch.Tensor) -> FP8Weight:
    """cached_weight for a bare [out, in] weight kept on the tensor itself: the LM head's, which the
    model reads through head_weight() (a tied head shares the embedding's tensor and its cache)."""
    return _cached(param.__dict__.setdefault("_fp8_cache", {}), "weight", param, True)


# Optimizer steps so far (train/optim.optimizer_step): FSDP2's all-gather writes the stepped shards into the unsharded
# weight under its old version counter, often at its old address, so the version alone would keep last step's layouts.
UPDATES = [0]


def _cached(cache: dict, name: str, param: torch.Tensor, contraction_last: bool) -> FP8Weight:
    hit = cache.get(name)
    key = (id(param), param._version, param.data_ptr(), UPDATES[0])
    if hit is not None and hit.key == key:
        return hit
    w = param.detach()
    amax = optimizer_amax(param)
    _ask_optimizer_for_amax(param, w)  # for the next version
    old = None if hit is None else (hit.fwd, hit.bwd) if contraction_last else (hit.bwd, hit.fwd)
    if old is not None and old[0][0].shape == w.shape and old[0][0].device == w.device:
        quantize_both(w, old, amax)  # in place: the same tensors
        hit.key = key
        return hit
    along_last, along_prev = quantize_both(w, amax=amax)
    fwd, bwd = (along_last, along_prev) if contraction_last else (along_prev, along_last)
    cache[name] = FP8Weight(fwd, bwd, key)
    return cache[name]


# ---- FP8 GEMMs with autograd ----


class _FP8Linear(torch.autograd.Function):
    """y = x [W_1; ...; W_n]^T (+ [b_1; ...; b_n]) for the parts W_i [out_i, in] of a stack of Linears of one
    input (n = 1: one Linear); their FP8 layouts come in already quantized, `parts` = weights, biases (or
    Nones), then each part's forward q, s and input-gradient q, s. The forward is one FP8 GEMM over the stacked
    forward layouts (a weight row has its own scale, so the stack is quantized as its parts are); the weight
    gradient one GEMM; the input gradient one FP8 GEMM a part (each its own dy slice's row scales and its
    weight's per-column ones, as the parts alone), summed."""

    @staticmethod
    def forward(ctx, x, out_dtype, fp8_wgrad, n, *parts):
        weights, biases, layouts = parts[:n], parts[n:2 * n], parts[2 * n:]
        x2 = x.reshape(-1, x.shape[-1])
        xq, xs = quantize(x2)
        with torch.autocast(x.device.type, enabled=False):  # autocast's cat refuses FP8
            wq, ws = (layouts[0], layouts[1]) if n == 1 else (torch.cat(layouts[0::4]), torch.cat(layouts[1::4]))
        y = scaled_mm(xq, xs, wq, ws, out_dtype)
        if biases[0] is not None:
            y = y + (biases[0] if n == 1 else torch.cat(biases)).to(out_dtype)
        wants_dw = any(ctx.needs_input_grad[4:4 + n])
        xtq = xts = x_hp = None
        if wants_dw and fp8_wgrad:
            xtq, xts = quantize_t(x2)  # saved: 1 byte a value
        elif wants_dw:
            x_hp = x2.to(out_dtype)  # what autocast's nn.Linear saves
        ctx.save_for_backward(xtq, xts, x_hp, *layouts[2::4], *layouts[3::4])
        ctx.meta = (x.shape, x.dtype, [w.shape[0] for w in weights], [w.dtype for w in weights], biases[0] is not None)
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        xtq, xts, x_hp, *bwd = ctx.saved_tensors
        x_shape, x_dtype, widths, w_dtypes, has_bias = ctx.meta
        n = len(widths)
        dy2 = dy.reshape(-1, dy.shape[-1])
        dys = dy2.split(widths, dim=1) if n > 1 else (dy2,)
        dx = dws = dbs = None
        if ctx.needs_input_grad[0]:
            each = [scaled_mm(*quantize(d), q, s, dy.dtype).to(x_dtype) for d, q, s in zip(dys, bwd[:n], bwd[n:])]
            dx = sum(each[1:], each[0]).view(x_shape)  # summed in x's dtype, as autograd sums the parts' alone
        if any(ctx.needs_input_grad[4:4 + n]):
            if x_hp is None:
                dytq, dyts = quantize_t(dy2)
                dw = scaled_mm(dytq, dyts[0], xtq, xts[0], torch.float32)
            else:
                dw = dy2.to(x_hp.dtype).t() @ x_hp
            dws = [d.to(t) for d, t in zip(dw.split(widths), w_dtypes)]
        if has_bias and any(ctx.needs_input_grad[4 + n:4 + 2 * n]):
            dbs = [d.to(t) for d, t in zip(dy2.float().sum(0).split(widths), w_dtypes)]
        return dx, None, None, None, *(dws or [None] * n), *(dbs or [None] * n), *[None] * (4 * n)


class Linear(nn.Linear):
    """nn.Linear whose GEMMs run in FP8 once `fp8` is switched on (train.fp8, `enable_fp8`); otherwise
    exactly nn.Linear. Eager calls take the weight's FP8 layouts from the per-version cache; a
    compiled stage reads `fp8_weight`, which `refresh_fp8_weights` fills (from the same cache, in
    eager code) before the compiled graph runs, so the cache is not bypassed."""

    fp8: bool | str = False  # or the recipe: "rowwise" | "rowwise_bf16_wgrad"
    fp8_weight: FP8Weight | None = None

    def forward(self, x):
        return _fp8_linears(x, self) if self.fp8 else F.linear(x, self.weight, self.bias)


def _fp8_linears(x: torch.Tensor, *linears: Linear) -> torch.Tensor:
    """The FP8 Linears' outputs of x, stacked in one tensor (_FP8Linear)."""
    out_dtype, layouts = core.autocast_dtype(x), []
    for m in linears:
        w = m.fp8_weight if torch.compiler.is_compiling() else cached_weight(m, "weight", True)
        layouts += [*w.fwd, *w.bwd]
    return _FP8Linear.apply(x, out_dtype, linears[0].fp8 != "rowwise_bf16_wgrad", len(linears),
                            *(m.weight for m in linears), *(m.bias for m in linears), *layouts)


# One GEMM for projections of the same input (q, k, v; DeepSeek-V3's q and KV latents; Qwen3.5's delta-rule inputs).
# The narrow ones (k and v: 512 wide at Qwen3's width) use the tensor cores poorly alone, above all in their
# weight gradient (M = 512 outputs: few tiles), and the input gradient becomes one product, not three and two
# adds. A part kept for the backward keeps the whole product alive, so callers stack only where every wide part
# is kept anyway. Off: one GEMM each (the A/B of benchmarks/train_throughput.py --ab fused-proj).
FUSED_PROJECTIONS = True


def stacked_projections(x: torch.Tensor, *linears: nn.Linear) -> torch.Tensor | None:
    """torch.cat([linear(x) for each of `linears`], -1) as one product with their weights (and biases) stacked: the
    same dot products; FP8 Linears of one recipe stack too (_FP8Linear: their quantization is the parts' own). None
    where they do not stack (FUSED_PROJECTIONS off, mixed recipes or biases)."""
    biased = [m.bias is not None for m in linears]
    recipes = {getattr(m, "fp8", False) for m in linears}
    if not FUSED_PROJECTIONS or len(recipes) > 1 or len(set(biased)) > 1:
        return None
    if recipes != {False}:
        return _fp8_linears(x, *linears)
    bias = torch.cat([m.bias for m in linears]) if biased[0] else None
    return F.linear(x, torch.cat([m.weight for m in linears]), bias)


def projections(x: torch.Tensor, *linears: nn.Linear) -> tuple[torch.Tensor, ...]:
    """(linear(x) for each of `linears`): the split of stacked_projections, or one product each."""
    stacked = stacked_projections(x, *linears)
    return tuple(m(x) for m in linears) if stacked is None else stacked.split([m.out_features for m in linears], dim=-1)


def refresh_fp8_weights(module: nn.Module) -> None:
    """Make (or reuse) the FP8 layouts of every FP8 Linear under `module`: called in eager code
    right before a compiled stage runs (after FSDP has gathered the weights)."""
    for m in module.modules():
        if isinstance(m, Linear) and m.fp8:
            m.fp8_weight = cached_weight(m, "weight", True)


def enable_fp8(model: nn.Module, compiled: bool, recipe: str = "rowwise", head: bool = False) -> None:
    """Switch the model's FP8-capable modules (ops/fp8.Linear and the `Experts` of each family, which
    declare `fp8`) to FP8, and with `head` (train.fp8_head) the LM head of the models (which declare
    `head_fp8`). With compiled stage 1s (train.compile), each layer's stage 1 first refreshes its Linears'
    FP8 layouts in eager code, and stage 5 runs eagerly (kernels.COMBINE_FP8_GRAD). Call before FSDP wraps
    the stages, so that its all-gather runs before the refresh."""
    odd = [f"{name} [{m.out_features} x {m.in_features}]" for name, m in model.named_modules()
           if isinstance(m, Linear) and (m.in_features % 16 or m.out_features % 16)] if recipe else []
    if odd:  # torch._scaled_mm's rule; the CPU's emulation refuses them too, so it predicts the GPU
        raise ConfigError(f"train.fp8={recipe}: FP8 GEMMs take sizes that are multiples of 16, and {odd[0]}"
                          f"{f' (and {len(odd) - 1} more)' if len(odd) > 1 else ''} is not; change the model's sizes, "
                          "or train.fp8=off")
    for m in model.modules():
        if isinstance(m, Linear) or "fp8" in type(m).__dict__:
            m.fp8 = recipe
        if "head_fp8" in type(m).__dict__:
            m.head_fp8 = head
    if compiled:
        for layer in all_layers(model).values():
            layer.stage1 = _refreshing(layer, layer.stage1)
            if kernels.COMBINE_FP8_GRAD and "stage5" in layer.__dict__:  # the compiled one (train/loop.compile_stages)
                del layer.stage5  # eager: its combine fills the down GEMM's FP8 slot, which a graph cannot


def _refreshing(layer: nn.Module, stage1):
    def run(*args, **kwargs):
        refresh_fp8_weights(layer)
        return stage1(*args, **kwargs)

    return run
