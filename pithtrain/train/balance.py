"""MoE load-balance losses (micro-batch, global-batch and sequence variants).

For one MoE layer with E experts, top-k routing and T tokens:
    f_e = (tokens routed to e) / (T * k)        (no gradient)
    P_e = mean over tokens of the normalised router score for e
    L   = E * sum_e f_e * P_e                   (1.0 when perfectly balanced)
The variants differ only in the scope of the statistics:
  micro   f and P over the tokens of this micro-batch (all CP ranks of it);
  global  f summed over every data-parallel rank's current micro-batch (an all-reduce of the
          counts), P over this micro-batch: balance is asked of the global batch, not each
          micro-batch; on one process it equals `micro`;
  seq     f and P per sequence, L averaged over sequences (DeepSeek-V3's sequence-wise loss).
The logged `lb_loss` is the mean of L over MoE layers; `train.lb_coef` scales it in the loss.

Context parallelism (`cp_group`): each CP rank holds an equal share of every sequence of the micro-batch, so the
per-sequence (`seq`) and per-micro-batch statistics are the means of the CP ranks' local ones: an all-reduce over
cp_group. Every CP rank then computes the same L. P must stay differentiable: its all-reduce passes the gradient to the
LOCAL share only (the other shares are constants here, and their ranks backpropagate them), so the parameter gradients
summed over the CP ranks, as FSDP does, are those of L."""

from __future__ import annotations

import torch
import torch.distributed as dist

from pithtrain.protocol import RoutingInfo
from pithtrain.ops.core import count_ids


def _sum_over(group: dist.ProcessGroup, t: torch.Tensor) -> torch.Tensor:
    """Sum of `t` over the ranks of `group`, differentiable in this rank's `t` (the other ranks'
    shares enter as constants)."""
    total = t.detach().clone()
    dist.all_reduce(total, group=group)
    return t + (total - t.detach())


class LoadBalance:
    def __init__(self, lb_type: str, count_group: dist.ProcessGroup | None = None,
                 cp_group: dist.ProcessGroup | None = None):
        self.lb_type = lb_type
        self.count_group = count_group  # ranks whose counts `global` sums (None: this process alone)
        self.cp_group = cp_group  # ranks sharing each sequence (None: no context parallelism)

    def layer_loss(self, routing: RoutingInfo, batch: int, seq: int, counts: torch.Tensor | None = None) -> torch.Tensor:
        """`seq`: this rank's tokens per sequence (its share under context parallelism); `counts`:
        tokens per expert of this micro-batch when the caller has them already."""
        num_experts, topk = routing.num_experts, routing.topk_ids.shape[1]
        scores = routing.scores.float()
        probs = scores / scores.sum(-1, keepdim=True)
        if self.lb_type == "seq":
            ids = routing.topk_ids.view(batch, seq * topk)
            counts = torch.zeros(batch, num_experts, device=ids.device)
            counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float))
            f, p = counts / (seq * topk), probs.view(batch, seq, num_experts).mean(1)
            if self.cp_group is not None:  # whole sequences: every CP rank holds `seq` of their tokens
                f, p = (_sum_over(self.cp_group, torch.stack([f, p])) / dist.get_world_size(self.cp_group)).unbind()
            return num_experts * (f * p).sum(-1).mean()
        counts = (count_ids(routing.topk_ids, num_experts) if counts is None else counts).float()
        total = torch.full((), float(routing.topk_ids.numel()), device=counts.device)  # no host-to-device copy (a sync)
        p = probs.mean(0)
        if self.cp_group is not None:  # the micro-batch's tokens are spread evenly over the CP ranks
            stats = _sum_over(self.cp_group, torch.cat([counts, total[None], p]))
            counts, total = stats[:num_experts].detach(), stats[num_experts].detach()
            p = stats[num_experts + 1 :] / dist.get_world_size(self.cp_group)
        if self.lb_type == "global" and self.count_group is not None:
            stats = torch.cat([counts, total[None]])
            dist.all_reduce(stats, group=self.count_group)
            counts, total = stats[:-1], stats[-1]
        f = counts / total
        return num_experts * (f * p).sum()
