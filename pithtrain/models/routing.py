"""DeepSeek-style expert selection as plain functions any model family can call.

`select_experts` covers the router variants of the DeepSeek line:
  - scores: softmax over experts (DeepSeek-V2) or an independent sigmoid per expert (DeepSeek-V3);
  - an optional correction bias (V3's auxiliary-loss-free balancing) that is added to the scores
    only to *choose* experts; the combine weights always come from the unbiased scores;
  - optional group-limited selection: experts are split into `n_group` equal groups, each token
    keeps its best `topk_group` groups and picks its top-k experts inside them. A group's score is
    its best expert ("max", V2's group_limited_greedy) or the sum of its best two ("top2sum",
    V3's noaux_tc);
  - optional renormalisation of the chosen k weights, then a constant `routed_scaling_factor`.

`update_correction_bias` is the aux-loss-free balancing rule that moves the bias between steps."""

from __future__ import annotations

import torch

from pithtrain.ops.kernels import topk_ids  # Triton on GPUs, torch.topk elsewhere


def select_experts(logits: torch.Tensor, topk: int, score_func: str = "softmax",
                   correction_bias: torch.Tensor | None = None, n_group: int = 1, topk_group: int = 1,
                   group_score: str = "max", norm_topk_prob: bool = False,
                   routed_scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits: [T, E] router logits. Returns topk_ids [T, k] (int64), topk_weights [T, k] and
    scores [T, E] (the unbiased softmax/sigmoid scores, for the load-balance loss).

    Computed in at least fp32 (routing decisions are sensitive to rounding). Gradients reach the
    logits through the weights; selection and the bias carry none."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    scores = logits.sigmoid() if score_func == "sigmoid" else logits.softmax(dim=-1)  # the config allows these two
    with torch.no_grad():
        choice = scores if correction_bias is None else scores + correction_bias.to(scores.dtype)
        if n_group > 1:
            num_tokens, num_experts = choice.shape
            grouped = choice.view(num_tokens, n_group, num_experts // n_group)
            per_group = grouped.topk(2, dim=-1).values.sum(dim=-1) if group_score == "top2sum" else grouped.amax(dim=-1)
            kept = per_group.topk(topk_group, dim=-1).indices
            keep = torch.zeros_like(per_group, dtype=torch.bool).scatter_(1, kept, True)
            choice = choice.masked_fill(~keep.repeat_interleave(num_experts // n_group, dim=1), float("-inf"))
        ids = topk_ids(choice, topk)
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)  # epsilon as in DeepSeek-V3
    return ids, weights * routed_scaling_factor, scores


@torch.no_grad()
def update_correction_bias(bias: torch.Tensor, expert_loads: torch.Tensor, rate: float) -> None:
    """Aux-loss-free balancing (DeepSeek-V3, "bias update speed" gamma), in place: bias += rate *
    sign(mean(load) - load), so overloaded experts become less likely to be chosen, underloaded ones more.
    Called once per optimizer step for each bias of `model.correction_biases()`, with `expert_loads` [E] the
    (token, slot) assignments per expert over the whole global batch (all-reduced over every rank holding a
    replica of the router, so every replica applies the same update). The bias is a buffer: the optimizer,
    weight decay and clipping never see it; it is saved with the model (HF: `mlp.gate.e_score_correction_bias`)."""
    load = expert_loads.to(device=bias.device, dtype=torch.float32)
    bias.add_(torch.sign(load.mean() - load).to(bias.dtype), alpha=rate)
