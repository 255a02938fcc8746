"""Acceptance test of feat_dynamic_topk (PithTrain): Qwen3MoeConfig.router_top_p in the router, checked
against a direct computation from the router weight, and the staged model against reference_forward."""

import torch

from pithtrain.models.qwen3_moe import Qwen3MoeConfig
from pithtrain.parallel.expert import ExpertEngine, LocalDispatch

SIZES = dict(vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=3,
             mlp_only_layers=[], max_position_embeddings=64, rope_theta=10000.0)


def build(top_p, norm):
    model = Qwen3MoeConfig(router_top_p=top_p, norm_topk_prob=norm, **SIZES).build_model()
    model.init_weights(5)
    routers = [m for m in model.modules() if type(m).__name__ == "Router"]
    with torch.no_grad():
        for r in routers:
            r.weight.mul_(40)  # peaked router distributions, so that top-p drops some slots
    return model, routers


def dense(ids, weights, experts):
    return torch.zeros(ids.shape[0], experts, dtype=torch.float64).scatter_add_(1, ids, weights.double())


def expected(x, weight, k, top_p, norm):
    probs = torch.softmax((x.double() @ weight.double().T), -1)
    top, ids = probs.topk(k, -1)
    before = top.cumsum(-1) - top  # probability mass of the better slots
    keep = before < top_p if top_p > 0 else torch.ones_like(top, dtype=torch.bool)
    w = top * keep
    if norm:
        w = w / w.sum(-1, keepdim=True)
    return dense(ids, w, weight.shape[0]), keep


def test_router_keeps_the_smallest_top_p_prefix():
    torch.manual_seed(0)
    for norm in (True, False):
        for top_p in (0.0, 0.6, 0.9):
            _, routers = build(top_p, norm)
            x = torch.randn(64, 32)
            r = routers[0](x)
            want, keep = expected(x, routers[0].weight, 3, top_p, norm)
            torch.testing.assert_close(dense(r.topk_ids, r.topk_weights, 8), want, rtol=1e-5, atol=1e-6)
            if top_p == 0.6:
                kept = keep.sum(-1)
                assert (kept < 3).any() and (kept > 1).any(), "the test input must exercise both cases"


def test_staged_model_matches_reference_forward():
    torch.manual_seed(1)
    model, _ = build(0.6, True)
    ids = torch.randint(0, 96, (2, 17))
    pos = torch.arange(17).expand(2, 17)
    staged = model(ids, pos, ExpertEngine(LocalDispatch()))
    ref = model.reference_forward(ids, pos)
    assert ((staged - ref).norm() / ref.norm()).item() < 1e-5
    full, _ = build(0.0, True)
    assert ((full(ids, pos, ExpertEngine(LocalDispatch())) - staged).norm() / ref.norm()).item() > 1e-4


def test_hf_config_round_trip():
    cfg = Qwen3MoeConfig(router_top_p=0.7, **SIZES)
    assert Qwen3MoeConfig.from_hf(cfg.to_hf()).router_top_p == 0.7
    assert Qwen3MoeConfig(**SIZES).router_top_p == 0.0
