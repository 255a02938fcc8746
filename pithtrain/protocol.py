"""The 5-stage decoder-layer contract every model family implements, and RoutingInfo.

A MoE decoder layer is cut at the expert-parallel communication boundaries:

  stage 1  norm -> attention -> norm -> (shared experts) -> router          (model, compute)
  stage 2  dispatch: each token to the ranks holding its experts           (engine, communication)
  stage 3  expert computation on tokens grouped by local expert            (model, compute)
  stage 4  combine: one row per (token, chosen expert) back home           (engine, communication)
  stage 5  weighted sum of expert outputs + shared output + residual       (model, compute)

A model layer provides `stage1(x, attn) -> Stage1Out`, `stage3(tokens, counts, weight_queue)
-> tokens` and `stage5(s1, combined) -> x`. With a `weight_queue` (ops/grouped_gemm.py), the
expert weight gradients are deferred to it (zero-bubble W passes run by the pipeline schedule). Dense layers (no routed experts) return `routing=None` from stage 1
and their output in `residual`. `run_layer` below is the plain sequential composition; the
pipeline engine interleaves the same calls of two micro-batches.
"""

from __future__ import annotations

import contextlib
import os
import zlib
from dataclasses import dataclass
from typing import Protocol

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


# Registered as pytrees so that FSDP2 sees the tensors inside a stage's output and gathers the
# layer's weights before ANY gradient reaches them (the load-balance loss reads `scores`
# without passing through stage 5).
torch.utils._pytree.register_dataclass(RoutingInfo)
torch.utils._pytree.register_dataclass(Stage1Out)


class DecoderLayer(Protocol):
    layer_id: int

    def stage1(self, x: torch.Tensor, attn) -> Stage1Out: ...

    def stage3(self, tokens: torch.Tensor, counts: torch.Tensor, weight_queue=None) -> torch.Tensor: ...

    def stage5(self, s1: Stage1Out, combined: torch.Tensor) -> torch.Tensor: ...


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
        engine.record_routing(layer.layer_id, s1.routing)
        tokens, counts, handle = engine.dispatch(s1.moe_input, s1.routing)
    with stage_range(3):
        expert_out = layer.stage3(tokens, counts, engine.weight_queue)
    with stage_range(4):
        combined = engine.combine(expert_out, handle)
    with stage_range(5):
        return layer.stage5(s1, combined)


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
