"""DeepSeek-V2 family and DeepSeek-style routing, against transformers' DeepseekV2/V3 and hand-computed values."""

import contextlib
import io
import json
import warnings

import numpy as np
import pytest
import torch
import transformers
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

from pithtrain.cli import main as cli_main
from pithtrain.config import ConfigError
from pithtrain.models.deepseek_v2 import DeepseekV2Config
from pithtrain.models.routing import select_experts, update_correction_bias
from pithtrain.parallel.expert import ExpertEngine, LocalDispatch
from pithtrain.tools.hf import load_model, read_hf_state, write_hf_dir

pytestmark = pytest.mark.fast  # the fast tier (make test-fast)

YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 24, "beta_slow": 2,
        "mscale": 0.9, "mscale_all_dim": 0.6}

# Odd sizes on purpose; HF requires hidden_size % num_attention_heads == 0.
BASE = dict(vocab_size=97, hidden_size=36, intermediate_size=50, moe_intermediate_size=14, num_hidden_layers=3,
            num_attention_heads=3, kv_lora_rank=10, qk_nope_head_dim=6, qk_rope_head_dim=8, v_head_dim=5,
            n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=3, first_k_dense_replace=1, rms_norm_eps=1e-5,
            max_position_embeddings=64, tie_word_embeddings=False)

VARIANTS = {
    "full_q_greedy_yarn": dict(q_lora_rank=None, topk_method="greedy", routed_scaling_factor=1.0, rope_scaling=YARN),
    "q_lora_grouped_yarn": dict(q_lora_rank=12, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                routed_scaling_factor=1.7, rope_scaling=YARN),
    "q_lora_plain_rope_bias": dict(q_lora_rank=7, topk_method="greedy", attention_bias=True, n_shared_experts=1,
                                   rope_scaling=None, rope_theta=500.0),
}


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def hf_model(overrides, seed=0):
    torch.manual_seed(seed)
    cfg = transformers.DeepseekV2Config(**{**BASE, **overrides}, experts_implementation="eager", attn_implementation="eager")
    model = transformers.DeepseekV2ForCausalLM(cfg).eval()
    with torch.no_grad():  # std 0.2 so that routing and attention are far from uniform
        for name, p in model.named_parameters():
            p.copy_((1.0 if "norm" in name else 0.0) + 0.2 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module", params=list(VARIANTS))
def hf_pair(request, tmp_path_factory):
    model = hf_model(VARIANTS[request.param])
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return model, path


def test_hf_parity_staged_and_reference(hf_pair):
    hf, path = hf_pair
    ours = load_model(path)
    ids = torch.randint(0, BASE["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(24).expand(2, 24)
    with torch.no_grad():
        expected = hf(ids).logits
        staged = ours(ids, pos, ExpertEngine(LocalDispatch()))
    assert rel(staged, expected) <= 1e-5
    assert rel(ours.reference_forward(ids), expected) <= 1e-5


def test_export_roundtrip_and_hf_loads_it(hf_pair, tmp_path):
    hf, path = hf_pair
    ours = load_model(path)
    out = write_hf_dir(ours, tmp_path / "exported")
    again = load_model(out)
    for (name, a), (_, b) in zip(ours.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert again.cfg == ours.cfg
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        out, output_loading_info=True, experts_implementation="eager", attn_implementation="eager")
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    ids = torch.randint(0, BASE["vocab_size"], (2, 16))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, hf(ids).logits)


def test_cli_eval_matches_hf_loss(hf_pair, tmp_path, capsys):
    hf, path = hf_pair
    tokens = np.random.default_rng(0).integers(0, BASE["vocab_size"], size=(5, 17)).astype(np.int32)
    np.save(tmp_path / "tokens.npy", tokens)
    capsys.readouterr()
    with pytest.raises(SystemExit) as done:  # main() exits with the command's status
        cli_main(["eval", str(path), "--tokens", str(tmp_path / "tokens.npy"), "--json", "--device", "cpu"])
    assert done.value.code == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    ids = torch.from_numpy(tokens.astype(np.int64))
    with torch.no_grad():
        expected = hf(ids, labels=ids).loss.item()
    assert result["tokens"] == 5 * 16
    assert abs(result["loss"] - expected) <= 1e-5 * expected


def test_pipeline_chunks_and_packed_documents_match_reference():
    torch.manual_seed(0)
    cfg = DeepseekV2Config(**{**BASE, **VARIANTS["q_lora_grouped_yarn"]})
    full = cfg.build_model()
    full.init_weights(3)
    with torch.no_grad():
        for p in full.parameters():
            p.add_(0.2 * torch.randn_like(p))
    first, last = cfg.build_model([0, 1], head=False), cfg.build_model([2], embed=False)
    first.load_state_dict(full.state_dict(), strict=False)
    last.load_state_dict(full.state_dict(), strict=False)
    ids = torch.randint(0, cfg.vocab_size, (2, 20))
    pos = torch.arange(20).expand(2, 20)
    doc_ids = torch.tensor([[0] * 7 + [1] * 13, [0] * 20])
    with torch.no_grad():
        whole = full(ids, pos, ExpertEngine(LocalDispatch()), doc_ids)
        chunked = last(first(ids, pos, ExpertEngine(LocalDispatch()), doc_ids), pos, ExpertEngine(LocalDispatch()), doc_ids)
    assert torch.equal(whole, chunked)
    assert rel(whole, full.reference_forward(ids, pos, doc_ids)) <= 1e-5
    cfg.topk_group, cfg.num_experts_per_tok = 0, 2  # one kept group (2 experts), model and oracle alike (the oracle kept none)
    with torch.no_grad():
        assert rel(full(ids, pos, ExpertEngine(LocalDispatch()), doc_ids), full.reference_forward(ids, pos, doc_ids)) <= 1e-5


# ---- routing ----


def v3_router_case(seed=0):
    cfg = transformers.DeepseekV3Config(hidden_size=24, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                                        norm_topk_prob=True, routed_scaling_factor=2.5)
    router = DeepseekV3TopkRouter(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen))
        router.e_score_correction_bias.copy_(0.3 * torch.randn(16, generator=gen))
    return cfg, router, torch.randn(64, 24, generator=gen)


def test_select_experts_matches_hf_deepseek_v3_router():
    cfg, router, x = v3_router_case()
    with torch.no_grad():
        logits, hf_weights, hf_ids = router(x)
    ids, weights, scores = select_experts(
        logits, cfg.num_experts_per_tok, score_func="sigmoid", correction_bias=router.e_score_correction_bias,
        n_group=cfg.n_group, topk_group=cfg.topk_group, group_score="top2sum", norm_topk_prob=True,
        routed_scaling_factor=cfg.routed_scaling_factor)
    assert torch.equal(scores, logits.sigmoid())
    ours = {(t, int(e)): w for t in range(len(x)) for e, w in zip(ids[t], weights[t])}
    theirs = {(t, int(e)): w for t in range(len(x)) for e, w in zip(hf_ids[t], hf_weights[t])}
    assert ours.keys() == theirs.keys()
    assert max(abs(ours[k] - theirs[k]).item() for k in ours) <= 1e-6
    # The bias changed some choices, and the weights still come from the unbiased scores.
    plain_ids, _, _ = select_experts(logits, 4, "sigmoid", None, 4, 2, "top2sum")
    assert not torch.equal(plain_ids.sort(-1).values, ids.sort(-1).values)
    assert torch.allclose(weights, 2.5 * scores.gather(1, ids) / scores.gather(1, ids).sum(-1, keepdim=True))


def test_select_experts_group_limited_greedy_by_hand():
    logits = torch.log(torch.tensor([[0.30, 0.05, 0.21, 0.19, 0.01, 0.24]]))  # softmax gives back these scores
    ids, weights, _ = select_experts(logits, 2, "softmax", n_group=3, topk_group=2, group_score="max")
    # Groups (0,1), (2,3), (4,5) have best scores 0.30, 0.21, 0.24: groups 0 and 2 survive, so expert 2 is out.
    assert sorted(ids[0].tolist()) == [0, 5]
    assert torch.allclose(weights.sort(-1).values, torch.tensor([[0.24, 0.30]]))
    ids, _, _ = select_experts(logits, 2, "softmax", n_group=3, topk_group=2, group_score="top2sum")
    assert sorted(ids[0].tolist()) == [0, 2]  # pair sums 0.35, 0.40, 0.25 (experts 0 and 2 win): groups 0 and 1


def test_update_correction_bias_by_hand():
    bias = torch.tensor([0.1, -0.2, 0.0, 0.3])
    same = bias
    update_correction_bias(bias, torch.tensor([5, 1, 3, 3]), rate=0.01)  # mean 3: over, under, even, even
    assert bias is same
    assert torch.allclose(bias, torch.tensor([0.09, -0.19, 0.0, 0.3]))
    update_correction_bias(bias, torch.tensor([0, 0, 4, 0]), rate=0.5)
    assert torch.allclose(bias, torch.tensor([0.59, 0.31, -0.5, 0.8]))


def test_noaux_tc_model_matches_hf_deepseek_v3(tmp_path):
    torch.manual_seed(0)
    hf_cfg = transformers.DeepseekV3Config(
        **BASE, num_key_value_heads=BASE["num_attention_heads"], q_lora_rank=12, n_group=4, topk_group=2, norm_topk_prob=True,
        routed_scaling_factor=2.5, rope_parameters={**YARN, "rope_theta": 10000.0}, rope_interleave=True,
        num_mtp_layers=0, experts_implementation="eager", attn_implementation="eager")
    hf = transformers.DeepseekV3ForCausalLM(hf_cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_((1.0 if "norm" in name else 0.0) + 0.2 * torch.randn_like(p))
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    hf.save_pretrained(tmp_path)
    hf_dict = json.loads((tmp_path / "config.json").read_text())
    cfg = DeepseekV2Config.from_hf({**hf_dict, "topk_method": "noaux_tc", "scoring_func": "sigmoid"})
    cfg.validate()
    ours = cfg.build_model()
    ours.load_hf_state_dict(read_hf_state(tmp_path))
    biases = ours.correction_biases()
    assert sorted(biases) == [1, 2] and all(b.abs().sum() > 0 for b in biases.values())
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in ours.hf_state_dict()
    ids = torch.randint(0, BASE["vocab_size"], (2, 20))
    with torch.no_grad():
        expected = hf(ids).logits
        staged = ours(ids, torch.arange(20).expand(2, 20), ExpertEngine(LocalDispatch()))
    assert rel(staged, expected) <= 1e-5
    assert rel(ours.reference_forward(ids), expected) <= 1e-5
    ours.init_weights(0)
    assert all(b.abs().sum() == 0 for b in ours.correction_biases().values())
    assert DeepseekV2Config(**BASE).build_model().correction_biases() == {}


# ---- gradients and config checks ----


def test_gradients_fp32_match_fp64():
    torch.manual_seed(0)
    cfg = DeepseekV2Config(**{**BASE, **VARIANTS["q_lora_grouped_yarn"], "topk_method": "noaux_tc",
                              "scoring_func": "sigmoid", "norm_topk_prob": True})
    model = cfg.build_model()
    model.init_weights(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.normal_(0.0, 0.2)
        for bias in model.correction_biases().values():
            bias.normal_(0.0, 0.05)
    wide = cfg.build_model().double()
    wide.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    ids = torch.randint(0, cfg.vocab_size, (2, 16))
    pos = torch.arange(15).expand(2, 15)

    def grads(m):
        logits = m(ids[:, :-1], pos, ExpertEngine(LocalDispatch()))
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
        return {n: p.grad for n, p in m.named_parameters()}

    narrow, exact = grads(model), grads(wide)
    assert exact["layers.1.mlp.gate.weight"].norm() > 0  # the router learns through the combine weights
    for name, g in exact.items():
        assert narrow[name] is not None, name
        assert (narrow[name].double() - g).norm() <= 1e-4 * g.norm() + 1e-12, name


def test_mla_attention_unpadded_v_equals_padded_and_softmax():
    """CUDA hands MLA's narrower v to SDPA as it is (plain causal, deepseek_v2.UNPADDED_V); the CPU and masked
    attention pad v to q's width and slice the output. Both are the attention of an explicit softmax: float64
    outputs and the gradients of q, k and v agree to 1e-12 relative, plain causal and with documents' masks."""
    from pithtrain.models.deepseek_v2 import mla_attention
    from pithtrain.ops.core import attention_mask

    gen = torch.Generator().manual_seed(3)
    b, h, s, dqk, dv, scale = 2, 3, 11, 14, 5, 0.3
    q, k = (torch.randn(b, h, s, dqk, dtype=torch.float64, generator=gen) for _ in range(2))
    v = torch.randn(b, h, s, dv, dtype=torch.float64, generator=gen)
    dout = torch.randn(b, s, h * dv, dtype=torch.float64, generator=gen)
    doc_ids = torch.tensor([[0] * 4 + [1] * 7, [0] * 9 + [1] * 2])
    for mask in (None, attention_mask(doc_ids, s, "cpu")):
        allowed = torch.ones(s, s, dtype=torch.bool).tril() if mask is None else mask
        runs = []
        for path in ("unpadded", "padded", "softmax"):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            if path == "softmax":
                scores = (leaves[0] @ leaves[1].mT * scale).masked_fill(~allowed, float("-inf"))
                out = (scores.softmax(-1) @ leaves[2]).transpose(1, 2).flatten(2)
            else:
                out = mla_attention(*leaves, mask, scale, pad_v=path == "padded")
            runs.append([out, *torch.autograd.grad(out, leaves, dout)])
        assert runs[0][0].shape == (b, s, h * dv)
        for got in runs[:2]:
            for a, ref in zip(got, runs[2]):
                assert rel(a, ref) < 1e-12


@pytest.mark.parametrize("change, field", [
    (dict(num_key_value_heads=1), "num_key_value_heads"),
    (dict(topk_method="group_limited_greedy", n_group=3, topk_group=1), "n_group"),
    (dict(topk_method="group_limited_greedy", n_group=4, topk_group=1), "num_experts_per_tok"),
    (dict(topk_method="noaux_tc", n_group=8, topk_group=4), "noaux_tc"),
    (dict(topk_method="top1"), "topk_method"),
    (dict(scoring_func="relu"), "scoring_func"),
    (dict(rope_scaling={"type": "linear", "factor": 2.0}), "rope_scaling"),
    (dict(rope_scaling={"type": "yarn", "factor": 2.0}), "original_max_position_embeddings"),
    (dict(rope_scaling={"type": "yarn", "factor": "4.0", "original_max_position_embeddings": 64}), r"'factor'\]='4.0'"),
    (dict(rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_slow": -1.0}),
     r"'beta_slow'\]=-1.0"),
    (dict(rope_scaling={"type": "yarn", "factor": 0.5, "original_max_position_embeddings": 64}), r"'factor'\]=0.5: .*>= 1"),
    (dict(rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 1, "beta_slow": 32}),
     r"'beta_fast'\]=1 is below beta_slow=32"),
    (dict(rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale_all_dims": 1.0}),
     r"'mscale_all_dims'\] is not read with type 'yarn'"),  # a misspelt key was ignored: another softmax scale
    (dict(rope_scaling={"factor": 4.0}), r"'factor'\] is not read with type 'default'"),
    (dict(rope_scaling={**YARN, "rope_theta": 5e5}), r"'rope_theta'\] is not read .*model.rope_theta=10000.0"),
    (dict(qk_rope_head_dim=7), "qk_rope_head_dim"),
])
def test_invalid_configs_name_the_field(change, field):
    with pytest.raises(ConfigError, match=field):
        DeepseekV2Config(**{**BASE, **change}).validate()


def test_from_hf_reads_deepseek_published_config_layout():
    published = {"model_type": "deepseek_v2", "q_lora_rank": None, "n_group": 1, "topk_group": 1, "rope_theta": 10000,
                 "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                                  "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
                 "eos_token_id": [100001], "aux_loss_alpha": 0.001, "seq_aux": True}
    cfg = DeepseekV2Config.from_hf(published)
    assert cfg.q_lora_rank is None and cfg.eos_token_id == 100001
    assert cfg.rope_scaling["factor"] == 40 and "rope_theta" not in cfg.rope_scaling
    assert DeepseekV2Config.from_hf(cfg.to_hf()) == cfg
    with contextlib.redirect_stderr(io.StringIO()), pytest.raises(ConfigError, match="mlp_bias"):
        DeepseekV2Config.from_hf({**published, "mlp_bias": True})


def test_hf_directory_with_routing_transformers_deepseek_v2_does_not_read_is_said(tmp_path):
    """transformers' DeepseekV2 routes by softmax and never renormalises the top-k weights, whatever config.json says:
    an HF directory asking for sigmoid scores or norm_topk_prob (PithTrain's export of such a run) is read as written
    with a one-line warning naming the fields and how to match transformers; a checkpoint's config.json and
    deepseek_v3 read them without one."""
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    from pithtrain.train.checkpoint import model_config

    rng = np.random.default_rng()
    asked = [{"scoring_func": "sigmoid"}, {"norm_topk_prob": True}, {"scoring_func": "sigmoid", "norm_topk_prob": True}]
    asked = asked[rng.integers(len(asked))]
    hf_cfg = lambda **kw: transformers.DeepseekV2Config(**{**BASE, "q_lora_rank": None, **kw})  # noqa: E731
    plain = DeepseekV2TopkRouter(hf_cfg())
    torch.nn.init.normal_(plain.weight)
    asking = DeepseekV2TopkRouter(hf_cfg(**asked))
    asking.load_state_dict(plain.state_dict())
    x = torch.randn(5, BASE["hidden_size"])
    assert all(torch.equal(a, b) for a, b in zip(plain(x), asking(x)))  # transformers ignores both
    config = {**DeepseekV2Config(**{**BASE, "q_lora_rank": None}).to_hf(), **asked}
    for kind in ("hf", "checkpoint"):
        (tmp_path / kind).mkdir()
        (tmp_path / kind / "config.json").write_text(json.dumps(config))
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"")
    with pytest.warns(UserWarning) as warned:
        read = model_config(tmp_path / "hf")
    said = str(warned[0].message)
    assert "\n" not in said and said.startswith(f"{tmp_path / 'hf' / 'config.json'}: transformers' deepseek_v2 does not read")
    assert all(f"{k}={v!r}" in said for k, v in asked.items()) and "scoring_func='softmax', norm_topk_prob=false" in said
    assert all(getattr(read, k) == v for k, v in asked.items()) and len(warned) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a checkpoint's config.json and a plain HF one: no warning
        assert all(getattr(model_config(tmp_path / "checkpoint"), k) == v for k, v in asked.items())
        (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, **{k: getattr(DeepseekV2Config, k) for k in asked}}))
        assert model_config(tmp_path / "hf").scoring_func == "softmax"
        v3 = {**config, "model_type": "deepseek_v3", "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True,
              "num_nextn_predict_layers": 0}  # named: no MTP layers looked for in the weights (an empty file here)
        (tmp_path / "hf" / "config.json").write_text(json.dumps(v3))
        assert model_config(tmp_path / "hf").norm_topk_prob is True


def test_convert_says_which_options_transformers_deepseek_v2_does_not_read(tmp_path):
    """An export of a config whose routing transformers' deepseek_v2 ignores (to_hf) warns; a plain one does not."""
    from pithtrain.tools.hf import convert
    from pithtrain.train import checkpoint as ckpt

    for overrides, unread in (({}, []), ({"norm_topk_prob": True, "scoring_func": "sigmoid"},
                                         ["scoring_func='sigmoid'", "norm_topk_prob=True"])):
        cfg = DeepseekV2Config(**{**BASE, "q_lora_rank": None, **overrides})
        assert cfg.transformers_ignores() == unread
        model = cfg.build_model()
        model.init_weights(0)
        ck = ckpt.write_checkpoint(tmp_path / f"ck{len(unread)}", {"model": ckpt.canonical_model_state(model)},
                                   {"step": 0}, cfg.to_hf())
        said = []
        convert(ck, tmp_path / f"hf{len(unread)}", echo=said.append)
        warned = [line for line in said if "does not read" in line]
        assert len(warned) == bool(unread) and all(option in warned[0] for option in unread), said
