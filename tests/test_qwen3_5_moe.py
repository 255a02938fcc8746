"""Qwen3.5-MoE (hybrid Gated DeltaNet + gated attention) against Hugging Face transformers: logits and
loss (fp32), gradients of every parameter kind against a float64 HF run, packed documents, the HF
round trip (export loads with AutoModelForCausalLM and generates), the multimodal checkpoint layout."""

import dataclasses
import json
import warnings

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

from conftest import hf_grads
from pithtrain.models import config_from_hf
from pithtrain.models.qwen3_5_moe import Qwen3_5MoeConfig
from pithtrain.parallel.expert import ExpertEngine, LocalDispatch
from pithtrain.tools.hf import eval_setup, load_model, read_hf_state, write_hf_dir

# both layer kinds (linear, full, linear, full), grouped value heads (4 value / 2 key heads), Dk != Dv,
# partial rotary (a quarter of head_dim 16), shared expert, odd sizes
HF_CONFIG = dict(vocab_size=67, hidden_size=36, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, linear_conv_kernel_dim=3, linear_key_head_dim=8, linear_value_head_dim=12,
                 linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=16,
                 shared_expert_intermediate_size=20, num_experts=5, num_experts_per_tok=2,
                 layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
                 rope_parameters={"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.25},
                 max_position_embeddings=64)


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    torch.manual_seed(35)
    hf = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(experts_implementation="eager", **HF_CONFIG)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if not name.endswith("A_log"):  # HF's A_log init (log U[0.01, 16]) kept: realistic decays
                p.normal_(0, 0.2)  # large enough that routing is far from uniform
    path = tmp_path_factory.mktemp("q35") / "hf"
    hf.save_pretrained(path)
    return hf, path




@pytest.mark.fast
def test_logits_loss_and_gradients_match_transformers(hf_model):
    hf, hf_dir = hf_model
    model = load_model(hf_dir)
    assert [layer.is_linear for layer in model.layers.values()] == [True, False, True, False]
    b, s = 2, 70  # more than one chunk of the delta rule (64 tokens)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.cfg.vocab_size, (b, s), generator=gen)
    labels = torch.randint(0, model.cfg.vocab_size, (b, s), generator=gen)
    pos = torch.arange(s).expand(b, s)
    ref = hf(ids).logits
    staged = model(ids, pos, ExpertEngine(LocalDispatch()))
    assert rel(staged, ref) <= 1e-5
    assert rel(model.reference_forward(ids), ref) <= 1e-5
    loss = torch.nn.functional.cross_entropy(staged.flatten(0, 1), labels.flatten())
    ref_loss, ref_grads = hf_grads(hf, ids, labels, torch.float64)
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * ref_loss.item()

    # every parameter kind (A_log, dt_bias, conv, in_proj_*, gated norm, zero-centred norms, q/k/v/o with
    # the output gate, router, experts, shared expert and its gate, embedding, head) against float64 HF
    loss.backward()
    grad_model = load_model(hf_dir)  # our gradients under HF's names, by the weight conversion itself
    with torch.no_grad():
        for p, q in zip(grad_model.parameters(), model.parameters()):
            p.copy_(q.grad)
    ours = grad_model.hf_state_dict()
    assert set(ours) == set(ref_grads)
    kinds = set()
    for key, g in ours.items():
        expected = ref_grads[key].float()
        if expected.norm() == 0:  # an expert no token chose
            assert g.norm() == 0, key
            continue
        assert rel(g, expected) <= 1e-4, key
        kinds.add(key.split(".")[-2] if key.endswith("weight") else key.split(".")[-1])
    for kind in ("A_log", "dt_bias", "conv1d", "in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "norm", "out_proj",
                 "q_proj", "q_norm", "k_norm", "o_proj", "gate", "shared_expert_gate", "gate_proj", "down_proj",
                 "input_layernorm", "embed_tokens", "lm_head"):
        assert kind in kinds, kind


@pytest.mark.fast
def test_packed_documents_reset_state_and_conv(hf_model):
    _, hf_dir = hf_model
    model = load_model(hf_dir)
    b, s = 2, 23
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, model.cfg.vocab_size, (b, s), generator=gen)
    doc = torch.tensor([[0] * 7 + [1] * 9 + [2] * 7, [0] * 20 + [1] * 3])
    pos = torch.stack([torch.cat([torch.arange(n) for n in (7, 9, 7)]), torch.cat([torch.arange(20), torch.arange(3)])])
    staged = model(ids, pos, ExpertEngine(LocalDispatch()), doc_ids=doc)
    assert rel(staged, model.reference_forward(ids, pos, doc)) <= 1e-5
    # a packed document gives the logits of that document alone (state and conv window reset)
    for row, lo, hi in ((0, 0, 7), (0, 7, 16), (0, 16, 23), (1, 20, 23)):
        alone = model(ids[row:row + 1, lo:hi], torch.arange(hi - lo)[None], ExpertEngine(LocalDispatch()))
        assert rel(staged[row:row + 1, lo:hi], alone) <= 1e-5, (row, lo, hi)


@pytest.mark.fast
def test_round_trip_export_loads_and_generates(hf_model, tmp_path):
    hf, hf_dir = hf_model
    model = load_model(hf_dir)
    write_hf_dir(model, tmp_path / "export")
    again = load_model(tmp_path / "export")
    for (n, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), n
    original, exported = read_hf_state(hf_dir), read_hf_state(tmp_path / "export")
    assert set(original) == set(exported)
    for k in original:
        assert torch.equal(original[k], exported[k]), k
    config = json.loads((tmp_path / "export/config.json").read_text())
    assert config["model_type"] == "qwen3_5_moe_text" and config["layer_types"] == HF_CONFIG["layer_types"]
    loaded, info = AutoModelForCausalLM.from_pretrained(str(tmp_path / "export"), output_loading_info=True,
                                                        experts_implementation="eager")
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids = torch.randint(0, HF_CONFIG["vocab_size"], (2, 11))
    assert rel(loaded.eval()(ids).logits, hf(ids).logits) <= 1e-6
    out = loaded.generate(ids[:1], max_new_tokens=5, do_sample=False)
    assert out.shape == (1, 16)
    assert Qwen3_5MoeConfig.from_hf(model.cfg.to_hf()) == model.cfg
    # no full-attention layer: transformers cannot run the export (its masks come from one), so convert says so
    from pithtrain.tools.hf import convert
    from pithtrain.train import checkpoint as ckpt

    assert model.cfg.transformers_ignores() == []
    as_tuple = dataclasses.replace(model.cfg, layer_types=tuple(model.cfg.layer_types))  # a run file's tuple is fine
    as_tuple.validate()
    assert as_tuple.to_hf() == model.cfg.to_hf()
    linear = dataclasses.replace(model.cfg, layer_types=["linear_attention"] * 4)
    ck = ckpt.write_checkpoint(tmp_path / "ck", {"model": ckpt.canonical_model_state(linear.build_model())}, {"step": 0},
                               linear.to_hf())
    said = []
    convert(ck, tmp_path / "linear", echo=said.append)
    assert [line for line in said if "does not read a model without full_attention layers" in line], said
    with pytest.raises(ValueError, match="Attention layers"):
        AutoModelForCausalLM.from_pretrained(str(tmp_path / "linear"), experts_implementation="eager")(ids)
    # a byte-level BPE of our own: AutoTokenizer builds Qwen3_5Tokenizer for a qwen3_5 export (Qwen's normalizer and
    # pre-tokenizer, not tokenizer.json's), other ids than training read; convert says so and how to load it as it is
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    from pithtrain.tools.tokenize import train_bpe

    src = ckpt.write_checkpoint(tmp_path / "src", {"model": ckpt.canonical_model_state(model)}, {"step": 0, "source": "x"},
                                model.cfg.to_hf())
    text = "alpha 12345 beta"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a tiny corpus fills few of the 300 tokens
        train_bpe([text] * 20, 300, str(src / "tokenizer.json"))
    said.clear()
    convert(src, tmp_path / "bpe", echo=said.append)
    assert [line for line in said if "PreTrainedTokenizerFast.from_pretrained" in line], said
    exact = Tokenizer.from_file(str(src / "tokenizer.json")).encode(text).ids
    assert AutoTokenizer.from_pretrained(str(tmp_path / "bpe"))(text)["input_ids"] != exact
    assert PreTrainedTokenizerFast.from_pretrained(str(tmp_path / "bpe"))(text)["input_ids"] == exact


@pytest.mark.fast
def test_multimodal_checkpoint_takes_the_language_model(hf_model, tmp_path, capsys):
    """A released-layout checkpoint: model_type qwen3_5_moe with a text_config, the language model under
    model.language_model., a vision tower and MTP weights beside it."""
    hf, hf_dir = hf_model
    text = json.loads((hf_dir / "config.json").read_text())
    mm = tmp_path / "mm"
    mm.mkdir()
    (mm / "config.json").write_text(json.dumps({"model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"],
                                                "text_config": text, "vision_config": {"depth": 2}}))
    state = {k.replace("model.", "model.language_model.", 1): v for k, v in read_hf_state(hf_dir).items()}
    state["model.visual.patch_embed.proj.weight"] = torch.randn(4, 3)
    state["mtp.fc.weight"] = torch.randn(4, 4)
    save_file(state, str(mm / "model.safetensors"))
    model = load_model(mm)
    eval_setup(mm), load_model(mm)  # what pithtrain eval reads: config.json for its sizes, then the model
    assert capsys.readouterr().err.count("vision tower") == 1
    ids = torch.randint(0, HF_CONFIG["vocab_size"], (1, 9))
    assert rel(model(ids, torch.arange(9)[None], ExpertEngine(LocalDispatch())), hf(ids).logits) <= 1e-5
    assert config_from_hf(text) == model.cfg
    (tmp_path / "text").mkdir()  # the text layout with MTP weights beside it: left out too, as transformers does
    (tmp_path / "text" / "config.json").write_text(json.dumps(text))
    save_file({**read_hf_state(hf_dir), "mtp.fc.weight": torch.randn(4, 4)}, str(tmp_path / "text" / "model.safetensors"))
    assert rel(load_model(tmp_path / "text")(ids, torch.arange(9)[None], ExpertEngine(LocalDispatch())), hf(ids).logits) <= 1e-5
    from cli_util import run_script  # the add-new-model skill's parity check takes it: the round trip is the language model

    result = run_script(".agents/skills/add-new-model/check_parity.py", mm, "--work", tmp_path / "parity")
    assert result.stdout.strip().endswith("PASS: 5 checks"), result.stdout
    for top, inner in ((True, False), (False, True)):  # as transformers' Qwen3_5MoeForConditionalGeneration ties
        outer = {"model_type": "qwen3_5_moe", "tie_word_embeddings": top, "text_config": {**text, "tie_word_embeddings": inner}}
        assert config_from_hf(outer).tie_word_embeddings is top
    # train.init_from it: a differing field is named as the run's field, not as config.json's rope_parameters
    from pithtrain.config import RunConfig, TrainConfig, UserError
    from pithtrain.train.loop import check_init_from

    run = RunConfig(model=dataclasses.replace(model.cfg, full_attention_interval=2), train=TrainConfig(init_from=str(mm)))
    check_init_from(run, echo=False)  # an interval layer_types overrides: the same layers, taken
    run.model = dataclasses.replace(model.cfg, partial_rotary_factor=0.5)
    with pytest.raises(UserError, match=r"in model\.partial_rotary_factor \(0\.25 there, 0\.5 in the run\); "):
        check_init_from(run, echo=False)


@pytest.mark.fast
def test_real_config_is_the_example():
    """The released Qwen3.5-35B-A3B text_config gives the model of examples/qwen3_5_35b_a3b.py."""
    from pithtrain.config import load_run_config

    text = {"model_type": "qwen3_5_moe_text", "vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 40,
            "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "linear_num_key_heads": 16,
            "linear_num_value_heads": 32, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4, "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
            "shared_expert_intermediate_size": 512, "full_attention_interval": 4, "rms_norm_eps": 1e-6,
            "max_position_embeddings": 262144, "tie_word_embeddings": False, "hidden_act": "silu",
            "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000, "partial_rotary_factor": 0.25,
                                "mrope_interleaved": True, "mrope_section": [11, 11, 10]}}
    cfg = config_from_hf({"model_type": "qwen3_5_moe", "text_config": text})
    cfg.validate()
    assert cfg == load_run_config("examples/qwen3_5_35b_a3b.py").model
    bare = config_from_hf({k: v for k, v in text.items() if k not in ("rope_parameters", "max_position_embeddings")})
    assert (bare.rope_theta, bare.max_position_embeddings) == (  # transformers' defaults
        Qwen3_5MoeTextConfig().rope_parameters["rope_theta"], Qwen3_5MoeTextConfig().max_position_embeddings)
    assert [cfg.layer_type(i) for i in range(8)] == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"]
    from pithtrain.config import ConfigError

    for scaling in ({"rope_type": "yarn", "factor": 4.0}, {"type": "yarn", "factor": 4.0}):  # "type": the older spelling
        with pytest.raises(ConfigError, match="rope_type 'yarn' is not supported"):
            config_from_hf({**text, "rope_parameters": None, "rope_scaling": scaling})


@pytest.mark.fast
def test_muon_takes_the_hybrid_matrices():
    """Muon: the matrices of both layer kinds, experts and shared expert; AdamW: the conv (a depthwise
    filter, not a matrix), the decay parameters, norms, the router and the shared expert's [1, H] gate."""
    from conftest import tiny_qwen3_5_config
    from pithtrain.train.optim import takes_muon

    cfg = tiny_qwen3_5_config("unused")
    model = cfg.model.build_model()
    taken = {n for n, p in model.named_parameters() if takes_muon(n, p, cfg.optim.muon_exclude)}
    for name in ("linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight", "linear_attn.in_proj_b.weight",
                 "linear_attn.in_proj_a.weight", "linear_attn.out_proj.weight", "mlp.experts.gate_up",
                 "mlp.shared_expert.down_proj.weight"):
        assert f"layers.0.{name}" in taken, name
    for name in ("self_attn.q_proj.weight", "self_attn.o_proj.weight", "mlp.experts.down"):
        assert f"layers.1.{name}" in taken, name
    for name in ("linear_attn.conv1d.weight", "linear_attn.A_log", "linear_attn.dt_bias", "linear_attn.norm.weight",
                 "mlp.shared_expert_gate.weight", "mlp.gate.weight", "input_layernorm.weight"):
        assert f"layers.0.{name}" not in taken, name


def test_compiles_without_graph_breaks_and_matches_eager(tmp_path, dataset_dir, capture_only_compile):
    """Both layer kinds' stage 1 (the chunked delta rule, the gated attention) and stage 5 trace in one
    graph each; the compiled run equals the eager one."""
    from torch._dynamo.utils import counters

    from conftest import tiny_qwen3_5_config
    from pithtrain.train.loop import train

    def cfg(**kw):
        c = tiny_qwen3_5_config(dataset_dir, steps=2, lb_coef=0.1, **kw)
        c.model.num_hidden_layers, c.model.layer_types = 2, ["linear_attention", "full_attention"]
        return c

    eager = train(cfg(), tmp_path / "eager", echo=False)
    torch._dynamo.reset()
    counters.clear()
    compiled = train(cfg(compile=True), tmp_path / "compiled", echo=False)
    assert counters["stats"]["unique_graphs"] > 0 and not counters["graph_break"]
    for a, b in zip(eager, compiled):
        for key in ("loss", "lb_loss", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-4), key


def test_fp8_and_load_balance_variants_train(tmp_path, dataset_dir):
    """FP8 (emulated on the CPU) and every load-balance variant run the hybrid family: FP8 within 1e-3
    of full precision (measured 2e-4) yet not equal (it ran); the lb variants give finite, distinct
    load-balance losses and the micro variant the full-precision run's curve."""
    from conftest import tiny_qwen3_5_config
    from pithtrain.train.loop import train

    def cfg(**kw):
        c = tiny_qwen3_5_config(dataset_dir, steps=2, lb_coef=0.1)
        c.model.num_hidden_layers, c.model.layer_types = 2, ["linear_attention", "full_attention"]
        for key, value in kw.items():
            section, name = key.split("__")
            setattr(getattr(c, section), name, value)
        return c

    base = train(cfg(), tmp_path / "base", echo=False)
    fp8 = train(cfg(train__fp8="rowwise", train__fp8_emulate=True), tmp_path / "fp8", echo=False)
    for a, b in zip(base, fp8):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-3) and b["loss"] != a["loss"]
    lb = {kind: train(cfg(train__lb_type=kind), tmp_path / kind, echo=False)[0]["lb_loss"] for kind in ("global", "seq")}
    assert all(torch.isfinite(torch.tensor(v)) and v > 0 for v in lb.values())
    assert lb["seq"] != base[0]["lb_loss"]
