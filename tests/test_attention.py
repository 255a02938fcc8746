"""pithtrain.ops.attention on the CPU: the SDPA path (what the CPU runs) and the document bounds
against independent float64 formulas and loops, gradients of q, k, v and the sinks included; then
the Triton kernels under the interpreter (TRITON_INTERPRET=1) in a fresh process: those cases live in
tests/attention_interpreter_cases.py (run them directly with
`TRITON_INTERPRET=1 python -m pytest -q tests/attention_interpreter_cases.py`).
"""

import os
import subprocess
import sys

import pytest
import torch

from pithtrain.ops import attention
from test_kernels import rel_err


def attention_float64(q, k, v, scale, sinks=None, window=None, doc_ids=None):
    """Independent formula: explicit scores, the visibility rule written out, the sink through
    log-sum-exp. Returns [B, S, Hq*D] in float64."""
    q, k, v = q.double(), k.double(), v.double()
    b, hq, s, _ = q.shape
    rep = hq // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k) * scale
    i, j = torch.arange(s, device=q.device)[:, None], torch.arange(s, device=q.device)[None, :]
    seen = (j <= i) & (i - j < (window or s))
    seen = seen.expand(b, s, s) if doc_ids is None else seen & (doc_ids[:, :, None] == doc_ids[:, None, :])
    scores = scores.masked_fill(~seen[:, None], float("-inf"))
    lse = torch.logsumexp(scores, -1, keepdim=True)
    if sinks is not None:
        lse = torch.logaddexp(lse, sinks.double().view(1, -1, 1, 1))
    return torch.einsum("bhqk,bhkd->bqhd", torch.exp(scores - lse), v).reshape(b, s, -1)


def random_case(b, hq, hkv, s, d, sink, docs, seed, dtype=torch.float32):
    """Leaves (q, k, v[, sinks]), doc ids (random runs, a one-token document included) and dout."""
    gen = torch.Generator().manual_seed(seed)
    leaves = [torch.randn(b, hq, s, d, generator=gen), torch.randn(b, hkv, s, d, generator=gen),
              torch.randn(b, hkv, s, d, generator=gen)]
    if sink:
        leaves.append(torch.randn(hq, generator=gen) * 2)
    doc_ids = None
    if docs:
        cuts = torch.rand(b, s, generator=gen) < 0.08
        cuts[:, s // 2] = cuts[:, s // 2 + 1] = True  # a document of one token
        cuts[:, 0] = False
        doc_ids = cuts.long().cumsum(1)
    dout = torch.randn(b, s, hq * d, generator=gen)
    return [t.to(dtype) for t in leaves], doc_ids, dout.to(dtype)


def grads_of(fn, leaves, dout):
    leaves = [t.detach().requires_grad_() for t in leaves]
    out = fn(*leaves)
    return out, torch.autograd.grad(out, leaves, dout.to(out.dtype))


def check_against_float64(fn, leaves, doc_ids, dout, scale, window, tol):
    sinks = len(leaves) == 4
    out, dx = grads_of(lambda q, k, v, *z: fn(q, k, v, scale, z[0] if sinks else None, window, doc_ids), leaves, dout)
    ref, ref_dx = grads_of(lambda q, k, v, *z: attention_float64(q, k, v, scale, z[0] if sinks else None, window, doc_ids),
                           [t.double() for t in leaves], dout)
    assert out.shape == ref.shape and out.dtype == leaves[0].dtype
    for name, a, r in zip(("out", "dq", "dk", "dv", "dsinks"), (out, *dx), (ref, *ref_dx)):
        assert rel_err(a, r) < tol, (name, rel_err(a, r))
    if sinks:
        assert dx[3].abs().min() > 0


@pytest.mark.fast
@pytest.mark.parametrize("sink, window, docs", [(True, None, True), (True, 4, False), (False, 3, True), (False, None, False)])
def test_reference_path_matches_float64(sink, window, docs):
    leaves, doc_ids, dout = random_case(2, 6, 2, 23, 8, sink, docs, seed=window or 0)
    check_against_float64(attention.attention_reference, leaves, doc_ids, dout, 8**-0.5, window, 2e-6)


@pytest.mark.fast
def test_document_bounds_against_loops():
    doc_ids = torch.tensor([[0, 0, 0, 1, 2, 2, 2, 2, 3], [5, 5, 5, 5, 5, 5, 5, 5, 5]])
    bounds = attention.document_bounds(doc_ids)
    for b in range(2):
        for i in range(9):
            start = next(j for j in range(i + 1) if all(doc_ids[b, j:i + 1] == doc_ids[b, i]))
            end = max(j for j in range(i, 9) if all(doc_ids[b, i:j + 1] == doc_ids[b, i])) + 1
            assert (bounds[0, b, i], bounds[1, b, i]) == (start, end)
    assert bounds.dtype == torch.int32 and attention.document_bounds(None) is None


@pytest.mark.fast
def test_flops_count_visible_pairs():
    assert attention.attention_flops(1, 1, 4, 1) == 4 * 10  # 10 causal pairs
    assert attention.attention_flops(2, 3, 5, 8, window=2) == 4 * 2 * 3 * 8 * 9  # 1 + 2 * 4 pairs


def test_flash_attention_under_the_interpreter():
    """Triton decides at import whether it interprets: the kernel cases run in a fresh pytest process."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    cases = os.path.join(os.path.dirname(__file__), "attention_interpreter_cases.py")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", cases]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and " passed" in done.stdout, done.stdout[-4000:] + done.stderr[-2000:]
