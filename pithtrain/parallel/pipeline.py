"""DualPipeV pipeline parallelism: V-shaped placement and the schedule.

Placement: the model is cut into 2*pp chunks; rank r holds chunk r (phase 0, the way down) and chunk 2pp-1-r (phase 1,
the way back up), so rank 0 holds both the embedding (chunk 0) and the LM head (chunk 2pp-1). Edge chunks get fewer
layers since they also carry embedding and head.

Schedule: per rank, a list of operations on (phase, micro-batch):
  F   forward of that rank's chunk of the phase
  B   backward for the inputs (the expert weight gradients may be deferred to a W)
  W   the deferred weight-gradient work of one earlier B
  FB  the forward of one micro-batch overlapped with the backward of another, on the two
      chunks of the rank (phase 0 forward with phase 1 backward, or the reverse)
  FF, BB  two forwards / two backwards, one on each chunk (the pipeline's edges: warm-up, drain)
  BW  a backward with the other chunk's W work computing under its all-to-alls
A pair is always of the two chunks (separate FSDP roots), never two ops of one chunk. The list is produced by simulating
the pipeline in unit time with DualPipeV's rules: warm-up with forwards bounded per phase, a steady state of overlapped
FB pairs, W work only where the rank would otherwise idle (or at the end), and the W queue empty at the end of the step;
the rules for FF/BB/BW are chosen by simulation (never slower; then fewest exposed all-to-alls). `simulate` replays any
schedule against the dependencies and reports its bubble fraction."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from pithtrain.protocol import LossTerms, RoutingInfo, stage_range
from pithtrain.ops.grouped_gemm import DeferredWeightGrads, head_logits
from pithtrain.parallel.fsdp import add_grad


def split_layers(num_layers: int, pp: int) -> list[list[int]]:
    """Global layer ids of each of the 2*pp chunks, in model order; edge chunks get fewer."""
    n = 2 * pp
    sizes = [num_layers // n] * n
    inner_first = sorted(range(n), key=lambda c: -min(c, n - 1 - c))  # innermost chunks first
    for c in inner_first[: num_layers % n]:
        sizes[c] += 1
    if n > 2:
        for edge in (0, n - 1):  # the embedding / head count as extra work: move a layer inward
            inner = min(range(1, n - 1), key=lambda c: sizes[c])
            if sizes[edge] > 0 and sizes[edge] >= sizes[inner]:
                sizes[edge] -= 1
                sizes[inner] += 1
    starts = [sum(sizes[:c]) for c in range(n)]
    return [list(range(start, start + size)) for start, size in zip(starts, sizes)]


def rank_chunks(pp: int, rank: int) -> tuple[int, int]:
    """(phase-0 chunk, phase-1 chunk) of a rank."""
    return rank, 2 * pp - 1 - rank


def ranks_without_layers(num_layers: int, pp: int) -> list[int]:
    """Pipeline ranks that split_layers gives no layer (rank 0 holds the embedding and the head anyway)."""
    chunks = split_layers(num_layers, pp)
    return [r for r in range(1, pp) if not any(chunks[c] for c in rank_chunks(pp, r))]


@dataclass(frozen=True)
class Op:
    kind: str  # "F", "B", "W", or a pair on the two chunks: "FB", "FF", "BB", "BW"
    phase: int = -1  # the phase of the op (of a pair's first; its second runs on the other phase)
    mb: int = -1  # the micro-batch (of a pair's first)
    mb_b: int = -1  # a pair's second micro-batch


def _parts(op: Op) -> list[tuple[str, int, int]]:
    """(kind, phase, mb) of each single op within `op`."""
    return ([(op.kind, op.phase, op.mb)] if len(op.kind) == 1
            else [(op.kind[0], op.phase, op.mb), (op.kind[1], 1 - op.phase, op.mb_b)])


def _deps(pp: int, rank: int, kind: str, phase: int, mb: int) -> list[tuple[int, str, int, int]]:
    """(rank, kind, phase, mb) that must finish before this op can start."""
    chunk = rank_chunks(pp, rank)[phase]

    def on(c, k):  # op k of this micro-batch on chunk c, at c's rank and phase
        return (c, k, 0, mb) if c < pp else (2 * pp - 1 - c, k, 1, mb)

    if kind == "W":
        return [(rank, "B", phase, mb)]
    if kind == "F":
        return [on(chunk - 1, "F")] if chunk > 0 else []
    return [(rank, "F", phase, mb)] + ([on(chunk + 1, "B")] if chunk < 2 * pp - 1 else [])


@functools.lru_cache(maxsize=16)  # a pure function of its arguments, asked for every step
def dualpipev_schedule(pp: int, num_micro: int, defer_w: bool = True,
                       pair_edges: bool | None = None) -> tuple[tuple[Op, ...], ...]:
    """The per-rank operation lists for `num_micro` >= 2*pp micro-batches. `pair_edges`: where no FB fits, run two ready
    forwards (FF) or backwards (BB) of the rank's two chunks as a pair, and a lone backward with the other chunk's
    queued W work (BW); False: none of it; None: of a few pairing rules, the one the simulation finds fastest by compute
    alone, ties going to the fewest exposed all-to-alls (a pair delays its first op's result: greedy FF/BB everywhere is
    often slower; BW is mostly chosen, FF/BB rarely). At pp = 1, F0.0 and B0.last can never be in a chunk pair and each
    pair takes one op of each chunk, so 4 F/B stay unpaired with FF/BB too; BW pairs the last two backwards, leaving
    F0.0 and F1.0 (no W work exists yet)."""
    if num_micro < 2 * pp:
        raise ValueError(f"DualPipeV needs at least 2*pp = {2 * pp} micro-batches per step, got {num_micro}; "
                         f"raise train.global_batch_size or lower train.micro_batch_size")
    every, with_w = {(r, k) for r in range(pp) for k in "FB"}, {(r, "W") for r in range(pp)}
    if pair_edges is not None:
        return _schedule(pp, num_micro, defer_w, frozenset(every | with_w if pair_edges else ()))
    rules = ((), {(pp - 1, "B")}, {(pp - 1, "B"), (pp - 1, "F")}, {(0, "B")}, every)
    candidates = [frozenset(c | w) for c in map(set, rules) for w in (set(), with_w)]

    def score(lists):  # compute-only makespan, then with each exposed all-to-all 1/4 of an op
        return [simulate(lists, pp, num_micro, defer_w, cost_a2a=c)["makespan"] for c in (0, 0.25)]
    return min((_schedule(pp, num_micro, defer_w, c) for c in candidates), key=score)


def _schedule(pp: int, num_micro: int, defer_w: bool, pairs: frozenset) -> tuple[tuple[Op, ...], ...]:
    """DualPipeV's rules, simulated in unit time; `pairs`: (rank, "F"/"B"/"W") allowed FF/BB/BW."""
    done: dict[tuple[int, str, int, int], int] = {}  # op -> finish time
    next_f = [[0, 0] for _ in range(pp)]  # next forward micro-batch per rank and phase
    next_b = [[0, 0] for _ in range(pp)]
    wqueue: list[list[tuple[int, int]]] = [[] for _ in range(pp)]
    busy_until = [0] * pp
    lists: list[list[Op]] = [[] for _ in range(pp)]
    # warm-up bound on forwards in flight per phase (DualPipeV fills rank r with 2pp-r-1 / r+1)
    # pp = 1: one rank holds both chunks; two forwards in flight per phase let the forward of
    # micro-batch i+1 overlap the backward of micro-batch i (FB ops) all the way through
    cap = [[2 * pp - r - 1, r + 1] for r in range(pp)] if pp > 1 else [[2, 2]]
    remaining, t = pp * 2 * num_micro * (3 if defer_w else 2), 0

    def ready(rank, kind, phase, mb):
        return mb < num_micro and all(done.get(d, 10**9) <= t for d in _deps(pp, rank, kind, phase, mb))

    while remaining:
        for rank in range(pp):
            if busy_until[rank] > t:
                continue
            f_ok = [ready(rank, "F", p, next_f[rank][p]) and next_f[rank][p] - next_b[rank][p] < cap[rank][p]
                    for p in (0, 1)]
            b_ok = [ready(rank, "B", p, next_b[rank][p]) for p in (0, 1)]
            op, cost = None, 0
            if pp == 1 and len(wqueue[rank]) > 2:  # no bubbles to fill: keep the queue (and the activations it holds) short
                op, cost = Op("W", *wqueue[rank].pop(0)), 1
            for pf in (0, 1) if op is None else ():  # steady state: a forward overlapped with the other phase's backward
                if f_ok[pf] and b_ok[1 - pf]:
                    op, cost = Op("FB", pf, next_f[rank][pf], next_b[rank][1 - pf]), 2 if defer_w else 3
                    break
            # else backward first (it frees memory and unblocks the other ranks), then forward;
            # where both chunks have one ready, the two run as a pair too (warm-up and drain,
            # the pipeline's edges): each forward still counts against its phase's warm-up cap,
            # so a pair keeps no more activations in flight than the two ops one after the other
            for kind, ok, nxt, unit in (("B", b_ok, next_b, 1 if defer_w else 2), ("F", f_ok, next_f, 1)):
                if op is None and ok[0] and ok[1] and (rank, kind) in pairs:
                    op, cost = Op(kind * 2, 1, nxt[rank][1], nxt[rank][0]), 2 * unit
                for p in (1, 0) if op is None else ():
                    if ok[p]:
                        op, cost = Op(kind, p, nxt[rank][p]), unit
                        other_w = [w for w in wqueue[rank] if w[0] != p]  # the other chunk's W work: run now,
                        if kind == "B" and (rank, "W") in pairs and other_w:  # not later, under B's all-to-alls
                            wqueue[rank].remove(other_w[0])
                            op, cost = Op("BW", p, op.mb, other_w[0][1]), unit + 1
                        break
            if op is None and wqueue[rank]:
                op, cost = Op("W", *wqueue[rank].pop(0)), 1
            if op is None:
                continue
            lists[rank].append(op)
            busy_until[rank] = t + cost
            for kind, phase, mb in _parts(op):
                if kind != "W":
                    (next_f if kind == "F" else next_b)[rank][phase] += 1
                if kind == "B" and defer_w:
                    wqueue[rank].append((phase, mb))
                done[(rank, kind, phase, mb)] = t + cost
                remaining -= 1
        t += 1
        if t > 100 * (num_micro + pp) * 4:
            raise RuntimeError("pipeline schedule did not converge")  # a bug, never an input problem
    return lists


def simulate(lists: list[list[Op]], pp: int, num_micro: int, defer_w: bool = True, cost_a2a: float = 0.0) -> dict:
    """Replay the per-rank lists in order against the dependencies (a rank waits for its next op's inputs). Raises on a
    missing, repeated or out-of-order op and on deadlock. Returns the makespan and bubble fraction (idle share of
    rank-time). F, B and W cost 1 each (B 2 with W inside it: not `defer_w`); `cost_a2a`: the exposed all-to-all time of
    an unpaired F or B (a pair hides it under the other chunk's compute)."""
    seen, finish = set(), {}
    pos, clock = [0] * pp, [0.0] * pp
    progressed = True
    while progressed:
        progressed = False
        for rank in range(pp):
            while pos[rank] < len(lists[rank]):
                op = lists[rank][pos[rank]]
                parts = _parts(op)
                deps = [d for kind, phase, mb in parts for d in _deps(pp, rank, kind, phase, mb)]
                if any(d not in finish for d in deps):
                    break
                start = max([clock[rank]] + [finish[d] for d in deps])
                cost = sum(2 if k == "B" and not defer_w else 1 for k, _, _ in parts)
                cost += cost_a2a if op.kind in ("F", "B") else 0  # exposed: no other chunk computes
                for kind, phase, mb in parts:
                    if (key := (rank, kind, phase, mb)) in seen:
                        raise AssertionError(f"rank {rank} runs {kind} phase {phase} mb {mb} twice")
                    seen.add(key)
                    finish[key] = start + cost
                clock[rank] = start + cost
                pos[rank] += 1
                progressed = True
    if stuck := {r: lists[r][pos[r]] for r in range(pp) if pos[r] < len(lists[r])}:
        raise AssertionError(f"deadlock: ranks wait forever at {stuck}")
    kinds = ("F", "B", "W") if defer_w else ("F", "B")
    expected = {(r, k, p, m) for r in range(pp) for k in kinds for p in (0, 1) for m in range(num_micro)}
    if seen != expected:
        raise AssertionError(f"missing ops: {sorted(expected - seen)[:5]}, unexpected: {sorted(seen - expected)[:5]}")
    makespan, work = max(clock), pp * 2 * num_micro * 3
    return {"makespan": makespan, "bubble_fraction": 1 - work / (pp * makespan)}


# ---- Execution on a (pp, dp, cp, ep) mesh ----


class ChunkPair(torch.nn.Module):
    """This rank's two chunks seen as one module with the model's own parameter names (global layer ids, no prefix), for
    the optimizer, checkpoints and the grad norm. Forward goes through the chunks themselves."""

    def __init__(self, down, up):
        super().__init__()
        self.chunks = (down, up)  # a tuple: not registered, so names carry no chunk prefix
        self.layers = torch.nn.ModuleDict({**down.layers, **up.layers})
        for name in ("embed_tokens", "norm", "lm_head", "mtp"):
            module = getattr(down, name, None) if getattr(down, name, None) is not None else getattr(up, name, None)
            setattr(self, name, module)

    def correction_biases(self) -> dict:
        return {**self.chunks[0].correction_biases(), **self.chunks[1].correction_biases()}


def build_chunks(cfg, pp: int, pp_rank: int, seed: int):
    """This rank's phase-0 and phase-1 chunks, initialised like the whole model."""
    placement = split_layers(cfg.num_hidden_layers, pp)
    first, second = rank_chunks(pp, pp_rank)
    down = cfg.build_model(placement[first], embed=first == 0, head=False)
    up = cfg.build_model(placement[second], embed=False, head=second == 2 * pp - 1)
    for chunk in (down, up):
        chunk.init_weights(seed)
    return down, up


class _Tape:
    """One chunk forward cut into segments at its all-to-alls, for the segmented backward.

    Segment k owns `roots[k]`, (tensor, grad) pairs known at forward time (loss, auxiliary loss values with their
    weights), and `cuts[k]`, (leaf, src, j, exchange): `leaf` is an input of segment k standing for `src` of the earlier
    segment j; its gradient becomes src's, through the reverse all-to-all if `exchange` is set. Every cross-segment
    tensor is cut, so each backward call stays inside one segment and every tensor gets its gradient exactly once."""

    def __init__(self):
        self.roots, self.cuts = [[]], [[]]

    def start_segment(self, exchange):
        """The all-to-all output just waited on starts a new segment."""
        self.roots.append([])
        self.cuts.append([(exchange.out, exchange.src, len(self.cuts) - 1, exchange)])

    def cut(self, src, segment):
        """A tensor of an earlier segment used by the current one (not via an all-to-all)."""
        if src is None or not src.requires_grad:
            return src
        leaf = src.detach().requires_grad_()
        self.cuts[-1].append((leaf, src, segment, None))
        return leaf


def _layer_steps(layer, x, attn, engine, tape, terms, note):
    """run_layer as a generator cut at the two all-to-alls: each is issued asynchronously, then
    the generator yields (the other micro-batch computes) and waits on it when resumed."""
    with stage_range(1):
        s1 = layer.stage1(x, attn)
    if s1.routing is None:
        return s1.residual
    recorded = {name: len(values) for name, values in engine.aux.items()}
    with stage_range(2):  # profiler ranges never span a yield: the other generator runs in between
        engine.record_routing(layer.layer_id, s1.routing, s1.aux)
        tape.roots[-1].extend(terms.value_roots(engine.aux, recorded))  # aux values, each with d(loss)/d(value)
        first, plan = len(tape.roots) - 1, engine.dispatcher.plan(s1.routing, async_op=True)
    note("counts-issue")
    yield  # the other micro-batch's compute is queued before the host reads the split sizes
    with stage_range(2):
        pending = engine.dispatcher.dispatch_start(s1.moe_input, s1.routing, async_op=True, plan=plan)
    note("dispatch-issue")
    yield
    with stage_range(2):
        tokens, counts, handle = engine.dispatcher.dispatch_finish(pending)
    note("dispatch-wait")
    tape.start_segment(pending[0])
    with stage_range(3):
        expert_out = layer.stage3(tokens, counts, engine.weight_queue)
    with stage_range(4):
        pending = engine.dispatcher.combine_start(expert_out, handle, async_op=True)
    note("combine-issue")
    yield
    with stage_range(4):
        combined = engine.dispatcher.combine_finish(pending)
    note("combine-wait")
    tape.start_segment(pending[0])
    r = s1.routing  # stage 5 reads stage 1's outputs: cut them too (their gradients go back to stage 1)
    routing = RoutingInfo(r.topk_ids, tape.cut(r.topk_weights, first), r.scores.detach(), r.num_experts)
    # aux values are roots of segment `first` already; left in s1, FSDP's stage-5 hooks would take
    # them in as inputs and a later segment's backward would run through stage 1
    s1 = dataclasses.replace(s1, residual=tape.cut(s1.residual, first), moe_input=None,
                             shared=tape.cut(s1.shared, first), routing=routing, aux=None)
    with stage_range(5):
        return layer.stage5(s1, combined)


def _chunk_steps(chunk, x, pos, doc, cp, engine, tape, terms, note, mtp_ids=None, mtp_embedded=None):
    """The model's forward template (embed -> attention inputs -> layers -> norm/head, the same in every family) as a
    generator over `_layer_steps`. Under FSDP, the chunk's own forward hooks run around the embedding part and the head
    part (so the root's weights are gathered again when backward reaches either); the layers gather theirs around their
    stages. Multi-token prediction (DeepSeek-V3) as in the model's forward: the embedding chunk also returns the MTP
    tokens embedded, the head chunk runs the MTP layers after the last layer and then every head in the last segment
    (the loss is a root there), from cuts of the hidden states."""
    state = chunk._get_fsdp_state() if isinstance(chunk, FSDPModule) else None

    def as_root(fn, *args):
        if state is None:
            return fn(*args)
        args, _ = state._pre_forward(chunk, args, {})
        return state._post_forward(chunk, args, fn(*args))

    def embed(h):
        embedded = chunk.embed_tokens(mtp_ids) if chunk.embed_tokens is not None and mtp_ids is not None else None
        if chunk.embed_tokens is not None:
            h = chunk.embed_tokens(h)
        return h, chunk.attn_inputs(pos, doc, h.dtype, cp), embedded

    x, attn, embedded = as_root(embed, x)
    for layer in chunk.layers.values():
        x = yield from _layer_steps(layer, x, attn, engine, tape, terms, note)
    if chunk.norm is None:
        return x if embedded is None else (x, embedded)
    mtp = getattr(chunk, "mtp", None) if mtp_embedded is not None else None
    hidden = [(x, len(tape.roots) - 1)]  # each head's input and the segment that made it
    for k, layer in enumerate((mtp or {}).values()):
        x = yield from _layer_steps(layer, torch.cat([mtp_embedded[:, :, k].to(x.dtype), x], -1), attn, engine,
                                    tape, terms, note)
        hidden.append((x, len(tape.roots) - 1))
    last = len(tape.roots) - 1
    hidden = [tape.cut(h, segment) if segment < last else h for h, segment in hidden]

    def heads(_positions):  # x stays out of the hook's arguments (FSDP would cast it); the hook still
        # needs one argument on GPUs (it moves args to the device): the integer positions
        logits = head_logits(chunk.norm(hidden[0]), chunk.head_weight(), chunk.head_fp8)
        if mtp is None:
            return logits
        return logits, torch.stack([head_logits(layer.shared_head(h), chunk.head_weight(), chunk.head_fp8)
                                    for layer, h in zip(mtp.values(), hidden[1:])], 2)

    return as_root(heads, pos)


def _backward_steps(tape, outputs, note, fsdp_state=None):
    """Backward of a `_Tape`, segment by segment from the last: one autograd call per segment,
    then the reverse all-to-all of its leaf gradient is issued, the generator yields, and waits.

    `fsdp_state`: the chunk's FSDP root state. FSDP finishes a backward in a callback at the end
    of every autograd call, which runs post-backward (reduce-scatter, reshard) for every layer
    that has not had it yet; here that is held back to the chunk's last segment, so a chunk's
    backward is finalised once, as if it were one autograd call (a private FSDP flag: checked in
    tests/test_parallel.py through the numerics and in tests/test_overlap.py through the calls)."""
    extra = [[] for _ in tape.roots]  # (src, grad) received from later segments
    extra[-1] += outputs
    for k in reversed(range(len(tape.roots))):
        pairs = [(t, g) for t, g in tape.roots[k] + extra[k] if t.requires_grad]
        note("compute")
        if fsdp_state is not None:  # "already queued" keeps FSDP from queueing its callback
            fsdp_state._state_ctx.post_backward_final_callback_queued = k > 0
        if pairs:
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        if k == 0 and fsdp_state is not None and any(
                st._training_state.name != "IDLE" for st in fsdp_state._state_ctx.all_states):
            fsdp_state._root_post_backward_final_callback()  # no FSDP hook fired in the last call
        for leaf, src, j, exchange in tape.cuts[k]:
            grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
            if exchange is not None:  # every rank of the EP group issues it, used or not
                buf, work = exchange.reverse(grad)
                note("a2a-issue")
                yield
                work.wait()
                note("a2a-wait")
                grad = buf
            if leaf.grad is not None or exchange is not None:
                extra[j].append((src, grad))
        tape.roots[k] = tape.cuts[k] = extra[k] = None  # free the segment


def _drive(*steps):
    """Run generators round-robin, one step each in turn, until all finish; their return values."""
    results, live = [None] * len(steps), list(range(len(steps)))
    while live:
        for i in list(live):
            try:
                next(steps[i])
            except StopIteration as stop:
                results[i] = stop.value
                live.remove(i)
    return results


class PipelineRunner:
    """Runs one optimizer step's micro-batches through this rank's two chunks in the order of the DualPipeV schedule,
    exchanging activations and gradients with the neighbouring pipeline ranks.

    With `overlap` (and expert parallelism), every chunk forward is cut at its all-to-alls (`_chunk_steps`, `_Tape`) and
    its backward walks the segments (`_backward_steps`); an FB op alternates the two: forward compute, issue its
    all-to-all | backward compute, issue its all-to-all | wait on the forward's, next forward compute ... so each
    micro-batch's communication runs under the other's compute. Without it, forward then backward (the reference; the
    numerics agree to rounding). `trace`, a list, records the order of events."""

    def __init__(self, down, up, mesh, make_engine, forward_inputs, act_dtype, overlap: bool = True):
        self.chunks, self.mesh, self.overlap, self.trace = (down, up), mesh, overlap, None
        self.act_dtype = act_dtype  # dtype of the activations and gradients exchanged
        self.make_engine = make_engine  # (batch, seq) -> ExpertEngine for one chunk forward
        self.forward_inputs = forward_inputs  # micro dict -> (position_ids, doc_ids, ContextParallel or None)
        self.group = mesh.device_mesh["pp"].get_group()
        self.peer = {d: dist.get_global_rank(self.group, mesh.pp_rank + d) for d in (-1, 1)
                     if 0 <= mesh.pp_rank + d < mesh.pp}

    def forward_only(self, micros: list[dict], loss_fn, make_engine) -> torch.Tensor:
        """Evaluation (call under no_grad): each micro-batch through the 2pp chunks in model order,
        one micro-batch after another, down the ranks (phase 0) and back up (phase 1) with blocking
        send/recv: without a backward there is nothing for a schedule to overlap. Returns the sum of
        loss_fn(logits, micro) over the micro-batches (rank 0, which holds the head; 0 elsewhere)."""
        rank, last, hidden = self.mesh.pp_rank, self.mesh.pp - 1, self.chunks[0].cfg.hidden_size
        total = torch.zeros((), dtype=torch.float64, device=self.mesh.device)

        def recv(b, s, side):
            buf = torch.empty(b, s, hidden, dtype=self.act_dtype, device=self.mesh.device)
            dist.recv(buf, self.peer[side], group=self.group)
            return buf

        for micro in micros:
            pos, doc, cp = self.forward_inputs(micro)
            b, s = micro["input_ids"].shape
            x = micro["input_ids"] if rank == 0 else recv(b, s, -1)
            x = self.chunks[0](x, pos, make_engine(b, s), doc_ids=doc, cp=cp)
            if rank < last:  # the last rank feeds its own phase-1 chunk
                dist.send(x.to(self.act_dtype).contiguous(), self.peer[1], group=self.group)
                x = recv(b, s, 1)
            x = self.chunks[1](x, pos, make_engine(b, s), doc_ids=doc, cp=cp)
            if rank > 0:
                dist.send(x.to(self.act_dtype).contiguous(), self.peer[-1], group=self.group)
            else:
                total += loss_fn(x, micro).double()
        return total

    def _sends(self, rank_ops: list[Op], rank: int):
        """Messages a rank sends, in its order: (destination pp rank, kind, phase, mb)."""
        pp, out = self.mesh.pp, []
        for op in rank_ops:  # a pair sends in the order of its parts (FB: the act, then the grad)
            for kind, phase, mb in _parts(op):
                if kind == "W":
                    continue
                if 0 <= (dest := rank + (1 if phase == 0 else -1) * (1 if kind == "F" else -1)) < pp:
                    out.append((dest, "act" if kind == "F" else "grad", phase, mb))
        return out

    def run(self, micros: list[dict], loss_fn, lists: list[list[Op]], terms: LossTerms) -> dict[str, torch.Tensor]:
        """loss_fn(logits, micro) -> this micro-batch's share of the cross-entropy loss. Each chunk's auxiliary loss
        values enter its backward as `terms` composes them (protocol.LossTerms). Returns, per aux term, the sum of its
        values over this rank's chunk forwards (detached, float64)."""
        mesh, rank, dtype = self.mesh, self.mesh.pp_rank, self.act_dtype
        inbox = {}  # (kind, phase, mb) -> tensor received
        expected = {d: [m for m in self._sends(lists[rank + d], rank + d) if m[0] == rank]
                    for d in self.peer}  # what each neighbour sends us, in its order
        posted = {d: 0 for d in self.peer}
        pending_recv, pending_send = {}, []
        saved = {}  # (phase, mb) -> (input leaf or None, outputs, grads-to-outputs template, ...)
        mtp_stash, mtp_grads = {}, {}  # mb -> the MTP tokens embedded (first chunk), their gradient (head)
        aux_totals = {}  # term name -> sum of its values over this rank's chunk forwards
        b, s = micros[0]["input_ids"].shape
        hidden = self.chunks[0].cfg.hidden_size

        def receive(kind, phase, mb):
            key = (kind, phase, mb)
            if key in inbox:  # the last rank's to itself: its phase-0 output, its phase-1 input gradient
                return inbox.pop(key)
            source = -1 if (phase == 0) == (kind == "act") else 1
            while key not in pending_recv:  # post receives in the sender's order (NCCL matches by order)
                _, k, p, m = expected[source][posted[source]]
                buf = torch.empty(b, s, hidden, dtype=dtype, device=mesh.device)
                pending_recv[(k, p, m)] = (buf, dist.irecv(buf, self.peer[source], group=self.group))
                posted[source] += 1
            buf, work = pending_recv.pop(key)
            work.wait()
            return buf

        def send(tensor, kind, phase):
            if (dest := (1 if phase == 0 else -1) * (1 if kind == "act" else -1)) in self.peer:
                pending_send.append((tensor, dist.isend(tensor.contiguous(), self.peer[dest], group=self.group)))
                return True
            return False

        def forward(phase, mb):
            """Generator: one chunk forward, yielding at each all-to-all when segmented."""
            micro, chunk = micros[mb], self.chunks[phase]
            pos, doc, cp = self.forward_inputs(micro)
            if phase == 0 and rank == 0:
                x, leaf = micro["input_ids"], None
            else:
                x = leaf = receive("act", phase, mb).detach().requires_grad_()
            engine = self.make_engine(b, s)
            if defer_w:
                engine.weight_queue = DeferredWeightGrads(add_grad, plain=True)
            # Multi-token prediction: rank 0's first chunk embeds the MTP tokens, its last chunk (the head)
            # takes them as a leaf; that leaf's gradient joins the first chunk's backward (mtp_grads).
            mtp = {}
            if "mtp_ids" in micro and chunk.embed_tokens is not None:
                mtp["mtp_ids"] = micro["mtp_ids"]
            if "mtp_ids" in micro and chunk.norm is not None:
                mtp["mtp_embedded"] = mtp_stash.pop(mb).detach().requires_grad_()
            tape = _Tape() if self.overlap and hasattr(engine.dispatcher, "dispatch_start") else None
            if tape is None:
                out = chunk(x, pos, engine, doc_ids=doc, cp=cp, **mtp)
            else:
                out = yield from _chunk_steps(chunk, x, pos, doc, cp, engine, tape, terms, tracer("F", phase, mb), **mtp)
            outputs, grads = [], []
            if "mtp_ids" in mtp:  # out: (hidden, the MTP tokens embedded)
                out, mtp_stash[mb] = out
                outputs.append(mtp_stash[mb])
                grads.append("mtp")
            if phase == 1 and rank == 0:
                outputs.append(loss_fn(out, micro))
                grads.append(None)
            else:
                local = out.detach()
                if not send(local, "act", phase):  # the last rank feeds its own phase-1 chunk
                    inbox[("act", 1, mb)] = local
                outputs.append(out)
                grads.append("recv")
            roots = terms.chunk_roots(engine.aux) if tape is None else []  # segmented: each aux value is a root already
            outputs += roots
            grads += [None] * len(roots)
            for name, total in terms.layer_sums(engine.aux, mean=False).items():
                aux_totals[name] = aux_totals[name] + total if name in aux_totals else total
            saved[(phase, mb)] = (leaf, outputs, grads, engine.weight_queue, tape, mtp.get("mtp_embedded"))

        def backward(phase, mb):
            """Generator: one chunk backward; returns the input gradient to pass on (or None)."""
            leaf, outputs, grads, queue, tape, mtp_leaf = saved.pop((phase, mb))
            chunk = self.chunks[phase]
            if isinstance(chunk, FSDPModule):  # a phase's backwards run in micro-batch order:
                last = mb == len(micros) - 1  # reduce-scatter and reshard after the last only
                chunk.set_requires_gradient_sync(last)
                chunk.set_reshard_after_backward(last)
            if queue is not None:
                weight_work[(phase, mb)] = queue
            tensors = [torch.ones_like(out) if g is None else mtp_grads.pop(mb) if g == "mtp" else receive("grad", phase, mb)
                       for out, g in zip(outputs, grads)]
            if tape is None:
                torch.autograd.backward(outputs, tensors)
            else:
                state = chunk._get_fsdp_state() if isinstance(chunk, FSDPModule) else None
                yield from _backward_steps(tape, list(zip(outputs, tensors)), tracer("B", phase, mb), state)
            if mtp_leaf is not None:
                mtp_grads[mb] = mtp_leaf.grad if mtp_leaf.grad is not None else torch.zeros_like(mtp_leaf)
            return None if leaf is None else leaf.grad.to(dtype)

        def weights(phase, mb):
            """Generator: the deferred weight gradients of one earlier B, one GEMM per step (BW:
            they compute while the backward's all-to-alls are in flight)."""
            queue, note = weight_work.pop((phase, mb)), tracer("W", phase, mb)
            while queue.work:
                note("compute")
                queue.work.pop(0)()
                yield

        def tracer(kind, phase, mb):
            trace = self.trace
            return (lambda event: trace.append((kind, phase, mb, event))) if trace is not None else (lambda event: None)

        weight_work = {}  # (phase, mb) -> its deferred expert weight gradients
        defer_w = any(kind == "W" for op in lists[rank] for kind, _, _ in _parts(op))
        for op in lists[rank]:
            parts = _parts(op)  # a pair is two chunks (two FSDP roots), never one chunk twice
            steps = [(forward if kind == "F" else backward if kind == "B" else weights)(phase, mb)
                     for kind, phase, mb in parts]
            # interleaved; a forward sends its act before the pair's grads are passed on
            results = _drive(*steps) if self.overlap else [_drive(step)[0] for step in steps]
            for (kind, phase, mb), grad in zip(parts, results):
                if kind == "B" and grad is not None and not send(grad, "grad", phase):
                    inbox[("grad", 0, mb)] = grad  # the last rank: its phase-1 input grad feeds its phase 0
        for _, work in pending_send:
            work.wait()
        assert not saved and not pending_recv, "pipeline step ended with work left over"
        assert not weight_work, "deferred weight gradients left in the queue at the end of the step"
        return aux_totals
