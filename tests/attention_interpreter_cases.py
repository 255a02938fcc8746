"""The Triton flash-attention kernels of pithtrain.ops.attention under the Triton interpreter, against
float64 (values and gradients of q, k, v and the sinks), and GPT-OSS running through them.

Not collected by default (the name does not start with test_): tests/test_attention.py runs this file
in a fresh process with TRITON_INTERPRET=1, which must be set before Triton is imported. The
interpreter takes 16 x 16 tiles, so these small shapes span several blocks, partial last ones too.
Tolerances: fp32 kernels agree with float64 to 1e-5 relative (norm of the difference); bf16 ones to
1e-2: one bf16 rounding, which the interpreter does toward zero (up to 2**-7 relative; the GPU rounds
to nearest, and tests/gpu/test_attention_gpu.py holds the kernel to the SDPA path's error).
"""

import os

import pytest
import torch

from pithtrain.models.gpt_oss import GptOssConfig
from pithtrain.ops import attention
from pithtrain.parallel.expert import ExpertEngine, LocalDispatch
from test_attention import attention_float64, check_against_float64, grads_of, random_case
from test_kernels import rel_err


@pytest.fixture(autouse=True)
def interpreter():
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1 (see tests/test_attention.py)"


def flash(q, k, v, scale, sinks=None, window=None, doc_ids=None):
    return attention._FlashAttention.apply(q, k, v, sinks, attention.document_bounds(doc_ids), scale, window or 0)


@pytest.mark.parametrize("b, hq, hkv, s, d, sink, window, docs", [
    (2, 2, 1, 37, 16, True, None, True),  # GQA, odd length, packed documents
    (1, 4, 1, 50, 32, True, 5, False),  # window shorter than a block
    (2, 2, 2, 45, 16, False, 20, True),  # window across blocks, with documents
    (1, 3, 3, 33, 16, False, None, False),  # plain causal
    (1, 2, 1, 40, 16, True, 1, True),  # a window of one: the sink and the token itself
])
def test_flash_matches_float64(b, hq, hkv, s, d, sink, window, docs):
    leaves, doc_ids, dout = random_case(b, hq, hkv, s, d, sink, docs, seed=s)
    check_against_float64(flash, leaves, doc_ids, dout, d**-0.5, window, 1e-5)


def test_flash_bf16():
    leaves, doc_ids, dout = random_case(2, 4, 2, 35, 32, True, True, seed=3, dtype=torch.bfloat16)
    leaves[3] = leaves[3].float()  # the model's sinks stay fp32
    scale, window = 32**-0.5, 9
    exact, exact_dx = grads_of(lambda q, k, v, z: attention_float64(q, k, v, scale, z, window, doc_ids),
                               [t.double() for t in leaves], dout)
    out, dx = grads_of(lambda q, k, v, z: flash(q, k, v, scale, z, window, doc_ids), leaves, dout)
    assert out.dtype == torch.bfloat16 and dx[3].dtype == torch.float32
    for name, a, e in zip(("out", "dq", "dk", "dv", "dsinks"), (out, *dx), (exact, *exact_dx)):
        assert rel_err(a, e) < 1e-2, name


def test_gpt_oss_through_the_kernel(monkeypatch):
    """Logits and every gradient of a small GPT-OSS (sliding and full layers, packed documents) with
    the kernel equal those of the SDPA path; no mask is built."""
    cfg = GptOssConfig(vocab_size=61, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=6)
    model = cfg.build_model()
    model.init_weights(0)
    with torch.no_grad():
        for layer in model.layers.values():
            layer.self_attn.sinks.normal_(0, 1)
    ids = torch.randint(0, 61, (2, 37), generator=torch.Generator().manual_seed(5))
    pos = torch.cat([torch.arange(20), torch.arange(17)]).expand(2, 37)
    doc = torch.tensor([0] * 20 + [1] * 17).expand(2, 37)

    def run():
        model.zero_grad()
        logits = model(ids, pos, ExpertEngine(LocalDispatch()), doc_ids=doc)
        logits.logsumexp(-1).mean().backward()
        return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    ref, ref_grads = run()
    monkeypatch.setattr(attention, "use_flash", lambda x: True)
    attn = model.attn_inputs(pos, doc, torch.float32)
    assert attn.flash and attn.full_mask is None and attn.sliding_mask is None
    out, out_grads = run()
    assert rel_err(out, ref) < 1e-5
    for name, g in ref_grads.items():
        assert rel_err(out_grads[name], g) < 1e-4, name


def test_flash_ops_are_sound_custom_ops_and_compile():
    """Schemas and fakes of both launches (opaque to torch.compile), then a fullgraph compile of the
    autograd function: the same output and gradients as eager."""
    leaves, doc_ids, dout = random_case(1, 4, 2, 20, 16, True, True, seed=1)
    q, k, v, sinks = leaves
    docs = attention.document_bounds(doc_ids)
    out, lse = attention._flash_fwd(q, k, v, sinks, docs, 0.25, 5)
    grad = dout.view(out.shape)
    delta = (grad * out).sum(-1).transpose(1, 2).contiguous()
    ops = torch.ops.pithtrain
    for op, args in [(ops.flash_attention_fwd, (q, k, v, sinks, docs, 0.25, 5)),
                     (ops.flash_attention_fwd, (q, k, v, None, None, 0.25, 0)),
                     (ops.flash_attention_bwd, (q, k, v, grad, lse, delta, docs, 0.25, 5))]:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))

    def fn(q, k, v, z):
        return flash(q, k, v, 0.25, z, 5, doc_ids)

    eager, eager_grads = grads_of(fn, leaves, dout)
    compiled, compiled_grads = grads_of(torch.compile(fn, fullgraph=True, backend="aot_eager"), leaves, dout)
    assert torch.equal(eager, compiled) and all(map(torch.equal, eager_grads, compiled_grads))
