"""Profile one training step and measure how much communication overlaps computation; PASS/FAIL.

    python .agents/skills/capture-profile/profile_step.py CONFIG --step 3 [--train-args "--nproc 2 --ep 2"]
        [--set a.b=v ...] [--min-overlap 0.5 [--kind all-to-all/p2p]]
    python .agents/skills/capture-profile/profile_step.py --trace RUN/profile/rank0.json [--trace RUN/profile/rank1.json]

Reads the Chrome trace that `train.profile_step` writes. GPU kernels are split into
communication (NCCL) and computation; the overlap is the share of communication time during
which a computation kernel runs on another stream. On the CPU (gloo) collectives run inline, so
the overlap is 0 by construction; the op table is still useful. The run goes to --work (kept: its
traces in WORK/run/profile/), else to a temporary directory removed at the end.
"""

import argparse
import re
import shlex
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))
import runs  # noqa: E402  (JSON files, argument types, working directories)
from timeline import COLLECTIVES, collective, gaps, merged, overlap_time, verdict  # noqa: E402


def intervals(events, predicate):
    out = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("ph") == "X" and "dur" in e and predicate(e)]
    return sorted(out)


CATEGORIES = (  # first match wins; by substring of the lower-cased kernel name
    ("communication", ("nccl",)),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "grouped_mm", "sm90")),
    ("triton", ("triton",)),
    ("copy/cast", ("copy", "memcpy", "memset", "cast", "fill")),
    ("sort/index", ("sort", "index", "scatter", "gather", "radix", "cumsum", "scan", "topk", "bincount", "nonzero")),
    ("reduction", ("reduce",)),
    ("elementwise", ("elementwise", "vectorized", "unrolled")),
)


def category(name: str) -> str:
    low = name.lower()
    return next((cat for cat, keys in CATEGORIES if any(k in low for k in keys)), "other")


HOST_CATS = ("cpu_op", "user_annotation", "cuda_runtime", "python_function", "cuda_driver")


def host_threads(events) -> dict:
    """Host events (ops, annotations, CUDA runtime calls) by (pid, tid), sorted by (ts, -dur): a
    parent before its children."""
    threads = {}
    for e in events:
        if e.get("ph") == "X" and "dur" in e and e.get("cat") in HOST_CATS:
            threads.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    for evs in threads.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
    return threads


def _stacks(thread_events, times):
    """For each time (any order), the events of one thread open at it, outermost first.
    `thread_events` sorted by (ts, -dur)."""
    order = sorted(range(len(times)), key=lambda i: times[i])
    out, active, j = [None] * len(times), [], 0
    for i in order:
        t = times[i]
        while j < len(thread_events) and thread_events[j]["ts"] <= t:
            active.append(thread_events[j])
            j += 1
        active = [e for e in active if e["ts"] + e["dur"] > t]
        out[i] = list(active)
    return out


def idle_gaps(threads, busy, min_us: float = 20.0):
    """GPU idle gaps (no kernel or copy on any stream) of at least `min_us`, each with the host
    call stack (outermost first) running on the main thread when the gap began: what the GPU
    was waiting for. The main thread is the one with the most host events."""
    if not threads or not busy:
        return []
    main = threads[max(threads, key=lambda t: len(threads[t]))]
    idle = gaps(busy, min_us)
    stacks = _stacks(main, [start for start, _ in idle])
    return [(end - start, [e["name"][:50] for e in stack]) for (start, end), stack in zip(idle, stacks)]


SYNCS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpy")


def host_syncs(threads):
    """Host calls that wait for the GPU (stream/event/device synchronise, blocking copies),
    grouped by the host call stack around them (outermost first): where the host drains the
    GPU's queue. Returns [(total us, count, stack)], largest first."""
    out = {}
    for evs in threads.values():
        syncs = [e for e in evs if e["name"] in SYNCS]
        for e, stack in zip(syncs, _stacks(evs, [e["ts"] for e in syncs])):
            around = [o for o in stack if o is not e and o["ts"] + o["dur"] >= e["ts"] + e["dur"]]
            key = " > ".join(o["name"][:40] for o in around[-4:]) + " > " + e["name"]
            total, count = out.get(key, (0.0, 0))
            out[key] = (total + e["dur"], count + 1)
    return sorted(((us, n, key) for key, (us, n) in out.items()), reverse=True)


STAGE = "pithtrain::stage"  # the ranges of protocol.stage_range


def stage_times(events, threads=None, by_kernel: bool = False):
    """Time per layer stage (the five of protocol.py), forward and backward.

    Forward work is what runs inside a `pithtrain::stage<n>` range; backward work is what runs
    inside autograd's `evaluate_function` of a node whose forward op (same sequence number) ran
    inside one, or inside a `.wgrad` range (deferred expert weight gradients). On GPUs the unit
    is kernel time, each kernel attributed through the host call that launched it (correlation
    id); on the CPU, the time of the outermost host ops. `threads`: host_threads(events), if
    already built. Returns ({label: us}, unit); `by_kernel`: keyed by (label, kernel name) instead (GPU)."""
    threads = host_threads(events) if threads is None else threads

    def is_backward(name):  # an autograd node's op (MulBackward0, CompiledFunctionBackward) or its evaluation
        return name.startswith("autograd::engine::evaluate_function") or re.search(r"Backward\d*$", name) is not None

    def innermost_stage(stack):
        for e in reversed(stack):
            if e["name"].startswith(STAGE):
                return e["name"][len(STAGE):]
        return None

    # autograd sequence number of a forward node -> its stage. Every op records the number the
    # next node will get, so ops that create no node share it with the next one that does (under
    # the pipeline's overlap, often in another stage): the node's creator is the last op to start
    # with that number (or an op nested in it). Numbers count per thread: only the threads that
    # run the stages are read.
    seq_stage = {}
    for evs in threads.values():
        if not any(e["name"].startswith(STAGE) for e in evs):
            continue
        last = {e["args"]["Sequence number"]: e for e in evs
                if "Sequence number" in e.get("args", {}) and not is_backward(e["name"])}
        creators = list(last.items())
        for (seq, _), stack in zip(creators, _stacks(evs, [e["ts"] for _, e in creators])):
            stage = innermost_stage(stack)
            seq_stage[seq] = None if stage is None else stage.split(".")[0]

    def label(stack):
        stage = innermost_stage(stack)
        if stage is not None:
            return f"stage {stage[0]} " + ("backward" if stage.endswith(".wgrad") else "forward")
        for e in reversed(stack):  # the node's own op carries the number (evaluate_function not
            if is_backward(e["name"]):  # always: FSDP's pre-backward hook may run first inside it)
                seq = e.get("args", {}).get("Sequence number")
                if seq_stage.get(seq) is not None:
                    return f"stage {seq_stage[seq]} backward"
        if any(e["name"].startswith("Optimizer.step") for e in stack):
            return "optimizer"
        return "other"

    kernels = [e for e in events if e.get("ph") == "X" and "dur" in e and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    out = {}
    if kernels:
        launches = {}  # correlation id -> (thread, ts)
        for thread, evs in threads.items():
            for e in evs:
                corr = e.get("args", {}).get("correlation")
                # runtime launches (cuBLAS, ATen) and driver launches (Triton, Inductor's kernels)
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and corr is not None:
                    launches[corr] = (thread, e["ts"])
        per_thread = {}
        for k in kernels:
            launch = launches.get(k.get("args", {}).get("correlation"))
            if launch is None:
                out["other"] = out.get("other", 0.0) + k["dur"]
                continue
            per_thread.setdefault(launch[0], []).append((launch[1], k["dur"], k["name"]))
        for thread, items in per_thread.items():
            for (_, dur, name), stack in zip(items, _stacks(threads[thread], [t for t, _, _ in items])):
                key = (label(stack), name) if by_kernel else label(stack)
                out[key] = out.get(key, 0.0) + dur
        return out, "GPU kernel"
    for thread, evs in threads.items():
        ops = [e for e in evs if e.get("cat") == "cpu_op"]
        for e, stack in zip(ops, _stacks(evs, [e["ts"] for e in ops])):
            if any(o is not e and o.get("cat") == "cpu_op" for o in stack):
                continue  # nested in another op: counted there
            key = label(stack)
            out[key] = out.get(key, 0.0) + e["dur"]
    return out, "host op"


def read_trace(path: Path) -> list[dict]:
    """A Chrome trace's events; runs.BadInput naming the file when it is none."""
    trace = runs.read_json(path)
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise runs.BadInput(f"{path} is not a Chrome trace (no traceEvents list): give the profile_step's "
                            f"RUN/profile/rank<r>.json")

    def complete_ok(e):  # a complete event ("X") is read by its name, ts, dur and args
        return e.get("ph") != "X" or (isinstance(e.get("name"), str) and isinstance(e.get("args", {}), dict)
                                      and all(isinstance(e.get(k), (int, float)) for k in ("ts", "dur")))

    events = [e for e in trace["traceEvents"] if isinstance(e, dict)]
    if left := sum(not complete_ok(e) for e in events):  # an edited trace, or another tool's: was a traceback
        print(f"note: {path}: {left} complete event(s) without a name, numeric ts and dur, or args: left out")
        events = [e for e in events if complete_ok(e)]
    if not any(isinstance(e.get("ts"), (int, float)) and isinstance(e.get("dur"), (int, float)) for e in events):
        raise runs.BadInput(f"{path} holds no timed event (numeric ts and dur): give the profile_step's RUN/profile/rank<r>.json")
    return events


def analyse(events: list[dict]) -> dict:
    is_gpu = lambda e: e.get("cat") in ("kernel", "gpu_memcpy")  # noqa: E731
    is_comm = lambda e: "nccl" in e.get("name", "").lower()  # noqa: E731
    comm = merged(intervals(events, lambda e: is_gpu(e) and is_comm(e)))
    compute = merged(intervals(events, lambda e: is_gpu(e) and not is_comm(e)))
    comm_time = sum(b - a for a, b in comm)
    top = {}
    for e in events:
        if e.get("ph") == "X" and "dur" in e and (is_gpu(e) or e.get("cat") in HOST_CATS[:3]):
            key = (e.get("cat"), e["name"][:60])
            top[key] = top.get(key, 0) + e["dur"]
    by_category = {}
    for e in events:
        if e.get("ph") == "X" and "dur" in e and is_gpu(e):
            by_category[category(e["name"])] = by_category.get(category(e["name"]), 0) + e["dur"]
    per_kind = {}  # overlap per collective kind: all-to-all (NCCL SendRecv), all-gather, ...
    for kind in COLLECTIVES:
        spans = merged(intervals(events, lambda e, kind=kind: is_gpu(e) and collective(e["name"]) == kind))
        t = sum(b - a for a, b in spans)
        if t:
            per_kind[kind] = (t, overlap_time(spans, compute) / t)
    busy = merged(intervals(events, is_gpu))
    span = (busy[-1][1] - busy[0][0]) if busy else 0.0
    threads = host_threads(events)
    gaps = idle_gaps(threads, busy)
    by_op = {}  # gap time by the innermost host call running when the gap began
    for us, stack in gaps:
        key = stack[-1] if stack else "(no host call: Python between calls)"
        by_op[key] = by_op.get(key, 0) + us
    return {
        "gpu": bool(compute),
        "span_us": span,
        "per_kind": per_kind,
        "busy_us": sum(b - a for a, b in busy),
        "by_category": sorted(by_category.items(), key=lambda kv: -kv[1]),
        "comm_us": comm_time,
        "compute_us": sum(b - a for a, b in compute),
        "overlap": overlap_time(comm, compute) / comm_time if comm_time else 0.0,
        "top": sorted(top.items(), key=lambda kv: -kv[1])[:25],
        "gap_us": sum(us for us, _ in gaps),
        "gaps_by_op": sorted(by_op.items(), key=lambda kv: -kv[1])[:12],
        "largest_gaps": sorted(gaps, key=lambda g: -g[0])[:6],
        "syncs": host_syncs(threads)[:8],
        "stages": stage_times(events, threads),
        "stage_kernels": stage_times(events, threads, by_kernel=True)[0] if compute else {},
    }


def print_stages(times: dict, unit: str) -> None:
    if not any(k.startswith("stage") for k in times):
        print("no pithtrain::stage ranges in the trace (a trace of this version of PithTrain?)")
        return
    total = sum(times.values())
    print(f"{unit} time by layer stage (ms; share of all {unit} time):")
    names = {1: "attention, router", 2: "dispatch", 3: "experts", 4: "combine", 5: "weighted combine"}
    for n in range(1, 6):
        f, b = times.get(f"stage {n} forward", 0.0), times.get(f"stage {n} backward", 0.0)
        print(f"  stage {n} {names[n]:17s} forward {f / 1e3:9.2f}  backward {b / 1e3:9.2f}  ({100 * (f + b) / max(total, 1):4.1f}%)")
    for key in ("optimizer", "other"):
        print(f"  {key:25s} {times.get(key, 0.0) / 1e3:9.2f}  ({100 * times.get(key, 0.0) / max(total, 1):4.1f}%)"
              + ("  (embedding, head and loss, gradient norm, collectives outside stages)" if key == "other" else ""))


def report(trace: Path, events: list[dict], args, label: str) -> str | None:
    """Print one rank's analysis; None if it meets --min-overlap, else why not (starting with `label`)."""
    print(f"trace {trace}")
    if not any(e.get("ph") == "X" for e in events):
        return f"{label}: no timed events in the trace (empty, or cut short while it was written); profile again"
    result = analyse(events)
    for (cat, name), us in result["top"]:
        print(f"  {us / 1e3:9.2f} ms  {cat:>15}  {name}")
    print_stages(*result["stages"])
    if args.stage_kernels and result["stage_kernels"]:  # what to fuse: the kernels of each stage
        per_stage = {}
        for (stage, name), us in result["stage_kernels"].items():
            per_stage.setdefault(stage, []).append((us, name))
        for stage in sorted(per_stage):
            rows = sorted(per_stage[stage], reverse=True)
            print(f"{stage}: {sum(us for us, _ in rows) / 1e3:.2f} ms in {len(rows)} kernels, the largest:")
            for us, name in rows[:args.stage_kernels]:
                print(f"  {us / 1e3:9.2f} ms  {category(name):12s} {name[:110]}")
    if result["gpu"]:
        print(f"GPU kernel time by category (first to last kernel: {result['span_us'] / 1e3:.2f} ms, "
              f"some stream busy {100 * result['busy_us'] / max(result['span_us'], 1):.1f}% of it, "
              f"compute kernels running {100 * result['compute_us'] / max(result['span_us'], 1):.1f}%):")
        for cat, us in result["by_category"]:
            print(f"  {us / 1e3:9.2f} ms  {cat}")
        print(f"GPU compute {result['compute_us'] / 1e3:.2f} ms, communication {result['comm_us'] / 1e3:.2f} ms, "
              f"communication overlapped with compute: {100 * result['overlap']:.1f}%")
        for kind, (us, share) in result["per_kind"].items():
            print(f"  {kind:15s} {us / 1e3:8.2f} ms, {100 * share:5.1f}% overlapped with compute")
        print(f"GPU idle (gaps >= 20 us, no kernel on any stream): {result['gap_us'] / 1e3:.2f} ms; "
              f"by the host call running when each gap began:")
        for name, us in result["gaps_by_op"]:
            print(f"  {us / 1e3:9.2f} ms  {name}")
        for us, stack in result["largest_gaps"]:
            print(f"  gap {us / 1e3:.2f} ms during: {' > '.join(stack[-4:]) or '-'}")
        print("host waits for the GPU (synchronise calls and blocking copies), by call stack:")
        for us, n, stack in result["syncs"]:
            print(f"  {us / 1e3:9.2f} ms  {n:5d}x  {stack}")
    else:
        print("no GPU kernels in the trace (CPU run): collectives run inline, overlap 0%")
    share = result["overlap"] if args.kind is None else result["per_kind"].get(args.kind, (0, 0.0))[1]
    what = "overlap" if args.kind is None else f"{args.kind} overlap"
    print(f"{trace.name}: {what} {100 * share:.1f}%")
    if share >= args.min_overlap:
        return None
    if not (result["comm_us"] if args.kind is None else args.kind in result["per_kind"]):
        return f"{label}: no NCCL{'' if args.kind is None else ' ' + args.kind} kernels (--min-overlap {100 * args.min_overlap:g}%)"
    return f"{label}: {what} {100 * share:.1f}% < {100 * args.min_overlap:g}%"


@runs.interruptible
def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?")
    parser.add_argument("--step", type=runs.COUNT, default=3, help="the step to profile (after warm-up)")
    parser.add_argument("--train-args", default="", help="extra `pithtrain train` arguments, e.g. '--nproc 2 --ep 2'")
    parser.add_argument("--set", action="append", default=[])
    parser.add_argument("--trace", action="append", type=Path, help="analyse an existing trace instead of running "
                        "(repeat for several ranks: each is reported, all must pass)")
    parser.add_argument("--stage-kernels", type=runs.number(int, low=0), default=0, help="also list each stage's N largest GPU kernels")
    parser.add_argument("--min-overlap", type=runs.FRACTION, default=0.0, help="FAIL below this communication overlap (0..1)")
    parser.add_argument("--kind", choices=COLLECTIVES, help="apply --min-overlap to this collective kind only "
                        "(e.g. all-to-all/p2p: the expert-parallel all-to-alls when pp = 1)")
    parser.add_argument("--work", type=runs.WORK_DIR, help="directory of the run, kept (default: a temporary one, removed at the end)")
    args = parser.parse_args()
    runs_only = [flag for flag, name in (("CONFIG", "config"), ("--step", "step"), ("--train-args", "train_args"),
                                         ("--set", "set"), ("--work", "work")) if getattr(args, name) != parser.get_default(name)]
    if args.trace and runs_only:  # would be ignored: the trace was written by a run made elsewhere
        parser.error(f"{', '.join(runs_only)}: for a run made here, but --trace analyses an existing trace; drop "
                     f"{', '.join(runs_only)}, or drop --trace to profile CONFIG")
    if args.trace:
        return analyse_traces(args.trace, args)
    if not args.config:
        parser.error("give CONFIG or --trace")
    sets = [*args.set, f"train.profile_step={args.step}"]
    refused = runs.check_train(f"the run ({args.train_args})", args.config, "OUT", args.step, args.train_args, sets)
    if refused:
        return verdict([refused])
    if args.work and (Path(args.work) / "run").exists():
        return verdict([f"--work {args.work} already holds a run: pass a new directory"])
    with runs.workdir(args.work, "profile-") as work:
        out = work / "run"
        cmd = [sys.executable, "-m", "pithtrain", *runs.train_args(args.config, out, args.step, args.train_args, sets)]
        print("$", shlex.join(cmd), flush=True)
        if subprocess.run(cmd).returncode != 0:
            return verdict(["the run did not finish (its output is above)"])
        return analyse_traces(sorted((out / "profile").glob("rank*.json")) or [out / "profile" / "rank0.json"], args)


def analyse_traces(traces: list[Path], args) -> int:
    """Report each trace (rank), then PASS or FAIL naming the ranks under --min-overlap."""
    try:
        events = [read_trace(t) for t in traces]  # every file read before any report
    except runs.BadInput as e:
        return verdict([str(e)])
    names = [t.stem for t in traces]
    labels = names if len(set(names)) == len(names) else [str(t) for t in traces]
    failures = [f for f in (report(t, e, args, label) for t, e, label in zip(traces, events, labels)) if f is not None]
    what = "communication" if args.kind is None else args.kind
    return verdict(failures, f"{len(traces)} trace(s) analysed" + (f", {what} overlap >= {100 * args.min_overlap:g}% in each"
                                                                    if args.min_overlap else " (no --min-overlap to judge)"))


if __name__ == "__main__":
    sys.exit(main())
