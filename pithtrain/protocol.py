"""The 5-stage decoder-layer contract every model family implements, RoutingInfo, and the loss's terms.

A MoE decoder layer is cut at the expert-parallel communication boundaries:

  stage 1  norm -> attention -> norm -> (shared experts) -> router          (model, compute)
  stage 2  dispatch: each token to the ranks holding its experts           (engine, communication)
  stage 3  expert computation on tokens grouped by local expert            (model, compute)
  stage 4  combine: one row per (token, chosen expert) back home           (engine, communication)
  stage 5  weighted sum of those rows + shared output + residual           (model, compute)

A model layer provides `stage1(x, attn) -> Stage1Out`, `stage3(tokens, counts, weight_queue)
-> tokens` and `stage5(s1, combined: Combined) -> x`. With a `weight_queue` (ops/grouped_gemm.py), the
expert weight gradients are deferred to it (zero-bubble W passes run by the pipeline schedule). Dense layers (no routed experts) return `routing=None` from stage 1
and their output in `residual`. `run_layer` below is the plain sequential composition; the
pipeline engine interleaves the same calls of two micro-batches.

The loss's terms (`AUX_TERMS`, `LossTerms`, `StepSums`) live here too, below the models that record
them, the engine and pipeline that carry them and the loop."""

from __future__ import annotations

import contextlib
import os
import zlib
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.utils._pytree

from pithtrain.config import UserError


@dataclass
class RoutingInfo:
    topk_ids: torch.Tensor  # [T, k] int64, global expert ids chosen per token
    topk_weights: torch.Tensor  # [T, k] combine weights
    scores: torch.Tensor  # [T, E] router probabilities (softmax or sigmoid), for the load-balance loss
    num_experts: int


@dataclass
class Stage1Out:
    residual: torch.Tensor  # [B, S, H] hidden state after attention (the layer output for dense layers)
    moe_input: torch.Tensor | None  # [T, H] normed tokens sent to the experts
    shared: torch.Tensor | None  # [T, H] shared-expert output, added in stage 5
    routing: RoutingInfo | None
    # this layer's values of auxiliary loss terms the model computes (a router z-loss), by AuxTerm.name;
    # run_layer hands them to engine.record_routing with the routing
    aux: dict[str, torch.Tensor] | None = None


class Combined(NamedTuple):
    """Stage 4's output, stage 5's input: the expert output rows [T*k, H] as they arrived, and the
    (token, slot) pair each one is (`index`: a permutation of T*k, pair t*k + j). Stage 5 places and
    weights them in one pass (ops/kernels.weighted_combine), without a [T, k, H] copy in between."""
    rows: torch.Tensor
    index: torch.Tensor


# Registered as pytrees so that FSDP2 sees the tensors inside a stage's output and gathers the layer's weights before
# ANY gradient reaches them (the load-balance loss reads `scores` without passing through stage 5).
torch.utils._pytree.register_dataclass(RoutingInfo)
torch.utils._pytree.register_dataclass(Stage1Out)


NVTX = os.environ.get("PITHTRAIN_NVTX") == "1"  # NVTX ranges for Nsight tools (the capture-nsys-profile skill)


def named_range(name: str):
    """A range named `name` around host calls, for the profilers: a torch.profiler range while
    one runs, else an NVTX range (Nsight Systems, `ncu --nvtx`) under PITHTRAIN_NVTX=1 on a CUDA
    build. Otherwise nothing, not even the range's cost. Never open one across a generator's
    `yield` (parallel/pipeline.py): the other generator would run inside it."""
    if torch._C._autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    if NVTX and torch.cuda.is_available():  # NVTX calls fail on a CPU-only build
        return torch.cuda.nvtx.range(name)
    return contextlib.nullcontext()


def stage_range(stage: int, part: str = ""):
    """The range `pithtrain::stage<n>` (`.wgrad`: a deferred weight gradient) around a stage's
    host calls: the profiling skills attribute GPU time to the five stages by it (capture-profile
    the backward kernels too, through autograd's sequence numbers)."""
    return named_range(f"pithtrain::stage{stage}" + (f".{part}" if part else ""))


def run_layer(layer, x: torch.Tensor, attn, engine) -> torch.Tensor:
    """Stages 1..5 in order; `engine` provides dispatch/combine and records routing statistics."""
    with stage_range(1):
        s1 = layer.stage1(x, attn)
    if s1.routing is None:
        return s1.residual
    with stage_range(2):
        engine.record_routing(layer.layer_id, s1.routing, s1.aux)
        tokens, counts, handle = engine.dispatch(s1.moe_input, s1.routing)
    with stage_range(3):
        expert_out = layer.stage3(tokens, counts, engine.weight_queue)
    with stage_range(4):
        combined = engine.combine(expert_out, handle)
    with stage_range(5):
        return layer.stage5(s1, combined)


class AuxTerm(NamedTuple):
    """An auxiliary loss term. A forward records one value per MoE layer under `name` (model code in `Stage1Out.aux`;
    the load-balance loss in `ExpertEngine.record_routing`). The loss adds train.<scale> x its mean over the layers and
    over the global batch's micro-batches; that mean is logged per step as `metric`. A value must be the same on every
    CP rank of a micro-batch (train/balance.py all-reduces its statistics over cp)."""
    name: str
    scale: str  # the TrainConfig field that scales it (0: recorded and logged, not in the loss)
    metric: str  # its key in metrics.jsonl


# Every auxiliary term; a new one is its model code plus one entry here (docs/architecture.md, "Loss").
AUX_TERMS: tuple[AuxTerm, ...] = (AuxTerm("lb", "lb_coef", "lb_loss"),)  # load balance: train/balance.py


class LossTerms:
    """How one step's loss is composed, the one place for both paths: the sum of token cross-entropies / the global
    batch's label tokens, plus for each AUX_TERMS entry its scale x the mean of its values over `n_layers` MoE layers
    and `n_micro` micro-batches (all data ranks).

    A whole-model forward (the plain loop) adds `micro_loss(ce, aux)` and backpropagates it. A pipeline chunk holds some
    of the layers: its micro-batch's share is `ce_share(ce)` on the rank with the head, and each aux value enters the
    backward with the gradient `weight(name)` (`chunk_roots`: summed per term, or one root per value in the segmented
    backward). Both are d(loss)/d(value); they are written as each path always computed them, so neither path's numbers
    change."""

    def __init__(self, train_config, n_label: int, n_micro: int, n_layers: int, n_mtp_label: int = 0):
        self.n_label, self.n_micro, self.n_layers = n_label, n_micro, n_layers
        self.coefs = {term.name: getattr(train_config, term.scale) for term in AUX_TERMS}
        self.n_mtp_label, self.mtp_coef = n_mtp_label, train_config.mtp_coef

    def ce_share(self, ce: torch.Tensor, mtp_ce: torch.Tensor | None = None) -> torch.Tensor:
        """The cross-entropy part of the loss for a micro-batch's token sums: the main one / the global
        batch's label tokens, plus multi-token prediction's (its sum over depths and tokens) times
        train.mtp_coef / the global batch's MTP label tokens (all depths)."""
        share = ce / max(self.n_label, 1)
        return share if mtp_ce is None else share + self.mtp_coef * mtp_ce / max(self.n_mtp_label, 1)

    def micro_loss(self, ce: torch.Tensor, aux: dict[str, list[torch.Tensor]], mtp_ce=None) -> torch.Tensor:
        """A whole-model forward's share of the step's loss (aux: its values by term)."""
        total = self.ce_share(ce, mtp_ce)
        for term in AUX_TERMS:
            if aux.get(term.name) and self.coefs[term.name]:
                total = total + self.coefs[term.name] * torch.stack(aux[term.name]).mean() / self.n_micro
        return total

    def weight(self, name: str) -> float:
        """d(loss)/d(one recorded value of term `name`); 0 for a term left out of the loss."""
        return self.coefs[name] / (self.n_layers * self.n_micro) if self.coefs[name] else 0.0

    def chunk_roots(self, aux: dict[str, list[torch.Tensor]]) -> list[torch.Tensor]:
        """A pipeline chunk's aux terms for its backward (gradient one each): per term, the sum of its
        values x weight."""
        return [torch.stack(aux[term.name]).sum() * self.weight(term.name) for term in AUX_TERMS
                if aux.get(term.name) and self.coefs[term.name]]

    def value_roots(self, aux: dict[str, list[torch.Tensor]], recorded: dict[str, int]) -> list[tuple]:
        """The values recorded since `recorded` (counts by term), each with its gradient
        weight(name): the roots of a segment in the pipeline's segmented backward."""
        return [(value, torch.full_like(value, self.weight(term.name))) for term in AUX_TERMS if self.coefs[term.name]
                for value in aux.get(term.name, [])[recorded.get(term.name, 0):]]

    @staticmethod
    def layer_sums(aux: dict[str, list[torch.Tensor]], mean: bool) -> dict[str, torch.Tensor]:
        """Per term, the detached float64 sum (`mean`: mean) of a forward's values, what StepSums
        adds up. Refuses a value no AuxTerm names (it would be left out of the loss unseen)."""
        if unknown := set(aux) - {term.name for term in AUX_TERMS}:
            raise ValueError(f"auxiliary loss values {sorted(unknown)} have no AuxTerm in protocol.AUX_TERMS")
        return {term.name: (torch.stack(aux[term.name]).mean() if mean else torch.stack(aux[term.name]).sum()).detach().double()
                for term in AUX_TERMS if aux.get(term.name)}


class StepSums:
    """This rank's sums over one step, by name: `ce` the token cross-entropy, `mtp` multi-token prediction's (over its
    depths); `aux[name]` each term's per-layer mean, summed over this rank's micro-batches; `stop` whether a stop was
    requested. One float64 tensor underneath, so `reduce` is one collective and one host sync."""

    def __init__(self, device):
        self.values = torch.zeros(3 + len(AUX_TERMS), dtype=torch.float64, device=device)
        self.ce, self.mtp = self.values[0], self.values[1]
        self.aux = {term.name: self.values[2 + i] for i, term in enumerate(AUX_TERMS)}

    def request_stop(self) -> None:
        self.values[-1] = 1  # summed over the ranks: every rank sees a stop requested anywhere

    def reduce(self, group=None, world: int = 1, cp: int = 1) -> tuple[float, float, dict[str, float], bool]:
        """(cross-entropy sum, MTP cross-entropy sum, {term name: sum}, stop requested) over the ranks of
        `group`; an aux value is the same on every CP rank of a micro-batch, so its sum is divided by cp."""
        if world > 1:
            torch.distributed.all_reduce(self.values, group=group)
            for value in self.aux.values():
                value /= cp
        values = self.values.tolist()
        return values[0], values[1], {term.name: values[2 + i] for i, term in enumerate(AUX_TERMS)}, values[-1] > 0

    @staticmethod
    def metrics(aux_sums: dict[str, float], n_micro: int) -> dict[str, float]:
        """Each term's metric: its mean per layer and micro-batch."""
        return {term.metric: aux_sums[term.name] / n_micro for term in AUX_TERMS}


def hf_tensor(hf: dict, key: str, shape, used: set) -> torch.Tensor:
    """HF tensor `key`, which must have exactly `shape` (copy_ would broadcast a [1] norm weight
    silently); marks it used. A missing key or another shape names the key (and both shapes)."""
    if key not in hf:
        raise UserError(f"HF checkpoint is missing {key}; does config.json match the weights?")
    if tuple(hf[key].shape) != tuple(shape):
        raise UserError(f"HF tensor {key} has shape {tuple(hf[key].shape)}, the model expects {tuple(shape)}; "
                        f"does config.json match the weights?")
    used.add(key)
    return hf[key]


def hf_name(name: str) -> str:
    """HF's name of a parameter: under `model.`, the head as `lm_head.weight`, and multi-token
    prediction layers (`mtp.{id}`, DeepSeek-V3) as the layers past the last one, as DeepSeek saves them."""
    return name if name == "lm_head.weight" else "model.layers." + name[4:] if name.startswith("mtp.") else f"model.{name}"


def all_layers(model) -> dict:
    """layer id -> decoder layer, multi-token prediction layers (DeepSeek-V3's `mtp`) included."""
    return {**model.layers, **(getattr(model, "mtp", None) or {})}


def hf_state(model) -> dict[str, torch.Tensor]:
    """HF tensors of a family whose parameter names are HF's under `model.` (the head `lm_head.weight`)
    and whose MoE layers stack SwiGLU experts in `mlp.experts` (gate_up [E, H, 2I], gate then up; down
    [E, I, H]): those as HF saves them, per expert (`mlp.experts.{e}.gate_proj/up_proj/down_proj.weight`)."""
    out = {hf_name(name): t for name, t in model.state_dict().items() if ".mlp.experts." not in name}
    for lid, layer in all_layers(model).items():
        if (ex := getattr(layer.mlp, "experts", None)) is None:  # a dense-MLP layer
            continue
        inter = ex.down.shape[1]
        for e in range(ex.gate_up.shape[0]):
            pre = f"model.layers.{lid}.mlp.experts.{e}"
            out[f"{pre}.gate_proj.weight"] = ex.gate_up[e, :, :inter].T.contiguous()
            out[f"{pre}.up_proj.weight"] = ex.gate_up[e, :, inter:].T.contiguous()
            out[f"{pre}.down_proj.weight"] = ex.down[e].T.contiguous()
    return out


@torch.no_grad()
def load_hf_state(model, hf: dict[str, torch.Tensor], past_layers: bool = False) -> set[str]:
    """The inverse of `hf_state`: copies HF tensors into `model` (experts per expert as saved, or HF's fused
    in-memory layout gate_up_proj [E, 2I, H], down_proj [E, H, I]), each shape-checked (`hf_tensor`).
    Keys of layers this model (a pipeline chunk) does not hold are ignored and returned; any other key
    left over raises, naming it (`check_hf_leftovers`)."""
    used = set()

    def take(key, shape):
        return hf_tensor(hf, key, shape, used)

    for name, t in model.state_dict().items():
        if ".mlp.experts." not in name:
            t.copy_(take(hf_name(name), t.shape))
    for lid, layer in all_layers(model).items():
        if (ex := getattr(layer.mlp, "experts", None)) is None:
            continue
        n, hidden, inter = ex.down.shape[0], ex.down.shape[2], ex.down.shape[1]
        fused = f"model.layers.{lid}.mlp.experts.gate_up_proj"
        for e in range(n):
            if fused in hf:
                ex.gate_up[e].copy_(take(fused, (n, 2 * inter, hidden))[e].T)
                ex.down[e].copy_(take(f"model.layers.{lid}.mlp.experts.down_proj", (n, hidden, inter))[e].T)
                continue
            pre = f"model.layers.{lid}.mlp.experts.{e}"
            gate, up = take(f"{pre}.gate_proj.weight", (inter, hidden)), take(f"{pre}.up_proj.weight", (inter, hidden))
            ex.gate_up[e].copy_(torch.cat([gate.T, up.T], 1))
            ex.down[e].copy_(take(f"{pre}.down_proj.weight", (hidden, inter)).T)
    return check_hf_leftovers(model, hf, used, past_layers)


def check_hf_leftovers(model, hf: dict, used: set, past_layers: bool = False) -> set[str]:
    """Raises naming any HF key neither `used` nor another chunk's (a pipeline chunk holds some layers, maybe no
    embedding, norm or head); returns the other layers' keys. A layer past the config's (num_hidden_layers plus
    multi-token prediction) is no chunk's: left over, unless `past_layers` (the caller reports them)."""
    own_layers = tuple(f"model.layers.{lid}." for lid in all_layers(model))
    depth = model.cfg.num_hidden_layers + getattr(model.cfg, "num_nextn_predict_layers", 0)
    layer_of = {k: int(i) for k in hf if k.startswith("model.layers.") and (i := k.split(".")[2]).isdigit()}
    other_layers = {k for k, i in layer_of.items() if not k.startswith(own_layers) and (past_layers or i < depth)}
    extra = set(hf) - used - other_layers
    head, embed = hf.get("lm_head.weight"), hf.get("model.embed_tokens.weight")
    if getattr(model.cfg, "tie_word_embeddings", False) and head is not None and embed is not None and not torch.equal(head, embed):
        raise UserError("model.tie_word_embeddings=True but the checkpoint's lm_head.weight differs from model.embed_tokens"
                        ".weight (transformers computes with the stored head); set tie_word_embeddings false in config.json")
    if model.lm_head is None:
        extra.discard("lm_head.weight")  # tied: HF may store a copy
    if model.embed_tokens is None:
        extra.discard("model.embed_tokens.weight")
    if model.norm is None:
        extra -= {"model.norm.weight", "lm_head.weight"}
    if past := sorted({layer_of[k] for k in extra if layer_of.get(k, -1) >= depth}):
        raise UserError(f"HF checkpoint holds layer(s) {past[:8]} past the config's {depth} (num_hidden_layers"
                        f"={model.cfg.num_hidden_layers}); set num_hidden_layers in config.json to the layers it holds")
    if extra:
        raise UserError(f"HF checkpoint has unexpected keys: {sorted(extra)[:8]}; does config.json match the weights?")
    return other_layers


@torch.no_grad()
def init_by_name(model: torch.nn.Module, seed: int, std: float) -> None:
    """Normal(0, std) for matrices (and any other parameter), ones for norm weights, zeros for
    biases; each parameter drawn from a generator seeded by (seed, its name), so every pipeline
    chunk or shard of a model draws the same values as the whole model."""
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith("bias"):
            p.zero_()
        else:
            gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            p.copy_(torch.randn(p.shape, generator=gen) * std)
