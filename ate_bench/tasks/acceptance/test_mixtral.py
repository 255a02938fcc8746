"""Acceptance test of feat_mixtral (PithTrain): a Mixtral family loaded from an HF directory matches
transformers' MixtralForCausalLM (logits and gradients), and its reference_forward agrees."""

import torch
from transformers import MixtralConfig, MixtralForCausalLM

from pithtrain.models import config_from_hf
from pithtrain.parallel.expert import ExpertEngine, LocalDispatch
from pithtrain.tools.hf import load_model


def test_matches_transformers(tmp_path):
    torch.manual_seed(0)
    hf_cfg = MixtralConfig(vocab_size=97, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, num_local_experts=5, num_experts_per_tok=2, max_position_embeddings=64,
                           rope_theta=5000.0, tie_word_embeddings=False, sliding_window=None)
    hf = MixtralForCausalLM(hf_cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.2)
    hf.save_pretrained(tmp_path / "hf")
    assert type(config_from_hf(hf_cfg.to_dict())).__module__ == "pithtrain.models.mixtral"
    model = load_model(tmp_path / "hf")
    ids = torch.randint(0, 97, (2, 13))
    pos = torch.arange(13).expand(2, 13)
    ref = hf(ids).logits
    out = model(ids, pos, ExpertEngine(LocalDispatch()))
    assert ((out - ref).norm() / ref.norm()).item() < 1e-4
    assert ((model.reference_forward(ids, pos) - ref).norm() / ref.norm()).item() < 1e-4
    g = torch.randn_like(ref)
    out.backward(g)
    ref.backward(g)
    ours = model.embed_tokens.weight.grad
    theirs = hf.model.embed_tokens.weight.grad
    assert ((ours - theirs).norm() / theirs.norm()).item() < 1e-4
