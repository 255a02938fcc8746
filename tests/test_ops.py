"""Operators against plain references: grouped GEMM, local dispatch/combine, RMSNorm, masks."""

import pytest
import torch

from pithtrain.protocol import RoutingInfo
from pithtrain.ops.core import attention, attention_mask, rms_norm
from pithtrain.ops.grouped_gemm import DeferredWeightGrads, expert_mm, grouped_mm
from pithtrain.ops.kernels import unpermute_reference
from pithtrain.parallel.expert import LocalDispatch
from pithtrain.train.optim import optimizer_step

pytestmark = pytest.mark.fast  # the fast tier (make test-fast)


@pytest.mark.parametrize("hidden, dtype", [(32, torch.float32), (37, torch.float32), (64, torch.bfloat16)])
def test_grouped_mm_matches_a_loop_with_gradients(hidden, dtype):
    torch.manual_seed(hidden)
    counts = torch.tensor([5, 0, 17, 3, 0, 9, 30, 1])  # empty groups included
    x = torch.randn(int(counts.sum()), hidden, dtype=torch.float64, requires_grad=True)
    w = torch.randn(len(counts), hidden, 24, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(int(counts.sum()), 24, dtype=torch.float64)
    ref = torch.cat([chunk @ w[e] for e, chunk in enumerate(x.split(counts.tolist()))])
    ref_gx, ref_gw = torch.autograd.grad(ref, (x, w), grad)
    xd, wd = x.detach().to(dtype).requires_grad_(), w.detach().to(dtype).requires_grad_()
    out = grouped_mm(xd, wd, counts)
    gx, gw = torch.autograd.grad(out, (xd, wd), grad.to(dtype))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for a, b in ((out, ref), (gx, ref_gx), (gw, ref_gw)):
        assert ((a.double() - b).norm() / b.norm()).item() < tol
    assert gw[1].abs().max() == 0 and gw[4].abs().max() == 0


@pytest.mark.parametrize("deferred", [False, True])
def test_expert_weight_cast_is_cached_per_update_and_gradients_still_accumulate(deferred):
    """Two bf16 micro-batches share one cast of the fp32 expert weight; their weight gradients
    reach the fp32 parameter summed (checked against float64); an in-place update re-casts."""
    torch.manual_seed(3)
    counts = torch.tensor([6, 0, 11, 4])
    module = torch.nn.Module()
    module.w = torch.nn.Parameter(torch.randn(4, 16, 8))
    queue = DeferredWeightGrads(lambda p, g: setattr(p, "grad", g.float() if p.grad is None else p.grad + g.float()))
    xs = [torch.randn(int(counts.sum()), 16, requires_grad=True) for _ in range(2)]
    dys = [torch.randn(int(counts.sum()), 8) for _ in range(2)]
    outs = []
    for x, dy in zip(xs, dys):
        out = expert_mm(x, module, "w", counts, torch.bfloat16, queue if deferred else None)
        out.backward(dy.bfloat16())
        queue.run()
        outs.append(out)
    assert len(module.w._cast_cache) == 1  # one cast served both micro-batches
    split = lambda t: t.detach().bfloat16().double().split(counts.tolist())  # noqa: E731
    ref = sum(torch.stack([xe.T @ de for xe, de in zip(split(x), split(dy))]) for x, dy in zip(xs, dys))
    torch.testing.assert_close(module.w.grad.double(), ref, rtol=2e-2, atol=2e-2)
    before = expert_mm(xs[0], module, "w", counts, torch.bfloat16).float()
    torch.testing.assert_close(before, outs[0].float())
    with torch.no_grad():
        module.w.mul_(-1.0)  # an in-place update bumps the version: a fresh cast
    after = expert_mm(xs[0], module, "w", counts, torch.bfloat16).float()
    torch.testing.assert_close(after, -before)
    # the fused AdamW kernel (the GPU default) does NOT bump versions: the loop's optimizer_step does
    optimizer = torch.optim.AdamW([module.w], lr=0.5, fused=True)
    optimizer_step(optimizer, [module.w])
    stepped = expert_mm(xs[0], module, "w", counts, torch.bfloat16).float()
    fresh = grouped_mm(xs[0].bfloat16(), module.w.detach().bfloat16(), counts).float()
    assert (stepped - after).abs().max() > 0.1
    torch.testing.assert_close(stepped, fresh)


@pytest.mark.parametrize("deferred", [False, True])
def test_fused_weight_grad_switch_leaves_cpu_gradients_unchanged(monkeypatch, deferred):
    """grouped_gemm.FUSED_WGRAD on: the CPU still takes the reference (grouped_weight_grad + add_into),
    so two bf16 micro-batches give bit-identical fp32 gradients, and those match float64.
    (The fused kernel itself, and the dispatch into it: tests/triton_interpreter_cases.py.)"""
    from pithtrain.ops import grouped_gemm
    from pithtrain.ops.grouped_gemm import accumulate_grad

    torch.manual_seed(11)
    counts = torch.tensor([9, 0, 14, 5])
    xs = [torch.randn(int(counts.sum()), 16) for _ in range(2)]
    dys = [torch.randn(int(counts.sum()), 12).bfloat16() for _ in range(2)]
    weight = torch.randn(4, 16, 12)

    def grad(fused):
        monkeypatch.setattr(grouped_gemm, "FUSED_WGRAD", fused)
        module = torch.nn.Module()
        module.w = torch.nn.Parameter(weight.clone())
        queue = DeferredWeightGrads(accumulate_grad) if deferred else None
        for x, dy in zip(xs, dys):
            expert_mm(x, module, "w", counts, torch.bfloat16, queue).backward(dy)
            if queue:
                queue.run()
        return module.w.grad

    fused = grad(True)
    assert fused.dtype == torch.float32 and torch.equal(fused, grad(False))
    split = lambda t: t.bfloat16().double().split(counts.tolist())  # noqa: E731
    ref = sum(torch.stack([xe.T @ de for xe, de in zip(split(x), split(dy))]) for x, dy in zip(xs, dys))
    torch.testing.assert_close(fused.double(), ref, rtol=2e-2, atol=2e-2)


def test_expert_weight_gradient_without_an_input_gradient():
    """bf16 compute over an fp32 weight, input not requiring grad: the weight still gets its gradient."""
    torch.manual_seed(5)
    counts = torch.tensor([3, 5, 0, 2])
    module = torch.nn.Module()
    module.w = torch.nn.Parameter(torch.randn(4, 8, 6))
    x, dy = torch.randn(10, 8), torch.randn(10, 6)
    expert_mm(x, module, "w", counts, torch.bfloat16).backward(dy.bfloat16())
    split = lambda t: t.bfloat16().double().split(counts.tolist())  # noqa: E731
    ref = torch.stack([xe.T @ de for xe, de in zip(split(x), split(dy))])
    torch.testing.assert_close(module.w.grad.double(), ref, rtol=2e-2, atol=2e-2)


def test_head_logits_casts_once_and_accumulates_its_weight_gradient_by_hand():
    """The LM head under bf16 autocast over an fp32 master weight: logits and input gradients as
    autocast's F.linear gives them; two micro-batches' weight gradients summed into .grad (float64
    reference; shared with an embedding use of the same weight, as a tied head is); one cast per
    update, a fresh one after an in-place change; outside autocast or without grad, F.linear itself."""
    from pithtrain.ops.grouped_gemm import head_logits

    torch.manual_seed(21)
    weight = torch.nn.Parameter(torch.randn(50, 16) * 0.3)
    twin = torch.nn.Parameter(weight.detach().clone())  # the same head through autocast's F.linear
    ids = torch.randint(0, 50, (2, 5))
    xs = [torch.randn(2, 5, 16) for _ in range(2)]
    dys = [torch.randn(2, 5, 50) for _ in range(2)]
    ref = torch.zeros(50, 16, dtype=torch.float64)
    for x, dy in zip(xs, dys):
        got_x, want_x = x.clone().requires_grad_(), x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = head_logits(got_x + torch.nn.functional.embedding(ids, weight), weight)
            want = torch.nn.functional.linear(want_x + torch.nn.functional.embedding(ids, twin), twin)
        assert got.dtype == want.dtype == torch.bfloat16 and torch.equal(got, want)
        got.backward(dy.bfloat16())
        want.backward(dy.bfloat16())
        assert got_x.grad.dtype == torch.float32 and torch.equal(got_x.grad, want_x.grad)
        h = (x + torch.nn.functional.embedding(ids, weight.detach())).bfloat16().double().reshape(10, 16)
        d = dy.bfloat16().double().reshape(10, 50)
        ref += d.t() @ h  # the head's part
        ref.index_add_(0, ids.flatten(), (d @ weight.detach().bfloat16().double()))  # the embedding's part
    assert weight.grad.dtype == torch.float32
    torch.testing.assert_close(weight.grad.double(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())
    torch.testing.assert_close(weight.grad, twin.grad, rtol=1e-2, atol=1e-2 * twin.grad.abs().max().item())
    cast = weight._head_cast[1]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        head_logits(xs[0], weight)
        assert weight._head_cast[1] is cast  # reused while the weight is unchanged
        with torch.no_grad():
            weight.mul_(-1.0)
        flipped = head_logits(xs[0], weight)
    assert weight._head_cast[1] is not cast
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.testing.assert_close(flipped, torch.nn.functional.linear(xs[0], weight))
    plain = torch.randn(3, 16)
    assert torch.equal(head_logits(plain, weight), torch.nn.functional.linear(plain, weight))  # fp32: untouched


def test_embedding_adds_its_rows_into_grad_by_hand():
    """grouped_gemm.Embedding over an fp32 weight under bf16 autocast: the lookup as nn.Embedding's; three
    micro-batches' gradients (repeated ids, a tied head's GEMM gradient between them, a second lookup per step as
    MTP makes) summed into .grad against a float64 index_add; its backward hands autograd no dense gradient; no
    autocast (fp32 math), a bf16 weight, no grad, padding_idx: nn.Embedding's own path."""
    from pithtrain.ops.grouped_gemm import Embedding, _EmbeddingRows, head_logits

    torch.manual_seed(22)
    emb = Embedding(40, 12)
    ref = torch.zeros(40, 12, dtype=torch.float64)
    for step in range(3):
        ids = torch.randint(0, 8 if step == 0 else 40, (2, 9))  # step 0: many repeats of few ids
        mtp_ids = torch.randint(0, 40, (2, 9, 2))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out, mtp = emb(ids), emb(mtp_ids)
        assert out.grad_fn.name().startswith(_EmbeddingRows.__name__)
        # the rows leave in the compute dtype (core.ACTIVATIONS_IN_COMPUTE_DTYPE), as under FSDP's bf16 copy
        assert out.dtype == mtp.dtype == torch.bfloat16
        assert torch.equal(out, torch.nn.functional.embedding(ids, emb.weight.detach()).bfloat16())
        # dy in bf16: the gradient reaching the rows is rounded to their dtype
        dy, dmtp = torch.randn(2, 9, 12).bfloat16().float(), torch.randn(2, 9, 2, 12).bfloat16().float()
        loss = (out * dy).sum() + (mtp * dmtp).sum()
        if step == 1:  # the head tied to the embedding adds its own part into the same .grad
            h, dlog = torch.randn(2, 9, 12), torch.randn(2, 9, 40)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = loss + (head_logits(h, emb.weight).float() * dlog).sum()
            # the head's part as its bf16 GEMM rounds it on the CPU (tested on its own above)
            ref += (dlog.bfloat16().reshape(-1, 40).t() @ h.bfloat16().reshape(-1, 12)).double()
        loss.backward()
        ref.index_add_(0, ids.flatten(), dy.double().reshape(-1, 12))
        ref.index_add_(0, mtp_ids.flatten(), dmtp.double().reshape(-1, 12))
        assert emb.weight.grad.dtype == torch.float32
        torch.testing.assert_close(emb.weight.grad.double(), ref, rtol=1e-5, atol=1e-4)
    _, grad_w = _EmbeddingRows.backward(type("Ctx", (), {"saved_tensors": (ids,), "weight": emb.weight})(), dy)
    assert grad_w is None
    assert emb(ids).grad_fn.name() == "EmbeddingBackward0"  # fp32 math
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with torch.no_grad():
            assert emb(ids).grad_fn is None
        for other in (Embedding(40, 12).bfloat16(), Embedding(40, 12, padding_idx=0)):
            assert other(ids).grad_fn.name() == "EmbeddingBackward0"


def test_local_dispatch_round_trip():
    torch.manual_seed(0)
    t, h, e, k = 13, 6, 5, 3
    x = torch.randn(t, h)
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)])
    ids[:4] = torch.tensor([0, 1, 2])  # several tokens on the same experts
    routing = RoutingInfo(ids, torch.rand(t, k), torch.rand(t, e), e)
    tokens, counts, handle = LocalDispatch().dispatch(x, routing)
    assert counts.tolist() == [int((ids == i).sum()) for i in range(e)]
    groups = tokens.split(counts.tolist())
    for expert, rows in enumerate(groups):  # each group holds exactly the tokens routed there
        expected = x[(ids == expert).any(1)]
        assert torch.equal(rows, expected)
    back = LocalDispatch().combine(tokens * 2, handle)
    placed = unpermute_reference(back.rows, back.index, t * k).view(t, k, h)
    assert torch.equal(placed, (2 * x)[:, None, :].expand(t, k, h))
    # through an engine: the dispatch of the routing just recorded takes its loads as its counts (counted once);
    # another routing's dispatch counts its own
    from pithtrain.parallel.expert import ExpertEngine

    engine = ExpertEngine(LocalDispatch())
    engine.record_routing(0, routing)
    _, reused, _ = engine.dispatch(x, routing)
    assert reused is engine.expert_loads[0] and torch.equal(reused, counts) and engine.counted is None
    other = RoutingInfo(ids.flip(0), routing.topk_weights, routing.scores, e)
    engine.record_routing(1, routing)
    _, fresh, _ = engine.dispatch(x, other)
    assert fresh is not engine.expert_loads[1] and torch.equal(fresh, counts)


def test_rms_norm_and_masks():
    torch.manual_seed(1)
    x, w = torch.randn(4, 9, dtype=torch.float64), torch.randn(9, dtype=torch.float64)
    ref = x / torch.sqrt((x**2).mean(-1, keepdim=True) + 1e-6) * w
    assert torch.allclose(rms_norm(x, w, 1e-6), ref)
    doc = torch.tensor([[0, 0, 1, 1, 1, 2]])
    mask = attention_mask(doc, 6, "cpu", sliding_window=2)[0, 0]
    for i in range(6):
        for j in range(6):
            assert bool(mask[i, j]) == (j <= i and i - j < 2 and doc[0, i] == doc[0, j])
    assert attention_mask(None, 6, "cpu") is None
    q, kv = torch.randn(2, 4, 6, 8), torch.randn(2, 2, 6, 8)
    full = attention(q, kv, kv, attention_mask(doc.expand(2, 6), 6, "cpu"), 0.3)
    scores = (q @ kv.repeat_interleave(2, 1).transpose(-1, -2)) * 0.3
    allowed = attention_mask(doc.expand(2, 6), 6, "cpu")
    ref = (scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ kv.repeat_interleave(2, 1)).transpose(1, 2).flatten(2)
    assert torch.allclose(full, ref, atol=1e-6)


def test_projections_stack_weights_into_one_product(monkeypatch):
    """ops/fp8.projections: q, k and v (unequal widths, with biases) from one F.linear whose outputs and input,
    weight and bias gradients equal three nn.Linear calls' in float64 (to 1e-12); one product under bf16 autocast
    too, its outputs as autocast's; FUSED_PROJECTIONS off, mixed biases or an FP8 module: each Linear on its own."""
    from pithtrain.ops import fp8

    torch.manual_seed(23)
    calls = []
    linear = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda *a: calls.append(a[1].shape) or linear(*a))
    mods = [fp8.Linear(24, n, bias=True).double() for n in (32, 8, 8)]
    twins = [fp8.Linear(24, n, bias=True).double() for n in (32, 8, 8)]
    for m, t in zip(mods, twins):
        t.load_state_dict(m.state_dict())
    x = torch.randn(3, 5, 24, dtype=torch.float64, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    outs = fp8.projections(x, *mods)
    assert calls == [(48, 24)]  # one product over the stacked weights
    wants = [t(x2) for t in twins]
    dys = [torch.randn_like(w) for w in wants]
    sum((o * d).sum() for o, d in zip(outs, dys)).backward()
    sum((w * d).sum() for w, d in zip(wants, dys)).backward()
    for got, want in [*zip(outs, wants), (x.grad, x2.grad)] + [
            (getattr(m, n).grad, getattr(t, n).grad) for m, t in zip(mods, twins) for n in ("weight", "bias")]:
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    calls.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outs = fp8.projections(x.float(), *(m.float() for m in mods))
        wants = [m(x.float()) for m in mods]
    assert len(calls) == 4 and all(o.dtype == torch.bfloat16 for o in outs)
    for got, want in zip(outs, wants):
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    mixed = [mods[0], fp8.Linear(24, 8, bias=False).double()]
    monkeypatch.setattr(mods[1], "fp8", "rowwise")
    for flag, group in [(False, mods), (True, mixed), (True, mods)]:
        monkeypatch.setattr(fp8, "FUSED_PROJECTIONS", flag)
        monkeypatch.setattr(fp8.Linear, "forward", lambda self, x: ("own", self))
        assert fp8.projections(x, *group) == tuple(("own", m) for m in group)  # each module's own forward
