"""Qwen3.5-MoE: the hybrid family (Gated DeltaNet linear attention + gated full attention) over a MoE with a shared
expert: config (HF `config.json` schema), the 5-stage decoder layer, the model, HF conversion.

HF `model_type` `qwen3_5_moe_text` (what `Qwen3_5MoeForCausalLM` saves) and `qwen3_5_moe` (the released multimodal
checkpoints: their `text_config` and the language model's weights; the vision tower and the MTP weights are left out).
`layer_types` says which layers are "linear_attention" (Gated DeltaNet) and which "full_attention"; every layer is MoE.

- Gated DeltaNet: in_proj_qkv -> short causal depthwise conv + SiLU -> q, k (L2-normed), v;
  beta = sigmoid(in_proj_b), decay g = -exp(A_log) * softplus(in_proj_a + dt_bias); the gated delta
  rule (ops/delta_rule.py); an RMSNorm of each head gated by silu(in_proj_z); out_proj. Packed
  documents reset the recurrent state and the conv window. Under context parallelism each rank
  gathers the whole sequence's projections and runs the recurrence over all of it (exact; the
  recurrence's compute is repeated cp times: parallel/context.gather_sequence).
- Full attention: q_proj gives each head's query and an output gate (sigmoid), QK-norm, partial
  rotary embedding (the first `partial_rotary_factor` of each head's dims).
- RMSNorms are zero-centred (scale 1 + weight, weights initialised to 0), except the gated norm.
- MoE: softmax router, top-k renormalised; a shared expert whose output is scaled by
  sigmoid(shared_expert_gate(x)), added in stage 5."""

from __future__ import annotations

import math
import sys
import zlib
from dataclasses import asdict, dataclass
from typing import ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from pithtrain.config import ConfigError, check, check_positive, hf_values
from pithtrain.protocol import RoutingInfo, Stage1Out, hf_state, init_by_name, load_hf_state, run_layer
from pithtrain.ops.core import apply_rope, attention, attention_mask, autocast_dtype, expert_tokens, rope_cos_sin
from pithtrain.ops.delta_rule import causal_conv1d, doc_cu_seqlens, gated_delta_rule, gated_delta_rule_recurrent, l2norm
from pithtrain.ops.kernels import topk_ids, weighted_combine  # Triton on GPUs, the reference elsewhere
from pithtrain.ops.fp8 import Linear, projections  # nn.Linear, with its GEMMs in FP8 under train.fp8
from pithtrain.ops.grouped_gemm import Embedding, activation_mm, expert_mm, head_logits
from pithtrain.parallel.context import ContextParallel, context_attention, gather_sequence, gathered_doc_ids, zigzag_split

LAYER_TYPES = ("linear_attention", "full_attention")


@dataclass
class Qwen3_5MoeConfig:
    vocab_size: int = 248320
    hidden_size: int = 2048
    num_hidden_layers: int = 40
    layer_types: list[str] | None = None  # None: every full_attention_interval-th layer full, the rest linear
    full_attention_interval: int = 4
    # full attention
    num_attention_heads: int = 16
    num_key_value_heads: int = 2
    head_dim: int = 256
    partial_rotary_factor: float = 0.25  # share of each head's dims that RoPE rotates
    rope_theta: float = 10_000_000.0
    attention_bias: bool = False
    # Gated DeltaNet
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    # MoE
    num_experts: int = 256
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 262144
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    model_type: ClassVar[str] = "qwen3_5_moe_text"
    num_nextn_predict_layers: ClassVar[int] = 0  # no multi-token prediction (DeepSeek-V3's)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def layer_type(self, layer_id: int) -> str:
        return (self.layer_types[layer_id] if self.layer_types is not None
                else "full_attention" if (layer_id + 1) % self.full_attention_interval == 0 else "linear_attention")

    def is_moe_layer(self, layer_id: int) -> bool:
        return True

    def num_routed_experts(self) -> int:
        return self.num_experts

    def validate(self) -> None:
        check_positive(self, "vocab_size hidden_size num_hidden_layers full_attention_interval num_attention_heads "
                             "num_key_value_heads head_dim rope_theta linear_num_key_heads linear_num_value_heads "
                             "linear_key_head_dim linear_value_head_dim linear_conv_kernel_dim num_experts "
                             "moe_intermediate_size shared_expert_intermediate_size rms_norm_eps max_position_embeddings")
        if self.layer_types is not None:
            check(len(self.layer_types) == self.num_hidden_layers,
                  f"model.layer_types has {len(self.layer_types)} entries, model.num_hidden_layers="
                  f"{self.num_hidden_layers}; give one per layer (or None for every "
                  f"{self.full_attention_interval}th layer full)")
            bad = sorted({t for t in self.layer_types if t not in LAYER_TYPES})
            check(not bad, f"model.layer_types has unknown types {bad}; each entry must be one of {list(LAYER_TYPES)}")
        check(self.num_attention_heads % self.num_key_value_heads == 0,
              f"model.num_attention_heads={self.num_attention_heads} is not divisible by model.num_key_value_heads="
              f"{self.num_key_value_heads}; choose a divisor of the query heads")
        check(self.linear_num_value_heads % self.linear_num_key_heads == 0,
              f"model.linear_num_value_heads={self.linear_num_value_heads} is not divisible by "
              f"model.linear_num_key_heads={self.linear_num_key_heads}; each key head serves a whole group of value heads")
        check(0 < self.partial_rotary_factor <= 1 and self.rotary_dim % 2 == 0 and self.rotary_dim > 0,
              f"model.partial_rotary_factor={self.partial_rotary_factor}: must be in (0, 1] and give an even, non-zero "
              f"number of rotated dims of head_dim={self.head_dim} (it gives {self.rotary_dim})")
        check(self.hidden_act == "silu", f"model.hidden_act={self.hidden_act!r}: only 'silu' is supported")
        check(1 <= self.num_experts_per_tok <= self.num_experts,
              f"model.num_experts_per_tok={self.num_experts_per_tok} must be in [1, num_experts={self.num_experts}]")

    @classmethod
    def from_hf(cls, hf: dict) -> "Qwen3_5MoeConfig":
        if hf.get("model_type") == "qwen3_5_moe":  # the released multimodal checkpoints
            check(isinstance(hf.get("text_config"), dict),
                  "model_type 'qwen3_5_moe' without a text_config: not a Qwen3.5-MoE checkpoint's config.json")
            print("qwen3_5_moe: a multimodal checkpoint; its language model (text_config) is used, "
                  "the vision tower and MTP weights are left out", file=sys.stderr)
            hf = {**hf["text_config"], "tie_word_embeddings": hf.get("tie_word_embeddings", False)}  # transformers' tying
        elif "text_config" in hf or "vision_config" in hf:
            raise ConfigError(f"model_type {hf.get('model_type')!r} with a text_config/vision_config is a multimodal "
                              f"config; set model_type to 'qwen3_5_moe' (or give the text_config alone)")
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        kind = rope.get("rope_type", rope.get("type", "default"))  # "type": the older rope_scaling spelling
        check(kind in ("default", None), f"qwen3_5_moe: rope_type {kind!r} is not supported (only default RoPE)")
        values = {"rope_theta": 10000.0, "max_position_embeddings": 32768, **hf_values(cls, hf)}  # transformers' defaults
        for key in ("rope_theta", "partial_rotary_factor"):  # text positions: mrope's sections all equal plain RoPE
            if key in rope:
                values[key] = rope[key]
        return cls(**values)

    def transformers_ignores(self) -> list[str]:  # hf.convert warns: transformers' masks come from a full layer
        full = any(self.layer_type(i) == "full_attention" for i in range(self.num_hidden_layers))
        return [] if full else ["a model without full_attention layers"]

    def to_hf(self) -> dict:
        out = asdict(self)
        out["layer_types"] = [self.layer_type(i) for i in range(self.num_hidden_layers)]
        del out["rope_theta"], out["partial_rotary_factor"], out["full_attention_interval"]  # layer_types says it (HF's own)
        out["rope_parameters"] = {"rope_type": "default", "rope_theta": self.rope_theta,
                                  "partial_rotary_factor": self.partial_rotary_factor}
        out.update(model_type=self.model_type, architectures=["Qwen3_5MoeForCausalLM"], dtype="float32")
        return out

    def build_model(self, layer_ids=None, embed: bool = True, head: bool = True) -> "Qwen3_5MoeModel":
        self.validate()  # a config edited after its run file was read: its field named, not torch's error in forward
        return Qwen3_5MoeModel(self, layer_ids, embed, head)


class AttnInputs(NamedTuple):
    cos: torch.Tensor  # [B, S, rotary_dim]
    sin: torch.Tensor
    mask: torch.Tensor | None  # full attention; None: plain causal
    doc_ids: torch.Tensor | None  # [B, S] packed documents: the linear layers reset their state at each
    cp: ContextParallel | None = None  # context parallel: ring attention / the gathered recurrence
    cu_seqlens: torch.Tensor | None = None  # doc_ids as FLA's varlen offsets (CUDA), found once per micro-batch


class ZeroCenteredRMSNorm(nn.Module):
    """RMSNorm with scale (1 + weight), normalised and scaled in fp32, then cast (HF's order)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.zeros(dim)), eps

    def forward(self, x):
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """Per-head RMSNorm of the delta rule's output, times silu(gate)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x, gate):
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x32.to(x.dtype) * F.silu(gate.float())).to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Partial RoPE (rotate-half layout) on the first cos.shape[-1] dims of x [B, heads, S, D]."""
    rot = cos.shape[-1]
    return torch.cat((apply_rope(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)


class GatedAttention(nn.Module):
    def __init__(self, cfg: Qwen3_5MoeConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = Linear(cfg.hidden_size, 2 * self.heads * self.head_dim, bias=bias)  # query and gate, per head
        self.k_proj = Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = Linear(self.heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = ZeroCenteredRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(self.head_dim, cfg.rms_norm_eps)

    def qkv_gate(self, x, cos, sin):
        b, s, _ = x.shape
        q_gate, k, v = projections(x, self.q_proj, self.k_proj, self.v_proj)
        q, gate = q_gate.view(b, s, self.heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q).transpose(1, 2)
        k = self.k_norm(k.view(b, s, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = v.view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        return rotate(q, cos, sin), rotate(k, cos, sin), v, gate.reshape(b, s, -1)

    def forward(self, x, attn: AttnInputs):
        q, k, v, gate = self.qkv_gate(x, attn.cos, attn.sin)
        out = (attention(q, k, v, attn.mask, self.head_dim**-0.5) if attn.cp is None
               else context_attention(q, k, v, self.head_dim**-0.5, attn.cp))
        return self.o_proj(out * torch.sigmoid(gate))


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: Qwen3_5MoeConfig):
        super().__init__()
        self.k_heads, self.v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.k_dim, self.v_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_size, self.value_size = self.k_heads * self.k_dim, self.v_heads * self.v_dim
        channels = 2 * self.key_size + self.value_size
        self.in_proj_qkv = Linear(cfg.hidden_size, channels, bias=False)
        self.in_proj_z = Linear(cfg.hidden_size, self.value_size, bias=False)
        self.in_proj_b = nn.Linear(cfg.hidden_size, self.v_heads, bias=False)  # too narrow to gain from FP8
        self.in_proj_a = nn.Linear(cfg.hidden_size, self.v_heads, bias=False)
        self.conv1d = nn.Conv1d(channels, channels, cfg.linear_conv_kernel_dim, groups=channels, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.v_heads))
        self.norm = GatedRMSNorm(self.v_dim, cfg.rms_norm_eps)
        self.out_proj = Linear(self.value_size, cfg.hidden_size, bias=False)

    def split_heads(self, mixed, a):
        """q, k [B, S, Hk, Dk] (L2-normed; each key head serves Hv / Hk consecutive value heads, which
        the op expands, FLA natively), v [B, S, Hv, Dv], and the decay g [B, S, Hv] (fp32) from the
        conv output `mixed` and the a-projection."""
        b, s, _ = mixed.shape
        q, k, v = mixed.split([self.key_size, self.key_size, self.value_size], dim=-1)
        q, k = (l2norm(t.reshape(b, s, self.k_heads, self.k_dim).float()) for t in (q, k))
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        return q, k, v.reshape(b, s, self.v_heads, self.v_dim), g

    def forward(self, x, attn: AttnInputs):
        b, s, _ = x.shape
        qkv, beta_in, a = projections(x, self.in_proj_qkv, self.in_proj_b, self.in_proj_a)  # not z: kept for the
        # norm's backward, it would keep the whole product alive (the conv and the gates keep their own copies)
        doc_ids = attn.doc_ids
        if attn.cp is not None:  # the recurrence needs every earlier token: run it over the whole sequence
            both = gather_sequence(torch.cat([qkv, beta_in.to(qkv.dtype), a.to(qkv.dtype)], -1), attn.cp)
            qkv, beta_in, a = both.split([qkv.shape[-1], self.v_heads, self.v_heads], dim=-1)
            doc_ids = gathered_doc_ids(attn.cp)
        q, k, v, g = self.split_heads(causal_conv1d(qkv, self.conv1d.weight.squeeze(1), doc_ids), a)
        out = gated_delta_rule(q, k, v, g, torch.sigmoid(beta_in.float()), doc_ids, cu_seqlens=attn.cu_seqlens)
        if attn.cp is not None:
            out = zigzag_split(out, attn.cp.cp, attn.cp.rank)
        z = self.in_proj_z(x).view(b, s, self.v_heads, self.v_dim)
        return self.out_proj(self.norm(out, z).reshape(b, s, self.value_size))


class DenseMLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = Linear(hidden, inter, bias=False)
        self.up_proj = Linear(hidden, inter, bias=False)
        self.down_proj = Linear(inter, hidden, bias=False)

    def forward(self, x):
        gate, up = projections(x, self.gate_proj, self.up_proj)
        return self.down_proj(F.silu(gate) * up)


class Experts(nn.Module):
    """Stacked expert weights: gate_up [E, H, 2I] (gate then up), down [E, I, H]."""

    fp8 = False  # train.fp8: expert_mm runs the grouped GEMMs in FP8 (ops/fp8.py)

    def __init__(self, num_experts: int, hidden: int, inter: int):
        super().__init__()
        self.gate_up = nn.Parameter(torch.empty(num_experts, hidden, 2 * inter))
        self.down = nn.Parameter(torch.empty(num_experts, inter, hidden))

    def forward(self, tokens, counts, weight_queue=None):
        dtype = autocast_dtype(tokens)  # under autocast the grouped GEMM is not cast for us
        h = expert_mm(tokens, self, "gate_up", counts, dtype, weight_queue)
        return activation_mm(h, self, counts, dtype, weight_queue)


class Router(nn.Module):
    def __init__(self, cfg: Qwen3_5MoeConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        self.topk, self.num_experts = cfg.num_experts_per_tok, cfg.num_experts

    def forward(self, x) -> RoutingInfo:
        probs = torch.softmax(F.linear(x, self.weight).float(), dim=-1)
        ids = topk_ids(probs, self.topk)
        weights = probs.gather(1, ids)
        return RoutingInfo(ids, weights / weights.sum(-1, keepdim=True), probs, self.num_experts)


class MoE(nn.Module):
    def __init__(self, cfg: Qwen3_5MoeConfig):
        super().__init__()
        self.gate = Router(cfg)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_expert = DenseMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def shared(self, x):
        return torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen3_5MoeConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.is_linear = cfg.layer_type(layer_id) == "linear_attention"
        self.input_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(cfg)
        else:
            self.self_attn = GatedAttention(cfg)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoE(cfg)

    def stage1(self, x, attn: AttnInputs) -> Stage1Out:
        h = x + (self.linear_attn if self.is_linear else self.self_attn)(self.input_layernorm(x), attn)
        normed = self.post_attention_layernorm(h)
        tokens = normed.flatten(0, 1)
        return Stage1Out(h, expert_tokens(normed), self.mlp.shared(tokens), self.mlp.gate(tokens))

    def stage3(self, tokens, counts, weight_queue=None):
        return self.mlp.experts(tokens, counts, weight_queue)

    def stage5(self, s1: Stage1Out, combined):
        addend = s1.residual + s1.shared.view_as(s1.residual).to(s1.residual.dtype)  # the shared expert's output
        return weighted_combine(combined.rows, combined.index, s1.routing.topk_weights, addend)


class Qwen3_5MoeModel(nn.Module):
    """A contiguous run of layers; the full model by default. `layer_ids`/`embed`/`head` select
    a pipeline chunk; layers keep their global ids as names so checkpoints do not depend on it."""

    head_fp8 = False  # the LM head in FP8 (train.fp8_head; set by ops/fp8.enable_fp8)

    def __init__(self, cfg: Qwen3_5MoeConfig, layer_ids=None, embed: bool = True, head: bool = True):
        super().__init__()
        self.cfg = cfg
        layer_ids = range(cfg.num_hidden_layers) if layer_ids is None else layer_ids
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size) if embed else None
        self.layers = nn.ModuleDict({str(i): DecoderLayer(cfg, i) for i in layer_ids})
        self.norm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if head else None
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False) if head and not cfg.tie_word_embeddings else None
        rot = cfg.rotary_dim
        self.register_buffer("inv_freq", 1.0 / cfg.rope_theta ** (torch.arange(0, rot, 2).double() / rot), persistent=False)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Normal(0, initializer_range) for matrices (seeded per parameter name, so every pipeline
        chunk or shard draws the same values), zeros for the zero-centred norms, ones for the gated
        norm and dt_bias, and A = exp(A_log) drawn uniformly from [1, 16] per value head (as HF
        initialises it: decay rates spread over an order of magnitude)."""
        init_by_name(self, seed, self.cfg.initializer_range)
        for name, m in self.named_modules():
            if isinstance(m, ZeroCenteredRMSNorm):
                m.weight.zero_()
            elif isinstance(m, GatedDeltaNet):
                m.dt_bias.fill_(1.0)
                gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(f"{name}.A_log".encode()))
                m.A_log.copy_(torch.empty(m.v_heads).uniform_(1.0, 16.0, generator=gen).log())

    def correction_biases(self) -> dict:
        """No aux-loss-free routing bias in this family (see deepseek_v2.py)."""
        return {}

    def head_weight(self):
        return self.lm_head.weight if self.lm_head is not None else self.embed_tokens.weight

    def attn_inputs(self, position_ids, doc_ids, dtype, cp: ContextParallel | None = None) -> AttnInputs:
        cos, sin = rope_cos_sin(position_ids, self.inv_freq, dtype=dtype)
        if cp is not None:  # the ring masks by global token index and cp's document ids
            return AttnInputs(cos, sin, None, None, cp)
        mask = attention_mask(doc_ids, position_ids.shape[1], position_ids.device)
        # FLA's kernels take documents as varlen offsets: one host sync here, not one per linear layer
        cu_seqlens = doc_cu_seqlens(doc_ids) if doc_ids is not None and doc_ids.is_cuda else None
        return AttnInputs(cos, sin, mask, doc_ids, None, cu_seqlens)

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
        """Plain oracle: eager softmax attention with an explicit mask; the Gated DeltaNet token by token (the
        recurrence, not the chunked form) with F.conv1d, each document run on its own; a loop over experts."""
        cfg = self.cfg
        b, s = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(s).expand(b, s)
        if doc_ids is None:
            doc_ids = torch.zeros(b, s, dtype=torch.long)
        x, freqs = self.embed_tokens(input_ids), position_ids[..., None].double() * self.inv_freq.double()
        cos, sin = torch.cat([freqs, freqs], -1).cos().to(x.dtype), torch.cat([freqs, freqs], -1).sin().to(x.dtype)
        pos = torch.arange(s)
        allowed = (pos[None, :] <= pos[:, None]) & (doc_ids[:, :, None] == doc_ids[:, None, :])
        for layer in self.layers.values():
            h = layer.input_layernorm(x)
            if layer.is_linear:
                mixed = self._reference_delta_net(layer.linear_attn, h, doc_ids)
            else:
                a = layer.self_attn
                q, k, v, gate = a.qkv_gate(h, cos, sin)
                rep = a.heads // a.kv_heads
                k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
                scores = (q @ k.transpose(-1, -2)) / math.sqrt(a.head_dim)
                scores = scores.masked_fill(~allowed[:, None], float("-inf"))
                out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, -1)
                mixed = a.o_proj(out * torch.sigmoid(gate))
            x = x + mixed
            flat = layer.post_attention_layernorm(x).reshape(-1, cfg.hidden_size)
            w, ids = torch.softmax(flat @ layer.mlp.gate.weight.T, -1).topk(cfg.num_experts_per_tok, -1)
            w = w / w.sum(-1, keepdim=True)
            m = layer.mlp.shared_expert  # spelled out: the model's DenseMLP stacks gate and up in one GEMM
            moe = torch.sigmoid(flat @ layer.mlp.shared_expert_gate.weight.T) * m.down_proj(F.silu(m.gate_proj(flat)) * m.up_proj(flat))
            ex = layer.mlp.experts
            for e in range(cfg.num_experts):
                tok, slot = (ids == e).nonzero(as_tuple=True)
                if tok.numel():
                    g, u = (flat[tok] @ ex.gate_up[e]).chunk(2, -1)
                    moe.index_add_(0, tok, ((F.silu(g) * u) @ ex.down[e]) * w[tok, slot, None])
            x = x + moe.view_as(x)
        return head_logits(self.norm(x), self.head_weight())

    @staticmethod
    def _reference_delta_net(net: GatedDeltaNet, h, doc_ids):
        b, s, _ = h.shape
        out = torch.empty(b, s, net.v_heads, net.v_dim, dtype=h.dtype)
        qkv, beta, a = net.in_proj_qkv(h), torch.sigmoid(net.in_proj_b(h).float()), net.in_proj_a(h)
        width = net.conv1d.weight.shape[-1]
        for row in range(b):
            starts = [0] + [t for t in range(1, s) if doc_ids[row, t] != doc_ids[row, t - 1]] + [s]
            for lo, hi in zip(starts[:-1], starts[1:]):  # each document alone: no state or conv window crosses
                seg = qkv[row:row + 1, lo:hi].transpose(1, 2)
                conv = F.conv1d(seg, net.conv1d.weight, padding=width - 1, groups=seg.shape[1])[..., :hi - lo]
                q, k, v, g = net.split_heads(F.silu(conv).transpose(1, 2), a[row:row + 1, lo:hi])
                out[row:row + 1, lo:hi] = gated_delta_rule_recurrent(q, k, v, g, beta[row:row + 1, lo:hi])
        z = net.in_proj_z(h).view(b, s, net.v_heads, net.v_dim)
        return net.out_proj(net.norm(out, z).reshape(b, s, -1))

    # ---- Hugging Face conversion (this model's names <-> HF's per-expert names) ----

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        return hf_state(self)

    def load_hf_state_dict(self, hf: dict[str, torch.Tensor]) -> None:
        """Load HF tensors (per-expert or fused expert layout; a multimodal checkpoint's language model
        under `model.language_model.`, its vision tower and MTP weights ignored); raises naming any
        missing or unexpected key."""
        hf = {k.replace("model.language_model.", "model.", 1): v for k, v in hf.items()  # mtp.*: text layouts' too
              if not k.startswith(("model.visual.", "mtp."))}  # (transformers ignores them in both)
        load_hf_state(self, hf)
