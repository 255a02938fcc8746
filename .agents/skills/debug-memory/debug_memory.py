"""Where a step's peak memory goes, by layer stage and by call site, against estimate-memory; PASS/FAIL.

    python .agents/skills/debug-memory/debug_memory.py CONFIG [--nproc N --pp P --cp C --ep E] \
        [--set train.micro_batch_size=2 ...] [--step 2] [--margin 0.15] [--top 12] [--work DIR]
    python .agents/skills/debug-memory/debug_memory.py CONFIG ... --snapshot RUN/memory/rank0.pickle

Runs CONFIG for --step steps with PITHTRAIN_DEBUG_MEMORY=STEP (pithtrain/train/debug.py), then reads
rank 0's record of that step:
  CUDA: the caching allocator's history and snapshot. The blocks live when the step started are
        those of the snapshot walked back through the history; replaying the history forward finds
        the peak of allocated bytes and the blocks live there, each with the Python stack that
        allocated it (none for blocks from before the step, nor for autograd's device threads).
        Compared with the estimate's total.
  CPU:  no allocator history: torch.profiler's allocation events of the step (size, address, the
        Python functions and op around each). Only what the step allocates is seen, so its peak is
        the net bytes allocated since the step began, compared with the estimate's terms made
        during a step (its total less the fp32 weights and AdamW moments, live between steps).
Prints the live bytes at the peak by layer stage and by call site, then PASS when the measured peak
is within --margin of the estimate (either side), else FAIL. A --snapshot is judged only where the
config, overrides and mesh given match its run's (RUN/run_config.json, one record per rank in
RUN/memory/). The run made here goes to --work (kept), else to a temporary directory removed at the end.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json
import linecache
import pickle
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "_common"))
import runs  # noqa: E402

estimate_memory = runs.skill_script("estimate-memory/estimate_memory.py")
GIB = estimate_memory.GIB
BEFORE = "(live before the step: no stack)"
NO_STACK = "(no Python stack: autograd's device threads or C++)"


STAGES = (  # (part of the step, a frame that places an allocation there): the first that matches any frame wins
    ("stage 2 dispatch", r"parallel/expert\.py\(\d+\): \w*dispatch"),
    ("stage 4 combine", r"parallel/expert\.py\(\d+\): \w*combine"),
    ("stage 1 forward", r"pithtrain/models/\w+\.py\(\d+\): stage1$"),
    ("stage 3 forward", r"pithtrain/models/\w+\.py\(\d+\): stage3$"),
    ("stage 5 forward", r"pithtrain/models/\w+\.py\(\d+\): stage5$"),
    ("optimizer", r"train/optim\.py|torch/optim/"),
    ("backward", r"\): (backward|_engine_run_backward|run_backward)$|autograd/__init__\.py"),
    ("FSDP", r"parallel/fsdp\.py|fsdp/"),
    ("embedding, final norm, head (forward)", r"pithtrain/models/\w+\.py"),
    ("loss", r"cross_entropy"),
)


CALLS = {"stage1": "stage 1 forward", "stage3": "stage 3 forward", "stage5": "stage 5 forward",
         "dispatch": "stage 2 dispatch", "combine": "stage 4 combine"}


def stage_of(frames: list[str]) -> str:
    """The layer stage (or part of the step) of an allocation, from its stack: first the source line
    of each frame (CUDA stacks carry the calling line: `layer.stage1(x, attn)` places what a compiled
    stage allocates, whose own frame is Inductor's), then the function names."""
    if frames == [BEFORE]:
        return "before the step (weights, optimizer state, caches)"
    for f in frames:
        where = re.match(r"(.*)\((\d+)\): ", f)
        call = re.search(r"\.(stage[135]|dispatch|combine)\w*\(", linecache.getline(where[1], int(where[2]))) if where else None
        if call and "pithtrain/" in f:
            return CALLS[call[1]]
    for stage, pattern in STAGES:
        if any(re.search(pattern, f) for f in frames):
            return stage
    return NO_STACK if not frames else "other"


def call_site(frames: list[str], op: str | None) -> str:
    """The innermost pithtrain frame (the instruments' own excepted), and the op on the CPU."""
    inner = next((f for f in frames if "pithtrain/" in f and "train/debug.py" not in f), frames[0] if frames else NO_STACK)
    inner = inner[inner.find("pithtrain/"):] if "pithtrain/" in inner else inner
    return f"{inner} > {op}" if op else inner


def cuda_peak(snapshot: dict) -> tuple[int, list[tuple[int, list[str], str | None]]]:
    """(peak bytes, [(bytes, frames, op)] live at the peak) from a CUDA allocator snapshot."""
    device = next(i for i, t in enumerate(snapshot["device_traces"]) if t)
    trace = snapshot["device_traces"][device]
    live = {}
    for seg in snapshot["segments"]:
        if seg.get("device", device) != device:
            continue
        addr = seg["address"]
        for block in seg["blocks"]:
            if block["state"] == "active_allocated":
                live[block.get("address", addr)] = block["size"]
            addr += block["size"]
    for e in reversed(trace):  # walk back to the step's start
        if e["action"] == "alloc":
            live.pop(e["addr"], None)
        elif e["action"] == "free_completed":
            live[e["addr"]] = e["size"]
    frames = lambda e: [f"{x['filename']}({x['line']}): {x['name']}" for x in e.get("frames", [])]  # noqa: E731
    live = {addr: (size, [BEFORE], None) for addr, size in live.items()}
    total = peak = sum(size for size, _, _ in live.values())
    peak_at = -1
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            total += e["size"]
            if total > peak:
                peak, peak_at = total, i
        elif e["action"] == "free_completed":
            total -= e["size"]
    for e in trace[:peak_at + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], frames(e), None)
        elif e["action"] == "free_completed":
            live.pop(e["addr"], None)
    return peak, list(live.values())


def cpu_peak(events: list[dict]) -> tuple[int, list[tuple[int, list[str], str | None]]]:
    """(peak net bytes allocated during the step, [(bytes, frames, op)] of them live at the peak) from
    torch.profiler's memory events; each allocation's frames are the Python functions around it."""
    memory = sorted((e for e in events if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0),
                    key=lambda e: e["ts"])
    spans = collections.defaultdict(list)  # per thread: (start, end, name, kind), properly nested
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("python_function", "cpu_op"):
            spans[e["tid"]].append((e["ts"], e["ts"] + e["dur"], e["name"], e["cat"]))
    for s in spans.values():
        s.sort(key=lambda x: (x[0], -x[1]))
    live, total, peak, peak_live = {}, 0, 0, {}
    for e in memory:
        size, addr = e["args"]["Bytes"], e["args"]["Addr"]
        total += size
        if size > 0:
            live[addr] = (size, e["ts"], e["tid"])
            if total > peak:
                peak, peak_live = total, dict(live)
        else:
            live.pop(addr, None)
    out = []
    for size, ts, tid in peak_live.values():
        s = spans[tid]
        around = [x for x in s[:bisect.bisect_right(s, (ts, float("inf")))] if x[1] >= ts]  # outermost first
        frames = [name for _, _, name, kind in reversed(around) if kind == "python_function"]
        op = next((name for _, _, name, kind in around if kind == "cpu_op"), None)  # the outermost op
        out.append((size, frames, op))
    return peak, out


def table(title: str, rows: dict[str, int], top: int) -> None:
    total = sum(rows.values()) or 1
    print(f"\n{title}")
    for key, size in sorted(rows.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {size / GIB:9.4f} GiB  {100 * size / total:5.1f}%  {key}")


ESTIMATED = ("parallel.pp", "parallel.cp", "parallel.ep", "data.seq_len", "train.micro_batch_size", "train.global_batch_size",
             "train.recompute", "train.fp8", "train.fp8_head")  # what estimate() reads, besides the model


def snapshot_run_differs(record: Path, config, nproc: int) -> str | None:
    """Why the record RUN/memory/rank0.* cannot be judged against `config` on `nproc` ranks: its run's
    run_config.json (the config it trained) differs in a field the estimate reads, or memory/ holds the
    records of another number of ranks (every rank writes one); None when they agree."""
    from pithtrain.config import run_dict

    path = record.parent.parent / "run_config.json"
    if not path.is_file():
        return f"--snapshot {record}: no {path} (a record is judged against its run's config: keep it in RUN/memory/)"
    flat = lambda d: {f"{s}.{k}": v for s, fields in d.items() if isinstance(fields, dict) for k, v in fields.items()}  # noqa: E731
    ran, want = runs.read_json(path), flat(json.loads(json.dumps(run_dict(config))))
    ran = flat(ran) if isinstance(ran, dict) else {}
    differ = [f"{k} {ran.get(k)!r} vs {want[k]!r}" for k in want
              if (k.startswith("model.") or k in ESTIMATED) and ran.get(k) != want[k]]
    ranks = len(list(record.parent.glob(f"rank*{record.suffix}")))
    if ranks != nproc:
        differ.append(f"{ranks} rank records vs --nproc {nproc}")
    return (f"--snapshot {record}: its run ({path}) differs from the config, --set and mesh flags given (the run's "
            f"value first): {'; '.join(differ)}; pass those of the run") if differ else None


@runs.interruptible
def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("--nproc", type=runs.COUNT, default=1)
    for name in ("pp", "cp", "ep"):
        parser.add_argument(f"--{name}", type=int)
    parser.add_argument("--set", action="append", default=[], help="config overrides")
    parser.add_argument("--step", type=runs.COUNT, default=2, help="the step to record (2: after the first step's warm-up)")
    parser.add_argument("--margin", type=runs.NON_NEGATIVE, default=0.15, help="PASS when |peak - estimate| <= margin x estimate")
    parser.add_argument("--top", type=runs.COUNT, default=12, help="rows of the call-site table")
    parser.add_argument("--work", type=runs.WORK_DIR, help="directory of the run made here, kept (default: a temporary one, removed at the end)")
    parser.add_argument("--snapshot", help="read this record (RUN/memory/rank0.pickle or .json) instead of running")
    args = parser.parse_args()
    from pithtrain.config import ConfigError

    try:  # the estimate first: it validates the config and mesh before anything runs
        config = estimate_memory.load_config(args.config, args.set, args.nproc,
                                             {n: getattr(args, n) for n in ("pp", "cp", "ep")})
    except ConfigError as err:
        return runs.verdict(False, str(err))
    estimate = estimate_memory.estimate(config, args.nproc)[0]  # pipeline rank 0, which global rank 0 is
    if args.snapshot:
        try:
            return judge(args, Path(args.snapshot), estimate, config)
        except runs.BadInput as e:
            return runs.verdict(False, str(e))
    if args.work and (Path(args.work) / "run").exists():
        return runs.verdict(False, f"--work {args.work} already holds a run: pass a new directory")
    with runs.workdir(args.work, "memory-") as work:
        out = work / "run"
        mesh = f"--nproc {args.nproc}" + "".join(f" --{n} {getattr(args, n)}" for n in ("pp", "cp", "ep") if getattr(args, n))
        code, said = runs.train(args.config, out, args.step, mesh, args.set, env={"PITHTRAIN_DEBUG_MEMORY": str(args.step)},
                                quiet=True, checkpoints=False)
        record = next((out / "memory").glob("rank0.*"), None) if (out / "memory").is_dir() else None
        if code != 0 or record is None:
            print(said[-3000:])
            return runs.verdict(False, "the run did not finish or wrote no memory record (its output is above)")
        return judge(args, record, estimate, measured=runs.metrics(out)[-1]["peak_mem_bytes"])


def judge(args, record: Path, estimate: dict, config=None, measured: int | None = None) -> int:
    """Read rank 0's record, print where the peak goes, PASS/FAIL against the estimate. `config`: the
    record is a --snapshot, checked against its run first."""
    if config is not None:
        if record.suffix not in (".pickle", ".json"):
            raise runs.BadInput(f"--snapshot {record}: not a memory record (RUN/memory/rank0.pickle or .json)")
        if not record.is_file():
            raise runs.BadInput(f"--snapshot {record}: no such file")
        why = snapshot_run_differs(record, config, args.nproc)
        if why:
            raise runs.BadInput(why)
    cuda = record.suffix == ".pickle"
    what = "a CUDA allocator snapshot" if cuda else "a profiler trace with memory events"
    try:
        if cuda:
            peak, blocks = cuda_peak(pickle.loads(record.read_bytes()))
        else:
            peak, blocks = cpu_peak(runs.read_json(record)["traceEvents"])
    except (pickle.UnpicklingError, EOFError, LookupError, TypeError, AttributeError, StopIteration, ValueError, ImportError) as e:
        raise runs.BadInput(f"{record} is not {what} ({type(e).__name__}: {e})") from None
    by_stage, by_site = collections.Counter(), collections.Counter()
    for size, frames, op in blocks:
        by_stage[stage_of(frames)] += size
        by_site[call_site(frames, op) if frames != [BEFORE] else BEFORE] += size
    what = "live at the peak" if cuda else "allocated during the step and live at its peak (CPU: the profiler's view)"
    table(f"by layer stage, {what}:", by_stage, len(by_stage))
    table(f"by call site (top {args.top}):", by_site, args.top)
    if cuda:
        expected, label = estimate["total"], "the estimate's total"
        if measured is not None:
            print(f"\nthe run's max_memory_allocated at step {args.step}: {measured / GIB:.3f} GiB")
    else:
        expected = estimate["total"] - estimate["master weights (fp32)"] - estimate["AdamW moments (fp32)"]
        label = "the estimate less weights and AdamW moments"
    print(f"peak {peak / GIB:.4f} GiB; {label}: {expected:.4f} GiB (ratio {peak / GIB / expected:.2f})")
    ok = abs(peak / GIB - expected) <= args.margin * expected
    return runs.verdict(ok, f"peak {peak / GIB:.4f} GiB {'within' if ok else 'outside'} {100 * args.margin:g}% of "
                            f"{expected:.4f} GiB ({label})")


if __name__ == "__main__":
    sys.exit(main())
