"""Context parallelism (CP): one sequence split over the CP ranks, attention computed as a ring.

Layout (zigzag): the sequence is cut into 2*cp equal chunks and CP rank r holds chunks r and 2cp-1-r. Under causal
attention an early chunk has little to attend to and a late one a lot, so pairing them gives every rank the same work.
The loop splits every [B, S] input (input_ids, labels, position_ids, doc_ids) with `zigzag_split`; RoPE reads the split
position_ids, so the models change only in where attention is computed.

Ring attention: each rank keeps its queries; key/value blocks travel around the CP ring (rank r sends to r+1 and
receives from r-1), so at step i rank r holds the block of rank r-i and after cp steps every query has met every key. A
block's scores are masked by the GLOBAL token indices of the queries and keys (causal, optional sliding window, optional
same-document), and blocks combine by the log-sum-exp rule in fp32 (flash attention's online softmax). The next block's
transfer is issued before computing on the current one, so the two overlap on GPUs. Only the bounding box of a block's
visible (query, key) pairs is computed and empty blocks are skipped: with zigzag and causal attention, every step after
the first computes half a block.

Backward: a second ring. Each rank recomputes block scores from the saved log-sum-exp; dQ stays home, while dK/dV
accumulate (fp32) in buffers that travel with their block and reach its owner after the cp-th hop.

What travels need not be K/V: `context_attention_expand` rings any payload, and an `expand` function rebuilds K/V from
it on every step. MLA sends its normed latent and shared rope key (kv_lora_rank + rope_dim numbers per token, not
heads * (qk_dim + v_dim)); the gradients of the payload and of expand's weights come from autograd through `expand`.

Sinks (GPT-OSS): one logit per head joins the softmax denominator once, after the ring.

Use, per micro-batch already on the device:
    micro, cp = shard_micro_batch(micro, mesh.cp_group)
    logits = model(micro["input_ids"], micro["position_ids"], engine, doc_ids=micro.get("doc_ids"), cp=cp)"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

KV_TAG, GRAD_TAG = 0, 1  # the two rings of the backward share peers; tags keep their messages apart
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)  # the new name since torch 2.13


def zigzag_indices(seq_len: int, cp: int, cp_rank: int, device=None) -> torch.Tensor:
    """Global token indices held by `cp_rank`: chunks cp_rank and 2cp-1-cp_rank of 2cp."""
    if seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} is not divisible by 2*cp={2 * cp}; change data.seq_len")
    chunk, late = seq_len // (2 * cp), 2 * cp - 1 - cp_rank
    return torch.cat([torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device),
                      torch.arange(late * chunk, (late + 1) * chunk, device=device)])


def zigzag_split(t: torch.Tensor, cp: int, cp_rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's share of `t` along its sequence dim."""
    return t.index_select(dim, zigzag_indices(t.shape[dim], cp, cp_rank, t.device))


def zigzag_merge(parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """Inverse of zigzag_split: the full tensor from every rank's share (in CP rank order)."""
    cp = len(parts)
    order = torch.cat([zigzag_indices(parts[0].shape[dim] * cp, cp, r, parts[0].device) for r in range(cp)])
    return torch.cat(parts, dim).index_select(dim, torch.argsort(order))


@dataclass
class ContextParallel:
    """One micro-batch's CP layout. `positions[r]` [1 or B, S_local] and `doc_ids[r]` [B, S_local] (None: no packing)
    are the global token indices and document ids of CP rank r's tokens; every rank knows all of them, since CP ranks
    read the same samples. Masks come from these, never from position_ids (which restart at each packed document). Build
    one per micro-batch: it caches which blocks are visible."""

    group: dist.ProcessGroup | None  # None: cp == 1 (no communication)
    cp: int
    rank: int
    positions: list[torch.Tensor]
    doc_ids: list[torch.Tensor] | None = None
    boxes: dict = field(default_factory=dict, repr=False)  # (source rank, window) -> (q slice, k slice) or None

    @staticmethod
    def zigzag(group, seq_len: int, doc_ids: torch.Tensor | None = None, device=None) -> "ContextParallel":
        """The zigzag layout of a [B, seq_len] micro-batch; `doc_ids` is the FULL [B, seq_len] tensor."""
        cp, rank = (1, 0) if group is None else (dist.get_world_size(group), dist.get_rank(group))
        device = device if doc_ids is None else doc_ids.device
        held = [zigzag_indices(seq_len, cp, r, device) for r in range(cp)]
        docs = None if doc_ids is None else [doc_ids[:, i] for i in held]
        return ContextParallel(group, cp, rank, [i[None] for i in held], docs)

    def mask(self, source: int, window: int | None, box) -> torch.Tensor:
        """bool [B or 1, q rows, k cols] of the box (True = attend): local queries vs `source`'s keys."""
        qs, ks = box
        diff = self.positions[self.rank][:, qs, None] - self.positions[source][:, None, ks]
        ok = diff >= 0
        if window is not None:
            ok = ok & (diff < window)
        if self.doc_ids is not None:
            ok = ok & (self.doc_ids[self.rank][:, qs, None] == self.doc_ids[source][:, None, ks])
        return ok

    def box(self, source: int, window: int | None):
        """(q slice, k slice) bounding every visible pair of local queries x `source`'s keys, or None
        when there is none. Found for all sources at once, one host sync per window and micro-batch."""
        if (source, window) not in self.boxes:
            masks = (self.mask(s, window, (slice(None), slice(None))) for s in range(self.cp))
            stats = [torch.cat([_extent(m.any(2).any(0)), _extent(m.any(1).any(0))]) for m in masks]
            for s, (q0, q1, k0, k1) in enumerate(torch.stack(stats).tolist()):
                self.boxes[(s, window)] = (slice(q0, q1), slice(k0, k1)) if q1 > q0 else None
        return self.boxes[(source, window)]


def _extent(hit: torch.Tensor) -> torch.Tensor:
    """[first, end) of the True entries of a 1-D bool tensor; end <= first when there is none."""
    first, end = hit.int().argmax(), hit.numel() - hit.flip(0).int().argmax()
    return torch.where(hit.any(), torch.stack([first, end]), torch.zeros(2, dtype=first.dtype, device=hit.device))


def context_attention(q, k, v, scale: float, cp: ContextParallel, sinks=None, sliding_window: int | None = None):
    """Causal GQA attention of this rank's queries over the whole CP-split sequence.
    q: [B, Hq, S_local, D], k/v: [B, Hkv, S_local, D / Dv], sinks: [Hq] or None. Returns [B, S_local, Hq*Dv]
    (the layout of ops.core.attention). Differentiable in q, k, v and the sinks."""
    return _RingAttention.apply(cp, scale, sliding_window, None, 2, q, sinks, k, v)


def context_attention_expand(q, payload: tuple, expand, params: tuple, scale: float, cp: ContextParallel,
                             sinks=None, sliding_window: int | None = None):
    """As context_attention, but the ring carries `payload` (tensors of this rank's tokens) and
    `expand(*payload, *params) -> (k, v)` rebuilds keys and values from it on every step.
    Differentiable in q, the payload, params and the sinks; `expand` must be a pure function."""
    return _RingAttention.apply(cp, scale, sliding_window, expand, len(payload), q, sinks, *payload, *params)


def _ring_shift(tensors, cp: ContextParallel, tag: int):
    """Start sending `tensors` to the next CP rank and receiving the previous rank's. Returns
    (handle, received); call _wait(handle) before reading `received`."""
    if cp.cp == 1:
        return None, list(tensors)
    group = cp.group
    nxt, prev = (dist.get_global_rank(group, (cp.rank + d) % cp.cp) for d in (1, -1))
    sent = [t.contiguous() for t in tensors]
    received = [torch.empty_like(t) for t in sent]
    ops = [dist.P2POp(dist.isend, t, nxt, group, tag) for t in sent]
    ops += [dist.P2POp(dist.irecv, t, prev, group, tag) for t in received]
    return (dist.batch_isend_irecv(ops), sent), received  # `sent` stays alive until the wait


def _wait(handle) -> None:
    if handle is not None:
        for work in handle[0]:
            work.wait()


def _finite(x: torch.Tensor) -> torch.Tensor:
    # rows without any visible key have lse = -inf; subtracting 0 instead keeps exp() at 0, not NaN
    return x.masked_fill(x == float("-inf"), 0.0)


def _wide(t: torch.Tensor) -> torch.dtype:
    """The accumulation dtype: fp32, or float64 for float64 inputs (exact checks in tests)."""
    return torch.promote_types(t.dtype, torch.float32)


def _scores(qb, kb, mask, scale):
    """Wide scores [B, Hkv, rep, bq, bk] of grouped queries qb [B, Hkv, rep, bq, D] and keys kb [B, Hkv, bk, D]."""
    s = (qb @ kb.unsqueeze(2).transpose(-1, -2)).to(_wide(qb)) * scale
    return s.masked_fill(~mask[:, None, None], float("-inf"))


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, cp, scale, window, expand, n_payload, q, sinks, *tensors):
        payload, params = tensors[:n_payload], tensors[n_payload:]
        device = q.device.type
        ctx.autocast = (device, torch.get_autocast_dtype(device), torch.is_autocast_enabled(device))
        b, hq, sq, _ = q.shape
        acc = _wide(q)
        out = lse = None
        current = payload
        for step in range(cp.cp):
            source = (cp.rank - step) % cp.cp
            if step + 1 < cp.cp:
                handle, incoming = _ring_shift(current, cp, KV_TAG)
            if (box := cp.box(source, window)) is not None:
                qs, ks = box
                k, v = current if expand is None else expand(*current, *params)
                hkv = k.shape[1]
                if out is None:  # step 0 always computes: every token sees itself
                    out = torch.zeros(b, hkv, hq // hkv, sq, v.shape[-1], dtype=acc, device=q.device)
                    lse = torch.full((b, hkv, hq // hkv, sq), float("-inf"), dtype=acc, device=q.device)
                s = _scores(q[:, :, qs].unflatten(1, (hkv, -1)), k[:, :, ks], cp.mask(source, window, box), scale)
                block_lse = s.logsumexp(-1)
                probs = torch.exp(s - _finite(block_lse).unsqueeze(-1))
                block_out = (probs.to(v.dtype) @ v[:, :, ks].unsqueeze(2)).to(acc)
                new_lse = torch.logaddexp(lse[..., qs], block_lse)
                base = _finite(new_lse)
                out[..., qs, :] = (out[..., qs, :] * torch.exp(lse[..., qs] - base).unsqueeze(-1)
                                   + block_out * torch.exp(block_lse - base).unsqueeze(-1))
                lse[..., qs] = new_lse
            if step + 1 < cp.cp:
                _wait(handle)
                current = incoming
        if sinks is not None:  # the sink's exp joins the denominator; its share of the mass is dropped
            with_sink = torch.logaddexp(lse, sinks.to(acc).view(1, out.shape[1], -1, 1))
            out, lse = out * torch.exp(lse - with_sink).unsqueeze(-1), with_sink
        result = out.to(v.dtype).flatten(1, 2).transpose(1, 2).flatten(2)  # [B, S, Hq*Dv]
        ctx.setup = (cp, scale, window, expand, n_payload)
        ctx.save_for_backward(q, sinks, *tensors, result, lse)
        return result

    @staticmethod
    def backward(ctx, grad_out):
        device, dtype, enabled = ctx.autocast
        with torch.autocast(device, dtype=dtype, enabled=enabled):  # recompute as the forward did
            return (None,) * 5 + _ring_backward(ctx, grad_out)


def _ring_backward(ctx, grad_out):
    cp, scale, window, expand, n_payload = ctx.setup
    q, sinks, *tensors, result, lse = ctx.saved_tensors
    payload, params = tensors[:n_payload], tensors[n_payload:]
    hkv, rep = lse.shape[1], lse.shape[2]
    # [B, S, Hq*Dv] -> [B, Hkv, rep, S, Dv]
    grouped = lambda t: t.unflatten(-1, (hkv * rep, -1)).transpose(1, 2).unflatten(1, (hkv, rep))  # noqa: E731
    d_out, out = grouped(grad_out), grouped(result)
    acc = _wide(q)
    zeros = lambda t: torch.zeros(t.shape, dtype=acc, device=t.device)  # noqa: E731
    delta = (d_out.to(acc) * out.to(acc)).sum(-1)  # dO . O per query row (the softmax backward's row term)
    dq, d_params = zeros(q).unflatten(1, (hkv, rep)), [zeros(p) for p in params]
    current, travelling = payload, None
    for step in range(cp.cp):
        source = (cp.rank - step) % cp.cp
        if step + 1 < cp.cp:
            kv_handle, incoming = _ring_shift(current, cp, KV_TAG)
        box, part = cp.box(source, window), None
        if box is not None:
            qs, ks = box
            if expand is None:
                kb, vb = current[0][:, :, ks], current[1][:, :, ks]
            else:  # rebuild K/V with a graph back to the payload and expand's weights
                leaves = [t.detach().requires_grad_() for t in (*current, *params)]
                with torch.enable_grad():
                    k, v = expand(*leaves)
                    kb, vb = k[:, :, ks], v[:, :, ks]
            # the softmax backward on the block (backward runs without grad mode: nothing below is recorded)
            qb = q[:, :, qs].unflatten(1, (hkv, rep))
            s = _scores(qb, kb, cp.mask(source, window, box), scale)
            probs, dob = torch.exp(s - _finite(lse[..., qs]).unsqueeze(-1)), d_out[..., qs, :]
            d_probs = (dob @ vb.unsqueeze(2).transpose(-1, -2)).to(acc)
            d_scores = (probs * (d_probs - delta[..., qs].unsqueeze(-1))).to(q.dtype)
            dv = (probs.to(dob.dtype).transpose(-1, -2) @ dob).to(acc).sum(2)
            dk = (d_scores.transpose(-1, -2) @ qb).to(acc).sum(2) * scale
            dq[..., qs, :] += (d_scores @ kb.unsqueeze(2)).to(acc) * scale
            if expand is None:
                part = [zeros(t) for t in current]
                part[0][:, :, ks] = dk
                part[1][:, :, ks] = dv
            else:
                grads = torch.autograd.grad((kb, vb), leaves, (dk.to(kb.dtype), dv.to(vb.dtype)), allow_unused=True)
                part = [zeros(t) if g is None else g.to(acc) for t, g in zip(leaves, grads)]
                for total, g in zip(d_params, part[n_payload:]):
                    total += g
                part = part[:n_payload]
        # dK/dV of `source`'s block: add ours to what the ranks before us accumulated, pass it on
        if step == 0:
            travelling = [zeros(t) for t in current]
        else:
            _wait(grad_handle)
            travelling = arrived
        if part is not None:
            travelling = [t + p for t, p in zip(travelling, part)]
        grad_handle, arrived = _ring_shift(travelling, cp, GRAD_TAG)
        if step + 1 < cp.cp:
            _wait(kv_handle)
            current = incoming
    _wait(grad_handle)  # after cp hops our own block's gradients are home
    d_payload, d_sinks = [g.to(t.dtype) for g, t in zip(arrived, payload)], None
    if sinks is not None:  # d(sink) = -sum over rows of p(sink) * (dO . O)
        p_sink = torch.exp(sinks.to(acc).view(1, hkv, rep, 1) - lse)
        d_sinks = -(p_sink * delta).sum((0, 3)).flatten().to(sinks.dtype)
    d_params = [g.to(p.dtype) for g, p in zip(d_params, params)]
    return (dq.flatten(1, 2).to(q.dtype), d_sinks, *d_payload, *d_params)


def shard_micro_batch(micro: dict, group) -> tuple[dict, ContextParallel]:
    """This CP rank's zigzag share of a micro-batch of [B, S] tensors (input_ids, labels,
    position_ids, doc_ids: already on the device) and the ContextParallel to pass to the model."""
    cp = ContextParallel.zigzag(group, micro["input_ids"].shape[1], micro.get("doc_ids"), micro["input_ids"].device)
    return {k: zigzag_split(v, cp.cp, cp.rank) for k, v in micro.items()}, cp


def gather_sequence(x: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    """The whole sequence [B, S, ...] in global token order from every CP rank's zigzag share
    [B, S_local, ...]; differentiable. For layers whose output at a token depends on every earlier
    token through a recurrence (Gated DeltaNet): each rank runs the recurrence over the whole
    sequence and keeps its own tokens (`zigzag_split`), exact at the price of cp x the recurrence's
    compute. The backward sums every rank's gradient of the whole sequence and keeps this rank's share."""
    return x if cp.cp == 1 else _GatherSequence.apply(x, cp)


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cp: ContextParallel):
        ctx.cp = cp
        flat = torch.empty(cp.cp * x.numel(), dtype=x.dtype, device=x.device)
        _all_gather(flat, x.contiguous().flatten(), group=cp.group)  # gloo: flat output only
        return zigzag_merge(list(flat.view(cp.cp, *x.shape).unbind(0)))

    @staticmethod
    def backward(ctx, grad):
        cp, grad = ctx.cp, grad.contiguous()
        dist.all_reduce(grad, group=cp.group)
        return zigzag_split(grad, cp.cp, cp.rank), None


def gathered_doc_ids(cp: ContextParallel) -> torch.Tensor | None:
    """The document ids [B, S] of the whole sequence (every rank knows every rank's)."""
    return None if cp.doc_ids is None else zigzag_merge(list(cp.doc_ids))
