"""Stages 2 and 4 of the layer contract: dispatch tokens to experts and combine the outputs.

`LocalDispatch` is the single-rank case (expert parallelism 1): tokens are permuted into the
expert-grouped layout and back, with no communication. It returns the same (tokens, counts,
handle) triple the all-to-all dispatcher does, so the model code does not know which one runs.
"""

from __future__ import annotations

import torch

from pithtrain.models.protocol import RoutingInfo


class LocalDispatch:
    def dispatch(self, x: torch.Tensor, routing: RoutingInfo):
        """x: [T, H]. Returns rows grouped by expert [T*k, H], rows per expert [E], and a handle."""
        topk = routing.topk_ids.shape[1]
        flat = routing.topk_ids.flatten()
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs sorted by expert
        counts = torch.bincount(flat, minlength=routing.num_experts)
        tokens = x.index_select(0, order // topk)
        return tokens, counts, (order, x.shape[0], topk)

    def combine(self, expert_out: torch.Tensor, handle) -> torch.Tensor:
        """Inverse permutation: returns [T, k, H] in the router's (token, slot) order."""
        order, num_tokens, topk = handle
        out = expert_out.new_zeros(expert_out.shape).index_copy(0, order, expert_out)
        return out.view(num_tokens, topk, -1)


class ExpertEngine:
    """What the model's layers call between their stages for one forward of one micro-batch:
    dispatch/combine (stages 2 and 4) and the routing bookkeeping (load-balance loss, expert loads)."""

    def __init__(self, dispatcher, balance=None, batch: int = 0, seq: int = 0):
        self.dispatcher, self.balance, self.batch, self.seq = dispatcher, balance, batch, seq
        self.lb_terms: list[torch.Tensor] = []
        self.expert_loads: dict[int, torch.Tensor] = {}  # layer id -> tokens per expert (detached)

    def record_routing(self, layer_id: int, routing: RoutingInfo) -> None:
        self.expert_loads[layer_id] = torch.bincount(routing.topk_ids.flatten(), minlength=routing.num_experts)
        if self.balance is not None:
            self.lb_terms.append(self.balance.layer_loss(routing, self.batch, self.seq))

    def dispatch(self, x, routing):
        return self.dispatcher.dispatch(x, routing)

    def combine(self, expert_out, handle):
        return self.dispatcher.combine(expert_out, handle)

    def lb_loss(self) -> torch.Tensor | None:
        return torch.stack(self.lb_terms).mean() if self.lb_terms else None
