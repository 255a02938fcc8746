"""Qwen3-MoE against Hugging Face transformers: logits, gradients, conversion round trip."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig as HFConfig, Qwen3MoeForCausalLM

from conftest import per_expert_grads
from pithtrain.config import UserError
from pithtrain.models import config_from_hf
from pithtrain.models.qwen3_moe import Qwen3MoeConfig
from pithtrain.parallel.expert import ExpertEngine, LocalDispatch
from pithtrain.tools.hf import load_model, read_hf_state, write_hf_dir

pytestmark = pytest.mark.fast  # the fast tier (make test-fast)

CONFIGS = {
    # non-default fields: norm_topk_prob off, attention bias, a dense layer, odd sizes
    "odd_dense_bias": dict(vocab_size=97, hidden_size=37, intermediate_size=41, moe_intermediate_size=19,
                           num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2, head_dim=10,
                           num_experts=5, num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[1],
                           attention_bias=True, tie_word_embeddings=False),
    # aligned sizes (grouped GEMM path), renormalised top-k, sparse step, tied embeddings
    "aligned_tied": dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                         num_experts=8, num_experts_per_tok=3, norm_topk_prob=True, decoder_sparse_step=2,
                         attention_bias=False, tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 5000.0}),
}


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def make_hf(tmp_path, name):
    torch.manual_seed(hash(name) % 1000)
    hf = Qwen3MoeForCausalLM(HFConfig(max_position_embeddings=64, experts_implementation="eager", **CONFIGS[name])).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.2)  # large enough that routing is far from uniform
    hf.save_pretrained(tmp_path / "hf")
    return hf, tmp_path / "hf"


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_and_gradients_match_transformers(tmp_path, name):
    hf, hf_dir = make_hf(tmp_path, name)
    model = load_model(hf_dir)
    b, s = 3, 19
    ids = torch.randint(0, model.cfg.vocab_size, (b, s))
    pos = torch.arange(s).expand(b, s)
    ref = hf(ids).logits
    staged = model(ids, pos, ExpertEngine(LocalDispatch()))
    assert rel(staged, ref) <= 1e-5
    assert rel(model.reference_forward(ids), ref) <= 1e-5

    # gradients of the same loss, parameter by parameter, under HF's names
    labels = torch.randint(0, model.cfg.vocab_size, (b, s))
    torch.nn.functional.cross_entropy(staged.flatten(0, 1), labels.flatten()).backward()
    hf.train()
    hf_loss = torch.nn.functional.cross_entropy(hf(ids).logits.flatten(0, 1), labels.flatten())
    hf_loss.backward()
    grad_model = load_model(hf_dir)  # our gradients, renamed to HF keys by the weight conversion itself
    with torch.no_grad():
        for p, g in zip(grad_model.parameters(), model.parameters()):
            p.copy_(g.grad)
    ours = grad_model.hf_state_dict()
    theirs = per_expert_grads(hf)  # HF keeps experts fused in memory: split per expert
    assert set(ours) == set(theirs)
    for key, g in ours.items():
        if theirs[key].norm() == 0:  # an expert no token chose
            assert g.norm() == 0, key
        else:
            assert rel(g, theirs[key]) <= 1e-4, key


def test_packed_documents_match_reference(tmp_path):
    _, hf_dir = make_hf(tmp_path, "odd_dense_bias")
    model = load_model(hf_dir)
    b, s = 2, 23
    ids = torch.randint(0, model.cfg.vocab_size, (b, s))
    doc = torch.tensor([[0] * 7 + [1] * 9 + [2] * 7, [0] * 20 + [1] * 3])
    pos = torch.cat([torch.arange(n) for n in (7, 9, 7)]), torch.cat([torch.arange(20), torch.arange(3)])
    pos = torch.stack(pos)
    staged = model(ids, pos, ExpertEngine(LocalDispatch()), doc_ids=doc)
    assert rel(staged, model.reference_forward(ids, pos, doc)) <= 1e-5
    # a packed document gives the same logits as that document alone
    alone = model.reference_forward(ids[:1, 7:16])
    assert rel(staged[:1, 7:16], alone) <= 1e-5


def test_round_trip_and_transformers_loads_export(tmp_path):
    hf, hf_dir = make_hf(tmp_path, "odd_dense_bias")
    model = load_model(hf_dir)
    write_hf_dir(model, tmp_path / "export")
    again = load_model(tmp_path / "export")
    for (n, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), n
    original, exported = read_hf_state(hf_dir), read_hf_state(tmp_path / "export")
    assert set(original) == set(exported)
    for k in original:
        assert torch.equal(original[k], exported[k]), k
    loaded, info = AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "export"), output_loading_info=True, experts_implementation="eager"
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids = torch.randint(0, 97, (2, 11))
    assert rel(loaded.eval()(ids).logits, hf(ids).logits) <= 1e-6
    assert json.loads((tmp_path / "export/config.json").read_text())["model_type"] == "qwen3_moe"


def test_unexpected_and_missing_keys_are_named(tmp_path):
    _, hf_dir = make_hf(tmp_path, "odd_dense_bias")
    model = load_model(hf_dir)
    state = read_hf_state(hf_dir)
    with pytest.raises(UserError, match="unexpected"):
        model.load_hf_state_dict(dict(state, **{"model.layers.0.mlp.extra.weight": torch.zeros(1)}))
    # a layer past the config's is no pipeline chunk's: refused, where a chunk ignores the layers it does not hold
    fewer = Qwen3MoeConfig(**dict(CONFIGS["odd_dense_bias"], num_hidden_layers=2, mlp_only_layers=[1]))
    with pytest.raises(UserError, match=r"layer\(s\) \[2\] past the config's 2 .*set num_hidden_layers"):
        fewer.build_model().load_hf_state_dict(state)
    chunk = model.cfg.build_model(layer_ids=[1], embed=False, head=False)
    chunk.load_hf_state_dict(state)
    assert torch.equal(chunk.layers["1"].mlp.down_proj.weight, state["model.layers.1.mlp.down_proj.weight"])
    del state["model.norm.weight"]
    with pytest.raises(UserError, match="model.norm.weight"):
        model.load_hf_state_dict(state)
    # tied, with a stored head: a copy is fine; a different head is what transformers computes with, so refused
    _, tied_dir = make_hf(tmp_path / "tied", "aligned_tied")
    tied, state = load_model(tied_dir), read_hf_state(tied_dir)
    tied.load_hf_state_dict(dict(state, **{"lm_head.weight": state["model.embed_tokens.weight"].clone()}))
    with pytest.raises(UserError, match=r"model.tie_word_embeddings=True but the checkpoint's lm_head.weight differs"):
        tied.load_hf_state_dict(dict(state, **{"lm_head.weight": state["model.embed_tokens.weight"] + 1}))


def test_config_from_hf_real_qwen3_30b_a3b_schema():
    hf = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048, "head_dim": 128,
          "num_attention_heads": 32, "num_key_value_heads": 4, "num_experts": 128, "num_experts_per_tok": 8,
          "moe_intermediate_size": 768, "num_hidden_layers": 48, "rope_theta": 1000000.0, "vocab_size": 151936,
          "norm_topk_prob": True, "max_position_embeddings": 40960, "torch_dtype": "bfloat16", "use_sliding_window": False}
    cfg = Qwen3MoeConfig.from_hf(hf)
    cfg.validate()
    assert cfg.dim_per_head == 128 and cfg.rope_theta == 1e6 and cfg.num_experts == 128
    assert Qwen3MoeConfig.from_hf(cfg.to_hf()) == cfg
    # a config.json without norm_topk_prob and rope_theta: transformers' defaults, the model it computes
    bare = Qwen3MoeConfig.from_hf({k: v for k, v in hf.items() if k not in ("norm_topk_prob", "rope_theta", "max_position_embeddings")})
    assert (bare.norm_topk_prob, bare.rope_theta, bare.max_position_embeddings) == (
        HFConfig().norm_topk_prob, HFConfig().rope_parameters["rope_theta"], HFConfig().max_position_embeddings)
    # HF applies sliding_window on every layer when use_sliding_window is on: refused, not run as full attention
    with pytest.raises(UserError, match=r"model.use_sliding_window=True \(sliding_window=4096\) is not supported"):
        Qwen3MoeConfig.from_hf(dict(hf, use_sliding_window=True, sliding_window=4096))
    with pytest.raises(ValueError, match=r"model.attention_dropout=0.1 is not supported by PithTrain's qwen3_moe"):
        config_from_hf(dict(hf, attention_dropout=0.1))
    with pytest.raises(ValueError, match=r"model.attention_dropout=0.2 is not supported by PithTrain's qwen3_5_moe"):
        config_from_hf({"model_type": "qwen3_5_moe", "text_config": {"attention_dropout": 0.2}})
    assert config_from_hf(dict(hf, attention_dropout=0.0)) == cfg
    with pytest.raises(ValueError, match=r"qwen3_moe: quantization_config 'fp8': quantized checkpoints are not read"):
        config_from_hf(dict(hf, quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]}))
    # a yarn rope_scaling added beside a default rope_parameters: transformers runs yarn, so refused, not read as default
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    with pytest.raises(ValueError, match=r"model.rope_scaling=\{'rope_type': 'yarn'.*differ \(transformers uses rope_scaling"):
        config_from_hf(dict(hf, rope_parameters={"rope_type": "default", "rope_theta": 1e6}, rope_scaling=yarn))
    with pytest.raises(ValueError, match=r"model.rope_scaling rope_type='yarn' is not.*make it .'rope_type': 'default'"):
        config_from_hf(dict(hf, rope_scaling={"type": "yarn", "factor": 4.0}))  # transformers 4's key
    same = {"rope_type": "default", "rope_theta": 1e6}
    assert config_from_hf(dict(hf, rope_parameters=same, rope_scaling=dict(same))) == cfg


def test_stage1_hands_the_experts_rows_in_the_matmul_dtype():
    """Under autocast the experts' rows leave stage 1 already in bf16 (the dispatch then moves half the
    bytes; ops/core.expert_tokens), equal to the normed hidden states cast once; the router's
    probabilities are those of the fp32 normed rows. Outside autocast the rows stay fp32."""
    cfg = Qwen3MoeConfig(**{k: v for k, v in CONFIGS["aligned_tied"].items() if k != "rope_parameters"})
    model = cfg.build_model()
    model.init_weights(0)
    layer = model.layers["1"]
    x = torch.randn(2, 9, cfg.hidden_size)
    attn = model.attn_inputs(torch.arange(9).expand(2, 9), None, x.dtype)
    with torch.autocast("cpu", torch.bfloat16):
        out = layer.stage1(x, attn)
        h = x + layer.self_attn(layer.input_layernorm(x), attn)
        normed = layer.post_attention_layernorm(h).flatten(0, 1)
        scores = layer.mlp.gate(normed).scores
    assert normed.dtype == torch.float32 and out.moe_input.dtype == torch.bfloat16
    assert torch.equal(out.moe_input, normed.to(torch.bfloat16))
    assert torch.equal(out.routing.scores, scores)
    assert layer.stage1(x, attn).moe_input.dtype == torch.float32
