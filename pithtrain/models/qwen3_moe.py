"""Qwen3-MoE: config (HF `config.json` schema), the 5-stage decoder layer, the model, HF conversion.

Self-contained on purpose: GQA attention with per-head q/k RMSNorm and RoPE, a softmax top-k router (optionally
renormalised over the chosen k), experts as stacked weights run by a grouped GEMM, and dense MLP layers where
`mlp_only_layers` / `decoder_sparse_step` say so. `reference_forward` is a plain, independent implementation (eager
attention, a loop over experts) used as the oracle in tests."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from pithtrain.config import check, check_positive, hf_values
from pithtrain.protocol import RoutingInfo, Stage1Out, hf_state, init_by_name, load_hf_state, run_layer
from pithtrain.ops import attention as flash  # Triton flash attention for packed documents (CUDA)
from pithtrain.ops.core import attention, attention_mask, autocast_dtype, expert_tokens, rms_norm, rope_cos_sin
from pithtrain.ops.kernels import qk_norm_rope, qk_norm_rope_reference, topk_ids, weighted_combine  # Triton on GPUs
from pithtrain.ops.fp8 import Linear, projections, stacked_projections  # nn.Linear, with its GEMMs in FP8 under train.fp8
from pithtrain.ops.grouped_gemm import Embedding, activation_mm, expert_mm, head_logits
from pithtrain.parallel.context import ContextParallel, context_attention


@dataclass
class Qwen3MoeConfig:
    vocab_size: int = 151936
    hidden_size: int = 2048
    intermediate_size: int = 6144  # dense-MLP layers
    moe_intermediate_size: int = 768  # each expert
    num_hidden_layers: int = 48
    num_attention_heads: int = 32
    num_key_value_heads: int = 4
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    num_experts: int = 128
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    model_type: ClassVar[str] = "qwen3_moe"
    num_nextn_predict_layers: ClassVar[int] = 0  # no multi-token prediction (DeepSeek-V3's)

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    def is_moe_layer(self, layer_id: int) -> bool:
        return (self.num_experts > 0 and layer_id not in self.mlp_only_layers
                and (layer_id + 1) % self.decoder_sparse_step == 0)

    def num_routed_experts(self) -> int:
        return self.num_experts

    def validate(self) -> None:
        check_positive(self, "vocab_size hidden_size intermediate_size moe_intermediate_size num_hidden_layers "
                             "num_attention_heads num_key_value_heads head_dim rms_norm_eps rope_theta max_position_embeddings")
        check(self.num_experts >= 0, f"model.num_experts={self.num_experts}: must be >= 0 (0: dense)")
        check(self.num_attention_heads % self.num_key_value_heads == 0,
              f"model.num_attention_heads={self.num_attention_heads} is not divisible by model.num_key_value_heads="
              f"{self.num_key_value_heads}; choose a divisor of the query heads")
        check(self.head_dim is not None or self.hidden_size % self.num_attention_heads == 0,
              f"model.hidden_size={self.hidden_size} is not divisible by model.num_attention_heads="
              f"{self.num_attention_heads}; set model.head_dim explicitly or change the sizes")
        check(self.dim_per_head % 2 == 0, f"model head dim {self.dim_per_head} must be even for RoPE")
        check(self.hidden_act == "silu", f"model.hidden_act={self.hidden_act!r}: only 'silu' is supported")
        check(self.decoder_sparse_step >= 1, "model.decoder_sparse_step must be at least 1")
        check(self.num_experts == 0 or 1 <= self.num_experts_per_tok <= self.num_experts,
              f"model.num_experts_per_tok={self.num_experts_per_tok} must be in [1, num_experts={self.num_experts}]")
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        check(not bad, f"model.mlp_only_layers has layer ids {bad} outside [0, {self.num_hidden_layers})")

    @classmethod
    def from_hf(cls, hf: dict) -> "Qwen3MoeConfig":
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        kind = rope.get("rope_type", rope.get("type", "default"))  # transformers 4 files spell it `type`
        key = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
        check(kind in ("default", None), f"model.{key} rope_type={kind!r} is not supported by PithTrain's qwen3_moe "
              "(only default RoPE); make it {'rope_type': 'default', 'rope_theta': ...} to train at the original context")
        check(not (hf.get("use_sliding_window") and hf.get("sliding_window")),
              f"model.use_sliding_window=True (sliding_window={hf.get('sliding_window')}) is not supported by "
              "PithTrain's qwen3_moe (full causal attention only); set use_sliding_window false")
        values = {"norm_topk_prob": False, "rope_theta": 10000.0, "max_position_embeddings": 32768,  # transformers' defaults
                  **hf_values(cls, hf)}
        if "num_experts" not in values and hf.get("num_local_experts") is not None:
            values["num_experts"] = hf["num_local_experts"]  # transformers 5 writes this alias
        if "rope_theta" in rope:
            values["rope_theta"] = rope["rope_theta"]
        return cls(**values)

    def to_hf(self) -> dict:
        rope = {"rope_type": "default", "rope_theta": self.rope_theta}
        return asdict(self) | {"head_dim": self.dim_per_head, "rope_parameters": rope, "model_type": self.model_type,
                               "architectures": ["Qwen3MoeForCausalLM"], "dtype": "float32"}

    def build_model(self, layer_ids=None, embed: bool = True, head: bool = True) -> "Qwen3MoeModel":
        self.validate()  # a config edited after its run file was read: its field named, not torch's error in forward
        return Qwen3MoeModel(self, layer_ids, embed, head)


class AttnInputs(NamedTuple):
    cos: torch.Tensor  # [B, S, D]
    sin: torch.Tensor
    mask: torch.Tensor | None  # None: plain causal
    cp: ContextParallel | None = None  # context parallel: ring attention, masked from cp's global token indices
    doc_ids: torch.Tensor | None = None  # packed documents on CUDA: the Triton flash kernel, no mask


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: Qwen3MoeConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.dim_per_head
        bias = cfg.attention_bias
        self.q_proj = Linear(cfg.hidden_size, self.heads * self.head_dim, bias=bias)
        self.k_proj = Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = Linear(self.heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def qkv(self, x, cos, sin):
        norms = self.q_norm.weight, self.k_norm.weight
        stacked = stacked_projections(x, self.q_proj, self.k_proj, self.v_proj)
        if stacked is not None:  # one Triton pass each way on GPUs
            return qk_norm_rope(stacked, *norms, cos, sin, self.heads, self.kv_heads, self.q_norm.eps)
        return qk_norm_rope_reference(*projections(x, self.q_proj, self.k_proj, self.v_proj), *norms, cos, sin,
                                      self.q_norm.eps)

    def forward(self, x, attn: AttnInputs):
        q, k, v = self.qkv(x, attn.cos, attn.sin)
        if attn.cp is not None:
            return self.o_proj(context_attention(q, k, v, self.head_dim**-0.5, attn.cp))
        if attn.doc_ids is not None:
            return self.o_proj(flash.attention(q, k, v, self.head_dim**-0.5, doc_ids=attn.doc_ids))
        return self.o_proj(attention(q, k, v, attn.mask, self.head_dim**-0.5))


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
    def __init__(self, cfg: Qwen3MoeConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        self.topk, self.norm_topk_prob, self.num_experts = cfg.num_experts_per_tok, cfg.norm_topk_prob, cfg.num_experts

    def forward(self, x) -> RoutingInfo:
        probs = torch.softmax(F.linear(x, self.weight).float(), dim=-1)
        ids = topk_ids(probs, self.topk)
        weights = probs.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        return RoutingInfo(ids, weights, probs, self.num_experts)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen3MoeConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.is_moe = cfg.is_moe_layer(layer_id)
        self.mlp = MoE(cfg) if self.is_moe else DenseMLP(cfg.hidden_size, cfg.intermediate_size)

    def stage1(self, x, attn: AttnInputs) -> Stage1Out:
        h = x + self.self_attn(self.input_layernorm(x), attn)
        normed = self.post_attention_layernorm(h)
        if not self.is_moe:
            return Stage1Out(h + self.mlp(normed), None, None, None)
        return Stage1Out(h, expert_tokens(normed), None, self.mlp.gate(normed.flatten(0, 1)))

    def stage3(self, tokens, counts, weight_queue=None):
        return self.mlp.experts(tokens, counts, weight_queue)

    def stage5(self, s1: Stage1Out, combined):
        return weighted_combine(combined.rows, combined.index, s1.routing.topk_weights, s1.residual)


class MoE(nn.Module):
    def __init__(self, cfg: Qwen3MoeConfig):
        super().__init__()
        self.gate = Router(cfg)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)


class Qwen3MoeModel(nn.Module):
    """A contiguous run of layers; the full model by default. `layer_ids`/`embed`/`head` select
    a pipeline chunk; layers keep their global ids as names so checkpoints do not depend on it."""

    head_fp8 = False  # the LM head in FP8 (train.fp8_head; set by ops/fp8.enable_fp8)

    def __init__(self, cfg: Qwen3MoeConfig, layer_ids=None, embed: bool = True, head: bool = True):
        super().__init__()
        self.cfg = cfg
        layer_ids = range(cfg.num_hidden_layers) if layer_ids is None else layer_ids
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size) if embed else None
        self.layers = nn.ModuleDict({str(i): DecoderLayer(cfg, i) for i in layer_ids})
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if head else None
        # With tied embeddings the head reads embed_tokens.weight (a pipeline puts both on one rank).
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False) if head and not cfg.tie_word_embeddings else None
        hd = cfg.dim_per_head
        self.register_buffer("inv_freq", 1.0 / cfg.rope_theta ** (torch.arange(0, hd, 2).double() / hd), persistent=False)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """protocol.init_by_name with initializer_range (seeded per parameter name)."""
        init_by_name(self, seed, self.cfg.initializer_range)

    def correction_biases(self) -> dict:
        """No aux-loss-free routing bias in this family (see deepseek_v2.py)."""
        return {}

    def head_weight(self):
        return self.lm_head.weight if self.lm_head is not None else self.embed_tokens.weight

    def attn_inputs(self, position_ids, doc_ids, dtype, cp: ContextParallel | None = None) -> AttnInputs:
        cos, sin = rope_cos_sin(position_ids, self.inv_freq, dtype=dtype)
        if cp is not None:  # the ring masks by global token index and cp's document ids
            return AttnInputs(cos, sin, None, cp)
        # packed documents on CUDA: the flash kernel, 1.8x SDPA's masked kernel at S = 4096, 8 documents
        # (docs/performance.md); without documents SDPA's causal kernel is the faster
        if doc_ids is not None and flash.use_flash(position_ids) and self.cfg.dim_per_head in flash.HEAD_DIMS:
            return AttnInputs(cos, sin, None, doc_ids=doc_ids)
        return AttnInputs(cos, sin, attention_mask(doc_ids, position_ids.shape[1], position_ids.device))

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
        """Plain oracle: eager softmax attention with an explicit mask and a loop over experts."""
        cfg = self.cfg
        b, s = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(s).expand(b, s)
        x, freqs = self.embed_tokens(input_ids), position_ids[..., None].double() * self.inv_freq.double()
        cos, sin = torch.cat([freqs, freqs], -1).cos().to(x.dtype), torch.cat([freqs, freqs], -1).sin().to(x.dtype)
        pos = torch.arange(s)
        allowed = (pos[None, :] <= pos[:, None]).expand(b, s, s)
        if doc_ids is not None:
            allowed = allowed & (doc_ids[:, :, None] == doc_ids[:, None, :])
        for layer in self.layers.values():
            a = layer.self_attn
            q, k, v = a.qkv(layer.input_layernorm(x), cos, sin)
            rep = a.heads // a.kv_heads
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            scores = (q @ k.transpose(-1, -2)) / math.sqrt(a.head_dim)
            scores = scores.masked_fill(~allowed[:, None], float("-inf"))
            x = x + a.o_proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, -1))
            h = layer.post_attention_layernorm(x)
            if not layer.is_moe:
                m = layer.mlp  # spelled out: the model's DenseMLP stacks gate and up in one GEMM
                x = x + m.down_proj(F.silu(m.gate_proj(h)) * m.up_proj(h))
                continue
            flat = h.reshape(-1, cfg.hidden_size)
            w, ids = torch.softmax(flat @ layer.mlp.gate.weight.T, -1).topk(cfg.num_experts_per_tok, -1)
            if cfg.norm_topk_prob:
                w = w / w.sum(-1, keepdim=True)
            moe, ex = torch.zeros_like(flat), layer.mlp.experts
            for e in range(cfg.num_experts):
                tok, slot = (ids == e).nonzero(as_tuple=True)
                if tok.numel():
                    g, u = (flat[tok] @ ex.gate_up[e]).chunk(2, -1)
                    moe.index_add_(0, tok, ((F.silu(g) * u) @ ex.down[e]) * w[tok, slot, None])
            x = x + moe.view_as(x)
        return head_logits(self.norm(x), self.head_weight())

    # ---- Hugging Face conversion (this model's names <-> HF's per-expert names) ----

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        return hf_state(self)

    def load_hf_state_dict(self, hf: dict[str, torch.Tensor]) -> None:
        """Load HF tensors; raises naming any missing or unexpected key."""
        load_hf_state(self, hf)
