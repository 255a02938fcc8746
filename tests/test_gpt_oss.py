"""GPT-OSS against Hugging Face transformers and independent references: logits parity (staged and
reference forward), packed documents with sliding windows, export round trip, sink gradients, MXFP4
decoding of hub-style checkpoints, and `pithtrain eval` on an HF directory."""

import contextlib
import io
import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, GptOssForCausalLM
from transformers import GptOssConfig as HFGptOssConfig
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from pithtrain.cli import main
from pithtrain.models.gpt_oss import GptOssConfig, dequantize_mxfp4, sink_attention
from pithtrain.parallel.expert import ExpertEngine, LocalDispatch
from pithtrain.tools.hf import load_model, read_hf_state, write_hf_dir

pytestmark = pytest.mark.fast  # the fast tier (make test-fast)

SEQ = 17
# Non-default everywhere: odd sizes, a window shorter than the sequence, both layer types, YaRN with and
# without truncation / an explicit attention factor, a SwiGLU limit small enough to clamp, tied embeddings.
HF_CONFIGS = {
    "yarn": dict(
        vocab_size=97, hidden_size=40, intermediate_size=24, num_hidden_layers=4, num_attention_heads=6,
        num_key_value_heads=2, head_dim=10, num_local_experts=5, num_experts_per_tok=2, sliding_window=5,
        layer_types=["sliding_attention", "full_attention", "full_attention", "sliding_attention"],
        swiglu_limit=0.9, max_position_embeddings=256, rms_norm_eps=1e-5,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64,
                             beta_fast=4.0, beta_slow=1.0, truncate=False),
    ),
    "yarn_truncate_tied": dict(
        vocab_size=83, hidden_size=36, intermediate_size=20, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, head_dim=14, num_local_experts=6, num_experts_per_tok=3, sliding_window=3,
        swiglu_limit=1.3, max_position_embeddings=256, tie_word_embeddings=True,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=8.0, original_max_position_embeddings=32,
                             attention_factor=1.2),  # the correction range is fractional: truncation matters
    ),
}


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.fixture(scope="module", params=sorted(HF_CONFIGS))
def hf_dir(request, tmp_path_factory):
    """(HF model in eval mode, its save_pretrained directory)."""
    torch.manual_seed(0)
    hf = GptOssForCausalLM(HFGptOssConfig(**HF_CONFIGS[request.param], attn_implementation="eager")).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith("sinks"):
                p.normal_(0, 1.0)
            else:
                p.normal_(0, 0.2)  # large enough that routing and clamping are non-trivial
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return hf, path


def staged(model, ids, pos, doc=None):
    with torch.no_grad():
        return model(ids, pos, ExpertEngine(LocalDispatch()), doc_ids=doc)


def test_hf_logits_parity(hf_dir):
    hf, path = hf_dir
    model = load_model(path)
    ids = torch.randint(0, hf.config.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(SEQ).expand(2, SEQ)
    with torch.no_grad():
        ref = hf(input_ids=ids, position_ids=pos).logits
    assert rel(staged(model, ids, pos), ref) <= 1e-5
    assert rel(model.reference_forward(ids, pos), ref) <= 1e-5


def test_packed_documents_with_sliding_window(hf_dir):
    """Two documents packed in one row (positions restart) equal HF run on each document alone."""
    hf, path = hf_dir
    model = load_model(path)
    lengths = (11, 9)  # both longer than the windows
    ids = torch.randint(0, hf.config.vocab_size, (1, sum(lengths)), generator=torch.Generator().manual_seed(2))
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    doc = torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)])[None]
    with torch.no_grad():
        ref = torch.cat([hf(input_ids=part).logits for part in ids.split(lengths, dim=1)], dim=1)
    assert rel(staged(model, ids, pos, doc), ref) <= 1e-5
    assert rel(model.reference_forward(ids, pos, doc), ref) <= 1e-5


def test_export_round_trip(hf_dir, tmp_path):
    hf, path = hf_dir
    model = load_model(path)
    out = write_hf_dir(model, tmp_path / "export")
    again = load_model(out)
    for (name, a), (name_b, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert name == name_b and torch.equal(a, b), name
    original, exported = read_hf_state(path), read_hf_state(out)
    assert set(original) == set(exported)
    for key in original:  # interleaved gate/up and everything else survive exactly
        assert torch.equal(original[key], exported[key]), key
    reloaded, info = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    ids = torch.randint(0, hf.config.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(reloaded.eval()(input_ids=ids).logits, hf(input_ids=ids).logits)


def sink_attention_float64(q, k, v, sinks, allowed, scale):
    """Independent formula: per batch row and head, p = exp(s - m) / (sum exp(s - m) + exp(sink - m))."""
    b, hq, s, _ = q.shape
    group = hq // k.shape[1]
    rows = []
    for bi in range(b):
        heads = []
        for h in range(hq):
            scores = (q[bi, h] @ k[bi, h // group].T) * scale
            scores = torch.where(allowed[bi], scores, torch.tensor(float("-inf"), dtype=scores.dtype))
            m = torch.maximum(scores.max(-1).values, sinks[h])
            e = torch.exp(scores - m[:, None])
            heads.append((e / (e.sum(-1) + torch.exp(sinks[h] - m))[:, None]) @ v[bi, h // group])
        rows.append(torch.cat(heads, dim=-1))
    return torch.stack(rows)


def test_sink_attention_gradients():
    gen = torch.Generator().manual_seed(4)
    b, hq, hkv, s, d, window = 2, 6, 2, 13, 8, 4
    leaves = [torch.randn(shape, generator=gen) for shape in ((b, hq, s, d), (b, hkv, s, d), (b, hkv, s, d), (hq,))]
    docs = torch.tensor([[0] * 7 + [1] * 6, [0] * 4 + [1] * 9])
    allowed = torch.zeros(b, s, s, dtype=torch.bool)
    for bi in range(b):
        for i in range(s):
            for j in range(s):
                allowed[bi, i, j] = j <= i and i - j < window and docs[bi, i] == docs[bi, j]
    upstream = torch.randn(b, s, hq * d, generator=gen)

    def grads(dtype, fn, mask):
        xs = [t.detach().to(dtype).requires_grad_() for t in leaves]
        out = fn(*xs, mask, d**-0.5)
        (out * upstream.to(dtype)).sum().backward()
        return out, [x.grad for x in xs]

    out32, g32 = grads(torch.float32, sink_attention, allowed[:, None])
    out64, g64 = grads(torch.float64, sink_attention_float64, allowed)
    assert rel(out32, out64) <= 1e-6
    for name, a, r in zip(("q", "k", "v", "sinks"), g32, g64):
        assert rel(a, r) <= 2e-6, name
    assert g32[3].abs().min() > 0


def test_sinks_get_gradients_in_staged_model():
    cfg = GptOssConfig(vocab_size=61, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=3)
    model = cfg.build_model()
    model.init_weights(0)
    ids = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(5))
    pos = torch.cat([torch.arange(5), torch.arange(7)]).expand(2, 12)
    doc = torch.tensor([0] * 5 + [1] * 7).expand(2, 12)
    model(ids, pos, ExpertEngine(LocalDispatch()), doc_ids=doc).logsumexp(-1).mean().backward()
    for layer in model.layers.values():
        grad = layer.self_attn.sinks.grad
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().min() > 0
        for p in (layer.mlp.experts.gate_up_bias, layer.mlp.experts.down_bias, layer.mlp.router.bias):
            assert p.grad is not None and p.grad.abs().sum() > 0


def fp4_e2m1(code):
    """Decode from the bit fields: sign (bit 3), exponent (bits 2-1, bias 1), mantissa (bit 0)."""
    sign = -1.0 if code & 8 else 1.0
    exponent, mantissa = (code >> 1) & 3, code & 1
    magnitude = mantissa * 0.5 if exponent == 0 else 2.0 ** (exponent - 1) * (1 + mantissa / 2)
    return sign * magnitude


def decode_mxfp4_loops(blocks, scales):
    """[..., G, 16] bytes + [..., G] exponents -> [..., G*32], the low nibble first, one byte at a time."""
    out = np.zeros(blocks.shape[:-1] + (32,))
    for idx in np.ndindex(*blocks.shape[:-1]):
        scale = 2.0 ** (int(scales[idx]) - 127)
        for j in range(16):
            byte = int(blocks[idx + (j,)])
            out[idx + (2 * j,)] = fp4_e2m1(byte & 0x0F) * scale
            out[idx + (2 * j + 1,)] = fp4_e2m1(byte >> 4) * scale
    return out.reshape(*blocks.shape[:-2], -1)


def random_mxfp4(rng, *prefix):
    blocks = rng.integers(0, 256, size=prefix + (16,), dtype=np.uint8)
    scales = rng.integers(115, 135, size=prefix[:-1] + (prefix[-1],), dtype=np.uint8)
    return blocks, scales


def test_dequantize_mxfp4_matches_independent_decoder():
    blocks, scales = random_mxfp4(np.random.default_rng(0), 3, 7, 2)
    ours = dequantize_mxfp4(torch.from_numpy(blocks), torch.from_numpy(scales))
    assert ours.dtype == torch.float32 and ours.shape == (3, 7, 64)
    assert np.array_equal(ours.numpy(), decode_mxfp4_loops(blocks, scales))
    # transformers' own decoder returns the transposed [E, in, out] layout of the parameter
    hf = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
    assert torch.equal(hf, ours.transpose(1, 2))


def test_load_mxfp4_checkpoint(tmp_path):
    """A hub-style checkpoint (experts as *_blocks/*_scales, quantization_config in config.json)."""
    hidden, inter, experts = 64, 32, 3
    cfg = GptOssConfig(vocab_size=50, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=experts,
                       num_experts_per_tok=2, sliding_window=4)
    source = cfg.build_model()
    source.init_weights(1)
    state = source.hf_state_dict()
    rng = np.random.default_rng(1)
    expected = {}
    for lid in range(2):
        pre = f"model.layers.{lid}.mlp.experts."
        for proj, rows, cols in (("gate_up_proj", 2 * inter, hidden), ("down_proj", hidden, inter)):
            blocks, scales = random_mxfp4(rng, experts, rows, cols // 32)
            del state[pre + proj]
            state[pre + proj + "_blocks"], state[pre + proj + "_scales"] = torch.from_numpy(blocks), torch.from_numpy(scales)
            expected[pre + proj] = torch.from_numpy(decode_mxfp4_loops(blocks, scales)).float().transpose(1, 2)
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "model.safetensors"))
    hf_config = cfg.to_hf() | {"quantization_config": {"quant_method": "mxfp4"}, "experts_per_token": 2}
    (tmp_path / "config.json").write_text(json.dumps(hf_config))
    model = load_model(tmp_path)
    exported = model.hf_state_dict()
    for key, value in expected.items():
        assert torch.equal(exported[key], value), key
    for key, value in state.items():
        if not key.endswith(("_blocks", "_scales")):
            assert torch.equal(exported[key], value), key
    ids = torch.randint(0, 50, (1, 9))
    pos = torch.arange(9)[None]
    assert rel(staged(model, ids, pos), model.reference_forward(ids, pos)) <= 1e-5


def test_eval_cli_on_hf_dir(hf_dir, tmp_path):
    hf, path = hf_dir
    tokens = torch.randint(0, hf.config.vocab_size, (3, SEQ), generator=torch.Generator().manual_seed(6))
    np.save(tmp_path / "tokens.npy", tokens.numpy())
    stdout, code = io.StringIO(), None
    with contextlib.redirect_stdout(stdout):
        try:  # main() exits with the command's status
            main(["eval", str(path), "--tokens", str(tmp_path / "tokens.npy"), "--json", "--device", "cpu"])
        except SystemExit as e:
            code = e.code
    assert code == 0
    result = json.loads(stdout.getvalue().strip().splitlines()[-1])
    with torch.no_grad():
        ref = hf(input_ids=tokens, labels=tokens).loss.item()
    assert result["tokens"] == 3 * (SEQ - 1)
    assert abs(result["loss"] - ref) <= 1e-5 * abs(ref)


def test_config_from_hub_style_json():
    """The published gpt-oss-20b config.json (transformers-4 names: rope_scaling, top-level rope_theta,
    experts_per_token) gives exactly the model of examples/gpt_oss_20b.py, so train.init_from accepts it."""
    from pithtrain.config import ConfigError, load_run_config
    from pithtrain.models import config_from_hf

    hub = {
        "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
        "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
        "initial_context_length": 4096, "initializer_range": 0.02, "intermediate_size": 2880,
        "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
        "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
        "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999,
        "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                           "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
        "rms_norm_eps": 1e-05, "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128,
        "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                         "rope_type": "yarn", "truncate": False},
        "swiglu_limit": 7.0, "tie_word_embeddings": False, "use_cache": True, "vocab_size": 201088,
    }
    cfg = config_from_hf(hub)
    cfg.validate()
    assert cfg == load_run_config("examples/gpt_oss_20b.py").model
    assert GptOssConfig.from_hf(cfg.to_hf()) == cfg
    del hub["num_experts_per_tok"], hub["layer_types"]
    alias = config_from_hf(hub)
    assert alias.num_experts_per_tok == 4 and alias.layer_types is None and alias == cfg
    with pytest.raises(ConfigError, match="sliding_window=None"):  # HF refuses it too: not silently the default 128
        config_from_hf({**hub, "sliding_window": None}).validate()
    # HF's YaRN truncates when the key is absent; the config writes that default out
    assert GptOssConfig(rope_parameters={"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 8}
                        ).rope_parameters == {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 8,
                                              "rope_theta": 150000.0, "truncate": True}


def test_config_errors_name_the_field():
    from pithtrain.config import ConfigError

    yarn = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 64}
    for bad, field_name in ((dict(layer_types=["full_attention"]), "layer_types"),
                            (dict(num_experts_per_tok=200), "num_experts_per_tok"),
                            (dict(sliding_window=None), "sliding_window"),
                            (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1.0}), "rope_type"),
                            (dict(rope_parameters={"rope_type": "default", "rope_theta": "1e4"}), r"\['rope_theta'\]='1e4'"),
                            (dict(rope_parameters={**yarn, "original_max_position_embeddings": 0}), "original_max_position_embeddings"),
                            (dict(rope_parameters={**yarn, "beta_fast": -32.0}), r"\['beta_fast'\]=-32.0"),
                            (dict(rope_parameters={**yarn, "attention_factor": 0.0}), r"\['attention_factor'\]=0.0"),
                            (dict(rope_parameters={**yarn, "truncat": False}), r"keys \['truncat'\] that rope_type='yarn'"),
                            (dict(rope_parameters={"rope_type": "default", "factor": 2.0}), r"keys \['factor'\]")):
        with pytest.raises(ConfigError, match=field_name):
            GptOssConfig(**bad).validate()
