"""Context parallelism on CPU processes (gloo): ring attention and whole models against one process.

One launch per CP size (2 and 4) runs every case. Oracles: eager float64 softmax attention over the
full sequence (written here), and the single-process model. Each rank compares its zigzag share of
outputs and input gradients; gradients of shared tensors (sinks, weights) are summed over ranks.
"""

import math

import pytest
import torch
import torch.distributed as dist

from conftest import tiny_config, tiny_deepseek_config, tiny_gpt_oss_config
from dist_util import run_fn
from pithtrain.parallel.context import (
    ContextParallel,
    context_attention,
    context_attention_expand,
    shard_micro_batch,
    zigzag_indices,
    zigzag_merge,
    zigzag_split,
)
from pithtrain.parallel.expert import ExpertEngine, LocalDispatch
from pithtrain.train.balance import LoadBalance

pytestmark = pytest.mark.fast  # the fast tier (make test-fast)

SCALE = 0.3


def reference_attention(q, k, v, sinks=None, window=None, docs=None):
    """Eager softmax attention over the full sequence; q [B, Hq, S, D], k/v [B, Hkv, S, D/Dv]."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = q.shape[2]
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    allowed = (j <= i) & (i - j < (window or s))
    allowed = allowed[None] if docs is None else allowed & (docs[:, :, None] == docs[:, None, :])
    scores = (q @ k.transpose(-1, -2) * SCALE).masked_fill(~allowed[:, None], -math.inf)
    lse = scores.logsumexp(-1, keepdim=True)
    if sinks is not None:
        lse = torch.logaddexp(lse, sinks.view(1, -1, 1, 1))
    return (torch.exp(scores - lse) @ v).transpose(1, 2).flatten(2)


def mla_expand(latent, k_rope, weight, heads=4, nope=6, v_dim=5):
    """MLA-like expansion: per-head [k_nope, shared rope key] and v from a latent."""
    b, s, _ = latent.shape
    kv = (latent @ weight.T).view(b, s, heads, nope + v_dim).transpose(1, 2)
    return torch.cat([kv[..., :nope], k_rope.expand(b, heads, s, -1)], -1), kv[..., nope:]


def doc_ids_from(boundaries: list[list[int]], seq: int) -> torch.Tensor:
    """[B, seq] document ids: a new document starts at each boundary of the row."""
    return torch.stack([torch.bucketize(torch.arange(seq), torch.tensor(row), right=True) for row in boundaries])


def assert_close(got, want, what, rel=1e-5):
    err = (got.double() - want.double()).abs().max().item()
    ref = want.double().abs().max().item()
    assert err <= rel * max(ref, 1e-6), f"{what}: max error {err:.3g} vs max |ref| {ref:.3g}"


def test_zigzag_layout():
    assert zigzag_indices(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert zigzag_indices(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    t = torch.arange(2 * 24).view(2, 24)
    assert torch.equal(zigzag_merge([zigzag_split(t, 4, r) for r in range(4)]), t)
    with pytest.raises(ValueError, match="2\\*cp=8"):
        zigzag_indices(20, 4, 0)


def test_one_rank_gradcheck():
    """cp=1 (no communication): exact float64 gradients, incl. sinks, window, documents and the expand path."""
    torch.manual_seed(0)
    b, s = 2, 12
    q, k, v = torch.randn(b, 4, s, 5), torch.randn(b, 2, s, 5), torch.randn(b, 2, s, 3)
    sinks = torch.randn(4)
    docs = doc_ids_from([[5], [2, 9]], s)
    cp = ContextParallel.zigzag(None, s, docs)
    inputs = [t.double().requires_grad_() for t in (q, k, v, sinks)]
    got = context_attention(*inputs[:3], SCALE, cp, inputs[3], 4)
    assert_close(got, reference_attention(*inputs[:3], inputs[3], 4, docs), "cp=1 output", rel=1e-12)
    assert torch.autograd.gradcheck(lambda q, k, v, si: context_attention(q, k, v, SCALE, cp, si, 4), inputs,
                                    fast_mode=True)
    latent, k_rope, weight = torch.randn(b, s, 3), torch.randn(b, 1, s, 2), torch.randn(4 * 11, 3)
    mla = [t.double().requires_grad_() for t in (torch.randn(b, 4, s, 8), latent, k_rope, weight)]
    assert torch.autograd.gradcheck(
        lambda q, lat, kr, w: context_attention_expand(q, (lat, kr), mla_expand, (w,), SCALE, cp), mla, fast_mode=True)


def _attention_cases(rank, world):
    torch.manual_seed(0)
    chunk = 6
    s, b = 2 * world * chunk, 2
    group = dist.group.WORLD
    docs = doc_ids_from([[3, chunk, 2 * chunk + 5, s - 2], [2 * chunk, 2 * chunk + 1]], s)  # inside / on chunk edges
    mine = lambda t, dim=2: zigzag_split(t, world, rank, dim)  # noqa: E731
    cases = [  # heads, kv heads, v dim, sinks, window, documents
        ("causal GQA", 4, 2, 8, False, None, False),
        ("window < chunk", 4, 2, 8, False, 4, False),
        ("window > chunk", 4, 1, 8, False, 9, False),
        ("sinks", 4, 2, 8, True, None, False),
        ("packed documents", 4, 2, 8, False, None, True),
        ("documents + window + sinks, Dv != D", 4, 2, 5, True, 9, True),
    ]
    for name, hq, hkv, dv, use_sinks, window, use_docs in cases:
        q, k, v = torch.randn(b, hq, s, 8), torch.randn(b, hkv, s, 8), torch.randn(b, hkv, s, dv)
        sinks = torch.randn(hq) if use_sinks else None
        full = [t.double().requires_grad_() for t in (q, k, v) + ((sinks,) if use_sinks else ())]
        want = reference_attention(*full[:3], full[3] if use_sinks else None, window, docs if use_docs else None)
        grad = torch.randn_like(want)
        want_grads = torch.autograd.grad(want, full, grad)

        cp = ContextParallel.zigzag(group, s, docs if use_docs else None)
        local = [mine(t).requires_grad_() for t in (q, k, v)] + ([sinks.clone().requires_grad_()] if use_sinks else [])
        got = context_attention(*local[:3], SCALE, cp, local[3] if use_sinks else None, window)
        got_grads = torch.autograd.grad(got, local, mine(grad.float(), 1))
        assert_close(got, mine(want, 1), f"{name}: output")
        for label, g, w in zip("qkv", got_grads, want_grads):
            assert_close(g, mine(w), f"{name}: d{label}")
        if use_sinks:
            dist.all_reduce(got_grads[3])
            assert_close(got_grads[3], want_grads[3], f"{name}: d sinks")

    # MLA: the ring carries the latent and the shared rope key; k/v are expanded on every rank
    for use_docs in (False, True):
        q, latent, k_rope = torch.randn(b, 4, s, 8), torch.randn(b, s, 3), torch.randn(b, 1, s, 2)
        weight = torch.randn(44, 3)
        full = [t.double().requires_grad_() for t in (q, latent, k_rope, weight)]
        want = reference_attention(full[0], *mla_expand(*full[1:]), docs=docs if use_docs else None)
        grad = torch.randn_like(want)
        want_grads = torch.autograd.grad(want, full, grad)
        cp = ContextParallel.zigzag(group, s, docs if use_docs else None)
        local = [mine(q), mine(latent, 1), mine(k_rope), weight.clone()]
        local = [t.requires_grad_() for t in local]
        got = context_attention_expand(local[0], (local[1], local[2]), mla_expand, (local[3],), SCALE, cp)
        got_grads = list(torch.autograd.grad(got, local, mine(grad.float(), 1)))
        dist.all_reduce(got_grads[3])
        assert_close(got, mine(want, 1), f"MLA docs={use_docs}: output")
        for label, g, w, dim in zip(["q", "latent", "rope key"], got_grads, want_grads, (2, 1, 2)):
            assert_close(g, mine(w, dim), f"MLA docs={use_docs}: d {label}")
        assert_close(got_grads[3], want_grads[3], f"MLA docs={use_docs}: d kv_b weight")


def _model_cases(rank, world):
    group = dist.group.WORLD
    b, s = 2, 32
    families = [(tiny_config, "seq"), (tiny_deepseek_config, "micro"), (tiny_gpt_oss_config, "seq")]
    for family, lb_type in families:
        torch.manual_seed(1)
        cfg = family("unused").model
        model = cfg.build_model()
        model.init_weights(3)
        ids = torch.randint(0, cfg.vocab_size, (b, s))
        docs = doc_ids_from([[5, s // 2], [11]], s)  # s/2 is a chunk edge for cp = 2 and 4
        starts = torch.diff(docs, prepend=docs[:, :1] - 1) != 0
        pos = torch.arange(s) - torch.where(starts, torch.arange(s), 0).cummax(1).values  # restart per document
        grad = torch.randn(b, s, cfg.vocab_size)
        name = type(model).__name__

        engine = ExpertEngine(LocalDispatch(), LoadBalance(lb_type), b, s)
        want = model(ids, pos, engine, doc_ids=docs)
        want_lb = engine.lb_loss()
        ((want * grad).sum() + want_lb).backward()
        want_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()

        micro, cp = shard_micro_batch({"input_ids": ids, "position_ids": pos, "doc_ids": docs, "grad": grad}, group)
        engine = ExpertEngine(LocalDispatch(), LoadBalance(lb_type, cp_group=group), b, s // world)
        got = model(micro["input_ids"], micro["position_ids"], engine, doc_ids=micro["doc_ids"], cp=cp)
        got_lb = engine.lb_loss()
        ((got * micro["grad"]).sum() + got_lb).backward()
        parts = [torch.empty_like(got) for _ in range(world)]
        dist.all_gather(parts, got.detach().contiguous())
        assert_close(zigzag_merge(parts), want, f"{name}: logits")
        assert_close(got_lb, want_lb, f"{name}: {lb_type} lb loss")
        for n, p in model.named_parameters():
            dist.all_reduce(p.grad)  # what FSDP does over the CP ranks
            assert_close(p.grad, want_grads[n], f"{name}: grad {n}")


def _all_cases(rank, world):
    _attention_cases(rank, world)  # each asserts its comparisons inside the worker
    _model_cases(rank, world)
    return rank


@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel(world):
    assert run_fn(world, _all_cases) == list(range(world))  # every rank finished every check
