"""Gated DeltaNet's token mixer (Qwen3.5-MoE's linear-attention layers): the gated delta rule and the short causal conv
before it, both with packed documents.

  gated_delta_rule(q, k, v, g, beta, doc_ids=None, chunk_size=64, cu_seqlens=None) -> o [B, S, H, Dv]
      chunked (WY/UT form): batched matmuls over all chunks, a sequential scan only over chunk states.
      On CUDA with flash-linear-attention installed (`USE_FLA`): FLA's Triton kernels (see below).
  gated_delta_rule_recurrent(q, k, v, g, beta, doc_ids=None)   token by token: the oracle.
  causal_conv1d(x, weight, doc_ids=None)   depthwise causal conv + SiLU, zero history at doc starts.
  l2norm(x, eps=1e-6)   HF/FLA's x * rsqrt(sum x^2 + eps). The ops do NOT normalise q, k: the caller
      does (the model applies it before the op, as HF does with use_qk_l2norm_in_kernel).
  doc_cu_seqlens(doc_ids)   FLA's varlen offsets (one host sync): compute once per micro-batch.
  chunked_flops(batch, seq, heads, dk, dv, chunk=64)   forward FLOPs of the chunked algorithm.

Recurrence per head, S: [Dk, Dv], zero at each document start, q scaled by Dk**-0.5 here:
  S_t = exp(g_t) S_{t-1};  S_t += k_t (beta_t (v_t - S_t^T k_t))^T;  o_t = S_t^T q_t.
Chunked form (chunk of C tokens, G the within-chunk cumsum of g, seg the document run of a token, S0 the state carried
in, c_i = [seg_i == seg of the token before the chunk]):
  M_ij = [j <= i][seg_i == seg_j] exp(G_i - G_j)   (the decay between two tokens of one document)
  A = strictly-lower(M * beta k k^T);  [u | w] = (I + A)^-1 [beta v | beta c exp(G) k]
  v_new = u - w S0;  o = scale (c exp(G) q S0 + (M * q k^T) v_new)
  S_end = c_last exp(G_last) S0 + (k * [seg == seg_last] exp(G_last - G))^T v_new.
Document resets are masks, never -inf in g, so cumsums stay exact and nothing turns NaN.

GPU path (CUDA inputs, `fla` importable, USE_FLA, chunk_size in 16/32/64): FLA 0.6.0's chunk_gated_delta_rule forward
and backward, documents as varlen sequences (B*S tokens flattened, cu_seqlens), wrapped as torch.library custom ops so a
compiled stage traces through them. FLA refuses its gated `chunk_bwd_dqkwg` kernel on Hopper with Triton in [3.4, 3.7.1)
(its issue #640: wrong results); there our `dqkwg_triton` (the same chunk formulas as one Triton kernel that never
transposes a matmul result; `dqkwg_torch` is its batched PyTorch reference) takes its place in FLA's gated-delta-rule
backward (`_patch_fla`). Without fla on CUDA: the chunked PyTorch path, with one warning per process. How each path is
checked, and its speed: docs/performance.md, "The gated delta rule"."""

from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F

from pithtrain.ops.kernels import _Kernel, _pow2

USE_FLA = True  # False: the PyTorch chunked path on CUDA too (tests, benchmarks)
FLA_CHUNKS = (16, 32, 64)  # the chunk sizes FLA's gated delta rule takes
DQKWG_TRITON = True  # where FLA's dqkwg is refused: our Triton kernel (False: the PyTorch one)
_warned = False


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, in fp32 (as HF and FLA do), back to x's dtype."""
    xf = x.float() if x.dtype != torch.float64 else x
    return (xf * torch.rsqrt((xf * xf).sum(-1, keepdim=True) + eps)).to(x.dtype)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _segments(doc_ids: torch.Tensor | None, b: int, s: int, device) -> torch.Tensor:
    """[B, S] run index of each token (0, 0, 1, 1, 2, ...): equal ids that are not contiguous
    count as different documents, so equality of runs is what 'same document' means."""
    if doc_ids is None:
        return torch.zeros(b, s, dtype=torch.long, device=device)
    change = (doc_ids[:, 1:] != doc_ids[:, :-1]).long()
    return F.pad(change.cumsum(1), (1, 0))


def _expand_heads(q, k, h):
    """q/k heads serve h // hk consecutive value heads (HF's repeat_interleave)."""
    rep = h // k.shape[2]
    return (q, k) if rep == 1 else (q.repeat_interleave(rep, 2), k.repeat_interleave(rep, 2))


def gated_delta_rule_recurrent(q, k, v, g, beta, doc_ids=None) -> torch.Tensor:
    """The token-by-token recurrence (the oracle for tests and reference_forward). Same contract as
    gated_delta_rule: q, k [B, S, Hk, Dk] (L2-normed, unscaled), v [B, S, H, Dv], g, beta [B, S, H]."""
    b, s, h, dv = v.shape
    ct = _compute_dtype(v)
    q, k = _expand_heads(q, k, h)
    q, k, v, g, beta = (t.to(ct) for t in (q, k, v, g, beta))
    q = q * q.shape[-1] ** -0.5
    seg = _segments(doc_ids, b, s, v.device)
    state = v.new_zeros(b, h, q.shape[-1], dv, dtype=ct)
    out = []
    for t in range(s):
        keep = torch.ones(b, dtype=ct, device=v.device) if t == 0 else (seg[:, t] == seg[:, t - 1]).to(ct)
        state = state * (keep[:, None] * g[:, t].exp())[..., None, None]
        kv_mem = torch.einsum("bhkv,bhk->bhv", state, k[:, t])
        delta = beta[:, t, :, None] * (v[:, t] - kv_mem)
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]
        out.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t]))
    return torch.stack(out, 1).to(v.dtype)


def gated_delta_rule(q, k, v, g, beta, doc_ids=None, chunk_size=64, cu_seqlens=None) -> torch.Tensor:
    """q, k: [B, S, Hk, Dk] (already L2-normed, NOT yet scaled; the op scales q by Dk**-0.5), v: [B, S, H, Dv] (Hk = H,
    or a divisor of it: each q/k head then serves H/Hk consecutive value heads), g: [B, S, H] log-decay (<= 0), beta:
    [B, S, H] in (0, 1). doc_ids: [B, S] int or None: packed documents; the state resets to zero at the first token of
    every document. cu_seqlens: optional, only read on FLA's path: doc_cu_seqlens(doc_ids) computed once by the caller
    (else computed here: one host sync per call, and a graph break under torch.compile, so a compiled caller with
    documents must pass it). Returns o [B, S, H, Dv] in v's dtype; computes in fp32 (fp64 if inputs are fp64)."""
    if v.is_cuda and USE_FLA and chunk_size in FLA_CHUNKS and v.dtype != torch.float64 and _fla_ready():
        return _fla_path(q, k, v, g, beta, doc_ids, chunk_size, cu_seqlens)
    return gated_delta_rule_chunked(q, k, v, g, beta, doc_ids, chunk_size)


def gated_delta_rule_chunked(q, k, v, g, beta, doc_ids=None, chunk_size=64) -> torch.Tensor:
    """The plain-PyTorch chunked path of gated_delta_rule (any device; autograd; compile-friendly)."""
    b, s, h, dv = v.shape
    ct, out_dtype = _compute_dtype(v), v.dtype
    c = chunk_size
    n = -(-s // c)
    pad = n * c - s
    q, k = _expand_heads(q, k, h)
    dk = q.shape[-1]
    seg = _segments(doc_ids, b, s, v.device)
    # Padded tokens: zero q/k/v/beta/g and their own document, so they touch nothing real.
    seg = F.pad(seg, (0, pad), value=0) + F.pad(torch.zeros_like(seg), (0, pad), value=1) * (seg[:, -1:] + 1)

    def chunks(x):  # [B, S, H, ...] -> [B, H, N, C, ...] in the compute dtype
        x = x.to(ct)
        x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad)) if pad else x
        return x.reshape(b, n, c, h, *x.shape[3:]).movedim(3, 1)

    q, k, v, g, beta = (chunks(t) for t in (q, k, v, g, beta))
    q = q * dk**-0.5
    seg = seg.reshape(b, 1, n, c)
    gc = g.cumsum(-1)  # [B, H, N, C]: log decay from the chunk start through each token
    same = seg[..., :, None] == seg[..., None, :]
    causal = torch.ones(c, c, dtype=torch.bool, device=v.device).tril()
    m_mask = same & causal  # [B, 1, N, C, C]
    # exp only where the mask holds: there G_i - G_j <= 0 (elsewhere it could overflow)
    decay = torch.where(m_mask, (gc[..., :, None] - gc[..., None, :]).where(m_mask, 0.0).exp(), 0.0)
    # c_i: does the state carried into the chunk reach token i (same document as the token before)?
    prev_last = F.pad(seg[..., :-1, -1], (1, 0), value=0)  # chunk 0's carried state is zero anyway
    carry = (seg == prev_last[..., None]).to(ct)  # [B, 1, N, C]
    end = (seg == seg[..., -1:]).to(ct)  # tokens of the chunk's last document
    kb = k * beta[..., None]
    a = (kb @ k.transpose(-1, -2)) * decay
    ut = a.tril(-1) + torch.eye(c, dtype=ct, device=v.device)
    rhs = torch.cat([v * beta[..., None], kb * (carry * gc.exp())[..., None]], -1)
    uw = torch.linalg.solve_triangular(ut, rhs, upper=False, unitriangular=True)
    u, w = uw[..., :dv], uw[..., dv:]
    attn = (q @ k.transpose(-1, -2)) * decay
    q_in = q * (carry * gc.exp())[..., None]  # reads the carried state
    k_out = k * (end * (gc[..., -1:] - gc).exp())[..., None]  # writes the chunk-end state
    chunk_decay = (carry[..., -1] * gc[..., -1].exp())[..., None, None]  # [B, H, N, 1, 1]
    state = v.new_zeros(b, h, dk, dv)
    out = []
    for i in range(n):  # the only sequential part: one state per chunk
        v_new = u[:, :, i] - w[:, :, i] @ state
        out.append(q_in[:, :, i] @ state + attn[:, :, i] @ v_new)
        state = state * chunk_decay[:, :, i] + k_out[:, :, i].transpose(-1, -2) @ v_new
    o = torch.stack(out, 2).reshape(b, h, n * c, dv)[:, :, :s]
    return o.transpose(1, 2).to(out_dtype)


def causal_conv1d(x, weight, doc_ids=None) -> torch.Tensor:
    """Depthwise causal conv over the sequence, then SiLU. x: [B, S, C], weight: [C, K] (HF's conv1d.weight
    [C, 1, K] squeezed), no bias: out_t = silu(sum_j weight[:, K-1-j] * x[t-j]), x[t-j] zero before the
    sequence or in an earlier document than t. Computes in fp32 (fp64 for fp64 x); returns x's dtype."""
    b, s, _ = x.shape
    ct = _compute_dtype(x)
    xc, wc = x.to(ct), weight.to(ct)
    seg = _segments(doc_ids, b, s, x.device)
    out = xc * wc[:, -1]
    for j in range(1, min(weight.shape[1], s)):  # K is small (4): one shifted, masked copy per tap within the sequence
        shifted = F.pad(xc, (0, 0, j, 0))[:, :s]
        if doc_ids is not None:
            shifted = shifted * (F.pad(seg, (j, 0), value=-1)[:, :s] == seg).to(ct)[..., None]
        out = out + shifted * wc[:, -1 - j]
    return F.silu(out).to(x.dtype)


def doc_cu_seqlens(doc_ids: torch.Tensor) -> torch.Tensor:
    """FLA's varlen offsets for the flattened B*S tokens: a sequence starts at every row start and every
    document change; int64 [N+1] ending in B*S. One host sync (nonzero): call once per micro-batch."""
    b, s = doc_ids.shape
    start = F.pad(doc_ids[:, 1:] != doc_ids[:, :-1], (1, 0), value=True)
    return F.pad(start.flatten().nonzero().squeeze(1), (0, 1), value=b * s)


def chunked_flops(batch: int, seq: int, heads: int, dk: int, dv: int, chunk: int = 64) -> int:
    """Forward FLOPs (2 a multiply-add) of the chunked algorithm. Per chunk of C tokens and head:
    k k^T C*C*Dk, the triangular inverse C^3/3, w and u C*C*(Dk+Dv), q k^T C*C*Dk, q S C*Dk*Dv,
    attn v_new C*C*Dv, w S C*Dk*Dv, the state update k^T v_new C*Dk*Dv. Backward is counted as 2x this."""
    c = chunk
    macs = c * c * dk + c**3 / 3 + c * c * (dk + dv) + c * c * dk + 3 * c * dk * dv + c * c * dv
    return int(2 * macs * heads * batch * -(-seq // c))


# --- FLA (flash-linear-attention) on CUDA -------------------------------------------------------------


@functools.cache
def _fla():
    """FLA's gated-delta-rule chunk module (patched where needed: _patch_fla), or None without fla."""
    try:
        import fla.ops.gated_delta_rule.chunk as chunk
        from fla.ops.utils.index import prepare_chunk_indices
    except Exception:  # ImportError, or a broken install: the PyTorch path serves
        return None
    _patch_fla(chunk)
    return chunk, prepare_chunk_indices


@torch._dynamo.assume_constant_result  # a compiled stage decides once, at trace time (no import traced)
def _fla_ready() -> bool:
    global _warned
    if _fla() is not None:
        return True
    if not _warned:
        _warned = True
        warnings.warn("pithtrain: flash-linear-attention is not installed: Gated DeltaNet runs the slower "
                      "PyTorch chunked path (pip install flash-linear-attention==0.6.0)", stacklevel=3)
    return False


def _patch_fla(chunk) -> None:
    """FLA refuses its gated chunk_bwd_dqkwg on Hopper with Triton >= 3.4, < 3.7.1 (wrong results there,
    its issue #640). Exactly there, the gated delta rule's backward calls ours instead (the name in that
    one module: no other FLA op changes): dqkwg_triton, or dqkwg_torch with DQKWG_TRITON = False."""
    from fla.utils import IS_NVIDIA_HOPPER, TRITON_ABOVE_3_4_0, TRITON_ABOVE_3_7_1

    if IS_NVIDIA_HOPPER and TRITON_ABOVE_3_4_0 and not TRITON_ABOVE_3_7_1:
        chunk.chunk_bwd_dqkwg = _our_dqkwg


def _our_dqkwg(*args, **kwargs):
    return (dqkwg_triton if DQKWG_TRITON else dqkwg_torch)(*args, **kwargs)


def _fla_layout(q, k, v, g, beta, doc_ids, cu_seqlens):
    """[B, S, ...] -> FLA's inputs: varlen (B = 1, cu_seqlens) when documents are packed."""
    if doc_ids is None and cu_seqlens is None:
        return q, k, v, g, beta, None
    if cu_seqlens is None:
        cu_seqlens = doc_cu_seqlens(doc_ids)  # one host sync: pass cu_seqlens to avoid it per layer
    return (*(t.reshape(1, -1, *t.shape[2:]) for t in (q, k, v, g, beta)), cu_seqlens.to(torch.long))


def _fla_path(q, k, v, g, beta, doc_ids, chunk_size, cu_seqlens):
    b, s = v.shape[:2]
    dt = v.dtype
    q, k = q.to(dt).contiguous(), k.to(dt).contiguous()
    fq, fk, fv, fg, fb, cu = _fla_layout(q, k, v.contiguous(), g.float().contiguous(), beta.to(dt).contiguous(),
                                         doc_ids, cu_seqlens)
    o = _fla_fwd(fq, fk, fv, fg, fb, cu, chunk_size)[0]
    return o.reshape(b, s, *o.shape[2:])


@torch.library.custom_op("pithtrain::gdn_fla_fwd", mutates_args=())
def _fla_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             cu_seqlens: torch.Tensor | None, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FLA's forward: o, and for the backward the chunk-local cumsum of g (log2 units) and the solved A."""
    chunk, prepare = _fla()
    idx = None if cu_seqlens is None else prepare(cu_seqlens, chunk_size)
    gc, o, a, *_ = chunk.chunk_gated_delta_rule_fwd(
        q=q, k=k, v=v, g=g, beta=beta, scale=q.shape[-1] ** -0.5, initial_state=None, output_final_state=False,
        cu_seqlens=cu_seqlens, chunk_indices=idx, chunk_size=chunk_size)
    return o.to(v.dtype), gc, a


@_fla_fwd.register_fake
def _(q, k, v, g, beta, cu_seqlens, chunk_size):
    return (torch.empty_like(v), torch.empty(g.shape, dtype=torch.float32, device=g.device),
            k.new_empty(*v.shape[:3], chunk_size))


@torch.library.custom_op("pithtrain::gdn_fla_bwd", mutates_args=())
def _fla_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gc: torch.Tensor, beta: torch.Tensor,
             a: torch.Tensor, do: torch.Tensor, cu_seqlens: torch.Tensor | None,
             chunk_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    chunk, prepare = _fla()
    idx = None if cu_seqlens is None else prepare(cu_seqlens, chunk_size)
    dq, dk, dv, db, dg, *_ = chunk.chunk_gated_delta_rule_bwd(
        q=q, k=k, v=v, g=gc, beta=beta, A=a, scale=q.shape[-1] ** -0.5, initial_state=None,
        do=do.contiguous(), dht=None, cu_seqlens=cu_seqlens, chunk_indices=idx, chunk_size=chunk_size)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.float(), db.to(beta.dtype)


@_fla_bwd.register_fake
def _(q, k, v, gc, beta, a, do, cu_seqlens, chunk_size):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(gc), torch.empty_like(beta)


def _fla_setup(ctx, inputs, output):
    q, k, v, g, beta, cu_seqlens, chunk_size = inputs
    _, gc, a = output
    ctx.save_for_backward(q, k, v, gc, beta, a, cu_seqlens)
    ctx.chunk_size = chunk_size


def _fla_backward(ctx, do, _dgc, _da):
    q, k, v, gc, beta, a, cu_seqlens = ctx.saved_tensors
    dq, dk, dv, dg, db = _fla_bwd(q, k, v, gc, beta, a, do, cu_seqlens, ctx.chunk_size)
    return dq, dk, dv, dg, db, None, None


_fla_fwd.register_autograd(_fla_backward, setup_context=_fla_setup)


def dqkwg_torch(q, k, v, do, h, dh, w=None, g=None, g_gamma=None, dv=None, scale=None, state_v_first=False,
                cu_seqlens=None, chunk_size=64, chunk_indices=None):
    """What FLA 0.6.0's gated `chunk_bwd_kernel_dqkwg` (fla/ops/common/chunk_o.py) computes, batched over
    all chunks in PyTorch (fp32). Per chunk (g: chunk-local cumsum in log2 units, l the chunk's last
    token, v = v_new, h/dh the state and its gradient at the chunk start, [K, V] per head):
      ds = (do v^T) * [i >= j] 2^(g_i - g_j) * scale
      dq = 2^g * scale * do h^T + ds k;   dk = 2^(g_l - g) * v dh^T + ds^T q;   dw = -dv h^T
      dg = rowsum(dq * q) - rowsum(dk * k), and at l also + 2^(g_l) sum(h * dh) + sum_i rowsum(dk_state * k)
    where dk_state is the first term of dk. q, k may have H heads for HV value heads: dq, dk are summed
    back over each q/k head's value heads. Returns dq, dk (q's, k's dtypes), dw (w's), dg (fp32)."""
    if g is None or w is None or dv is None or g_gamma is not None:
        raise NotImplementedError("dqkwg_torch covers the gated delta rule only (g, w and dv given)")
    b, t, hk, kd = k.shape
    hv, vd = v.shape[2], v.shape[3]
    c, dev, f32 = chunk_size, k.device, torch.float32
    if cu_seqlens is None:  # equal rows of t tokens in the flattened b*t
        nt = -(-t // c)
        seq_start = torch.arange(b, device=dev).repeat_interleave(nt) * t
        chunk_bos = seq_start + torch.arange(nt, device=dev).repeat(b) * c
        chunk_eos = seq_start + t
    else:
        if chunk_indices is None:
            from fla.ops.utils.index import prepare_chunk_indices
            chunk_indices = prepare_chunk_indices(cu_seqlens, c)
        seq, it = chunk_indices[:, 0].long(), chunk_indices[:, 1].long()
        chunk_bos = cu_seqlens[seq].long() + it * c
        chunk_eos = cu_seqlens[seq + 1].long()
    pos = chunk_bos[:, None] + torch.arange(c, device=dev)  # [NC, C] flattened token index
    valid = pos < chunk_eos[:, None]
    last = torch.minimum(chunk_bos + c, chunk_eos) - 1
    nc = pos.shape[0]
    # Equal rows that fill whole chunks need no gather or scatter: the chunks are a reshape.
    dense = cu_seqlens is None and t % c == 0
    at = torch.where(valid, pos, 0)
    vmask = valid.to(f32)[:, None, :]  # [NC, 1, C]

    def gather(x, heads):  # [B, T, heads, D] -> [NC, HV, C, D] fp32 (batched-matmul layout), zero past the end
        x = x.reshape(nc, c, heads, -1) if dense else x.reshape(b * t, heads, -1)[at]
        x = x.transpose(1, 2).float()
        if heads != hv:
            x = x.repeat_interleave(hv // heads, 1)
        return x if dense else x * vmask[..., None]

    qc, kc = gather(q, hk), gather(k, hk)
    vc, doc, dvc = gather(v, hv), gather(do, hv), gather(dv, hv)
    gflat = g.reshape(b * t, hv).float()
    gc = (gflat.reshape(nc, c, hv) if dense else gflat[at]).transpose(1, 2) * vmask  # [NC, HV, C]
    g_last = gflat[last]  # [NC, HV]
    hh, dhh = (x.reshape(nc, hv, *x.shape[-2:]).float() for x in (h, dh))
    if state_v_first:
        hh, dhh = hh.transpose(-1, -2), dhh.transpose(-1, -2)
    dg_last = (hh * dhh).sum((-1, -2)) * torch.exp2(g_last)
    dq = (doc @ hh.transpose(-1, -2)) * (torch.exp2(gc) * scale)[..., None]
    dk = (vc @ dhh.transpose(-1, -2)) * (torch.exp2(g_last[..., None] - gc) * vmask)[..., None]
    dw = -(dvc @ hh.transpose(-1, -2))
    dg_last = dg_last + (dk * kc).sum((-1, -2))
    mask = torch.ones(c, c, dtype=torch.bool, device=dev).tril() & (valid[:, :, None] & valid[:, None, :])[:, None]
    ds = doc @ vc.transpose(-1, -2)  # [NC, HV, C, C]
    ds = torch.where(mask, ds * torch.exp2((gc[..., :, None] - gc[..., None, :]).where(mask, 0.0)), 0.0) * scale
    dq = dq + ds @ kc
    dk = dk + ds.transpose(-1, -2) @ qc
    dg = (dq * qc).sum(-1) - (dk * kc).sum(-1)  # [NC, HV, C]
    at_last = (torch.arange(c, device=dev)[None, :] == (last - chunk_bos)[:, None]).to(f32)[:, None]
    dg = dg + at_last * dg_last[..., None]

    def scatter(x, like_heads, dtype):  # [NC, HV, C, ...] -> [B, T, heads, ...], each valid token once
        x = x.transpose(1, 2)
        if dense:
            flat = x.reshape(b * t, *x.shape[2:])
        else:  # past-the-end rows land in a dropped extra row
            dst = torch.where(valid, pos, b * t).flatten()
            flat = x.new_zeros(b * t + 1, *x.shape[2:]).index_copy(0, dst, x.flatten(0, 1))[: b * t]
        if like_heads != hv:
            flat = flat.reshape(b * t, like_heads, hv // like_heads, *x.shape[3:]).sum(2)
        return flat.reshape(b, t, like_heads, *x.shape[3:]).to(dtype)

    return (scatter(dq, hk, q.dtype), scatter(dk, hk, k.dtype), scatter(dw, hv, w.dtype),
            scatter(dg, hv, torch.float32))


def dqkwg_triton(q, k, v, do, h, dh, w=None, g=None, g_gamma=None, dv=None, scale=None, state_v_first=False,
                 cu_seqlens=None, chunk_size=64, chunk_indices=None):
    """dqkwg_torch's computation as one Triton kernel (a program per chunk and value head), for FLA's
    gated-delta-rule backward on Hopper with Triton < 3.7.1. FLA's own kernel is miscompiled there
    (its issue #640) at `tl.trans` of the ds tile, a matmul result; this kernel never transposes a
    matmul result: ds^T is a second (C x C) matmul of the loaded tiles, v do^T. fp32 inputs multiply in
    full fp32: dg = rowsum(dq q) - rowsum(dk k) cancels, and TF32's error there reaches the decay
    parameters' gradients (A_log, dt_bias) at the size of the gradients themselves."""
    if g is None or w is None or dv is None or g_gamma is not None:
        raise NotImplementedError("dqkwg_triton covers the gated delta rule only (g, w and dv given)")
    b, t, hk, kd = k.shape
    hv, vd = v.shape[2], v.shape[3]
    if cu_seqlens is not None and chunk_indices is None:
        from fla.ops.utils.index import prepare_chunk_indices
        chunk_indices = prepare_chunk_indices(cu_seqlens, chunk_size)
    nt = -(-t // chunk_size) if cu_seqlens is None else len(chunk_indices)
    dq = q.new_empty(b, t, hv, kd)
    dk = k.new_empty(b, t, hv, kd)
    dw, dg = torch.empty_like(w), torch.empty(b, t, hv, dtype=torch.float32, device=g.device)
    sk, sv = (1, kd) if state_v_first else (vd, 1)  # h, dh: [.., K, V] or [.., V, K] per chunk and head
    _dqkwg_kernel[(nt, b * hv)](
        q, k, v, g, h, do, dh, dv, dq, dk, dw, dg, cu_seqlens, chunk_indices, scale, t, sk, sv,
        HK=hk, HV=hv, K=kd, V=vd, BT=chunk_size, BK=_pow2(max(kd, 16)), BV=min(_pow2(max(vd, 16)), 64),
        VARLEN=cu_seqlens is not None, PRECISION="ieee" if v.dtype == torch.float32 else "tf32", num_warps=DQKWG_WARPS, num_stages=DQKWG_STAGES)
    if hk != hv:  # each q/k head's gradient sums over its value heads
        dq, dk = (x.view(b, t, hk, hv // hk, kd).sum(3) for x in (dq, dk))
    return dq, dk, dw, dg


DQKWG_WARPS, DQKWG_STAGES = 8, 2  # measured on an H200 (benchmarks/delta_rule.py --dqkwg)
tl = None  # triton.language, bound by kernels._Kernel at the first launch


def _dqkwg_body(q, k, v, g, h, do, dh, dv, dq, dk, dw, dg, cu_seqlens, chunk_indices, scale, T, sk, sv,
                HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                BK: tl.constexpr, BV: tl.constexpr, VARLEN: tl.constexpr, PRECISION: tl.constexpr):
    i_t = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    i_b, i_hv = i_bh // HV, i_bh % HV
    if VARLEN:  # chunk i_t is chunk i_c of sequence i_n; its state is h[i_t]
        i_n = tl.load(chunk_indices + i_t * 2).to(tl.int64)
        i_c = tl.load(chunk_indices + i_t * 2 + 1).to(tl.int64)
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        T = (tl.load(cu_seqlens + i_n + 1) - bos).to(tl.int32)
        i_state = i_t.to(tl.int64)
    else:
        i_c = i_t.to(tl.int64)
        bos = i_b * T
        i_state = i_b * tl.cdiv(T, BT) + i_t
    o_t = i_c * BT + tl.arange(0, BT)
    m_t = o_t < T
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    tok = (bos + o_t).to(tl.int64)
    rows_v = tok[:, None] * HV + i_hv  # [BT, 1]: the chunk's rows of the [B*T, HV, .] tensors
    rows_k = tok[:, None] * HK + i_hv // (HV // HK)
    state = (i_state * HV + i_hv) * (K * V)
    acc_ds = tl.zeros([BT, BT], dtype=tl.float32)  # do v^T
    acc_dst = tl.zeros([BT, BT], dtype=tl.float32)  # v do^T (ds transposed, without transposing a result)
    acc_dq = tl.zeros([BT, BK], dtype=tl.float32)
    acc_dk = tl.zeros([BT, BK], dtype=tl.float32)
    acc_dw = tl.zeros([BT, BK], dtype=tl.float32)
    hdh = tl.zeros([BK], dtype=tl.float32)
    for i_v in range(0, tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        m_vk = (o_v < V)[:, None] & m_k[None, :]
        b_v = tl.load(v + rows_v * V + o_v[None, :], mask=m_tv, other=0.0)
        b_do = tl.load(do + rows_v * V + o_v[None, :], mask=m_tv, other=0.0)
        b_dv = tl.load(dv + rows_v * V + o_v[None, :], mask=m_tv, other=0.0)
        at_state = state + o_v[:, None] * sv + o_k[None, :] * sk  # [BV, BK]: the state tile, transposed
        b_ht = tl.load(h + at_state, mask=m_vk, other=0.0).to(b_v.dtype)
        b_dht = tl.load(dh + at_state, mask=m_vk, other=0.0).to(b_v.dtype)
        acc_ds = tl.dot(b_do, tl.trans(b_v), acc_ds, input_precision=PRECISION)
        acc_dst = tl.dot(b_v, tl.trans(b_do), acc_dst, input_precision=PRECISION)
        acc_dq = tl.dot(b_do, b_ht, acc_dq, input_precision=PRECISION)
        acc_dk = tl.dot(b_v, b_dht, acc_dk, input_precision=PRECISION)
        acc_dw = tl.dot(b_dv.to(b_v.dtype), b_ht, acc_dw, input_precision=PRECISION)
        hdh += tl.sum(b_ht.to(tl.float32) * b_dht.to(tl.float32), axis=0)
    m_tk = m_t[:, None] & m_k[None, :]
    tl.store(dw + rows_v * K + o_k[None, :], (-acc_dw).to(dw.dtype.element_ty), mask=m_tk)
    b_q = tl.load(q + rows_k * K + o_k[None, :], mask=m_tk, other=0.0)
    b_k = tl.load(k + rows_k * K + o_k[None, :], mask=m_tk, other=0.0)
    b_g = tl.load(g + tok * HV + i_hv, mask=m_t, other=0.0)
    last = tl.minimum(i_c * BT + BT, T) - 1
    g_last = tl.load(g + (bos + last) * HV + i_hv)
    acc_dq = acc_dq * (tl.exp2(b_g) * scale)[:, None]
    acc_dk = acc_dk * tl.where(m_t, tl.exp2(g_last - b_g), 0.0)[:, None]
    dg_last = tl.sum(hdh) * tl.exp2(g_last) + tl.sum(acc_dk * b_k.to(tl.float32))
    causal = (o_t[:, None] >= o_t[None, :]) & m_t[:, None] & m_t[None, :]  # [i, j]: i >= j
    ds = tl.where(causal, acc_ds * tl.exp2(b_g[:, None] - b_g[None, :]), 0.0) * scale
    causal_t = (o_t[None, :] >= o_t[:, None]) & m_t[:, None] & m_t[None, :]  # [j, i]
    dst = tl.where(causal_t, acc_dst * tl.exp2(b_g[None, :] - b_g[:, None]), 0.0) * scale
    acc_dq = tl.dot(ds.to(b_k.dtype), b_k, acc_dq, input_precision=PRECISION)
    acc_dk = tl.dot(dst.to(b_q.dtype), b_q, acc_dk, input_precision=PRECISION)
    b_dg = tl.sum(acc_dq * b_q.to(tl.float32), axis=1) - tl.sum(acc_dk * b_k.to(tl.float32), axis=1)
    b_dg = tl.where(o_t == last, b_dg + dg_last, b_dg)
    tl.store(dq + rows_v * K + o_k[None, :], acc_dq.to(dq.dtype.element_ty), mask=m_tk)
    tl.store(dk + rows_v * K + o_k[None, :], acc_dk.to(dk.dtype.element_ty), mask=m_tk)
    tl.store(dg + tok * HV + i_hv, b_dg, mask=m_t)


_dqkwg_kernel = _Kernel(_dqkwg_body)
