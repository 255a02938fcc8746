"""DeepSeek-V2 (and V2-Lite): config (HF `config.json` schema), the 5-stage decoder layer, the model, HF conversion.

Self-contained on purpose, like qwen3_moe.py:
  - Multi-head Latent Attention (MLA). Queries come from `q_proj`, or with `q_lora_rank` from the
    low-rank path q_a_proj -> q_a_layernorm -> q_b_proj. Keys and values come from one compressed
    latent: `kv_a_proj_with_mqa` gives the latent (kv_lora_rank) plus a rope key shared by all
    heads; the latent is normed (`kv_a_layernorm`) and expanded per head by `kv_b_proj` into the
    non-rope key part and the value. Each head's query/key = [nope part, rope part]; the value
    head dim may differ from the query/key head dim.
  - RoPE on the rope parts only, with DeepSeek's layout: rotated pairs are adjacent dimensions
    (x0, x1), (x2, x3), ... (HF applies it as complex multiplication). Optional YaRN with its
    cos/sin factor and the softmax-scale correction mscale(factor, mscale_all_dim)^2.
  - MoE layers: routed experts as stacked weights run by a grouped GEMM (stage 3), shared
    experts computed in stage 1 and added in stage 5, routing from `routing.py` (softmax or
    sigmoid scores, greedy / group-limited / bias-corrected selection). Dense MLP layers for
    the first `first_k_dense_replace` layers and where `moe_layer_freq` says so.
`reference_forward` is a plain, independent implementation (eager attention, complex-number RoPE, a loop over experts)
used as the oracle in tests."""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass, fields
from typing import ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from pithtrain.config import (YARN_KEYS, ConfigError, UserError, check, check_numbers, check_positive, check_yarn,
                              hf_values)
from pithtrain.protocol import RoutingInfo, Stage1Out, all_layers, hf_state, init_by_name, load_hf_state, run_layer
from pithtrain.models.routing import select_experts
from pithtrain.ops.core import (apply_rope, attention, attention_mask, autocast_dtype, expert_tokens, rms_norm, rope_cos_sin,
                                rope_inv_freq, yarn_mscale)
from pithtrain.ops.kernels import weighted_combine  # Triton on GPUs, the reference elsewhere
from pithtrain.ops.fp8 import Linear, projections  # nn.Linear, with its GEMMs in FP8 under train.fp8
from pithtrain.ops.grouped_gemm import Embedding, activation_mm, expert_mm, head_logits
from pithtrain.parallel.context import ContextParallel, context_attention_expand

TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: DeepSeek and HF use this default, not rms_norm_eps
# MLA's v head (128) is narrower than q and k's (192). Plain causal attention on CUDA hands v to SDPA as it is,
# which runs cuDNN; v padded to 192 gets FlashAttention-2 (cuDNN's sm90 backward takes q/k 192 only with v 128)
# on 20% more attention FLOPs forward, 15% backward, plus two copies. The CPU pads (its fused kernel needs one
# head dim), and so do packed documents' masks on CUDA (unmeasured unpadded). False: pad everywhere, for an A/B
# (benchmarks/attention.py --mla, train_throughput.py --mla-v padded).
UNPADDED_V = True


@dataclass
class DeepseekV2Config:
    vocab_size: int = 102400
    hidden_size: int = 4096
    intermediate_size: int = 11008  # dense-MLP layers
    moe_intermediate_size: int = 1407  # each routed expert; shared experts are n_shared_experts times this
    num_hidden_layers: int = 30
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None  # MLA expands keys/values per head: must equal num_attention_heads
    q_lora_rank: int | None = 1536  # None: a full-rank q_proj
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    n_routed_experts: int = 64
    n_shared_experts: int | None = 2
    num_experts_per_tok: int = 6
    first_k_dense_replace: int = 0  # the first k layers use a dense MLP
    moe_layer_freq: int = 1  # later layers are MoE when layer_id % moe_layer_freq == 0
    # Routing. topk_method: greedy (plain top-k), group_limited_greedy (V2: best topk_group of
    # n_group groups by their best expert), noaux_tc (V3: groups by the sum of their top-2 scores,
    # plus a per-expert `e_score_correction_bias` used only for selection and moved by the
    # aux-loss-free rule, routing.update_correction_bias, instead of by gradients).
    topk_method: str = "greedy"
    n_group: int | None = None
    topk_group: int | None = None
    scoring_func: str = "softmax"  # softmax (V2) | sigmoid (V3)
    norm_topk_prob: bool = False  # renormalise the chosen k weights to sum 1 (before the scaling)
    routed_scaling_factor: float = 1.0
    bias_update_speed: float = 0.001  # noaux_tc: the `rate` the training loop passes to update_correction_bias; may change at a resume
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # None (plain RoPE) or {"type": "yarn", "factor", "original_max_position_embeddings",
    # optional "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate"}
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    attention_bias: bool = False  # biases on q_a_proj, kv_a_proj_with_mqa and o_proj (the HF layout)
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    model_type: ClassVar[str] = "deepseek_v2"
    rope_interleave: ClassVar[bool] = True  # rope dims in adjacent pairs; a field of deepseek_v3
    num_nextn_predict_layers: ClassVar[int] = 0  # multi-token prediction depths; a field of deepseek_v3

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def yarn(self) -> dict | None:
        rope = self.rope_scaling or {}
        return rope if rope.get("type", rope.get("rope_type")) == "yarn" else None

    def is_moe_layer(self, layer_id: int) -> bool:
        return (self.n_routed_experts > 0 and layer_id >= self.first_k_dense_replace
                and layer_id % self.moe_layer_freq == 0)

    def num_routed_experts(self) -> int:
        return self.n_routed_experts

    def validate(self) -> None:
        check_positive(self, "vocab_size hidden_size intermediate_size moe_intermediate_size num_hidden_layers "
                             "num_attention_heads kv_lora_rank qk_nope_head_dim qk_rope_head_dim v_head_dim "
                             "moe_layer_freq rms_norm_eps rope_theta max_position_embeddings")
        check(self.num_key_value_heads in (None, self.num_attention_heads),
              f"model.num_key_value_heads={self.num_key_value_heads}: MLA expands keys and values for every head; "
              f"set it to num_attention_heads={self.num_attention_heads} (or leave it unset)")
        check(self.q_lora_rank is None or self.q_lora_rank >= 1,
              f"model.q_lora_rank={self.q_lora_rank}: must be at least 1, or None for a full-rank q_proj")
        check(self.qk_rope_head_dim % 2 == 0, f"model.qk_rope_head_dim={self.qk_rope_head_dim} must be even for RoPE")
        check(self.hidden_act == "silu", f"model.hidden_act={self.hidden_act!r}: only 'silu' is supported")
        check(self.n_routed_experts >= 0, f"model.n_routed_experts={self.n_routed_experts}: must be >= 0 (0: dense)")
        check((self.n_shared_experts or 0) >= 0, f"model.n_shared_experts={self.n_shared_experts}: must be >= 0")
        check(0 <= self.first_k_dense_replace <= self.num_hidden_layers,
              f"model.first_k_dense_replace={self.first_k_dense_replace} must be in [0, num_hidden_layers]")
        check(self.topk_method in TOPK_METHODS,
              f"model.topk_method={self.topk_method!r}: use one of {', '.join(TOPK_METHODS)}")
        check(self.scoring_func in ("softmax", "sigmoid"),
              f"model.scoring_func={self.scoring_func!r}: use softmax or sigmoid")
        check(self.routed_scaling_factor > 0, f"model.routed_scaling_factor={self.routed_scaling_factor}: must be > 0")
        check(self.bias_update_speed >= 0, f"model.bias_update_speed={self.bias_update_speed}: must be >= 0")
        if self.n_routed_experts > 0:
            experts, k = self.n_routed_experts, self.num_experts_per_tok
            check(1 <= k <= experts, f"model.num_experts_per_tok={k} must be in [1, n_routed_experts={experts}]")
            if self.topk_method != "greedy":
                groups, kept = self.n_group or 1, self.topk_group or 1
                check(groups >= 1, f"model.n_group={self.n_group}: must be at least 1 (or 0 / None: one group)")
                check(experts % groups == 0,
                      f"model.n_group={groups} does not divide n_routed_experts={experts}; choose a divisor")
                check(1 <= kept <= groups, f"model.topk_group={kept} must be in [1, n_group={groups}]")
                check(k <= kept * (experts // groups),
                      f"model.num_experts_per_tok={k} exceeds the {kept * (experts // groups)} experts of the "
                      f"topk_group={kept} kept groups; raise topk_group or lower num_experts_per_tok")
                check(self.topk_method != "noaux_tc" or groups == 1 or experts // groups >= 2,
                      f"model.topk_method='noaux_tc' scores a group by its top-2 experts: n_group={groups} leaves "
                      f"{experts // groups} per group; use fewer groups")
        rope = self.rope_scaling or {}
        rope_type = rope.get("type", rope.get("rope_type", "default"))
        check_numbers(rope, "model.rope_scaling")
        check(rope_type in ("default", "yarn"),
              f"model.rope_scaling type {rope_type!r} is not supported; use None (plain RoPE) or type 'yarn'")
        extra = next((k for k in rope if k not in ("type", "rope_type", *(YARN_KEYS if rope_type == "yarn" else ()))
                      and not (k == "rope_theta" and rope[k] == self.rope_theta)), None)  # HF 5 copies rope_theta in
        check(extra is None, f"model.rope_scaling['{extra}'] is not read with type {rope_type!r} (YaRN reads "
              f"{', '.join(YARN_KEYS)}; the RoPE base is model.rope_theta={self.rope_theta}); fix its name or remove it")
        if rope_type == "yarn":
            check_yarn(rope, "model.rope_scaling")

    @classmethod
    def from_hf(cls, hf: dict) -> "DeepseekV2Config":
        if hf.get("mlp_bias"):
            raise ConfigError("deepseek_v2: mlp_bias=true is not supported (DeepSeek models have no MLP biases)")
        # In nullable fields None means something (q_lora_rank=None: a full-rank q_proj), so keep it.
        values = hf_values(cls, hf, frozenset(f.name for f in fields(cls) if "None" in str(f.type)))
        # HF 5 writes `rope_parameters` (with rope_theta inside); DeepSeek's own configs `rope_scaling` + `rope_theta`.
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        if (theta := rope.pop("rope_theta", hf.get("rope_theta"))) is not None:
            values["rope_theta"] = theta
        rope_type = next(filter(None, (rope.pop("rope_type", None), rope.pop("type", None))), "default")  # both popped
        values["rope_scaling"] = None if rope_type == "default" else {"type": rope_type, **rope}
        return cls(**values)

    def to_hf(self) -> dict:
        """HF deepseek_v2 config.json. transformers' deepseek_v2 reads softmax greedy/group_limited_greedy
        routing only: it ignores scoring_func, moe_layer_freq and norm_topk_prob, and has no
        e_score_correction_bias; configs using those options run in PithTrain but not in transformers, which
        import and export say (checkpoint.model_config, tools/hf.convert)."""
        out, rope = asdict(self), dict(self.rope_scaling or {})
        rope_type = rope.pop("type", None) or rope.pop("rope_type", "default")
        rope.pop("rope_type", None)
        del out["rope_scaling"], out["rope_theta"]
        out["rope_parameters"] = {"rope_type": rope_type, "rope_theta": self.rope_theta, **rope}
        out["head_dim"] = self.qk_rope_head_dim  # what HF stores there for MLA configs
        # None / 0 here: no shared expert, one group, one kept; transformers reads them as written (None fails its
        # load, 0 groups divide by zero or keep none)
        out.update(n_shared_experts=self.n_shared_experts or 0, **{k: getattr(self, k) or 1 for k in ("n_group", "topk_group")
                                                                   if self.topk_method != "greedy"})
        out.update(model_type=self.model_type, architectures=["DeepseekV2ForCausalLM"], dtype="float32")
        return out

    def transformers_ignores(self) -> list[str]:
        """The options set here that transformers' deepseek_v2 does not read (to_hf): its model of an export differs."""
        if self.model_type != "deepseek_v2":
            return []  # transformers' deepseek_v3 reads them all
        unread = [f"{k}={getattr(self, k)!r}" for k, read in (("scoring_func", "softmax"), ("moe_layer_freq", 1),
                                                               ("norm_topk_prob", False)) if getattr(self, k) != read]
        return unread + (["topk_method='noaux_tc' (its correction bias)"] if self.topk_method == "noaux_tc" else [])

    def build_model(self, layer_ids=None, embed: bool = True, head: bool = True) -> "DeepseekV2Model":
        self.validate()  # a config edited after its run file was read: its field named, not torch's error in forward
        return DeepseekV2Model(self, layer_ids, embed, head)


@dataclass
class DeepseekV3Config(DeepseekV2Config):
    """DeepSeek-V3 (and Kimi K2, Moonlight): the same model as V2 with the V3 switches on (sigmoid scores, `noaux_tc`
    selection with its correction bias), HF's deepseek_v3 defaults, and its own HF schema and model_type for import and
    export. `rope_interleave=False`: the rope dims are in rotate-half layout already (HF's option). Multi-token
    prediction is not built: a checkpoint's MTP layers (past num_hidden_layers) are imported, trained and exported with
    `num_nextn_predict_layers` (MTPLayer; 0: ignored on load)."""

    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 61
    num_attention_heads: int = 128
    q_lora_rank: int | None = 1536
    n_routed_experts: int = 256
    n_shared_experts: int | None = 1
    num_experts_per_tok: int = 8
    first_k_dense_replace: int = 3
    topk_method: str = "noaux_tc"
    n_group: int | None = 8
    topk_group: int | None = 4
    scoring_func: str = "sigmoid"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    max_position_embeddings: int = 4096
    bos_token_id: int | None = 0
    eos_token_id: int | None = 1
    rope_interleave: bool = True  # rope dims in adjacent pairs (DeepSeek's layout); False: rotate-half halves
    num_nextn_predict_layers: int = 0  # multi-token prediction depths (MTPLayer, on the head's pipeline stage); 0: off

    model_type: ClassVar[str] = "deepseek_v3"

    def validate(self) -> None:
        super().validate()
        for name, value in (("topk_method", "noaux_tc"), ("scoring_func", "sigmoid")):
            check(getattr(self, name) == value, f"model.{name}={getattr(self, name)!r}: deepseek_v3 routes with "
                  f"{name}={value!r} (what HF's DeepseekV3 does); use DeepseekV2Config (deepseek_v2) for other routing")
        for name, ok in (("moe_layer_freq", self.moe_layer_freq == 1), ("n_routed_experts", self.n_routed_experts >= 1)):
            check(ok, f"model.{name}={getattr(self, name)}: deepseek_v3 makes every layer from first_k_dense_"
                      "replace on MoE (transformers' too); set moe_layer_freq=1 and n_routed_experts >= 1")
        check(0 <= self.num_nextn_predict_layers <= 8, f"model.num_nextn_predict_layers={self.num_nextn_predict_layers}"
              f": must be in [0, 8] (DeepSeek-V3 uses 1; 0 turns multi-token prediction off)")

    @classmethod
    def from_hf(cls, hf: dict) -> "DeepseekV3Config":
        if hf.get("model_type") == "kimi_k25":  # Kimi K2.5: a multimodal config around a deepseek_v3 text model
            check(isinstance(hf.get("text_config"), dict),
                  "model_type 'kimi_k25' without a text_config: not a Kimi K2.5 checkpoint's config.json")
            print("kimi_k25: a multimodal checkpoint; its language model (text_config) is used, the vision tower "
                  "is left out", file=sys.stderr)
            hf = {"tie_word_embeddings": hf.get("tie_word_embeddings", False), **hf["text_config"]}
        if "num_nextn_predict_layers" not in hf and "num_mtp_layers" in hf:  # transformers 5 saves this name
            hf = {**hf, "num_nextn_predict_layers": hf["num_mtp_layers"]}
        return super().from_hf(hf)

    def to_hf(self) -> dict:
        """HF deepseek_v3 config.json (what DeepseekV3ForCausalLM reads; a kimi_k2 import exports as this too)."""
        return dict(super().to_hf(), architectures=["DeepseekV3ForCausalLM"])


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[.., (d0 d1) (d2 d3) ..] -> [.., d0 d2 .., d1 d3 ..]: DeepSeek's adjacent-pair RoPE becomes the
    rotate-half layout. Queries and keys get the same permutation, so their dot products are unchanged."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


class AttnInputs(NamedTuple):
    cos: torch.Tensor  # [B, S, rope_dim], YaRN factor included
    sin: torch.Tensor
    mask: torch.Tensor | None  # None: plain causal
    cp: ContextParallel | None = None  # context parallel: ring attention, masked from cp's global token indices


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    """Multi-head Latent Attention."""

    def __init__(self, cfg: DeepseekV2Config, softmax_scale: float):
        super().__init__()
        self.heads, self.v_dim = cfg.num_attention_heads, cfg.v_head_dim
        self.nope, self.rope = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        self.kv_lora_rank, self.q_lora_rank, self.scale = cfg.kv_lora_rank, cfg.q_lora_rank, softmax_scale
        self.interleaved = cfg.rope_interleave
        hidden, bias, q_out = cfg.hidden_size, cfg.attention_bias, self.heads * cfg.qk_head_dim
        if cfg.q_lora_rank is None:
            self.q_proj = Linear(hidden, q_out, bias=False)
        else:
            self.q_a_proj = Linear(hidden, cfg.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = Linear(cfg.q_lora_rank, q_out, bias=False)
        self.kv_a_proj_with_mqa = Linear(hidden, cfg.kv_lora_rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, self.heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = Linear(self.heads * self.v_dim, hidden, bias=bias)

    def q_and_latent(self, x, cos, sin):
        """q [B, heads, S, nope + rope], the normed KV latent [B, S, kv_lora_rank] and the rope key
        shared by all heads [B, 1, S, rope]; rope parts rotated, in rotate-half layout."""
        b, s, _ = x.shape
        if self.q_lora_rank is None:  # not stacked: the latent's norm keeps its input, which would keep q's part too
            q, compressed = self.q_proj(x), self.kv_a_proj_with_mqa(x)
        else:
            q_latent, compressed = projections(x, self.q_a_proj, self.kv_a_proj_with_mqa)
            q = self.q_b_proj(self.q_a_layernorm(q_latent))
        q = q.reshape(b, s, self.heads, self.nope + self.rope).transpose(1, 2)
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        latent, k_rope = compressed.split([self.kv_lora_rank, self.rope], dim=-1)
        if self.interleaved:
            q_rope, k_rope = deinterleave(q_rope), deinterleave(k_rope)
        q = torch.cat([q_nope, apply_rope(q_rope, cos, sin)], dim=-1)
        return q, self.kv_a_layernorm(latent), apply_rope(k_rope.unsqueeze(1), cos, sin)

    def expand_kv(self, latent, k_rope, kv_b_weight):
        """k [B, heads, S, nope + rope] and v [B, heads, S, v_dim] from the normed latent and the shared
        rope key. A pure function of its arguments: context parallelism rings (latent, k_rope) and calls it."""
        b, s, _ = latent.shape
        kv = F.linear(latent, kv_b_weight).view(b, s, self.heads, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        return torch.cat([k_nope, k_rope.expand(b, self.heads, s, self.rope)], dim=-1), v

    def qkv(self, x, cos, sin):
        """q, k: [B, heads, S, nope + rope] (rope part in rotate-half layout); v: [B, heads, S, v_dim]."""
        q, latent, k_rope = self.q_and_latent(x, cos, sin)
        return (q, *self.expand_kv(latent, k_rope, self.kv_b_proj.weight))

    def forward(self, x, attn: AttnInputs):
        if attn.cp is not None:  # the ring carries the latent and rope key (not per-head K/V); each rank expands them
            q, latent, k_rope = self.q_and_latent(x, attn.cos, attn.sin)
            weights = (self.kv_b_proj.weight,)
            return self.o_proj(context_attention_expand(q, (latent, k_rope), self.expand_kv, weights, self.scale, attn.cp))
        q, k, v = self.qkv(x, attn.cos, attn.sin)
        pad_v = not (UNPADDED_V and q.is_cuda and attn.mask is None)  # plain causal on CUDA: cuDNN takes v as it is
        return self.o_proj(mla_attention(q, k, v, attn.mask, self.scale, pad_v))


def mla_attention(q, k, v, mask, scale: float, pad_v: bool) -> torch.Tensor:
    """SDPA for v narrower than q and k ([B, heads, S, v_dim] against [.., qk_dim]); [B, S, heads * v_dim].
    pad_v: v padded with zero columns to q's width and the output sliced back, the same attention for the fused
    kernels that need one head dim (flash on GPU, the CPU one; the unfused fallback is ~10x slower)."""
    if (pad := q.shape[-1] - v.shape[-1]) <= 0 or not pad_v:
        return attention(q, k, v, mask, scale)
    out = attention(q, k, F.pad(v, (0, pad)), mask, scale)
    return out.unflatten(-1, (q.shape[1], -1))[..., : v.shape[-1]].flatten(2)


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
    """Stacked routed-expert weights: gate_up [E, H, 2I] (gate then up), down [E, I, H]."""

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
    def __init__(self, cfg: DeepseekV2Config):
        super().__init__()
        self.cfg, self.num_experts = cfg, cfg.n_routed_experts
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        bias = torch.zeros(cfg.n_routed_experts) if cfg.topk_method == "noaux_tc" else None  # a buffer: no optimizer
        self.register_buffer("e_score_correction_bias", bias)  # saved with the model, moved by the aux-free rule

    def forward(self, x) -> RoutingInfo:
        cfg, dtype = self.cfg, torch.promote_types(x.dtype, torch.float32)
        with torch.autocast(x.device.type, enabled=False):  # routing decisions in full precision, as HF does
            logits = F.linear(x.to(dtype), self.weight.to(dtype))
        grouped = cfg.topk_method != "greedy"
        ids, weights, scores = select_experts(
            logits, cfg.num_experts_per_tok, score_func=cfg.scoring_func, correction_bias=self.e_score_correction_bias,
            n_group=(cfg.n_group or 1) if grouped else 1, topk_group=(cfg.topk_group or 1) if grouped else 1,
            group_score="top2sum" if cfg.topk_method == "noaux_tc" else "max", norm_topk_prob=cfg.norm_topk_prob,
            routed_scaling_factor=cfg.routed_scaling_factor)
        return RoutingInfo(ids, weights, scores, self.num_experts)


class MoE(nn.Module):
    def __init__(self, cfg: DeepseekV2Config):
        super().__init__()
        self.gate = Router(cfg)
        self.experts = Experts(cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        shared = cfg.n_shared_experts or 0
        self.shared_experts = DenseMLP(cfg.hidden_size, cfg.moe_intermediate_size * shared) if shared else None


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DeepseekV2Config, layer_id: int, softmax_scale: float):
        super().__init__()
        self.layer_id = layer_id
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, softmax_scale)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.is_moe = cfg.is_moe_layer(layer_id)
        self.mlp = MoE(cfg) if self.is_moe else DenseMLP(cfg.hidden_size, cfg.intermediate_size)

    def stage1(self, x, attn: AttnInputs) -> Stage1Out:
        h = x + self.self_attn(self.input_layernorm(x), attn)
        normed = self.post_attention_layernorm(h)
        if not self.is_moe:
            return Stage1Out(h + self.mlp(normed), None, None, None)
        tokens = normed.flatten(0, 1)
        shared = self.mlp.shared_experts(tokens) if self.mlp.shared_experts is not None else None
        return Stage1Out(h, expert_tokens(normed), shared, self.mlp.gate(tokens))

    def stage3(self, tokens, counts, weight_queue=None):
        return self.mlp.experts(tokens, counts, weight_queue)

    def stage5(self, s1: Stage1Out, combined):
        addend = s1.residual
        if s1.shared is not None:  # the shared experts' output
            addend = addend + s1.shared.view_as(addend).to(addend.dtype)
        return weighted_combine(combined.rows, combined.index, s1.routing.topk_weights, addend)


class MTPLayer(DecoderLayer):
    """Multi-token prediction depth k (DeepSeek-V3 report, section 2.2): a decoder layer whose input at token t is
    eh_proj([enorm(Emb(token t+k)); hnorm(h^{k-1}_t)]) (h^0: the main model's last hidden state, before its final norm),
    and whose output h^k predicts token t+k+1 through its own norm (`shared_head`) and the main model's output head. The
    embedding and head are shared; DeepSeek's checkpoints store copies of them under the layer (`embed_tokens`,
    `shared_head.head`), which the HF conversion reads and writes. The concatenation puts the embedding first, as the
    released weights (eh_proj [H, 2H]) are laid out. stage1 takes [Emb(token t+k); h^{k-1}] as one [B, S, 2H] input, so
    its projections run inside the stage (where FSDP gathers the layer's weights)."""

    def __init__(self, cfg: DeepseekV2Config, layer_id: int, softmax_scale: float):
        super().__init__(cfg, layer_id, softmax_scale)
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.shared_head = MTPHeadNorm(cfg)

    def stage1(self, x, attn: AttnInputs) -> Stage1Out:
        embedded, h = x.chunk(2, -1)
        return super().stage1(self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(h)], -1)), attn)


class MTPHeadNorm(nn.Module):
    """An MTP depth's norm before the shared output head (HF: shared_head.norm); a module with a
    forward, so FSDP gathers its weight when called outside the layer's stages."""

    def __init__(self, cfg: DeepseekV2Config):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x):
        return self.norm(x)


class DeepseekV2Model(nn.Module):
    """A contiguous run of layers; the full model by default. `layer_ids`/`embed`/`head` select
    a pipeline chunk; layers keep their global ids as names so checkpoints do not depend on it."""

    head_fp8 = False  # the LM head in FP8 (train.fp8_head; set by ops/fp8.enable_fp8)

    def __init__(self, cfg: DeepseekV2Config, layer_ids=None, embed: bool = True, head: bool = True):
        super().__init__()
        self.cfg = cfg
        layer_ids = range(cfg.num_hidden_layers) if layer_ids is None else layer_ids
        inv_freq, self.rope_factor = rope_inv_freq(cfg.rope_theta, cfg.qk_rope_head_dim, cfg.yarn)
        softmax_scale = cfg.qk_head_dim**-0.5
        if cfg.yarn is not None and cfg.yarn.get("mscale_all_dim"):  # DeepSeek's YaRN scales the softmax too
            softmax_scale *= yarn_mscale(cfg.yarn["factor"], cfg.yarn["mscale_all_dim"]) ** 2
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size) if embed else None
        self.layers = nn.ModuleDict({str(i): DecoderLayer(cfg, i, softmax_scale) for i in layer_ids})
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if head else None
        # With tied embeddings the head reads embed_tokens.weight (a pipeline puts both on one rank).
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False) if head and not cfg.tie_word_embeddings else None
        n, depths = cfg.num_hidden_layers, cfg.num_nextn_predict_layers  # MTP layers: ids n .. n + depths - 1
        self.mtp = nn.ModuleDict({str(n + k): MTPLayer(cfg, n + k, softmax_scale) for k in range(depths)}) if head and depths else None
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """protocol.init_by_name with initializer_range (seeded per parameter name); routing correction biases zero."""
        init_by_name(self, seed, self.cfg.initializer_range)
        for bias in self.correction_biases().values():
            bias.zero_()

    def correction_biases(self) -> dict[int, torch.Tensor]:
        """layer id -> e_score_correction_bias [E] of this chunk's MoE layers (empty unless
        topk_method='noaux_tc'); the training loop updates them with routing.update_correction_bias."""
        return {int(lid): layer.mlp.gate.e_score_correction_bias for lid, layer in all_layers(self).items()
                if layer.is_moe and layer.mlp.gate.e_score_correction_bias is not None}

    def head_weight(self):
        return self.lm_head.weight if self.lm_head is not None else self.embed_tokens.weight

    def attn_inputs(self, position_ids, doc_ids, dtype, cp: ContextParallel | None = None) -> AttnInputs:
        cos, sin = rope_cos_sin(position_ids, self.inv_freq, scale=self.rope_factor, dtype=dtype)
        if cp is not None:  # the ring masks by global token index and cp's document ids
            return AttnInputs(cos, sin, None, cp)
        return AttnInputs(cos, sin, attention_mask(doc_ids, position_ids.shape[1], position_ids.device))

    def forward(self, x, position_ids, engine, doc_ids=None, cp: ContextParallel | None = None, mtp_ids=None,
                mtp_embedded=None):
        """x: token ids [B, S] if this chunk embeds, else hidden states [B, S, H]. Returns logits
        [B, S, V] if this chunk holds the head, else hidden states. With `cp`, the inputs are this
        rank's zigzag share of the sequence (parallel/context.py).

        Multi-token prediction (training): `mtp_ids` [B, S, D], token t+k at (t, k-1) (train/data.py
        mtp_targets). The chunk with the embedding embeds them; a head chunk without it takes them
        embedded (`mtp_embedded` [B, S, D, H]). Then the head chunk returns (logits, MTP logits
        [B, S, D, V]) and a chunk with the embedding but no head (hidden, mtp_embedded)."""
        if self.embed_tokens is not None:
            if mtp_ids is not None:
                mtp_embedded = self.embed_tokens(mtp_ids)
            x = self.embed_tokens(x)
        attn = self.attn_inputs(position_ids, doc_ids, x.dtype, cp)
        for layer in self.layers.values():
            x = run_layer(layer, x, attn, engine)
        if self.norm is None:
            return x if mtp_embedded is None else (x, mtp_embedded)
        logits = head_logits(self.norm(x), self.head_weight(), self.head_fp8)
        if self.mtp is None or mtp_embedded is None:
            return logits
        out = []
        for k, layer in enumerate(self.mtp.values()):
            x = run_layer(layer, torch.cat([mtp_embedded[:, :, k].to(x.dtype), x], -1), attn, engine)
            out.append(head_logits(layer.shared_head(x), self.head_weight(), self.head_fp8))
        return logits, torch.stack(out, 2)

    @torch.no_grad()
    def reference_forward(self, input_ids, position_ids=None, doc_ids=None, inputs_embeds=None, final_hidden=False):
        """Plain oracle: eager softmax attention with an explicit mask, RoPE as complex
        multiplication of adjacent pairs, routing written out, and a loop over experts. From
        `inputs_embeds` instead of token ids, and to the last hidden state (`final_hidden`, before the
        final norm): a test's reference for a block alone (multi-token prediction)."""
        cfg = self.cfg
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        b, s = x.shape[:2]
        if position_ids is None:
            position_ids = torch.arange(s).expand(b, s)
        angles = position_ids[..., None].float() * self.inv_freq.float()  # [B, S, rope/2]
        rotation = torch.polar(torch.full_like(angles, self.rope_factor), angles)[:, None]  # broadcast over heads

        def rotate(t):  # t: [B, h, S, rope], pairs (t0, t1), (t2, t3), ... are complex numbers
            wide = t.to(torch.promote_types(t.dtype, torch.float32))
            if not cfg.rope_interleave:  # halves: pairs (t0, t_d/2), ...; made adjacent
                wide = wide.unflatten(-1, (2, -1)).transpose(-1, -2).flatten(-2)
            pairs = torch.view_as_complex(wide.unflatten(-1, (-1, 2)).contiguous())
            return torch.view_as_real(pairs * rotation).flatten(-2).to(t.dtype)

        pos = torch.arange(s)
        allowed = (pos[None, :] <= pos[:, None]).expand(b, s, s)
        if doc_ids is not None:
            allowed = allowed & (doc_ids[:, :, None] == doc_ids[:, None, :])
        nope, rope, heads = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.num_attention_heads
        for layer in self.layers.values():
            a, h = layer.self_attn, layer.input_layernorm(x)
            q = a.q_proj(h) if cfg.q_lora_rank is None else a.q_b_proj(a.q_a_layernorm(a.q_a_proj(h)))
            q = q.view(b, s, heads, nope + rope).transpose(1, 2)
            latent, k_rope = a.kv_a_proj_with_mqa(h).split([cfg.kv_lora_rank, rope], -1)
            kv = a.kv_b_proj(a.kv_a_layernorm(latent)).view(b, s, heads, nope + cfg.v_head_dim).transpose(1, 2)
            k_rope = rotate(k_rope[:, None]).expand(b, heads, s, rope)
            q = torch.cat([q[..., :nope], rotate(q[..., nope:])], -1)
            k, v = torch.cat([kv[..., :nope], k_rope], -1), kv[..., nope:]
            scores = (q @ k.transpose(-1, -2)) * a.scale
            scores = scores.masked_fill(~allowed[:, None], float("-inf"))
            x = x + a.o_proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, -1))
            h = layer.post_attention_layernorm(x)
            if not layer.is_moe:
                m = layer.mlp  # spelled out: the model's DenseMLP stacks gate and up in one GEMM
                x = x + m.down_proj(F.silu(m.gate_proj(h)) * m.up_proj(h))
                continue
            flat, gate = h.reshape(-1, cfg.hidden_size), layer.mlp.gate
            ids, w = _reference_routing(cfg, flat.float() @ gate.weight.float().T, gate.e_score_correction_bias)
            moe, ex = torch.zeros_like(flat), layer.mlp.experts
            for e in range(cfg.n_routed_experts):
                tok, slot = (ids == e).nonzero(as_tuple=True)
                if tok.numel():
                    g, u = (flat[tok] @ ex.gate_up[e]).chunk(2, -1)
                    moe.index_add_(0, tok, ((F.silu(g) * u) @ ex.down[e]) * w[tok, slot, None].to(flat.dtype))
            if (m := layer.mlp.shared_experts) is not None:
                moe = moe + m.down_proj(F.silu(m.gate_proj(flat)) * m.up_proj(flat))
            x = x + moe.view_as(x)
        return x if final_hidden else head_logits(self.norm(x), self.head_weight())

    # ---- Hugging Face conversion (this model's names <-> HF's per-expert names) ----

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """HF tensors; an MTP layer as DeepSeek-V3 saves it (model.layers.{n + k}), with its copies of
        the shared embedding and head."""
        out = hf_state(self)
        for lid in self.mtp or {}:
            out[f"model.layers.{lid}.embed_tokens.weight"] = self.embed_tokens.weight.detach().clone()
            out[f"model.layers.{lid}.shared_head.head.weight"] = self.head_weight().detach().clone()
        return out

    def load_hf_state_dict(self, hf: dict[str, torch.Tensor]) -> None:
        """Load HF tensors (per-expert keys as saved, or the fused in-memory layout); raises
        naming any missing or unexpected key. An MTP layer's copies of the embedding and head are
        checked against the main model's (which it shares) and dropped."""
        for lid in self.mtp or {}:
            if f"model.layers.{lid}.eh_proj.weight" not in hf:
                raise UserError(f"model.num_nextn_predict_layers={self.cfg.num_nextn_predict_layers}: the checkpoint "
                                f"has no multi-token prediction layer {lid} (model.layers.{lid}.eh_proj.weight); set "
                                f"model.num_nextn_predict_layers to the MTP layers it has (0: none)")
        hf = dict(hf)
        for lid in self.mtp or {}:
            for copy, own in ((f"model.layers.{lid}.embed_tokens.weight", "model.embed_tokens.weight"),
                              (f"model.layers.{lid}.shared_head.head.weight", "lm_head.weight")):
                kept = hf.pop(copy, None)
                if kept is not None and own in hf and not torch.equal(kept, hf[own]):
                    print(f"{self.cfg.model_type}: {copy} differs from {own}; MTP shares the main model's "
                          f"(the export writes it as the copy)", file=sys.stderr)
        other_layers = load_hf_state(self, hf, past_layers=True)
        past = {k.split(".")[2] for k in other_layers if int(k.split(".")[2]) >= self.cfg.num_hidden_layers}
        if past:  # DeepSeek-V3's multi-token prediction layers sit past the last decoder layer
            print(f"{self.cfg.model_type}: weights of layer(s) {', '.join(sorted(past, key=int))} (past num_hidden_layers="
                  f"{self.cfg.num_hidden_layers}: multi-token prediction) are ignored: model.num_nextn_predict_layers="
                  f"{self.cfg.num_nextn_predict_layers}", file=sys.stderr)


def _reference_routing(cfg: DeepseekV2Config, logits: torch.Tensor, bias: torch.Tensor | None):
    """The router written out for the oracle: (ids [T, k], weights [T, k])."""
    scores = logits.softmax(-1) if cfg.scoring_func == "softmax" else logits.sigmoid()
    biased = scores if bias is None else scores + bias
    if cfg.topk_method != "greedy" and (cfg.n_group or 1) > 1:
        per_group = biased.view(len(biased), cfg.n_group, -1)
        group_rank = (per_group.sort(-1, descending=True).values[..., :2].sum(-1) if cfg.topk_method == "noaux_tc"
                      else per_group.max(-1).values)
        best_groups = group_rank.argsort(-1, descending=True)[:, : cfg.topk_group or 1]
        allowed = torch.zeros_like(group_rank).scatter(1, best_groups, 1.0).bool()
        biased = per_group.masked_fill(~allowed[..., None], float("-inf")).flatten(1)
    ids = biased.argsort(-1, descending=True)[:, : cfg.num_experts_per_tok]
    w = scores.gather(1, ids)
    if cfg.norm_topk_prob:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return ids, w * cfg.routed_scaling_factor
