"""DeepSeek-V3 family (deepseek_v3, kimi_k2, kimi_k25's text_config): DeepseekV3Config in the DeepSeek-V2
file, against transformers' DeepseekV3ForCausalLM with every routing switch on (fp32, CPU)."""

import contextlib
import io
import json
import shutil

import pytest
import torch
import transformers

from conftest import hf_grads
from pithtrain.config import ConfigError
from pithtrain.models import config_from_hf, families
from pithtrain.models.deepseek_v2 import DeepseekV3Config
from pithtrain.parallel.expert import ExpertEngine, LocalDispatch
from pithtrain.tools.hf import load_model, read_hf_state, write_hf_dir

pytestmark = pytest.mark.fast  # the fast tier (make test-fast)

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 24, "beta_slow": 2,
        "mscale": 0.9, "mscale_all_dim": 0.6, "rope_theta": 10000.0}

# Every switch on: q-LoRA, n_group > 1 with topk_group, norm_topk_prob, routed_scaling_factor != 1, two shared
# experts, a dense first layer (its own intermediate_size), YaRN with mscale and mscale_all_dim. Odd sizes on purpose.
HF_CONFIG = dict(vocab_size=97, hidden_size=36, intermediate_size=50, moe_intermediate_size=14, num_hidden_layers=3,
                 num_attention_heads=3, num_key_value_heads=3, q_lora_rank=12, kv_lora_rank=10, qk_nope_head_dim=6,
                 qk_rope_head_dim=8, v_head_dim=5, n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=3,
                 first_k_dense_replace=1, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
                 rms_norm_eps=1e-5, max_position_embeddings=64, tie_word_embeddings=False, rope_parameters=YARN,
                 num_mtp_layers=0)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def make_hf(interleave=True, seed=0):
    torch.manual_seed(seed)
    cfg = transformers.DeepseekV3Config(**HF_CONFIG, rope_interleave=interleave, experts_implementation="eager",
                                        attn_implementation="eager")
    hf = transformers.DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():  # std 0.2 so that routing and attention are far from uniform
        for name, p in hf.named_parameters():
            p.copy_((1.0 if "norm" in name else 0.0) + 0.2 * torch.randn_like(p))
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):  # changes some choices, never the weights
                b.copy_(0.1 * torch.randn_like(b))
    return hf


@pytest.fixture(scope="module", params=[True, False], ids=["interleaved", "rotate_half"])
def hf_pair(request, tmp_path_factory):
    hf = make_hf(request.param)
    path = tmp_path_factory.mktemp("v3") / "hf"
    hf.save_pretrained(path)
    return hf, path




def test_logits_loss_and_gradients_match_hf(hf_pair):
    hf, path = hf_pair
    model = load_model(path)
    cfg = model.cfg
    assert isinstance(cfg, DeepseekV3Config) and cfg.topk_method == "noaux_tc" and cfg.scoring_func == "sigmoid"
    assert cfg.rope_interleave == hf.config.rope_interleave and cfg.yarn["mscale_all_dim"] == 0.6
    assert sorted(model.correction_biases()) == [1, 2]
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))  # fresh inputs each run
    b, s = 2, 24
    ids = torch.randint(0, cfg.vocab_size, (b, s), generator=gen)
    labels = torch.randint(0, cfg.vocab_size, (b, s), generator=gen)
    pos = torch.arange(s).expand(b, s)
    with torch.no_grad():
        expected = hf(ids).logits
        assert rel(model.reference_forward(ids), expected) <= 1e-5
        hf_loss = hf(ids, labels=ids).loss  # HF shifts the labels itself
    staged = model(ids, pos, ExpertEngine(LocalDispatch()))
    assert rel(staged, expected) <= 1e-5
    shifted = torch.nn.functional.cross_entropy(staged[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    assert abs(shifted.item() - hf_loss.item()) <= 1e-5 * hf_loss.item()

    loss = torch.nn.functional.cross_entropy(staged.flatten(0, 1), labels.flatten())
    ref_loss, ref_grads = hf_grads(hf, ids, labels)
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * ref_loss.item()
    loss.backward()
    grad_model = load_model(path)  # our gradients under HF's names, by the weight conversion itself
    with torch.no_grad():
        for p, q in zip(grad_model.parameters(), model.parameters()):
            p.copy_(q.grad)
    ours = {k: v for k, v in grad_model.hf_state_dict().items() if not k.endswith("e_score_correction_bias")}
    assert set(ours) == set(ref_grads)
    for key, g in ours.items():
        expected = ref_grads[key].float()
        if expected.norm() == 0:  # an expert no token chose
            assert g.norm() == 0, key
            continue
        assert rel(g, expected) <= 1e-4, key
    assert ref_grads["model.layers.1.mlp.gate.weight"].norm() > 0  # the router learns through the combine weights


def test_round_trip_exact_and_transformers_loads_and_generates_export(hf_pair, tmp_path):
    hf, path = hf_pair
    model = load_model(path)
    out = write_hf_dir(model, tmp_path / "export")
    exported = json.loads((out / "config.json").read_text())
    assert exported["model_type"] == "deepseek_v3" and exported["architectures"] == ["DeepseekV3ForCausalLM"]
    assert exported["num_nextn_predict_layers"] == 0 and exported["rope_interleave"] == hf.config.rope_interleave
    again = load_model(out)
    assert again.cfg == model.cfg
    for (n, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.equal(a, b), n
    original, written = read_hf_state(path), read_hf_state(out)
    assert set(original) == set(written)
    for k in original:
        assert torch.equal(original[k], written[k]), k
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        out, output_loading_info=True, experts_implementation="eager", attn_implementation="eager")
    assert type(loaded).__name__ == "DeepseekV3ForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    ids = torch.randint(0, HF_CONFIG["vocab_size"], (2, 16))
    with torch.no_grad():
        assert torch.equal(loaded.eval()(ids).logits, hf(ids).logits)
    generated = loaded.generate(ids[:1, :5], max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert generated.shape == (1, 9)


def mtp_checkpoint(tmp_path, depths=1):
    """A tiny HF DeepSeek-V3 directory with `depths` multi-token prediction layers as DeepSeek saves
    them: layers num_hidden_layers.. with enorm, hnorm, eh_proj, a decoder layer (random), shared_head.norm,
    and copies of the embedding and head. Returns (path, the tensors written)."""
    from safetensors.torch import save_file

    hf = make_hf()
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": depths}))
    state = read_hf_state(tmp_path)
    n, h = HF_CONFIG["num_hidden_layers"], HF_CONFIG["hidden_size"]
    gen = torch.Generator().manual_seed(5)
    for lid in range(n, n + depths):
        state.update({f"model.layers.{lid}.enorm.weight": 1 + 0.2 * torch.randn(h, generator=gen),
                      f"model.layers.{lid}.hnorm.weight": 1 + 0.2 * torch.randn(h, generator=gen),
                      f"model.layers.{lid}.eh_proj.weight": 0.2 * torch.randn(h, 2 * h, generator=gen),
                      f"model.layers.{lid}.shared_head.norm.weight": 1 + 0.2 * torch.randn(h, generator=gen),
                      f"model.layers.{lid}.embed_tokens.weight": state["model.embed_tokens.weight"].clone(),
                      f"model.layers.{lid}.shared_head.head.weight": state["lm_head.weight"].clone()})
        for k, v in list(state.items()):  # its decoder block: layer 2's shapes (MoE), fresh values
            if k.startswith("model.layers.2."):
                state[k.replace("layers.2.", f"layers.{lid}.")] = v + 0.1 * torch.randn(v.shape, generator=gen)
    for f in tmp_path.glob("*.safetensors*"):
        f.unlink()
    save_file({k: v.clone().contiguous() for k, v in state.items()}, tmp_path / "model.safetensors")
    return tmp_path, state


def test_mtp_round_trip_is_exact_and_the_export_loads(tmp_path):
    """Import -> export of a checkpoint with an MTP layer is bit-exact, every tensor (the MTP layer's
    copies of the embedding and head included); transformers loads the export (its MTP layer aside)
    and generates. An MTP layer asked for but absent is refused in one line; with
    num_nextn_predict_layers=0 the layer is ignored with a one-line note."""
    path, state = mtp_checkpoint(tmp_path / "in")
    model = load_model(path)
    assert model.cfg.num_nextn_predict_layers == 1 and model.mtp is not None
    out = write_hf_dir(model, tmp_path / "out")
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1
    back = read_hf_state(out)
    assert set(back) == set(state)
    for k, v in state.items():
        assert torch.equal(back[k], v), k
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, experts_implementation="eager").eval()
    ids = torch.randint(0, HF_CONFIG["vocab_size"], (1, 6))
    with torch.no_grad():
        assert rel(model.reference_forward(ids), hf(ids).logits) <= 1e-5
    assert hf.generate(ids, max_new_tokens=3, do_sample=False).shape == (1, 9)

    n = HF_CONFIG["num_hidden_layers"]
    plain = {k: v for k, v in state.items() if not k.startswith(f"model.layers.{n}.")}
    cfg = DeepseekV3Config.from_hf({**json.loads((path / "config.json").read_text()), "num_nextn_predict_layers": 1})
    with pytest.raises(Exception, match=f"no multi-token prediction layer {n}.*num_nextn_predict_layers"):
        cfg.build_model().load_hf_state_dict(plain)
    cfg0 = DeepseekV3Config.from_hf({**json.loads((path / "config.json").read_text()), "num_nextn_predict_layers": 0})
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        cfg0.build_model().load_hf_state_dict(state)
    assert f"layer(s) {n}" in err.getvalue() and "multi-token prediction" in err.getvalue()
    assert len(err.getvalue().strip().splitlines()) == 1
    from pithtrain.config import RunConfig, TrainConfig, UserError
    from pithtrain.train.loop import check_init_from

    run = RunConfig(model=cfg0, train=TrainConfig(init_from=str(out)))
    check_init_from(run, echo=False)  # train.init_from with MTP off: the source's MTP layer is left out
    run.model = DeepseekV3Config.from_hf({**json.loads((path / "config.json").read_text()), "num_nextn_predict_layers": 2})
    with pytest.raises(UserError, match=r"num_nextn_predict_layers \(1 there, 2 in the run\)"):
        check_init_from(run, echo=False)  # a depth the source lacks: refused
    # transformers' own save_pretrained leaves the MTP layer out while its config.json still names it: the
    # directory reads as one without MTP (eval, convert, init_from), said once
    from safetensors.torch import save_file

    (tmp_path / "nomtp").mkdir()
    (tmp_path / "nomtp" / "config.json").write_text((out / "config.json").read_text())
    save_file(plain, str(tmp_path / "nomtp" / "model.safetensors"))
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        bare = load_model(tmp_path / "nomtp")
        run.model = cfg0
        run.train.init_from = str(tmp_path / "nomtp")
        check_init_from(run, echo=False)
    assert bare.mtp is None and torch.equal(bare.reference_forward(ids), model.reference_forward(ids))
    assert err.getvalue().count("read as model.num_nextn_predict_layers=0") == 1, err.getvalue()
    run.model = cfg
    with pytest.raises(UserError, match=r"num_nextn_predict_layers \(0 there, 1 in the run\)"):
        check_init_from(run, echo=False)
    # a config.json that names no depth (hand-edited; transformers reads 1): the MTP layers its weights hold, kept
    (tmp_path / "unnamed").mkdir()
    unnamed = {k: v for k, v in json.loads((out / "config.json").read_text()).items() if k != "num_nextn_predict_layers"}
    (tmp_path / "unnamed" / "config.json").write_text(json.dumps(unnamed))
    shutil.copyfile(out / "model.safetensors", tmp_path / "unnamed" / "model.safetensors")
    assert load_model(tmp_path / "unnamed").mtp is not None
    run.train.init_from = str(tmp_path / "unnamed")
    check_init_from(run, echo=False)


def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def test_mtp_matches_the_report_equations(tmp_path):
    """Multi-token prediction (2 depths) against the DeepSeek-V3 report's equations written out here:
    h'^k_t = M_k [RMSNorm(Emb(t_{t+k})); RMSNorm(h^{k-1}_t)] (the released weights' order: embedding
    first), h^k = TRM_k(h'^k) (the decoder block, through the model's own reference_forward on a
    one-layer model holding the block's weights), P^k = OutHead(RMSNorm(h^k)), L_MTP = lambda x the
    token cross-entropy over every depth's labels / their number (train/data.mtp_targets' labels,
    checked by hand below). Loss and the gradient of every parameter within 1e-5 (fp32), packed
    documents so that some targets cross a boundary and are masked."""
    from pithtrain.protocol import LossTerms
    from pithtrain.train.data import mtp_targets
    from types import SimpleNamespace

    cfg = DeepseekV3Config.from_hf({**HF_CONFIG, "model_type": "deepseek_v3", "num_nextn_predict_layers": 2,
                                    "rope_scaling": None, "rope_parameters": None})
    torch.manual_seed(11)
    model = cfg.build_model()
    model.init_weights(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(0.1 * torch.randn_like(p))  # norms away from 1, so enorm / hnorm / shared_head.norm matter
    b, s, depths, n = 2, 12, 2, cfg.num_hidden_layers
    ids = torch.randint(0, cfg.vocab_size, (b, s + 1))
    doc = torch.zeros(b, s, dtype=torch.long)
    doc[0, 7:] = 1
    pos = torch.cat([torch.arange(7), torch.arange(s - 7)]).expand(b, s).clone()
    pos[1] = torch.arange(s)
    labels = ids[:, 1:].clone()
    labels[0, 6] = -100  # token 6 is its document's last
    batch = {"input_ids": ids[:, :-1], "labels": labels}
    batch.update(mtp_targets(batch, depths))
    # by hand: depth 1 at t predicts token t+2: masked from t = s-1 (past the window) and where t..t+1 cross the boundary
    assert batch["mtp_labels"][1, :, 0].tolist() == ids[1, 2:].tolist() + [-100]
    assert batch["mtp_labels"][0, 5, 0] == -100 and batch["mtp_labels"][0, 6, 0] == -100 and batch["mtp_labels"][0, 4, 0] == ids[0, 6]
    assert batch["mtp_ids"][1, :, 1].tolist() == ids[1, 2:].tolist() + [0]
    # depth 2 at t predicts token t+3: t = 3 reaches token 6, its document's last; t = 4, 5 would cross
    assert batch["mtp_labels"][0, 3, 1] == ids[0, 6] and (batch["mtp_labels"][0, 4:7, 1] == -100).all()
    n_label, n_mtp = int((labels != -100).sum()), int((batch["mtp_labels"] != -100).sum())
    terms = LossTerms(SimpleNamespace(lb_coef=0.0, mtp_coef=0.3), n_label, 1, 0, n_mtp)

    logits, mtp_logits = model(batch["input_ids"], pos, ExpertEngine(LocalDispatch()), doc_ids=doc, mtp_ids=batch["mtp_ids"])
    ce = torch.nn.functional.cross_entropy
    loss = terms.ce_share(ce(logits.flatten(0, 1), labels.flatten(), reduction="sum"),
                          ce(mtp_logits.flatten(0, 2), batch["mtp_labels"].flatten(), reduction="sum"))
    ours = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)

    # the reference: the main model through reference_forward (gradients on), then the equations
    ref_fwd = type(model).reference_forward.__wrapped__  # without its no_grad
    h = ref_fwd(model, batch["input_ids"], pos, doc, final_hidden=True)
    ref_main = ce(ref_fwd(model, batch["input_ids"], pos, doc).flatten(0, 1), labels.flatten(), reduction="sum")
    blocks, mtp_sum = [], 0.0
    for k in range(1, depths + 1):
        layer = model.mtp[str(n + k - 1)]
        block = cfg.build_model(layer_ids=[n + k - 1], embed=False, head=False)
        block.layers[str(n + k - 1)].load_state_dict(
            {kk: v for kk, v in layer.state_dict().items() if kk.split(".")[0] not in ("enorm", "hnorm", "eh_proj", "shared_head")})
        blocks.append(block)
        emb = model.embed_tokens.weight[batch["mtp_ids"][:, :, k - 1]]
        h_in = torch.cat([rms(emb, layer.enorm.weight, cfg.rms_norm_eps), rms(h, layer.hnorm.weight, cfg.rms_norm_eps)], -1) @ layer.eh_proj.weight.T
        h = ref_fwd(block, None, pos, doc, inputs_embeds=h_in, final_hidden=True)
        p_k = rms(h, layer.shared_head.norm.weight, cfg.rms_norm_eps) @ model.lm_head.weight.T
        mtp_sum = mtp_sum + ce(p_k.flatten(0, 1), batch["mtp_labels"][:, :, k - 1].flatten(), reduction="sum")
    ref_loss = ref_main / n_label + 0.3 * mtp_sum / n_mtp
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item())
    params = dict(model.named_parameters())
    block_params = {f"mtp.{name[len('layers.'):]}": p for blk in blocks for name, p in blk.named_parameters()}
    ref = dict(zip(list(params) + list(block_params),
                   torch.autograd.grad(ref_loss, list(params.values()) + list(block_params.values()), allow_unused=True)))
    checked = set()
    for (name, p), g in zip(params.items(), ours):
        r = ref[name]  # an MTP block's decoder weight: the reference copy's gradient (same name, later in ref)
        if r is None or g is None or r.abs().max() == 0:
            assert (g is None or g.abs().max() == 0) and (r is None or r.abs().max() == 0), name
            continue
        assert rel(g, r) <= 1e-5, (name, rel(g, r))
        checked.add(name)
    kinds = ("embed_tokens", "lm_head", "enorm", "hnorm", "eh_proj", "shared_head", "self_attn", "experts", "gate")
    assert all(any(kind in name and name.startswith("mtp.") == (kind not in ("embed_tokens", "lm_head")) for name in checked)
               for kind in kinds), sorted(checked)


def test_kimi_configs_load():
    text = {"model_type": "kimi_k2", "vocab_size": 163840, "hidden_size": 7168, "num_hidden_layers": 61,
            "n_routed_experts": 384, "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
            "num_attention_heads": 64, "routed_scaling_factor": 2.827, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
            "rope_theta": 50000.0, "rope_scaling": {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                                                    "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
            "num_nextn_predict_layers": 0, "eos_token_id": 163585, "bos_token_id": 163584}
    k2 = config_from_hf(text)
    k2.validate()
    assert isinstance(k2, DeepseekV3Config) and k2.n_routed_experts == 384 and k2.q_lora_rank == 1536  # V3's default
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        k25 = config_from_hf({"model_type": "kimi_k25", "architectures": ["KimiK25ForConditionalGeneration"],
                              "text_config": {**text, "model_type": "deepseek_v3"}, "vision_config": {"hidden_size": 1152}})
    assert k25 == k2 and "text_config" in err.getvalue() and len(err.getvalue().strip().splitlines()) == 1
    assert k2.to_hf()["model_type"] == "deepseek_v3" and DeepseekV3Config.from_hf(k2.to_hf()) == k2
    # None / 0 (no shared expert, one group, one kept) export as the ints transformers needs (None failed its load)
    loose = DeepseekV3Config(n_group=None, topk_group=0, n_shared_experts=None, n_routed_experts=8, num_experts_per_tok=2)
    hf_loose = transformers.DeepseekV3Config(**loose.to_hf())
    assert (hf_loose.n_group, hf_loose.topk_group, hf_loose.n_shared_experts) == (1, 1, 0)
    assert DeepseekV3Config in families()
    with pytest.raises(ConfigError, match="text_config"):
        config_from_hf({"model_type": "kimi_k25"})
    for bad in ([text], json.dumps(text)):  # a list, the file's text: what it takes, not an AttributeError
        with pytest.raises(ConfigError, match=f"expected the dict of an HF config.json .*got {type(bad).__name__}$"):
            config_from_hf(bad)
    with pytest.raises(ConfigError, match="quantization_config"):
        config_from_hf({**text, "quantization_config": {"quant_method": "fp8"}})
    with pytest.raises(ConfigError, match="quantization_config 'compressed-tensors'"):  # K2.5's release: INT4 experts
        config_from_hf({"model_type": "kimi_k25", "text_config": text,
                        "quantization_config": {"quant_method": "compressed-tensors"}})


@pytest.mark.parametrize("change, field", [
    (dict(topk_method="greedy"), "topk_method"),
    (dict(scoring_func="softmax"), "scoring_func"),
    (dict(n_group=8, topk_group=9), "topk_group"),
    (dict(moe_layer_freq=2), "moe_layer_freq"),
    (dict(n_routed_experts=0), "n_routed_experts=0"),  # transformers' DeepseekV3 cannot run an export without experts
])
def test_invalid_v3_configs_name_the_field(change, field):
    with pytest.raises(ConfigError, match=field):
        DeepseekV3Config(**{**change}).validate()
