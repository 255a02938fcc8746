"""pithtrain.ops.kernels on the CPU.

First the plain-PyTorch references (what the public functions run on the CPU) against independent
float64 formulas and loops, gradients included; then, only where Triton is installed, the Triton
kernels themselves under the interpreter (TRITON_INTERPRET=1, numpy on CPU tensors) against the
references. CI has no Triton: that second half skips with its reason.

Triton decides at import whether its own library functions are interpreted, and other test files
import it (through transformers) during collection, so the interpreter tests run in a fresh pytest
process started with TRITON_INTERPRET=1 (test_triton_kernels_under_the_interpreter); run directly with
`TRITON_INTERPRET=1 python -m pytest -q tests/test_kernels.py -k triton`.
"""

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from pithtrain.models.protocol import RoutingInfo
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


def test_cpu_tensors_take_the_reference_path():
    assert not kernels.use_triton(torch.zeros(1))
    x = torch.randn(5, 8)
    assert torch.equal(kernels.swiglu(x), core.swiglu(x))
    labels = torch.tensor([1, -100, 3, 0, 2])
    assert torch.equal(kernels.cross_entropy_sum(x, labels), core.cross_entropy_sum(x, labels))


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


def test_permute_and_unpermute_are_local_dispatch_and_combine():
    torch.manual_seed(2)
    t, k, e, h = 19, 3, 8, 12
    ids = routed_ids(t, k, e, empty=(2, 5))  # two experts get no tokens
    x = torch.randn(t, h)
    routing = RoutingInfo(ids, torch.rand(t, k), torch.rand(t, e), e)
    dispatcher = LocalDispatch()
    tokens, counts, handle = dispatcher.dispatch(x, routing)
    order = handle[0]
    assert counts[2] == 0 and counts[5] == 0
    assert torch.equal(kernels.permute(x, order // k), tokens)
    y = torch.randn_like(tokens)
    assert torch.equal(kernels.unpermute(y, order, t * k).view(t, k, h), dispatcher.combine(y, handle))


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


def test_unpermute_reference_gradients_and_zero_rows():
    torch.manual_seed(4)
    index = torch.tensor([5, 0, 2, 7])
    y, dy = torch.randn(4, 6), torch.randn(9, 6)
    out, (dx,) = grads(lambda a: kernels.unpermute(a, index, 9), [y], dy)
    for i, dst in enumerate(index.tolist()):
        assert torch.equal(out[dst], y[i]) and torch.equal(dx[i], dy[dst])
    assert (out[[1, 3, 4, 6, 8]] == 0).all()


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


NO_TRITON = importlib.util.find_spec("triton") is None
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # set before this process imported Triton


@pytest.mark.skipif(NO_TRITON, reason="Triton is not installed (an optional, GPU-only dependency)")
@pytest.mark.skipif(INTERPRETED, reason="this process runs the interpreter tests itself")
def test_triton_kernels_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
           "-k", "triton_ and not interpreter"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and " passed" in done.stdout, done.stdout[-4000:] + done.stderr[-2000:]


@pytest.fixture
def interpreter():
    if NO_TRITON:
        pytest.skip("Triton is not installed (an optional, GPU-only dependency)")
    if not INTERPRETED:
        pytest.skip("runs in a fresh process with TRITON_INTERPRET=1 (test_triton_kernels_under_the_interpreter)")


def check_kernel(fn, ref, inputs, grad_out, tol):
    out, dx = grads(fn, inputs, grad_out)
    ref_out, ref_dx = grads(ref, inputs, grad_out)
    assert out.dtype == ref_out.dtype and out.shape == ref_out.shape
    for a, b in [(out, ref_out), *zip(dx, ref_dx)]:
        if tol == 0:
            assert torch.equal(a, b)
        else:
            assert torch.allclose(a.double(), b.double(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, inter", [(37, 24), (5, 300), (0, 8)])
def test_triton_glu_kernels(interpreter, dtype, rows, inter):
    torch.manual_seed(rows)
    x = (torch.randn(rows, 2 * inter) * 3).to(dtype)
    dy = torch.randn(rows, inter, dtype=dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the kernel rounds once, the reference per op
    check_kernel(lambda t: kernels._GLU.apply(t, 1.0, 0.0, False), core.swiglu, [x], dy, tol)
    check_kernel(lambda t: kernels._GLU.apply(t, 1.702, 2.5, True),
                 lambda t: kernels.clamped_swiglu_reference(t, 1.702, 2.5), [x], dy, tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_permute_kernels(interpreter, dtype):
    torch.manual_seed(7)
    t, k, e, h = 23, 4, 9, 600  # h above the column block: several column programs
    ids = routed_ids(t, k, e, empty=(0, 4))
    order = torch.argsort(ids.flatten(), stable=True)
    x, dy = torch.randn(t, h).to(dtype), torch.randn(t * k, h).to(dtype)
    tol = 0 if dtype == torch.float32 else 1e-2  # bf16: fp32 sums of the copies vs the reference's bf16 adds
    check_kernel(kernels._Permute.apply, kernels.permute_reference, [x, order // k], dy, tol)
    check_kernel(lambda y: kernels._Unpermute.apply(y, order, t * k),
                 lambda y: kernels.unpermute_reference(y, order, t * k), [dy], x.repeat_interleave(k, 0), 0)
    # varying copies per row (the expert-parallel receiver), a row never picked, and a larger output
    index = torch.tensor([3, 3, 0, 7, 3, 1, 7])
    check_kernel(kernels._Permute.apply, kernels.permute_reference, [x[:8], index], dy[:7], tol)
    check_kernel(lambda y: kernels._Unpermute.apply(y, index.unique(), 12),
                 lambda y: kernels.unpermute_reference(y, index.unique(), 12), [dy[:4]], dy[:12], 0)


@pytest.mark.parametrize("tokens, topk, experts, ep, empty", [
    (100, 8, 64, 16, ()),  # 32 tokens per block: several blocks
    (300, 4, 16, 8, (4, 5)),  # rank 2 receives nothing
    (9, 3, 6, 3, ()),  # ep and k not powers of two
    (17, 1, 8, 1, ()),
    (0, 2, 4, 2, ()),
])
def test_triton_dispatch_plan_matches_reference_exactly(interpreter, tokens, topk, experts, ep, empty):
    ids = routed_ids(tokens, topk, experts, empty, seed=tokens)
    plan = kernels.DispatchPlan(*kernels._dispatch_plan(ids, experts // ep, ep))
    ref = kernels.dispatch_plan_reference(ids, experts // ep, ep)
    for name, a, b in zip(plan._fields, plan, ref):
        assert a.dtype == b.dtype and torch.equal(a, b), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_expert_bias_add(interpreter, dtype):
    torch.manual_seed(8)
    counts = torch.tensor([0, 40, 3, 0, 70, 1, 0])  # empty groups, groups longer than the row block
    x = torch.randn(int(counts.sum()), 300).to(dtype)
    bias = torch.randn(len(counts), 300)  # fp32 bias on bf16 rows: rounded to bf16 before the add
    out, (dx, dbias) = grads(kernels._ExpertBiasAdd.apply, [x, bias, counts], x)
    ref, (ref_dx, ref_dbias) = grads(kernels.expert_bias_add_reference, [x, bias, counts], x)
    if dtype == torch.float32:
        assert torch.equal(out, ref)
    else:  # the interpreter rounds fp32 -> bf16 toward zero (the GPU to nearest even, tested exact there)
        assert torch.allclose(out.float(), ref.float(), rtol=2**-6, atol=2**-6)
    assert torch.equal(dx, ref_dx)
    # per-expert row sums in fp32 (the reference adds in x's dtype): against float64 sums
    sums = torch.stack([rows.double().sum(0) for rows in x.split(counts.tolist())])
    assert torch.allclose(dbias.double(), sums, rtol=1e-5, atol=1e-5) and (dbias[[0, 3, 6]] == 0).all()
    assert rel_err(dbias, sums) <= rel_err(ref_dbias, sums) + 1e-7
    empty = torch.zeros(0, 300, dtype=dtype)
    assert kernels._ExpertBiasAdd.apply(empty, bias, torch.zeros(7, dtype=torch.long)).shape == (0, 300)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_cross_entropy(interpreter, dtype):
    torch.manual_seed(9)
    wide = (torch.randn(6, 9100) * 3).to(dtype)
    logits = wide[:, :9000]  # rows strided (not contiguous), more than two vocabulary chunks
    labels = torch.randint(0, 9000, (6,))
    labels[[1, 4]] = -100
    check_kernel(lambda z: kernels._CrossEntropySum.apply(z, labels) * 0.7,
                 lambda z: core.cross_entropy_sum(z, labels) * 0.7, [logits], torch.tensor(1.0),
                 1e-5 if dtype == torch.float32 else 1e-2)
    logits3 = torch.randn(2, 3, 50, dtype=dtype)
    labels3 = torch.full((2, 3), -100)
    loss, (grad,) = grads(lambda z: kernels._CrossEntropySum.apply(z, labels3), [logits3], torch.tensor(1.0))
    assert loss == 0 and (grad == 0).all() and grad.shape == logits3.shape


def test_triton_ops_are_sound_custom_ops_and_compile(interpreter, monkeypatch):
    """Schemas and fakes of every launch (opaque to torch.compile), then a fullgraph compile through all of them."""
    ops = torch.ops.pithtrain
    x, ends = torch.randn(5, 16), torch.tensor([2, 2, 5], dtype=torch.int32)
    labels = torch.tensor([1, -100, 3, 0, 2])
    ids = routed_ids(6, 2, 8)
    for op, args in [
        (ops.glu_fwd, (x, 1.702, 2.0, True)), (ops.glu_bwd, (x, torch.randn(5, 8), 1.0, 0.0, False)),
        (ops.gather_rows, (x, torch.tensor([4, 0, 4]))), (ops.scatter_rows, (x, torch.tensor([3, 0, 6, 1, 2]), 7)),
        (ops.segment_sum, (x, torch.tensor([1, 0, 2, 4, 3]), ends)), (ops.dispatch_plan, (ids, 2, 4)),
        (ops.expert_bias_add, (x, torch.randn(3, 16), ends)), (ops.expert_bias_grad, (x, ends, torch.float32)),
        (ops.cross_entropy_fwd, (x, labels)), (ops.cross_entropy_bwd, (x, labels, torch.randn(5), torch.ones(1))),
    ]:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))

    monkeypatch.setattr(kernels, "use_triton", lambda t: True)  # the Triton path on CPU tensors
    t, k, e = 16, 2, 8
    ids = routed_ids(t, k, e, empty=(3,))
    counts, order = torch.bincount(ids.flatten(), minlength=e), torch.argsort(ids.flatten(), stable=True)

    def layer(x, w, bias, logits):
        h = kernels.expert_bias_add(kernels.permute(x, order // k) @ w, bias, counts)
        act = kernels.swiglu(h) + kernels.clamped_swiglu(h, 1.702, 2.0)
        out = kernels.unpermute(act, order, t * k).view(t, k, -1).sum(1)
        plan = kernels.dispatch_plan(ids, e // 4, 4)
        return out.square().sum() + kernels.cross_entropy_sum(logits, labels.repeat(4)[:t]) + plan.send_counts.sum()

    inputs = [torch.randn(t, 8), torch.randn(8, 12), torch.randn(e, 12), torch.randn(t, 40)]
    eager, eager_grads = grads(layer, inputs, torch.tensor(1.0))
    compiled, compiled_grads = grads(torch.compile(layer, fullgraph=True, backend="aot_eager"), inputs,
                                     torch.tensor(1.0))
    assert torch.equal(eager, compiled) and all(map(torch.equal, eager_grads, compiled_grads))
