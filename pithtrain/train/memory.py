"""Peak GPU memory per rank of a training run, estimated before launching it (`pithtrain train --dry-run`
and the estimate-memory skill, whose SKILL.md explains the terms and their calibration).

Static part (exact: counted from the model built on the meta device, split and sharded as the run
will be): fp32 master weights, gradients and AdamW moments of the rank's shard, the bf16 copies,
FP8 caches and accumulation buffers. Activation part (calibrated to measured H200 peaks, bf16
compute): bytes per token per layer times a factor, times the micro-batches a rank holds at once."""

from __future__ import annotations

import torch

from pithtrain.config import runs_dualpipev
from pithtrain.ops import grouped_gemm, kernels
from pithtrain.parallel.pipeline import rank_chunks, split_layers

GIB = 2**30
# Fitted (least squares, relative) to the one-GPU peaks since the loss's gradient went over the logits and the
# residual stream went bf16 (tests/test_skills.py's five shapes, docs/performance.md Memory): within 1.7%.
ACTIVATION_FACTOR = 0.90  # on layer_activation_bytes
HEAD_BYTES_PER_LOGIT = 2.3  # per token and vocabulary entry: the bf16 logits, their gradient in place, the loss's chunks
# 2 H200s, ep2, three widths: 0.12 kept the fit before those changes 4-15% above the peaks then; raised to stay
# near them (-6% to +10%) until two GPUs measure the peaks since, which the changes lowered by ~4% on one GPU
MULTI_GPU_OVERHEAD = 0.2


def param_counts(cfg, layer_ids, embed: bool, head: bool) -> tuple[int, int]:
    """(dense, expert) parameter counts of one model chunk, from a meta-device build."""
    with torch.device("meta"):
        named = list(cfg.build_model(layer_ids, embed=embed, head=head).named_parameters())
    expert = sum(p.numel() for name, p in named if ".experts." in name)
    return sum(p.numel() for _, p in named) - expert, expert


def layer_activation_bytes(cfg, layer_id: int, seq: int, recompute: str = "off", cp: int = 1) -> float:
    """Bytes saved for backward per (rank-local) token by one layer (bf16, before the calibration factor).
    cp: a Gated DeltaNet layer saves its mixer's tensors over the sequence gathered from cp ranks.
    train.recompute: selective drops the experts' SwiGLU output (top-k x I); full keeps of stages
    1 (norms, attention, shared experts or dense MLP, router) and 3 (experts) only their inputs."""
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    if cfg.model_type in ("deepseek_v2", "deepseek_v3"):  # MLA
        q = k = heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
        v = o = heads * cfg.v_head_dim
    else:
        d = getattr(cfg, "head_dim", None) or cfg.dim_per_head
        q, k, v, o = heads * d, cfg.num_key_value_heads * d, cfg.num_key_value_heads * d, heads * d
    full = recompute == "full"
    if cfg.model_type == "qwen3_5_moe_text":
        q += heads * d  # the output gate, and its product with the attention output
        o += heads * d
        if cfg.layer_type(layer_id) == "linear_attention":  # Gated DeltaNet instead of attention
            kd, vd = cfg.linear_num_key_heads * cfg.linear_key_head_dim, cfg.linear_num_value_heads * cfg.linear_value_head_dim
            # the qkv projection, the conv before and after SiLU; q, k L2-normed in fp32 (2 units each) and
            # their bf16 copies for the kernel; v, z, the rule's output and the gated norm's; the kernel's
            # per-chunk solve (heads x 64, fp32)
            q = cp * (3 * (2 * kd + vd) + 2 * 2 * 2 * kd + 2 * kd + 4 * vd + 2 * 64 * cfg.linear_num_value_heads)
            k = v = o = 0
    elements = h if full else 6 * h + q + k + v + o  # stage 1's input, or its norms and attention
    if cfg.is_moe_layer(layer_id):
        topk, inter = cfg.num_experts_per_tok, getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
        experts = 0 if full else 2 * inter if recompute == "selective" else 3 * inter  # gate/up product, SwiGLU output
        elements += topk * (2 * h + experts) + topk * h + 2 * cfg.num_routed_experts()
        shared = 0 if full else getattr(cfg, "n_shared_experts", None) or 0  # shared experts run in stage 1
        elements += 3 * inter * shared + (h if shared else 0)
        if not full and getattr(cfg, "shared_expert_intermediate_size", 0):  # Qwen3.5's gated shared expert
            elements += 3 * cfg.shared_expert_intermediate_size + 2 * h
    elif not full:  # the dense MLP runs in stage 1
        elements += 3 * cfg.intermediate_size + h
    return 2.0 * elements


def estimate(config, world: int) -> list[dict]:
    """Per pipeline rank: a dict of GiB by component, and 'total'."""
    cfg, p, t = config.model, config.parallel, config.train
    pp, cp, ep = p.pp, p.cp, p.ep
    dp = world // (pp * cp * ep)
    micro_per_rank = t.global_batch_size // (t.micro_batch_size * dp * ep)  # per data rank: dp x ep of them
    pipeline, tokens = runs_dualpipev(config, world), t.micro_batch_size * config.data.seq_len // cp
    if pipeline:
        placement = split_layers(cfg.num_hidden_layers, pp)
        caps = [[2 * pp - r - 1, r + 1] for r in range(pp)] if pp > 1 else [[2, 2]]
        ranks = [[(placement[first], first == 0, False, caps[r][0]),
                  (placement[second], False, second == 2 * pp - 1, caps[r][1])]
                 for r in range(pp) for first, second in [rank_chunks(pp, r)]]
    else:
        ranks = [[(list(range(cfg.num_hidden_layers)), True, True, 1)]]
    out = []
    for chunks in ranks:
        dense = expert = table = act = 0  # table: embedding and head parameters, never FP8
        for layer_ids, embed, head, in_flight in chunks:
            d, e = param_counts(cfg, layer_ids, embed, head)
            dense, expert = dense + d, expert + e
            table += cfg.vocab_size * cfg.hidden_size * (int(embed) + int(head))
            # the head's chunk also runs the multi-token prediction layers (DeepSeek-V3), each with its head
            mtp = range(cfg.num_hidden_layers, cfg.num_hidden_layers + cfg.num_nextn_predict_layers) if head else ()
            per_token = sum(layer_activation_bytes(cfg, i, config.data.seq_len, t.recompute, cp) for i in [*layer_ids, *mtp])
            per_token = per_token * ACTIVATION_FACTOR + (HEAD_BYTES_PER_LOGIT * cfg.vocab_size * (1 + len(mtp)) if head else 0.0)
            act += in_flight * tokens * per_token
        local = dense / (dp * cp * ep) + expert / ep / (dp * cp)
        parts = {"master weights (fp32)": 4 * local, "gradients (fp32)": 4 * local, "AdamW moments (fp32)": 8 * local}
        fp8 = config.train.fp8 != "off"
        if fp8:  # ops/fp8.py: two 1-byte layouts of every FP8 weight (experts, projections), per step
            parts["FP8 weight caches (2 layouts)"] = 2 * (expert / (1 if world == 1 else ep) + dense - table)
        if world == 1 and not fp8:
            parts["bf16 expert weights (cast once per step)"] = 2 * expert
        elif world > 1:
            parts["gathered bf16 parameters"] = 2 * (dense + expert / ep)
            if micro_per_rank > 1:  # the pipeline adds expert gradients to the shards directly
                parts["unsharded fp32 gradients (accumulation)"] = 4 * (dense + (0 if pipeline else expert / ep))
        parts["activations"] = act
        if config.train.fp8_head and any(head for *_, head, _ in chunks):  # the FP8 copy of d logits: the loss
            rows = tokens if kernels.CE_FP8_GRAD else min(tokens, grouped_gemm.HEAD_DGRAD_ROWS)  # backward's, or a block's
            parts["FP8 head's d logits copy"] = rows * cfg.vocab_size
        if world > 1:  # all-to-all and FSDP buffers, the deferred-W queue, pipeline tape leaves
            parts[f"runtime buffers (multi-GPU, calibrated +{MULTI_GPU_OVERHEAD:.0%})"] = MULTI_GPU_OVERHEAD * sum(parts.values())
        gib = {k: v / GIB for k, v in parts.items()}
        gib["total"] = sum(gib.values())
        out.append(gib)
    return out
