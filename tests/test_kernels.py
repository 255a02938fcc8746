"""pithtrain.ops.kernels on the CPU.

First the plain-PyTorch references (what the public functions run on the CPU) against independent
float64 formulas and loops, gradients included; then the Triton kernels themselves under the
interpreter (TRITON_INTERPRET=1, numpy on CPU tensors) against the references: those cases live in
tests/triton_interpreter_cases.py and run in a fresh process (run them directly with
`TRITON_INTERPRET=1 python -m pytest -q tests/triton_interpreter_cases.py`).
"""

import os
import subprocess
import sys

import pytest
import torch

from pithtrain.protocol import RoutingInfo
from pithtrain.ops import core, kernels
from pithtrain.parallel.expert import LocalDispatch


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def grads(fn, inputs, grad_out):
    """Output of fn(*inputs) and the gradients of its floating-point inputs for the output gradient grad_out."""
    inputs = [x.detach().requires_grad_(x.is_floating_point()) for x in inputs]
    out = fn(*inputs)
    return out, torch.autograd.grad(out, [x for x in inputs if x.requires_grad], grad_out, allow_unused=True)


def routed_ids(tokens, topk, experts, empty=(), seed=0):
    """[tokens, topk] distinct expert ids per token that never choose the experts in `empty`."""
    gen = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([e for e in range(experts) if e not in empty])
    return torch.stack([allowed[torch.randperm(len(allowed), generator=gen)[:topk]] for _ in range(tokens)]) \
        if tokens else torch.zeros(0, topk, dtype=torch.long)


# --- float64 formulas -------------------------------------------------------------------------------


def swiglu_f64(x, dy):
    g, u = x.double().chunk(2, -1)
    s = torch.sigmoid(g)
    dy = dy.double()
    return g * s * u, torch.cat([dy * u * s * (1 + g * (1 - s)), dy * g * s], -1)


def clamped_swiglu_f64(x, dy, alpha, limit):
    g, u = x.double().chunk(2, -1)
    gc, uc = torch.minimum(g, torch.tensor(limit)), u.clamp(-limit, limit)
    s = torch.sigmoid(alpha * gc)
    dy = dy.double()
    dg = torch.where(g <= limit, dy * (uc + 1) * s * (1 + alpha * gc * (1 - s)), 0.0)
    du = torch.where((u >= -limit) & (u <= limit), dy * gc * s, 0.0)
    return (uc + 1) * gc * s, torch.cat([dg, du], -1)


def cross_entropy_f64(logits, labels):
    x = logits.double().flatten(0, -2)
    y = labels.flatten()
    keep = y != -100
    logp = x - torch.logsumexp(x, -1, keepdim=True)
    loss = -logp[keep, y[keep]].sum()
    grad = torch.softmax(x, -1)
    grad[keep, y[keep]] -= 1
    grad[~keep] = 0
    return loss, grad.view(logits.shape)


def dispatch_plan_loops(ids, experts_per_rank, ep):
    """AllToAllDispatch's plan written as loops: rows by (rank, token), one per rank a token visits."""
    rank_of, local = (ids // experts_per_rank).tolist(), (ids % experts_per_rank).tolist()
    send_rank, send_token, meta, home = [], [], [], []
    counts = [[0, 0] for _ in range(ep)]
    for r in range(ep):
        for t, ranks in enumerate(rank_of):
            if r in ranks:
                send_rank.append(r)
                send_token.append(t)
                meta.append([local[t][s] if ranks[s] == r else -1 for s in range(len(ranks))])
                home += [t * len(ranks) + s for s in range(len(ranks)) if ranks[s] == r]
                counts[r][0] += 1
                counts[r][1] += ranks.count(r)
    return send_rank, send_token, meta, counts, home


# --- references ---------------------------------------------------------------------------------------


@pytest.mark.fast
def test_cpu_tensors_take_the_reference_path():
    assert not kernels.use_triton(torch.zeros(1))
    x = torch.randn(5, 8)
    assert torch.equal(kernels.swiglu(x), core.swiglu(x))
    labels = torch.tensor([1, -100, 3, 0, 2])
    assert torch.equal(kernels.cross_entropy_sum(x, labels), core.cross_entropy_sum(x, labels))


@pytest.mark.fast
@pytest.mark.parametrize("shape", [(37, 48), (2, 5, 32), (0, 16)])
def test_swiglu_reference_matches_float64(shape):
    torch.manual_seed(0)
    x = torch.randn(shape) * 3
    dy = torch.randn(*shape[:-1], shape[-1] // 2)
    out, (dx,) = grads(kernels.swiglu, [x], dy)
    ref_out, ref_dx = swiglu_f64(x, dy)
    if x.numel():
        assert rel_err(out, ref_out) < 1e-6 and rel_err(dx, ref_dx) < 1e-6
    assert out.shape == ref_out.shape and dx.shape == x.shape


@pytest.mark.fast
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_clamped_swiglu_reference_is_the_models_and_matches_float64(dtype):
    torch.manual_seed(1)
    alpha, limit = 1.702, 2.5
    x = torch.randn(41, 2 * 24) * 3
    x[0, :4] = limit  # exactly on the clamp bounds: the gradient passes, as in torch.clamp
    x[0, 24:28] = torch.tensor([limit, -limit, limit + 1, -limit - 1])
    x = x.to(dtype)
    dy = torch.randn(41, 24, dtype=dtype)
    out, (dx,) = grads(lambda t: kernels.clamped_swiglu(t, alpha, limit), [x], dy)
    model_out, (model_dx,) = grads(lambda t: kernels.clamped_swiglu_reference(t, alpha, limit), [x], dy)
    assert torch.equal(out, model_out) and torch.equal(dx, model_dx)  # bit for bit the model's function
    ref_out, ref_dx = clamped_swiglu_f64(x, dy, alpha, limit)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert rel_err(out, ref_out) < tol and rel_err(dx, ref_dx) < tol
    assert (dx[:, :24][x[:, :24] > limit] == 0).all() and (dx[:, 24:][x[:, 24:].abs() > limit] == 0).all()


@pytest.mark.fast
def test_permute_and_unpermute_are_local_dispatch_and_combine():
    torch.manual_seed(2)
    t, k, e, h = 19, 3, 8, 12
    ids = routed_ids(t, k, e, empty=(2, 5))  # two experts get no tokens
    x = torch.randn(t, h)
    routing = RoutingInfo(ids, torch.rand(t, k), torch.rand(t, e), e)
    dispatcher = LocalDispatch()
    tokens, counts, order = dispatcher.dispatch(x, routing)
    assert counts[2] == 0 and counts[5] == 0
    assert torch.equal(kernels.permute(x, order // k), tokens)
    y = torch.randn_like(tokens)
    rows, index = dispatcher.combine(y, order)
    assert rows is y and index is order
    # the expert order: sorting ids as uint8 / int16 / int32 (fewer radix passes on CUDA) is int64's stable sort
    for bound in (2, 256, 257, 2**15, 2**15 + 1, 2**31 + 1):
        ids = torch.randint(0, min(bound, 2**20), (4000,)) if bound < 2**31 else torch.randint(2**31 - 9, 2**31 + 1, (99,))
        assert torch.equal(core.stable_argsort_ids(ids, bound), torch.argsort(ids, stable=True)), bound


@pytest.mark.fast
def test_weighted_combine_reference_against_loops():
    """Stage 5's sum over each token's k rows, placed by `index` and weighted, and its gradients
    (rows and weights), against float64 loops; weights are cast to the rows' dtype first."""
    torch.manual_seed(5)
    t, k, h = 7, 3, 5
    index = torch.randperm(t * k)
    rows, weights, dout = torch.randn(t * k, h), torch.rand(t, k, dtype=torch.float64), torch.randn(t, h)
    out, (drows, dw) = grads(kernels.weighted_combine, [rows, index, weights], dout)
    ref, ref_drows, ref_dw = torch.zeros(t, h, dtype=torch.float64), torch.zeros(t * k, h, dtype=torch.float64), torch.zeros(t, k)
    for i, pair in enumerate(index.tolist()):
        tok, slot = divmod(pair, k)
        ref[tok] += float(weights[tok, slot].float()) * rows[i].double()
        ref_drows[i] = float(weights[tok, slot].float()) * dout[tok].double()
        ref_dw[tok, slot] = float(rows[i].double() @ dout[tok].double())
    assert out.dtype == rows.dtype and dw.dtype == weights.dtype
    assert rel_err(out, ref) < 1e-6 and rel_err(drows, ref_drows) < 1e-6 and rel_err(dw, ref_dw) < 1e-6


@pytest.mark.fast
def test_permute_reference_gradients_against_loops():
    torch.manual_seed(3)
    t, h = 11, 7
    index = torch.tensor([4, 0, 4, 9, 1, 4, 0, 10, 3])  # repeats and rows never picked (varying copies)
    x, dy = torch.randn(t, h), torch.randn(len(index), h)
    out, (dx,) = grads(kernels.permute, [x, index], dy)
    ref_dx = torch.zeros(t, h, dtype=torch.float64)
    for i, src in enumerate(index.tolist()):
        assert torch.equal(out[i], x[src])
        ref_dx[src] += dy[i].double()
    assert rel_err(dx, ref_dx) < 1e-6


@pytest.mark.fast
def test_unpermute_reference_gradients_and_zero_rows():
    torch.manual_seed(4)
    index = torch.tensor([5, 0, 2, 7])
    y, dy = torch.randn(4, 6), torch.randn(9, 6)
    out, (dx,) = grads(lambda a: kernels.unpermute(a, index, 9), [y], dy)
    for i, dst in enumerate(index.tolist()):
        assert torch.equal(out[dst], y[i]) and torch.equal(dx[i], dy[dst])
    assert (out[[1, 3, 4, 6, 8]] == 0).all()


@pytest.mark.fast
@pytest.mark.parametrize("tokens, topk, experts, ep, empty", [
    (13, 3, 8, 4, ()),
    (20, 4, 8, 1, ()),
    (9, 2, 8, 8, (2, 3)),  # rank 1 receives nothing
    (7, 1, 4, 4, ()),
    (0, 2, 4, 2, ()),
])
def test_dispatch_plan_reference_against_loops(tokens, topk, experts, ep, empty):
    ids = routed_ids(tokens, topk, experts, empty, seed=tokens)
    local = experts // ep
    plan = kernels.dispatch_plan(ids, local, ep)
    send_rank, send_token, meta, counts, home = dispatch_plan_loops(ids, local, ep)
    rows = len(send_rank)
    assert plan.send_rank[:rows].tolist() == send_rank and plan.send_token[:rows].tolist() == send_token
    assert plan.slot_meta[:rows].tolist() == (meta or [])
    assert plan.send_counts.tolist() == counts and plan.home_index.tolist() == home
    padded = tokens * min(topk, ep)  # padding up to the sync-free bound
    assert plan.send_rank.shape == (padded,) and plan.slot_meta.shape == (padded, topk)
    assert (plan.send_rank[rows:] == ep).all() and (plan.send_token[rows:] == 0).all()
    assert (plan.slot_meta[rows:] == -1).all()
    assert plan.send_counts.dtype == plan.slot_meta.dtype == torch.long


@pytest.mark.fast
def test_expert_bias_add_reference_with_empty_groups():
    torch.manual_seed(5)
    counts = torch.tensor([3, 0, 5, 1, 0, 4])
    x, bias = torch.randn(int(counts.sum()), 10), torch.randn(len(counts), 10)
    dy = torch.randn_like(x)
    out, (dx, dbias) = grads(kernels.expert_bias_add, [x, bias, counts], dy)
    ends = counts.cumsum(0).tolist()
    for e, (start, end) in enumerate(zip([0] + ends[:-1], ends)):
        assert torch.equal(out[start:end], x[start:end] + bias[e])
        assert rel_err(dbias[e], dy[start:end].double().sum(0)) < 1e-6 if end > start else (dbias[e] == 0).all()
    assert torch.equal(dx, dy)


@pytest.mark.fast
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cross_entropy_reference_matches_float64(dtype):
    torch.manual_seed(6)
    logits = (torch.randn(2, 7, 301) * 4).to(dtype)
    labels = torch.randint(0, 301, (2, 7))
    labels[0, 2], labels[1, 6] = -100, -100
    loss, (dlogits,) = grads(kernels.cross_entropy_sum, [logits, labels], torch.tensor(0.5))
    ref_loss, ref_grad = cross_entropy_f64(logits, labels)
    assert loss.dtype == torch.float32 and dlogits.dtype == dtype
    assert rel_err(loss, ref_loss) < 1e-6
    assert rel_err(dlogits, 0.5 * ref_grad) < (1e-6 if dtype == torch.float32 else 1e-2)
    assert (dlogits[0, 2] == 0).all() and (dlogits[1, 6] == 0).all()


# --- Triton kernels under the interpreter ----------------------------------------------------------------


def test_triton_kernels_under_the_interpreter():
    """Triton decides at import whether it interprets, and other test files import it (through
    transformers) during collection: the kernel cases run in a fresh pytest process."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    cases = os.path.join(os.path.dirname(__file__), "triton_interpreter_cases.py")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", cases]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and " passed" in done.stdout, done.stdout[-4000:] + done.stderr[-2000:]
