"""GPT-OSS (gpt-oss-20b / -120b): config (HF `config.json` schema), the 5-stage decoder layer, the model, HF conversion
including the MXFP4 expert weights of hub checkpoints.

What differs from Qwen3-MoE:
  - attention has biases and one learnable "sink" logit per head that joins the softmax denominator
    (it takes probability mass, then is dropped). On CUDA ops/attention.py's Triton kernel holds it
    in the denominator and skips the blocks outside the window or document (no mask); on the CPU
    `sink_attention` runs it through SDPA's fused kernels as one extra key with an explicit mask;
  - layers use sliding-window (the last `sliding_window` tokens, the current one included) or full
    causal attention, per `layer_types`; both combine with the packed-document mask;
  - YaRN RoPE in HF's GPT-OSS form: the two halves of each head rotate against each other (the same
    numbers as rotate-half) and cos/sin are scaled by the YaRN attention factor;
  - the router has a bias and softmaxes over the chosen k logits only;
  - experts have biases and a clamped SwiGLU: gate <= limit, |up| <= limit,
    out = (up + 1) * gate * sigmoid(alpha * gate).
HF fuses gate/up with the two INTERLEAVED along the last dim (even columns gate, odd up); here they are stored gate then
up (the convention of every family's `Experts`) and converted on import/export. `reference_forward` is an independent
eager implementation (complex-number RoPE, log-sum-exp sinks, a loop over experts) used as the oracle in tests."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from pithtrain.config import YARN_KEYS, check, check_numbers, check_positive, check_yarn, hf_values
from pithtrain.protocol import RoutingInfo, Stage1Out, hf_name, check_hf_leftovers, hf_tensor, init_by_name, run_layer
from pithtrain.ops import attention, kernels
from pithtrain.ops.attention import sink_attention  # the SDPA path (CPU)
from pithtrain.ops.core import apply_rope, attention_mask, autocast_dtype, expert_tokens, rope_cos_sin, rope_inv_freq
from pithtrain.ops.fp8 import Linear, projections  # nn.Linear, with its GEMMs in FP8 under train.fp8
from pithtrain.ops.grouped_gemm import Embedding, activation_mm, expert_mm, head_logits
from pithtrain.parallel.context import ContextParallel, context_attention

SLIDING, FULL = "sliding_attention", "full_attention"


def _default_rope() -> dict:
    # HF's GptOssConfig default: what gpt-oss-20b/120b were trained with.
    return {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": False, "original_max_position_embeddings": 4096}


@dataclass
class GptOssConfig:
    vocab_size: int = 201088
    hidden_size: int = 2880
    intermediate_size: int = 2880  # each expert
    num_hidden_layers: int = 36
    num_attention_heads: int = 64
    num_key_value_heads: int = 8
    head_dim: int = 64
    num_local_experts: int = 128
    num_experts_per_tok: int = 4
    sliding_window: int | None = 128
    layer_types: list[str] | None = None  # None: sliding, full, sliding, full, ... (HF's default)
    rope_parameters: dict = field(default_factory=_default_rope)  # HF 5 layout, rope_theta inside
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 131072
    attention_bias: bool = True
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None

    model_type: ClassVar[str] = "gpt_oss"
    num_nextn_predict_layers: ClassVar[int] = 0  # no multi-token prediction (DeepSeek-V3's)

    def __post_init__(self):
        # One spelling of the RoPE dict: HF 5 keys, with HF's implicit defaults written out.
        rope = dict(self.rope_parameters or _default_rope())  # None: HF's GPT-OSS default
        rope.setdefault("rope_type", rope.pop("type", "default"))  # an explicit rope_type wins over `type`
        rope.setdefault("rope_theta", 150000.0)
        if rope["rope_type"] == "yarn":
            rope.setdefault("truncate", True)  # what HF's YaRN assumes when the key is absent
        self.rope_parameters = rope

    def __eq__(self, other):
        # Same model, same answer: layer_types=None equals the explicit list HF writes.
        return isinstance(other, GptOssConfig) and self.to_hf() == other.to_hf()

    def layer_type(self, layer_id: int) -> str:
        return self.layer_types[layer_id] if self.layer_types is not None else SLIDING if layer_id % 2 == 0 else FULL

    def is_moe_layer(self, layer_id: int) -> bool:
        return True  # every GPT-OSS layer is MoE

    def num_routed_experts(self) -> int:
        return self.num_local_experts

    def validate(self) -> None:
        check_positive(self, "vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads "
                             "num_key_value_heads head_dim num_local_experts rms_norm_eps swiglu_alpha max_position_embeddings")
        check(self.num_attention_heads % self.num_key_value_heads == 0,
              f"model.num_attention_heads={self.num_attention_heads} is not divisible by model.num_key_value_heads="
              f"{self.num_key_value_heads}; choose a divisor of the query heads")
        check(self.head_dim % 2 == 0, f"model.head_dim={self.head_dim}: must be even for RoPE")
        check(1 <= self.num_experts_per_tok <= self.num_local_experts,
              f"model.num_experts_per_tok={self.num_experts_per_tok} must be in [1, num_local_experts="
              f"{self.num_local_experts}]")
        if self.layer_types is not None:
            check(len(self.layer_types) == self.num_hidden_layers,
                  f"model.layer_types has {len(self.layer_types)} entries but model.num_hidden_layers="
                  f"{self.num_hidden_layers}; give one per layer or set layer_types=None (alternating)")
            bad = sorted({t for t in self.layer_types if t not in (SLIDING, FULL)})
            check(not bad, f"model.layer_types has {bad}; use {SLIDING!r} or {FULL!r}")
        if any(self.layer_type(i) == SLIDING for i in range(self.num_hidden_layers)):
            check(self.sliding_window is not None and self.sliding_window >= 1,
                  f"model.sliding_window={self.sliding_window}: sliding layers need a window of at least 1 token")
        check(self.swiglu_limit > 0, f"model.swiglu_limit={self.swiglu_limit}: must be > 0")
        rope = self.rope_parameters
        kind = rope.get("rope_type")
        check_numbers(rope, "model.rope_parameters")
        check(kind in ("yarn", "default"), f"model.rope_parameters rope_type={kind!r}: use 'yarn' (GPT-OSS) or 'default'")
        check(rope.get("rope_theta", 0) > 0, "model.rope_parameters needs rope_theta > 0")
        known = {"rope_type", "rope_theta", *(YARN_KEYS if kind == "yarn" else ())}
        check(not (extra := sorted(set(rope) - known)), f"model.rope_parameters has keys {extra} that rope_type={kind!r} "
              f"does not read (a misspelling is silently a default); remove them, or use {sorted(known)}")
        if kind == "yarn":
            check_yarn(rope, "model.rope_parameters")
            check(rope["factor"] >= 1, f"model.rope_parameters factor={rope['factor']}: must be >= 1")

    @classmethod
    def from_hf(cls, hf: dict) -> "GptOssConfig":
        values = hf_values(cls, hf, frozenset({"sliding_window"}))  # null: no window (HF then refuses sliding layers), not 128
        # Aliases: hub config.json files also carry `experts_per_token`; HF maps `num_experts`.
        for ours, alias in (("num_experts_per_tok", "experts_per_token"), ("num_local_experts", "num_experts")):
            if ours not in values and hf.get(alias) is not None:
                values[ours] = hf[alias]
        # Hub files use transformers-4 names (`rope_scaling` + top-level `rope_theta`); HF 5 writes
        # `rope_parameters` with rope_theta inside. Absent both, HF uses GPT-OSS's YaRN default.
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or _default_rope())
        if hf.get("rope_theta") is not None:
            rope.setdefault("rope_theta", hf["rope_theta"])
        values["rope_parameters"] = rope
        return cls(**values)

    def to_hf(self) -> dict:
        return asdict(self) | {"layer_types": [self.layer_type(i) for i in range(self.num_hidden_layers)],
                               "model_type": self.model_type, "architectures": ["GptOssForCausalLM"], "dtype": "float32"}

    def build_model(self, layer_ids=None, embed: bool = True, head: bool = True) -> "GptOssModel":
        self.validate()  # a config edited after its run file was read: its field named, not torch's error in forward
        return GptOssModel(self, layer_ids, embed, head)


# ---- MXFP4 (hub checkpoints store the experts this way) ----

# FP4 E2M1 code -> value: bit 3 sign, bits 2-1 exponent (bias 1), bit 0 mantissa; exponent 0 is subnormal.
FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """blocks: uint8 [..., G, 16], two FP4 E2M1 codes per byte, the LOW nibble the earlier element;
    scales: uint8 [..., G], an E8M0 exponent per block of 32 values (value = code * 2**(scale - 127)).
    Returns [..., G*32]. For a GPT-OSS expert tensor stored as [E, out, G, 16] this is [E, out, in]:
    transpose the last two dims for HF's [E, in, out] parameter."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks/scales must be uint8, got {blocks.dtype}/{scales.dtype}")
    if blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} must be scales {tuple(scales.shape)} + (16,)")
    table = torch.tensor(FP4_E2M1, dtype=torch.float32, device=blocks.device)
    flat_blocks, flat_scales = blocks.reshape(-1, 16), scales.reshape(-1, 1).to(torch.int32) - 127
    out = torch.empty(flat_blocks.shape[0], 32, dtype=dtype, device=blocks.device)
    step = 1 << 20  # rows per chunk: bounds the int64 index temporaries for 20B-sized tensors
    for i in range(0, flat_blocks.shape[0], step):
        chunk = flat_blocks[i : i + step]
        codes = torch.stack([chunk & 0x0F, chunk >> 4], dim=-1).flatten(-2).long()  # [rows, 32]
        out[i : i + step] = torch.ldexp(table[codes], flat_scales[i : i + step]).to(dtype)
    return out.view(*scales.shape[:-1], scales.shape[-1] * 32)


def _interleave(t):  # gate then up -> HF's gate/up interleaved along the last dim
    return torch.stack(t.chunk(2, dim=-1), dim=-1).flatten(-2)


def _deinterleave(t):
    return torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1)


# ---- the model ----


class AttnInputs(NamedTuple):
    cos: torch.Tensor  # [B, S, D]
    sin: torch.Tensor
    full_mask: torch.Tensor | None  # bool [B or 1, 1, S, S]: causal (and same document); None with cp or flash
    sliding_mask: torch.Tensor | None  # also within the window; None when no layer slides, with cp or flash
    cp: ContextParallel | None = None  # context parallel: ring attention, masked from cp's global token indices
    flash: bool = False  # ops/attention.py's kernel: no masks, the window and these document ids instead
    doc_ids: torch.Tensor | None = None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x):
        # HF's GPT-OSS order: the weight multiplies in fp32, then the cast back (Llama casts first).
        x32 = x.float()
        return (self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps))).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: GptOssConfig, layer_id: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = Linear(cfg.hidden_size, self.heads * self.head_dim, bias=bias)
        self.k_proj = Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = Linear(self.heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.sinks = nn.Parameter(torch.zeros(self.heads))
        self.sliding = cfg.layer_type(layer_id) == SLIDING
        self.window = cfg.sliding_window if self.sliding else None

    def qkv(self, x, cos, sin):
        b, s, _ = x.shape
        k, v = projections(x, self.k_proj, self.v_proj)  # not q: the attention keeps v, which would keep q's part too
        q = self.q_proj(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k, v = (t.view(b, s, self.kv_heads, self.head_dim).transpose(1, 2) for t in (k, v))
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, x, attn: AttnInputs):
        q, k, v = self.qkv(x, attn.cos, attn.sin)
        if attn.cp is not None:
            return self.o_proj(context_attention(q, k, v, self.head_dim**-0.5, attn.cp, self.sinks, self.window))
        if attn.flash:
            return self.o_proj(attention.attention(q, k, v, self.head_dim**-0.5, self.sinks, self.window, attn.doc_ids))
        mask = attn.sliding_mask if self.sliding else attn.full_mask
        return self.o_proj(sink_attention(q, k, v, self.sinks, mask, self.head_dim**-0.5))


class Experts(nn.Module):
    """Stacked expert weights: gate_up [E, H, 2I] (gate then up), gate_up_bias [E, 2I], down [E, I, H],
    down_bias [E, H]."""

    fp8 = False  # train.fp8: expert_mm runs the grouped GEMMs in FP8 (ops/fp8.py)

    def __init__(self, cfg: GptOssConfig):
        super().__init__()
        e, h, i = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
        self.gate_up = nn.Parameter(torch.empty(e, h, 2 * i))
        self.gate_up_bias = nn.Parameter(torch.empty(e, 2 * i))
        self.down = nn.Parameter(torch.empty(e, i, h))
        self.down_bias = nn.Parameter(torch.empty(e, h))
        self.alpha, self.limit = cfg.swiglu_alpha, cfg.swiglu_limit

    def forward(self, tokens, counts, weight_queue=None):
        dtype = autocast_dtype(tokens)  # under autocast the grouped GEMM is not cast for us
        h = kernels.expert_bias_add(expert_mm(tokens, self, "gate_up", counts, dtype, weight_queue), self.gate_up_bias, counts)
        out = activation_mm(h, self, counts, dtype, weight_queue, clamp=(self.alpha, self.limit))
        return kernels.expert_bias_add(out, self.down_bias, counts)


class Router(nn.Module):
    def __init__(self, cfg: GptOssConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.num_local_experts, cfg.hidden_size))
        self.bias = nn.Parameter(torch.empty(cfg.num_local_experts))
        self.topk, self.num_experts = cfg.num_experts_per_tok, cfg.num_local_experts

    def forward(self, x) -> RoutingInfo:
        # Routing is sensitive to rounding (bf16 logits tie and flip experts): this small GEMM stays fp32.
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.float(), self.weight.float(), self.bias.float())
        ids = kernels.topk_ids(logits, self.topk)
        top = logits.gather(1, ids)
        # Combine weights: softmax over the chosen k only. `scores` (all experts) feed the balance loss.
        return RoutingInfo(ids, top.softmax(-1), logits.softmax(-1), self.num_experts)


class MoE(nn.Module):
    def __init__(self, cfg: GptOssConfig):
        super().__init__()
        self.router = Router(cfg)
        self.experts = Experts(cfg)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: GptOssConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_id)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoE(cfg)

    def stage1(self, x, attn: AttnInputs) -> Stage1Out:
        h = x + self.self_attn(self.input_layernorm(x), attn)
        normed = self.post_attention_layernorm(h)
        return Stage1Out(h, expert_tokens(normed), None, self.mlp.router(normed.flatten(0, 1)))

    def stage3(self, tokens, counts, weight_queue=None):
        return self.mlp.experts(tokens, counts, weight_queue)

    def stage5(self, s1: Stage1Out, combined):
        return kernels.weighted_combine(combined.rows, combined.index, s1.routing.topk_weights, s1.residual)


class GptOssModel(nn.Module):
    """A contiguous run of layers; the full model by default. `layer_ids`/`embed`/`head` select
    a pipeline chunk; layers keep their global ids as names so checkpoints do not depend on it."""

    head_fp8 = False  # the LM head in FP8 (train.fp8_head; set by ops/fp8.enable_fp8)

    def __init__(self, cfg: GptOssConfig, layer_ids=None, embed: bool = True, head: bool = True):
        super().__init__()
        self.cfg = cfg
        layer_ids = range(cfg.num_hidden_layers) if layer_ids is None else layer_ids
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size) if embed else None
        self.layers = nn.ModuleDict({str(i): DecoderLayer(cfg, i) for i in layer_ids})
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if head else None
        # With tied embeddings the head reads embed_tokens.weight (a pipeline puts both on one rank).
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False) if head and not cfg.tie_word_embeddings else None
        rope = cfg.rope_parameters
        inv_freq, self.rope_scale = rope_inv_freq(rope["rope_theta"], cfg.head_dim, None if rope["rope_type"] == "default" else rope)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """protocol.init_by_name with initializer_range (seeded per parameter name; the sinks are drawn too)."""
        init_by_name(self, seed, self.cfg.initializer_range)

    def correction_biases(self) -> dict:
        """No aux-loss-free routing bias in this family (see deepseek_v2.py)."""
        return {}

    def head_weight(self):
        return self.lm_head.weight if self.lm_head is not None else self.embed_tokens.weight

    def attn_inputs(self, position_ids, doc_ids, dtype, cp: ContextParallel | None = None) -> AttnInputs:
        cos, sin = rope_cos_sin(position_ids, self.inv_freq, self.rope_scale, dtype=dtype)
        if cp is not None:  # the ring masks by global token index, the window and cp's document ids
            return AttnInputs(cos, sin, None, None, cp)
        if attention.use_flash(cos):
            return AttnInputs(cos, sin, None, None, flash=True, doc_ids=doc_ids)
        s, device = position_ids.shape[1], position_ids.device
        if (full := attention_mask(doc_ids, s, device)) is None:  # sink attention always takes an explicit mask
            full = torch.ones(s, s, dtype=torch.bool, device=device).tril()[None, None]
        sliding = any(layer.self_attn.sliding for layer in self.layers.values())
        return AttnInputs(cos, sin, full, attention_mask(doc_ids, s, device, self.cfg.sliding_window) if sliding else None)

    def forward(self, x, position_ids, engine, doc_ids=None, cp: ContextParallel | None = None):
        """x: token ids [B, S] if this chunk embeds, else hidden states [B, S, H]. Returns logits
        [B, S, V] if this chunk holds the head, else hidden states. With `cp`, the inputs are this
        rank's zigzag share of the sequence (parallel/context.py)."""
        if self.embed_tokens is not None:
            x = self.embed_tokens(x)
        attn = self.attn_inputs(position_ids, doc_ids, x.dtype, cp)
        for layer in self.layers.values():
            x = run_layer(layer, x, attn, engine)
        if self.norm is not None:
            x = head_logits(self.norm(x), self.head_weight(), self.head_fp8)
        return x

    @torch.no_grad()
    def reference_forward(self, input_ids, position_ids=None, doc_ids=None):
        """Plain oracle: RoPE as a complex rotation, sinks through log-sum-exp, an explicit mask,
        a loop over experts."""
        cfg = self.cfg
        b, s = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(s).expand(b, s)
        x = self.embed_tokens(input_ids)
        angles = position_ids[..., None].double() * self.inv_freq.double()  # [B, S, D/2]
        rotation = torch.polar(torch.full_like(angles, self.rope_scale), angles)[:, None]

        def rope(t):  # (first half, second half) as (real, imaginary), rotated and scaled
            half = t.shape[-1] // 2
            z = torch.complex(t[..., :half].double(), t[..., half:].double()) * rotation
            return torch.cat([z.real, z.imag], -1).to(t.dtype)

        i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
        causal = (j <= i).expand(b, s, s)
        if doc_ids is not None:
            causal = causal & (doc_ids[:, :, None] == doc_ids[:, None, :])
        windowed, inter = causal & (i - j < (cfg.sliding_window or s)), cfg.intermediate_size
        for layer in self.layers.values():
            a, hn = layer.self_attn, layer.input_layernorm(x)
            q, k, v = (p(hn).view(b, s, -1, a.head_dim).transpose(1, 2) for p in (a.q_proj, a.k_proj, a.v_proj))
            q, k = rope(q), rope(k)
            rep = a.heads // a.kv_heads
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            scores = torch.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(a.head_dim)
            scores = scores.masked_fill(~(windowed if a.sliding else causal)[:, None], float("-inf"))
            # The sink joins the normaliser only: p = exp(score - log(sum exp(scores) + exp(sink))).
            lse = torch.logaddexp(torch.logsumexp(scores, -1, keepdim=True), a.sinks.view(1, -1, 1, 1))
            x = x + a.o_proj(torch.einsum("bhqk,bhkd->bqhd", torch.exp(scores - lse), v).reshape(b, s, -1))
            flat = layer.post_attention_layernorm(x).reshape(-1, cfg.hidden_size)
            top, ids = (flat @ layer.mlp.router.weight.T + layer.mlp.router.bias).topk(cfg.num_experts_per_tok, -1)
            w = torch.exp(top - torch.logsumexp(top, -1, keepdim=True))
            moe, ex = torch.zeros_like(flat), layer.mlp.experts
            for e in range(cfg.num_local_experts):
                tok, slot = (ids == e).nonzero(as_tuple=True)
                if not tok.numel():
                    continue
                g = flat[tok] @ ex.gate_up[e, :, :inter] + ex.gate_up_bias[e, :inter]
                u = flat[tok] @ ex.gate_up[e, :, inter:] + ex.gate_up_bias[e, inter:]
                g, u = g.clamp(max=cfg.swiglu_limit), u.clamp(-cfg.swiglu_limit, cfg.swiglu_limit)
                act = (u + 1) * g / (1 + torch.exp(-cfg.swiglu_alpha * g))
                moe.index_add_(0, tok, (act @ ex.down[e] + ex.down_bias[e]) * w[tok, slot, None])
            x = x + moe.view_as(x)
        return head_logits(self.norm(x), self.head_weight())

    # ---- Hugging Face conversion (gate then up here <-> interleaved in HF; MXFP4 on import) ----

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        out = {hf_name(name): t for name, t in self.state_dict().items() if ".mlp.experts." not in name}
        for lid, layer in self.layers.items():
            ex, pre = layer.mlp.experts, f"model.layers.{lid}.mlp.experts."
            out[pre + "gate_up_proj"] = _interleave(ex.gate_up.detach())
            out[pre + "gate_up_proj_bias"] = _interleave(ex.gate_up_bias.detach())
            out[pre + "down_proj"] = ex.down.detach()
            out[pre + "down_proj_bias"] = ex.down_bias.detach()
        return out

    @torch.no_grad()
    def load_hf_state_dict(self, hf: dict[str, torch.Tensor]) -> None:
        """Load HF tensors (plain or MXFP4 `*_blocks`/`*_scales` experts); raises naming any missing or
        unexpected key or mismatched shape."""
        used = set()

        def take(key):  # any shape: an expert tensor's is checked once converted
            return hf_tensor(hf, key, hf[key].shape if key in hf else (), used)

        def put(param, key, convert=lambda v: v):  # plain [E, in, out], or MXFP4 blocks [E, out, G, 16] and scales
            plain = key in hf or key + "_blocks" not in hf
            value = take(key) if plain else dequantize_mxfp4(take(key + "_blocks"), take(key + "_scales")).transpose(1, 2)
            param.copy_(hf_tensor({key: convert(value)}, key, param.shape, set()))  # names the key on another shape

        for name, t in self.state_dict().items():
            if ".mlp.experts." not in name:
                t.copy_(hf_tensor(hf, hf_name(name), t.shape, used))
        for lid, layer in self.layers.items():
            ex, pre = layer.mlp.experts, f"model.layers.{lid}.mlp.experts."
            put(ex.gate_up, pre + "gate_up_proj", _deinterleave)
            put(ex.gate_up_bias, pre + "gate_up_proj_bias", _deinterleave)
            put(ex.down, pre + "down_proj")
            put(ex.down_bias, pre + "down_proj_bias")
        check_hf_leftovers(self, hf, used)
