"""Causal attention for the GPU fast path: a Triton flash-attention forward and backward with GQA, an optional learnable
per-head "sink" logit in the softmax denominator (GPT-OSS), an optional sliding window and packed documents, none of
which materialises an [S, S] mask or score tensor.

  attention(q, k, v, scale, sinks=None, window=None, doc_ids=None) -> [B, S, Hq*D]
      q: [B, Hq, S, D], k/v: [B, Hkv, S, D] (Hq a multiple of Hkv), sinks: [Hq] or None,
      window: a query sees the last `window` tokens, itself included (None: all earlier ones),
      doc_ids: [B, S], equal ids in contiguous runs (train/data.py's packing): a query sees only
      keys of its own run.
  Triton when `use_flash(q)` (CUDA, Triton installed, `ENABLED`), else `attention_reference` (SDPA).

Math (base-2 inside the kernels: s = q.k * scale * log2(e)). With the sink logit z of a head, every
row's softmax runs over its visible keys plus z, whose value is 0: p_j = exp(s_j - L),
L = log(exp(z) + sum_j exp(s_j)), o = sum_j p_j v_j. The forward starts each row's running max at z
with running sum 1 (the sink's term), so z only adds to the denominator; it saves L per row.
Backward (FA2): delta = rowsum(dO * O); dp_j = dO.v_j; ds_j = p_j (dp_j - delta) (the sink's dp is
0, so delta = sum_j p_j dp_j is unchanged by it); dq = scale sum_j ds_j k_j, dk_j and dv_j summed
over the queries (and the Hq/Hkv query heads of a key head). The sink's gradient (its logit is
one more score, with dp_z = 0): d loss/dz = sum_rows p_z (dp_z - delta) = -sum_rows exp(z - L) delta,
the rows of that head over batch and positions.
Key blocks wholly outside the window or before the document of the block's first query are never
visited (and query blocks after the window or document of a key block in dK/dV). dQ and dK/dV are
separate kernels, so no atomics: gradients are bit-identical run to run."""

from __future__ import annotations  # keeps the kernels' `tl.constexpr` annotations unevaluated

import os

import torch
import torch.nn.functional as F

from pithtrain.ops import core
from pithtrain.ops.kernels import _cdiv, use_triton

HEAD_DIMS = (16, 32, 64, 128)  # the kernels' head sizes
ENABLED = True  # False: the SDPA paths on CUDA too (benchmarks/train_throughput.py --attention sdpa)
LOG2E = 1.4426950408889634
tl = None  # triton.language; bound on the first launch
_compiled = {}


def use_flash(x: torch.Tensor) -> bool:
    return ENABLED and use_triton(x)


def sink_attention(q, k, v, sinks, mask, scale: float) -> torch.Tensor:
    """Causal GQA attention whose softmax denominator also holds one learnable logit per head. q: [B, Hq, S, D], k/v:
    [B, Hkv, S, D], sinks: [Hq], mask: bool [B or 1, 1, S, S] (True = attend). Returns [B, S, Hq*Dv]; gradients reach q,
    k, v and the sinks.

    The sink becomes one more key that every query sees, so SDPA's fused kernels do the work (no [S, S] fp32 scores):
    queries get an extra coordinate holding sink/scale, the sink key is the unit vector along it (the other keys are 0
    there) and its value is 0. Then q'.k_sink * scale = sink and q'.k_j = q.k_j, and the sink only adds to the
    denominator. Seven more zero coordinates keep the head dim a multiple of 8, as the fused kernels want."""
    b, hq, s, d = q.shape
    rep = hq // k.shape[1]
    if rep > 1:  # the masked fused kernel takes equal head counts
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    sink_q = (sinks.to(q.dtype) / scale).view(1, hq, 1, 1).expand(b, hq, s, 1)
    q = torch.cat([q, sink_q, q.new_zeros(b, hq, s, 7)], dim=-1)
    sink_k = F.pad(q.new_ones(b, hq, 1, 1), (d, 7))  # [B, Hq, 1, D+8]: 1 at coordinate D
    k = torch.cat([sink_k, F.pad(k, (0, 8))], dim=2)
    v = F.pad(v, (0, 0, 1, 0))  # the sink's value row: zeros
    mask = F.pad(mask, (1, 0), value=True)  # every query sees the sink
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.transpose(1, 2).flatten(2)


def attention_reference(q, k, v, scale: float, sinks=None, window=None, doc_ids=None) -> torch.Tensor:
    """The SDPA path (the CPU's, and CUDA's with ENABLED off): an explicit mask when needed."""
    mask = core.attention_mask(doc_ids, q.shape[2], q.device, window)
    if sinks is None:
        return core.attention(q, k, v, mask, scale)
    if mask is None:
        mask = torch.ones(q.shape[2], q.shape[2], dtype=torch.bool, device=q.device).tril()[None, None]
    return sink_attention(q, k, v, sinks, mask, scale)


def attention(q, k, v, scale: float, sinks=None, window=None, doc_ids=None) -> torch.Tensor:
    """See the module docstring. Under autocast q, k, v run in the autocast dtype (as SDPA does);
    fp32 runs the SDPA path (the kernel's dots would round fp32 operands to TF32)."""
    if use_flash(q) and torch.is_autocast_enabled(q.device.type):
        dtype = torch.get_autocast_dtype(q.device.type)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    if not use_flash(q) or q.dtype not in (torch.bfloat16, torch.float16):
        return attention_reference(q, k, v, scale, sinks, window, doc_ids)
    return _FlashAttention.apply(q, k, v, sinks, document_bounds(doc_ids), scale, window or 0)


def document_bounds(doc_ids: torch.Tensor | None) -> torch.Tensor | None:
    """int32 [2, B, S]: the index of the first token of each token's run of equal ids, and one past
    its last. The first serves as the document id in the kernels, both bound the blocks they visit."""
    if doc_ids is None:
        return None
    b, s = doc_ids.shape
    pos = torch.arange(s, device=doc_ids.device).expand(b, s)
    change = F.pad(doc_ids[:, 1:] != doc_ids[:, :-1], (1, 0), value=True)
    start = torch.where(change, pos, 0).cummax(1).values
    last = F.pad(change[:, 1:], (0, 1), value=True)
    end = torch.where(last, pos + 1, s).flip(1).cummin(1).values.flip(1)
    return torch.stack([start, end]).to(torch.int32).contiguous()


# ---- the kernels ----


def _visible(offs_q, offs_k, doc_q, doc_k, seq, window, HAS_WINDOW: tl.constexpr, HAS_DOCS: tl.constexpr):
    """[len(offs_q), len(offs_k)] True where the query sees the key (both in range)."""
    ok = (offs_k[None, :] <= offs_q[:, None]) & (offs_q[:, None] < seq)
    if HAS_WINDOW:
        ok = ok & (offs_q[:, None] - offs_k[None, :] < window)
    if HAS_DOCS:
        ok = ok & (doc_q[:, None] == doc_k[None, :])
    return ok


def _needs_mask(start_m, start_n, seq, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                HAS_WINDOW: tl.constexpr, HAS_DOCS: tl.constexpr):
    """Whether the tile (queries from start_m, keys from start_n) has a hidden pair or a row past seq."""
    need = (start_n + BLOCK_N > start_m + 1) | (start_m + BLOCK_M > seq)
    if HAS_WINDOW:
        need = need | (start_m + BLOCK_M - start_n > window)
    if HAS_DOCS:
        need = need | (start_m >= 0)
    return need


def _key_range(start_m, b, seq, window, docs_ptr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               HAS_WINDOW: tl.constexpr, HAS_DOCS: tl.constexpr):
    """[lo, hi) of the keys a query block [start_m, start_m + BLOCK_M) may see, lo on a block edge."""
    lo = start_m * 0
    if HAS_WINDOW:
        lo = tl.maximum(start_m - window + 1, 0)
    if HAS_DOCS:
        lo = tl.maximum(lo, tl.load(docs_ptr + b * seq + start_m))
    return (lo // BLOCK_N) * BLOCK_N, tl.minimum(start_m + BLOCK_M, seq)


def _fwd_kernel(q_ptr, k_ptr, v_ptr, sinks_ptr, docs_ptr, out_ptr, lse_ptr,
                sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, sob, soh, sos,
                seq, heads, rep, qk_scale, window,
                D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_SINK: tl.constexpr,
                HAS_WINDOW: tl.constexpr, HAS_DOCS: tl.constexpr):
    start_m = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M  # the longest rows first
    b, h = tl.program_id(1) // heads, tl.program_id(1) % heads
    offs_m, offs_d = start_m + tl.arange(0, BLOCK_M), tl.arange(0, D)
    row_ok = offs_m < seq
    q = tl.load(q_ptr + b.to(tl.int64) * sqb + h * sqh + offs_m[:, None] * sqs + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)
    k_base, v_base = k_ptr + b.to(tl.int64) * skb + (h // rep) * skh, v_ptr + b.to(tl.int64) * svb + (h // rep) * svh
    doc_q = offs_m
    if HAS_DOCS:
        doc_q = tl.load(docs_ptr + b * seq + offs_m, mask=row_ok, other=-1)
    if HAS_SINK:  # the sink's term: running max z, running sum exp(z - z) = 1
        m_i = tl.zeros([BLOCK_M], tl.float32) + tl.load(sinks_ptr + h).to(tl.float32) * 1.4426950408889634
        l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    lo, hi = _key_range(start_m, b, seq, window, docs_ptr, BLOCK_M, BLOCK_N, HAS_WINDOW, HAS_DOCS)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        col_ok = offs_n < seq
        k = tl.load(k_base + offs_n[:, None] * sks + offs_d[None, :], mask=col_ok[:, None], other=0.0)
        v = tl.load(v_base + offs_n[:, None] * svs + offs_d[None, :], mask=col_ok[:, None], other=0.0)
        s = _dot(q, tl.trans(k)) * qk_scale
        doc_k = offs_n
        if HAS_DOCS:
            doc_k = tl.load(docs_ptr + b * seq + offs_n, mask=col_ok, other=-2)
        # Blocks strictly below the diagonal and inside the window need no mask (the common case).
        if _needs_mask(start_m, start_n, seq, window, BLOCK_M, BLOCK_N, HAS_WINDOW, HAS_DOCS):
            s = tl.where(_visible(offs_m, offs_n, doc_q, doc_k, seq, window, HAS_WINDOW, HAS_DOCS), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet (no sink)
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v)
        m_i = m_new
    l_i = tl.where(row_ok, l_i, 1.0)  # rows past seq (never stored) saw no key
    out = acc / l_i[:, None]
    tl.store(out_ptr + b.to(tl.int64) * sob + h * soh + offs_m[:, None] * sos + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    tl.store(lse_ptr + tl.program_id(1).to(tl.int64) * seq + offs_m, m_i + tl.log2(l_i), mask=row_ok)


def _bwd_dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, docs_ptr, dq_ptr,
                   sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, sob, soh, sos,
                   seq, heads, rep, qk_scale, scale, window,
                   D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   HAS_WINDOW: tl.constexpr, HAS_DOCS: tl.constexpr):
    """dQ of one query block: the forward's key loop again. dO and dQ share out's strides."""
    start_m = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M  # the longest rows first
    b, h = tl.program_id(1) // heads, tl.program_id(1) % heads
    offs_m, offs_d = start_m + tl.arange(0, BLOCK_M), tl.arange(0, D)
    row_ok = offs_m < seq
    q = tl.load(q_ptr + b.to(tl.int64) * sqb + h * sqh + offs_m[:, None] * sqs + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)
    o_offs = b.to(tl.int64) * sob + h * soh + offs_m[:, None] * sos + offs_d[None, :]
    do = tl.load(do_ptr + o_offs, mask=row_ok[:, None], other=0.0)
    lse = tl.load(lse_ptr + tl.program_id(1).to(tl.int64) * seq + offs_m, mask=row_ok, other=0.0)
    delta = tl.load(delta_ptr + tl.program_id(1).to(tl.int64) * seq + offs_m, mask=row_ok, other=0.0)
    k_base, v_base = k_ptr + b.to(tl.int64) * skb + (h // rep) * skh, v_ptr + b.to(tl.int64) * svb + (h // rep) * svh
    doc_q = offs_m
    if HAS_DOCS:
        doc_q = tl.load(docs_ptr + b * seq + offs_m, mask=row_ok, other=-1)
    dq = tl.zeros([BLOCK_M, D], tl.float32)
    lo, hi = _key_range(start_m, b, seq, window, docs_ptr, BLOCK_M, BLOCK_N, HAS_WINDOW, HAS_DOCS)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        col_ok = offs_n < seq
        k = tl.load(k_base + offs_n[:, None] * sks + offs_d[None, :], mask=col_ok[:, None], other=0.0)
        v = tl.load(v_base + offs_n[:, None] * svs + offs_d[None, :], mask=col_ok[:, None], other=0.0)
        p = tl.exp2(_dot(q, tl.trans(k)) * qk_scale - lse[:, None])
        doc_k = offs_n
        if HAS_DOCS:
            doc_k = tl.load(docs_ptr + b * seq + offs_n, mask=col_ok, other=-2)
        if _needs_mask(start_m, start_n, seq, window, BLOCK_M, BLOCK_N, HAS_WINDOW, HAS_DOCS):
            p = tl.where(_visible(offs_m, offs_n, doc_q, doc_k, seq, window, HAS_WINDOW, HAS_DOCS), p, 0.0)
        ds = p * (_dot(do, tl.trans(v)) - delta[:, None])
        dq += _dot(ds.to(k.dtype), k)
    tl.store(dq_ptr + o_offs, (dq * scale).to(dq_ptr.dtype.element_ty), mask=row_ok[:, None])


def _bwd_dkv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, docs_ptr, ends_ptr, dk_ptr, dv_ptr,
                    sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, sob, soh, sos, sdb, sdh, sds,
                    seq, heads, kv_heads, rep, qk_scale, scale, window,
                    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    HAS_WINDOW: tl.constexpr, HAS_DOCS: tl.constexpr):
    """dK, dV of one key block of one key head: a loop over the query blocks that may see it, for each
    of its `rep` query heads (no atomics). dK and dV share the strides sdb, sdh, sds."""
    start_n = tl.program_id(0) * BLOCK_N
    b, hk = tl.program_id(1) // kv_heads, tl.program_id(1) % kv_heads
    offs_n, offs_d = start_n + tl.arange(0, BLOCK_N), tl.arange(0, D)
    col_ok = offs_n < seq
    k = tl.load(k_ptr + b.to(tl.int64) * skb + hk * skh + offs_n[:, None] * sks + offs_d[None, :],
                mask=col_ok[:, None], other=0.0)
    v = tl.load(v_ptr + b.to(tl.int64) * svb + hk * svh + offs_n[:, None] * svs + offs_d[None, :],
                mask=col_ok[:, None], other=0.0)
    doc_k = offs_n
    if HAS_DOCS:
        doc_k = tl.load(docs_ptr + b * seq + offs_n, mask=col_ok, other=-2)
    lo = (start_n // BLOCK_M) * BLOCK_M
    hi = seq + start_n * 0
    if HAS_WINDOW:  # the last query that sees key j is j + window - 1
        hi = tl.minimum(hi, start_n + BLOCK_N - 1 + window)
    if HAS_DOCS:
        hi = tl.minimum(hi, tl.load(ends_ptr + b * seq + tl.minimum(start_n + BLOCK_N, seq) - 1))
    dk = tl.zeros([BLOCK_N, D], tl.float32)
    dv = tl.zeros([BLOCK_N, D], tl.float32)
    for g in range(rep):
        h = hk * rep + g
        row = (b * heads + h).to(tl.int64) * seq
        for start_m in range(lo, hi, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            row_ok = offs_m < seq
            q = tl.load(q_ptr + b.to(tl.int64) * sqb + h * sqh + offs_m[:, None] * sqs + offs_d[None, :],
                        mask=row_ok[:, None], other=0.0)
            do = tl.load(do_ptr + b.to(tl.int64) * sob + h * soh + offs_m[:, None] * sos + offs_d[None, :],
                         mask=row_ok[:, None], other=0.0)
            lse = tl.load(lse_ptr + row + offs_m, mask=row_ok, other=0.0)
            delta = tl.load(delta_ptr + row + offs_m, mask=row_ok, other=0.0)
            p = tl.exp2(_dot(q, tl.trans(k)) * qk_scale - lse[:, None])  # [BLOCK_M, BLOCK_N]
            doc_q = offs_m
            if HAS_DOCS:
                doc_q = tl.load(docs_ptr + b * seq + offs_m, mask=row_ok, other=-1)
            if _needs_mask(start_m, start_n, seq, window, BLOCK_M, BLOCK_N, HAS_WINDOW, HAS_DOCS):
                p = tl.where(_visible(offs_m, offs_n, doc_q, doc_k, seq, window, HAS_WINDOW, HAS_DOCS), p, 0.0)
            dv += _dot(tl.trans(p.to(do.dtype)), do)
            ds = p * (_dot(do, tl.trans(v)) - delta[:, None])
            dk += _dot(tl.trans(ds.to(q.dtype)), q)
    d_offs = b.to(tl.int64) * sdb + hk * sdh + offs_n[:, None] * sds + offs_d[None, :]
    tl.store(dk_ptr + d_offs, (dk * scale).to(dk_ptr.dtype.element_ty), mask=col_ok[:, None])
    tl.store(dv_ptr + d_offs, dv.to(dv_ptr.dtype.element_ty), mask=col_ok[:, None])


def _dot(a, b):
    return tl.dot(a, b)


def _dot_upcast(a, b):  # the interpreter (Triton 3.9) multiplies bf16 operands' raw bits: fp32 there
    return tl.dot(a.to(tl.float32), b.to(tl.float32))


_HELPERS = ("_visible", "_needs_mask", "_key_range", "_dot")


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


# Tile configurations the autotuner tries on the GPU (BLOCK_M, BLOCK_N, warps, stages), each without
# register spills on sm_90 at D=64 (ptxas; most also at D=128, where the backward's choices are few);
# the interpreter takes the fixed small tiles of INTERPRETER_BLOCKS (several blocks at small shapes).
FWD_CONFIGS = [(128, 64, 4, 3), (128, 128, 8, 3), (64, 64, 4, 4), (128, 32, 4, 4)]
DQ_CONFIGS = [(128, 64, 8, 2), (64, 64, 8, 2), (64, 64, 4, 3), (64, 32, 4, 3)]
# dK/dV: the BLOCK_M = 32 tiles (32, 128, 8, 2) and (32, 64, 4, 2) gave a dK that differs run to run on
# the H200 (by up to 0.7, at D = 64 and 128), the others never (tests/gpu/test_attention_gpu.py runs each
# offered tile five times): a race in the code made for those tiles, so they are not offered.
DKV_CONFIGS = [(64, 64, 8, 2), (64, 128, 8, 3)]  # BLOCK_N: the key block
INTERPRETER_BLOCKS = {"BLOCK_M": 16, "BLOCK_N": 16}


def _launcher(fn, configs):
    """fn jit-compiled (and autotuned over `configs` on the GPU) on its first launch."""
    if fn not in _compiled:
        global tl
        import triton
        import triton.language

        tl = triton.language
        if not _compiled:  # the helpers the kernels call: jit-compiled in their place
            if _interpreting():
                globals()["_dot"] = _dot_upcast
            for name in _HELPERS:
                globals()[name] = triton.jit(globals()[name])
        jitted = triton.jit(fn)
        if not _interpreting():
            jitted = triton.autotune([triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=st)
                                      for m, n, w, st in configs], key=["seq", "rep", "D", "HAS_WINDOW", "HAS_DOCS"])(jitted)
        _compiled[fn] = jitted
    return _compiled[fn]


def _strides(t):  # (batch, head, position) strides of a [B, H, S, D] view
    return t.stride(0), t.stride(1), t.stride(2)


def _flags(docs, window):
    return {"HAS_WINDOW": window > 0, "HAS_DOCS": docs is not None} | (INTERPRETER_BLOCKS if _interpreting() else {})


@torch.library.custom_op("pithtrain::flash_attention_fwd", mutates_args=())
def _flash_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None,
               docs: torch.Tensor | None, scale: float, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """out [B, S, Hq, D] (q's dtype), lse [B, Hq, S] (fp32, base 2) from [B, H, S, D] inputs."""
    b, hq, s, d = q.shape
    out = q.new_empty(b, s, hq, d)
    lse = torch.empty(b, hq, s, dtype=torch.float32, device=q.device)
    if out.numel():
        kernel = _launcher(_fwd_kernel, FWD_CONFIGS)
        grid = lambda meta: (_cdiv(s, meta["BLOCK_M"]), b * hq)  # noqa: E731
        kernel[grid](q, k, v, q if sinks is None else sinks, q if docs is None else docs[0], out, lse,
                     *_strides(q), *_strides(k), *_strides(v), *_strides(out.transpose(1, 2)),
                     s, hq, hq // k.shape[1], scale * LOG2E, window, D=d, HAS_SINK=sinks is not None, **_flags(docs, window))
    return out, lse


@_flash_fwd.register_fake
def _(q, k, v, sinks, docs, scale, window):
    b, hq, s, d = q.shape
    return q.new_empty(b, s, hq, d), q.new_empty(b, hq, s, dtype=torch.float32)


@torch.library.custom_op("pithtrain::flash_attention_bwd", mutates_args=())
def _flash_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor,
               delta: torch.Tensor, docs: torch.Tensor | None, scale: float, window: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq [B, S, Hq, D], dk, dv [B, S, Hkv, D] for dout [B, S, Hq, D] (contiguous), lse/delta [B, Hq, S]."""
    b, hq, s, d = q.shape
    hkv = k.shape[1]
    dq, dk, dv = torch.empty_like(dout), k.new_empty(b, s, hkv, d), v.new_empty(b, s, hkv, d)
    if dq.numel():
        flags = _flags(docs, window)
        starts, ends = (q, q) if docs is None else (docs[0], docs[1])
        do_strides = _strides(dout.transpose(1, 2))
        grid = lambda meta: (_cdiv(s, meta["BLOCK_M"]), b * hq)  # noqa: E731
        _launcher(_bwd_dq_kernel, DQ_CONFIGS)[grid](
            q, k, v, dout, lse, delta, starts, dq, *_strides(q), *_strides(k), *_strides(v), *do_strides,
            s, hq, hq // hkv, scale * LOG2E, scale, window, D=d, **flags)
        grid = lambda meta: (_cdiv(s, meta["BLOCK_N"]), b * hkv)  # noqa: E731
        _launcher(_bwd_dkv_kernel, DKV_CONFIGS)[grid](
            q, k, v, dout, lse, delta, starts, ends, dk, dv, *_strides(q), *_strides(k), *_strides(v), *do_strides,
            *_strides(dk.transpose(1, 2)), s, hq, hkv, hq // hkv, scale * LOG2E, scale, window, D=d, **flags)
    return dq, dk, dv


@_flash_bwd.register_fake
def _(q, k, v, dout, lse, delta, docs, scale, window):
    b, hq, s, d = q.shape
    return torch.empty_like(dout), k.new_empty(b, s, k.shape[1], d), v.new_empty(b, s, k.shape[1], d)


class _FlashAttention(torch.autograd.Function):
    """Saves q, k, v, the output and the log-sum-exp; the backward recomputes the probabilities."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, docs, scale: float, window: int):
        if q.shape[1] % k.shape[1] or k.shape != v.shape or q.shape[-1] not in HEAD_DIMS:
            raise ValueError(f"flash attention takes q [B, Hq, S, D], k = v [B, Hkv, S, D], Hkv | Hq, "
                             f"D in 16/32/64/128; got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
        out, lse = _flash_fwd(q, k, v, sinks, docs, scale, window)
        ctx.save_for_backward(q, k, v, sinks, docs, out, lse)
        ctx.args = scale, window
        return out.flatten(2)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, sinks, docs, out, lse = ctx.saved_tensors
        scale, window = ctx.args
        grad = grad.reshape(out.shape).contiguous()
        delta = (grad.float() * out.float()).sum(-1).transpose(1, 2).contiguous()  # [B, Hq, S]
        dq, dk, dv = _flash_bwd(q, k, v, grad, lse, delta, docs, scale, window)
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[3]:  # -sum over rows of p_sink * delta
            p_sink = torch.exp2(sinks.float().view(1, -1, 1) * LOG2E - lse)
            dsinks = -(p_sink * delta).sum((0, 2)).to(sinks.dtype)
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2), dsinks, None, None, None


def attention_flops(batch: int, heads: int, seq: int, head_dim: int, window: int | None = None) -> int:
    """Forward FLOPs counting only the visible (query, key) pairs: 2 matmuls of 2 FLOPs per
    multiply-add. The backward is 2.5 times this (5 matmuls)."""
    w = min(window or seq, seq)
    pairs = seq * (seq + 1) // 2 - (seq - w) * (seq - w + 1) // 2
    return 4 * batch * heads * head_dim * pairs
