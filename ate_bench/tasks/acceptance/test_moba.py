"""Acceptance test of feat_moba (PithTrain): pithtrain.ops.moba.moba_attention against a per-query loop."""

import math

import pytest
import torch
import torch.nn.functional as F

from pithtrain.ops.moba import moba_attention


def reference(q, k, v, block, top_k, scale):
    """Each query: the top_k earlier blocks by q . mean(block keys), plus its own block up to itself."""
    B, H, S, _ = q.shape
    rows = []
    for b in range(B):
        for h in range(H):
            for i in range(S):
                cur = i // block
                gate = [q[b, h, i] @ k[b, h, j * block:(j + 1) * block].mean(0) for j in range(cur)]
                chosen = sorted(range(cur), key=lambda j: -float(gate[j]))[:top_k]
                keys = [t for j in sorted(chosen) for t in range(j * block, (j + 1) * block)] + list(range(cur * block, i + 1))
                w = torch.softmax((k[b, h, keys] @ q[b, h, i]) * scale, 0)
                rows.append(w @ v[b, h, keys])
    return torch.stack(rows).view_as(q)


@pytest.mark.parametrize("seq,block,top_k", [(40, 8, 2), (37, 8, 1), (24, 4, 3)])
def test_matches_reference_values_and_gradients(seq, block, top_k):
    torch.manual_seed(seq * 31 + top_k)
    q, k, v = (torch.randn(2, 2, seq, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    scale = 1 / math.sqrt(8)
    out = moba_attention(q, k, v, block, top_k, scale)
    ref = reference(q, k, v, block, top_k, scale)
    assert out.shape == q.shape
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9)
    g = torch.randn_like(ref)
    got = torch.autograd.grad(out, (q, k, v), g)
    want = torch.autograd.grad(ref, (q, k, v), g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_all_blocks_selected_is_causal_attention():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 3, 32, 16, dtype=torch.float64) for _ in range(3))
    out = moba_attention(q, k, v, 8, 4, 0.25)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.25), rtol=1e-9, atol=1e-9)


def test_sparse_differs_from_dense():
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 1, 32, 8, dtype=torch.float64) for _ in range(3))
    dense = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3)
    assert (moba_attention(q, k, v, 8, 1, 0.3) - dense).abs().max() > 1e-3


def test_the_framework_still_works():
    """The feature must not break what was there: a tiny Qwen3-MoE still matches its reference."""
    from pithtrain.models.qwen3_moe import Qwen3MoeConfig
    from pithtrain.parallel.expert import ExpertEngine, LocalDispatch

    model = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
                           max_position_embeddings=64).build_model()
    model.init_weights(0)
    ids = torch.randint(0, 64, (2, 11))
    pos = torch.arange(11).expand(2, 11)
    out, ref = model(ids, pos, ExpertEngine(LocalDispatch())), model.reference_forward(ids, pos)
    assert ((out - ref).norm() / ref.norm()).item() < 1e-5
