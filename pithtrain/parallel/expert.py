"""Stages 2 and 4 of the layer contract: dispatch tokens to experts and combine the outputs.

`LocalDispatch` is the single-rank case (expert parallelism 1): tokens are permuted into the
expert-grouped layout and back, with no communication. It returns the same (tokens, counts,
handle) triple the all-to-all dispatcher does, so the model code does not know which one runs."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from pithtrain.protocol import Combined, RoutingInfo, named_range
from pithtrain.ops.core import count_ids, stable_argsort_ids
from pithtrain.ops.fp8 import expand_quantized
from pithtrain.ops.kernels import dispatch_plan, expand, permute, unpermute  # Triton row moves on GPUs


class LocalDispatch:
    def dispatch(self, x: torch.Tensor, routing: RoutingInfo, loads: torch.Tensor | None = None):
        """x: [T, H]. Returns rows grouped by expert [T*k, H], rows per expert [E] (`loads` where counted
        already), a handle. The rows offer FP8 experts their FP8 copy quantized from the T tokens (`_fp8_rows`)."""
        topk, flat = routing.topk_ids.shape[1], routing.topk_ids.flatten()
        order = stable_argsort_ids(flat, routing.num_experts)  # (token, slot) pairs sorted by expert
        counts = count_ids(flat, routing.num_experts) if loads is None else loads
        rows = expand(x, order, topk)
        rows._fp8_rows = lambda: expand_quantized(x, order, topk)
        return rows, counts, order

    def combine(self, expert_out: torch.Tensor, handle) -> Combined:
        """The expert-grouped rows stay where they are: row i is (token, slot) pair order[i]."""
        return Combined(expert_out, handle)


class ExpertEngine:
    """What the model's layers call between their stages for one forward of one micro-batch: dispatch/combine (stages 2
    and 4) and the routing bookkeeping: the auxiliary loss values (`aux`: term name -> one value per MoE layer,
    protocol.AUX_TERMS; the load-balance loss's under "lb") and the expert loads."""

    def __init__(self, dispatcher, balance=None, batch: int = 0, seq: int = 0, weight_queue=None):
        self.dispatcher, self.balance, self.batch, self.seq = dispatcher, balance, batch, seq
        self.weight_queue = weight_queue  # DeferredWeightGrads: expert weight gradients run later
        self.aux: dict[str, list[torch.Tensor]] = {}
        self.expert_loads: dict[int, torch.Tensor] = {}  # layer id -> tokens per expert (detached)
        self.counted = None  # (routing, its loads) of the last record_routing, for its dispatch

    def record_routing(self, layer_id: int, routing: RoutingInfo, aux: dict[str, torch.Tensor] | None = None) -> None:
        """A MoE layer's routing (stage 1's), and its model-computed aux loss values (Stage1Out.aux)."""
        loads = count_ids(routing.topk_ids, routing.num_experts)
        self.expert_loads[layer_id] = loads
        self.counted = (routing, loads)  # the dispatch of this routing reuses them (LocalDispatch's counts)
        if self.balance is not None:
            self.aux.setdefault("lb", []).append(self.balance.layer_loss(routing, self.batch, self.seq, counts=loads))
        for name, value in (aux or {}).items():
            self.aux.setdefault(name, []).append(value)

    def dispatch(self, x, routing):
        counted, self.counted = self.counted, None
        loads = counted[1] if counted is not None and counted[0] is routing else None
        return self.dispatcher.dispatch(x, routing, loads)

    def combine(self, expert_out, handle):
        return self.dispatcher.combine(expert_out, handle)

    def lb_loss(self) -> torch.Tensor | None:
        """The load-balance loss of this forward: its mean over the MoE layers."""
        return torch.stack(self.aux["lb"]).mean() if self.aux.get("lb") else None


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with autograd: the backward sends gradients along the reverse splits,
    in the profiler range `name`.backward."""

    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group, name: str):
        ctx.splits, ctx.group, ctx.name = (out_splits, in_splits), group, name
        return _issue(x, out_splits, in_splits, group, async_op=False)[0]

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        with named_range(ctx.name + ".backward"):
            return _issue(grad, in_splits, out_splits, ctx.group, async_op=False)[0], None, None, None, None


def all_to_all(x, out_splits, in_splits, group, name: str = "pithtrain::all_to_all"):
    return _AllToAll.apply(x, out_splits, in_splits, group, name)


class Exchange:
    """One all-to-all of `src`, returned by the `*_start` halves and read back with `wait()`.

    Plain (async_op=False): the autograd all_to_all, run at once. Async (the overlapped pipeline):
    issued with async_op=True on a detached `src`, so the graph is cut here: `wait()` returns a
    fresh leaf, and the pipeline sends the leaf's gradient back itself with `reverse(grad)`.
    `name`: the profiler range of the collective (`name`.backward: its gradient's)."""

    def __init__(self, src, out_splits, in_splits, group, async_op=False, name="pithtrain::all_to_all"):
        self.src, self.splits, self.group, self.work, self.name = src, (out_splits, in_splits), group, None, name
        with named_range(name):
            if async_op:
                self.out, self.work = _issue(src.detach(), out_splits, in_splits, group)
            else:
                self.out = all_to_all(src, out_splits, in_splits, group, name)

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
            self.out.requires_grad_(self.src.requires_grad)
        return self.out

    def reverse(self, grad):
        """Issue the all-to-all of a gradient of `out` back to the senders: (buffer, work)."""
        out_splits, in_splits = self.splits
        with named_range(self.name + ".backward"):
            return _issue(grad, in_splits, out_splits, self.group)


def _issue(x, out_splits, in_splits, group, async_op: bool = True):
    """all_to_all_single of `x` into a new buffer: (buffer, work; None unless `async_op`)."""
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    return out, dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group, async_op=async_op)


class _Plan(NamedTuple):
    send_token: torch.Tensor  # [rows] token of each send row, rows ordered by destination rank
    slot_meta: torch.Tensor  # [rows, k] local expert id of each slot on the destination, -1 elsewhere
    home_index: torch.Tensor  # [pairs] where each returning (token, slot) pair lands in [T*k]
    counts: "_Counts"
    topk: int


class _Counts:
    """The split sizes [ep, 4] (rows and pairs sent, rows and pairs received) on their way to the host. Async on CUDA:
    the count all-to-all is issued now and a side stream copies its result to pinned memory behind it, so `host()` waits
    for that stream only. The overlapped pipeline queues the other micro-batch's compute between the two: the host sync
    no longer drains the GPU."""

    def __init__(self, send_counts, group, stream: torch.cuda.Stream | None):
        """`stream`: the side stream for the async path; None: exchange and copy synchronously."""
        recv = torch.empty_like(send_counts)
        if stream is None:
            dist.all_to_all_single(recv, send_counts, group=group)
            self.both, self.event = torch.cat([send_counts, recv], 1), None
            return
        work = dist.all_to_all_single(recv, send_counts, group=group, async_op=True)
        stream.wait_stream(torch.cuda.current_stream(send_counts.device))
        with torch.cuda.stream(stream):
            work.wait()
            both = torch.cat([send_counts, recv], 1)
            self.both = torch.empty(both.shape, dtype=both.dtype, pin_memory=True)
            self.both.copy_(both, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record(stream)
        self._alive = (send_counts, recv, both)  # not freed before the side stream is done

    def host(self) -> list[list[int]]:
        if self.event is not None:
            with torch.profiler.record_function("pithtrain::wait_split_sizes"):  # host blocked: shows in profiles
                self.event.synchronize()
        return self.both.tolist()


class AllToAllDispatch:
    """Expert parallelism over `group` (size ep): rank r holds experts [r*E/ep, (r+1)*E/ep).

    Dispatch sends each token ONCE to every rank that holds at least one of its chosen experts (deduplication), with the
    local expert ids of its slots there; the receiver expands the rows to one per (token, expert) and groups them by
    local expert. Combine returns one row per (token, chosen expert) to the token's home rank, where stage 5 does the
    weighted sum, so the arithmetic is the same as on one rank.

    Host synchronisations: one per MoE layer in forward, the `.tolist()` of the exchanged split sizes (all_to_all_single
    needs them on the host); the backward reuses them. On GPUs the plan is a Triton kernel (no sync) and the received
    pairs are expanded with a host-known size. The grouped GEMM takes its group offsets on the device (no sync); its CPU
    fallback loop syncs."""

    def __init__(self, group, num_experts: int):
        self.group, self.ep, self.side_stream = group, dist.get_world_size(group), None
        self.local_experts = num_experts // self.ep

    def dispatch(self, x: torch.Tensor, routing: RoutingInfo, loads: torch.Tensor | None = None):
        """`loads` (the routing's global expert loads) do not give this rank's counts: unused."""
        return self.dispatch_finish(self.dispatch_start(x, routing))

    def combine(self, expert_out: torch.Tensor, handle) -> Combined:
        return self.combine_finish(self.combine_start(expert_out, handle))

    # Each stage is split in a start half (everything up to issuing the all-to-all) and a finish
    # half (wait, then the local re-layout), so that the pipeline can run another micro-batch's
    # compute in between. Dispatch has a third, earlier part, `plan`, which starts the exchange
    # of the split sizes: the overlapped pipeline runs other compute before reading them.

    def plan(self, routing: RoutingInfo, async_op: bool = False) -> _Plan:
        """Where each token goes (ops/kernels.dispatch_plan: no host sync on GPUs), and the exchange
        of the split sizes, started but not waited on."""
        ids = routing.topk_ids
        plan, stream = dispatch_plan(ids, self.local_experts, self.ep), None
        if async_op and ids.is_cuda:  # the async counts' copy stream, made on first use
            stream = self.side_stream = self.side_stream or torch.cuda.Stream(ids.device)
        with named_range("pithtrain::dispatch"):  # the exchange of the split sizes
            counts = _Counts(plan.send_counts, self.group, stream)
        return _Plan(plan.send_token, plan.slot_meta, plan.home_index, counts, ids.shape[1])

    def dispatch_start(self, x: torch.Tensor, routing: RoutingInfo, async_op: bool = False, plan=None):
        plan = self.plan(routing, async_op) if plan is None else plan
        counts = plan.counts.host()  # the one host sync of the layer
        send_rows, send_pairs, recv_rows, recv_pairs = (list(column) for column in zip(*counts))
        real = sum(send_rows)  # the plan's rows past this are padding
        send, send_meta = permute(x, plan.send_token[:real]), plan.slot_meta[:real].contiguous()
        rows = Exchange(send, recv_rows, send_rows, self.group, async_op, "pithtrain::dispatch")
        meta = torch.empty((sum(recv_rows), plan.topk), dtype=plan.slot_meta.dtype, device=plan.slot_meta.device)
        with named_range("pithtrain::dispatch"):
            meta_work = dist.all_to_all_single(meta, send_meta, recv_rows, send_rows, group=self.group, async_op=True)
        return rows, (meta, meta_work), (recv_pairs, send_pairs, plan.home_index)

    def dispatch_finish(self, pending):
        rows, (meta, meta_work), (recv_pairs, send_pairs, home_index) = pending
        rows = rows.wait()
        meta_work.wait()
        # expand to one row per (received token, local expert), grouped by local expert
        # (row, slot) order == source-rank order; the count is known on the host: no sync
        row_idx, slot_idx = torch.nonzero_static(meta >= 0, size=sum(recv_pairs)).unbind(1)
        experts = meta[row_idx, slot_idx]
        order = stable_argsort_ids(experts, self.local_experts)
        tokens = permute(rows, row_idx[order])
        return tokens, count_ids(experts, self.local_experts), (order, recv_pairs, send_pairs, home_index)

    def combine_start(self, expert_out: torch.Tensor, handle, async_op: bool = False):
        order, recv_pairs, send_pairs, home_index = handle
        by_source = unpermute(expert_out, order, expert_out.shape[0])  # undo expert grouping
        return Exchange(by_source, send_pairs, recv_pairs, self.group, async_op, "pithtrain::combine"), home_index

    def combine_finish(self, pending) -> Combined:
        back, home_index = pending
        return Combined(back.wait(), home_index)  # every (token, slot) pair comes back once
