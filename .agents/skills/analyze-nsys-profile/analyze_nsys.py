"""GPU time per PithTrain NVTX range, NCCL overlap and idle gaps from an Nsight Systems SQLite export; PASS/FAIL.

    nsys export --type sqlite -o RUN.sqlite RUN.nsys-rep
    python .agents/skills/analyze-nsys-profile/analyze_nsys.py RUN.sqlite [--min-overlap 0.5] [--gap-us 20]

Reads the export's tables: CUPTI_ACTIVITY_KIND_KERNEL (and _MEMCPY, _MEMSET when present: start,
end, deviceId, streamId, correlationId, globalPid, demangledName -> StringIds), CUPTI_ACTIVITY_KIND_RUNTIME
(the CUDA API call that launched each: start, correlationId, globalTid), NVTX_EVENTS (push/pop
ranges, eventType 59: start, end, text or textId -> StringIds, globalTid). Times are nanoseconds.
A kernel belongs to the innermost `pithtrain::` range open on the thread that launched it when it
was launched (protocol.named_range opens them under PITHTRAIN_NVTX=1). Each process (a rank,
one GPU) is reported on its own. PASS when every process shows GPU time in layer stages 1, 2, 3 and 5
(dispatch counted inside stage 2; stage 4, the combine, is empty with one expert rank) and the
optimizer, and its NCCL overlap is at least --min-overlap.
"""

import argparse
import sqlite3
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))
import runs  # noqa: E402  (argument types)
from timeline import COLLECTIVES, collective, gaps, merged, overlap_time, verdict  # noqa: E402

PUSH_POP = 59  # NVTX_EVENTS.eventType of a push/pop range (NvtxPushPopRange)
NEEDED = {"StringIds": "the kernel and range names", "CUPTI_ACTIVITY_KIND_RUNTIME": "the CUDA API calls that launched "
          "the kernels: capture with --trace=cuda", "NVTX_EVENTS": "the ranges: capture with PITHTRAIN_NVTX=1 and --trace=cuda,nvtx"}
PREFIX = "pithtrain::"
OUTSIDE = "(outside ranges)"


def pid_of(global_id: int) -> int:
    """The process id inside nsys's serialized globalPid / globalTid."""
    return (global_id >> 24) & 0xFFFFFF


def tables(db) -> set:
    return {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}


def read_activity(db) -> list[tuple]:
    """GPU activities: (start, end, pid, device, stream, correlationId, name) for kernels, copies, memsets."""
    have = tables(db)
    rows = []
    if "CUPTI_ACTIVITY_KIND_KERNEL" in have:
        rows += db.execute(
            "SELECT k.start, k.end, k.globalPid, k.deviceId, k.streamId, k.correlationId, COALESCE(d.value, s.value, '?') "
            "FROM CUPTI_ACTIVITY_KIND_KERNEL k LEFT JOIN StringIds d ON d.id = k.demangledName "
            "LEFT JOIN StringIds s ON s.id = k.shortName").fetchall()
    for table, name in (("CUPTI_ACTIVITY_KIND_MEMCPY", "[memcpy]"), ("CUPTI_ACTIVITY_KIND_MEMSET", "[memset]")):
        if table in have:
            rows += db.execute(f"SELECT start, end, globalPid, deviceId, streamId, correlationId, '{name}' "
                               f"FROM {table}").fetchall()
    return [(a, b, pid_of(gpid), dev, stream, corr, name) for a, b, gpid, dev, stream, corr, name in rows]


def read_launches(db) -> dict:
    """(pid, correlationId) -> (globalTid, start) of the API call that launched the activity."""
    rows = db.execute("SELECT correlationId, globalTid, start FROM CUPTI_ACTIVITY_KIND_RUNTIME").fetchall()
    return {(pid_of(tid), corr): (tid, start) for corr, tid, start in rows}


def read_ranges(db) -> dict:
    """globalTid -> the thread's closed `pithtrain::` push/pop ranges [(start, end, name)], sorted
    with a parent before the ranges nested in it."""
    rows = db.execute(
        "SELECT n.start, n.end, COALESCE(n.text, s.value), n.globalTid FROM NVTX_EVENTS n "
        "LEFT JOIN StringIds s ON s.id = n.textId WHERE n.eventType = ? AND n.end IS NOT NULL", (PUSH_POP,)).fetchall()
    out = {}
    for start, end, name, tid in rows:
        if name and name.startswith(PREFIX):
            out.setdefault(tid, []).append((start, end, name))
    for spans in out.values():
        spans.sort(key=lambda r: (r[0], -r[1]))
    return out


def open_ranges(spans, times):
    """For each time (any order), the names of the ranges open at it, outermost first."""
    order = sorted(range(len(times)), key=lambda i: times[i])
    out, active, j = [None] * len(times), [], 0
    for i in order:
        while j < len(spans) and spans[j][0] <= times[i]:
            active.append(spans[j])
            j += 1
        active = [r for r in active if r[1] > times[i]]
        out[i] = [r[2] for r in active]
    return out


def attribute(activity, launches, ranges) -> list[list[str]]:
    """For each activity, the `pithtrain::` ranges open at its launch on the launching thread."""
    stacks = [[] for _ in activity]
    by_thread = {}
    for i, (_, _, pid, _, _, corr, _) in enumerate(activity):
        launch = launches.get((pid, corr))
        if launch is not None:
            by_thread.setdefault(launch[0], []).append((i, launch[1]))
    for tid, items in by_thread.items():
        for (i, _), stack in zip(items, open_ranges(ranges.get(tid, []), [t for _, t in items])):
            stacks[i] = stack
    return stacks


def stage_of(stack) -> str | None:
    """The layer stage (or the optimizer) of a range stack: its innermost stage range."""
    for name in reversed(stack):
        if name.startswith(PREFIX + "stage"):
            n = name[len(PREFIX + "stage"):]
            return f"stage {n[0]}" + (" wgrad" if n.endswith(".wgrad") else "")
        if name == PREFIX + "optimizer":
            return "optimizer"
    return None


def analyse(activity, launches, ranges, gap_us: float) -> dict:
    """One process's figures (times in ns)."""
    stacks = attribute(activity, launches, ranges)
    by_range, by_stage = {}, {}
    for (a, b, *_), stack in zip(activity, stacks):
        key = stack[-1] if stack else OUTSIDE
        by_range[key] = by_range.get(key, 0) + (b - a)
        stage = stage_of(stack)
        if stage is not None:
            by_stage[stage] = by_stage.get(stage, 0) + (b - a)
    spans = lambda keep: merged(sorted((a, b) for a, b, *_, name in activity if keep(name)))  # noqa: E731
    comm, compute = spans(lambda n: collective(n) is not None), spans(lambda n: collective(n) is None)
    per_kind = {}
    for kind in COLLECTIVES:
        kind_spans = spans(lambda n, kind=kind: collective(n) == kind)
        total = sum(b - a for a, b in kind_spans)
        if total:
            per_kind[kind] = (total, overlap_time(kind_spans, compute) / total)
    busy = spans(lambda n: True)
    # each gap is charged to the range of the activity that ended it (what the GPU waited for); the
    # host was late when that activity was launched after the gap began
    firsts = sorted(range(len(activity)), key=lambda i: activity[i][0])
    idle, by_next, late = gaps(busy, gap_us * 1e3), {}, 0
    k = 0
    for start, end in idle:
        while activity[firsts[k]][0] < end:
            k += 1
        i = firsts[k]
        key = stacks[i][-1] if stacks[i] else OUTSIDE
        by_next[key] = by_next.get(key, 0) + (end - start)
        launch = launches.get((activity[i][2], activity[i][5]))
        late += (end - start) if launch is not None and launch[1] > start else 0
    comm_t = sum(b - a for a, b in comm)
    return {
        "count": len(activity), "devices": sorted({row[3] for row in activity}),
        "total": sum(b - a for a, b, *_ in activity), "span": busy[-1][1] - busy[0][0],
        "by_range": by_range, "by_stage": by_stage, "comm": comm_t, "per_kind": per_kind,
        "overlap": overlap_time(comm, compute) / comm_t if comm_t else 0.0,
        "idle": sum(b - a for a, b in idle), "gaps": len(idle), "late": late, "by_next": by_next,
    }


def report(pid: int, r: dict, gap_us: float) -> None:
    ms = lambda ns: ns / 1e6  # noqa: E731
    print(f"process {pid} (device {', '.join(map(str, r['devices']))}): {r['count']} GPU activities, "
          f"{ms(r['total']):.2f} ms, first to last {ms(r['span']):.2f} ms")
    print("GPU time by innermost NVTX range at launch (ms, share):")
    for name, ns in sorted(r["by_range"].items(), key=lambda kv: -kv[1]):
        print(f"  {ms(ns):9.2f}  {100 * ns / r['total']:5.1f}%  {name}")
    keys = [f"stage {n}" for n in range(1, 6)] + ["stage 3 wgrad", "optimizer"]
    print("by layer stage, ranges nested in a stage included (ms): "
          + ", ".join(f"{key} {ms(r['by_stage'].get(key, 0)):.2f}" for key in keys))
    print(f"NCCL {ms(r['comm']):.2f} ms, overlapped with compute: {100 * r['overlap']:.1f}%")
    for kind, (ns, share) in r["per_kind"].items():
        print(f"  {kind:15s} {ms(ns):8.2f} ms, {100 * share:5.1f}% overlapped with compute")
    print(f"GPU idle (gaps >= {gap_us:g} us, nothing on any stream): {ms(r['idle']):.2f} ms in {r['gaps']} gaps, "
          f"{ms(r['late']):.2f} ms of it before the host had launched the next activity; by the range of that launch:")
    for name, ns in sorted(r["by_next"].items(), key=lambda kv: -kv[1]):
        print(f"  {ms(ns):9.2f}  {name}")


@runs.interruptible
def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sqlite", type=Path, help="`nsys export --type sqlite` of a capture")
    parser.add_argument("--min-overlap", type=runs.FRACTION, default=0.0, help="FAIL below this share of NCCL time overlapped (0..1)")
    parser.add_argument("--gap-us", type=runs.POSITIVE, default=20.0, help="the shortest idle gap counted (microseconds)")
    args = parser.parse_args()
    if args.sqlite.is_dir():  # a capture's folder: name the export in it, or the capture to export into it
        exports, captures = sorted(args.sqlite.glob("*.sqlite")), sorted(args.sqlite.glob("*.nsys-rep"))
        rep = captures[0] if captures else args.sqlite / "RUN.nsys-rep"
        fix = (f"give {exports[0]}" if exports else
               f"make it: nsys export --type sqlite -o {rep.with_suffix('.sqlite')} {rep}")
        return verdict([f"{args.sqlite} is a directory, not the SQLite export of a capture ({fix})"])
    target = (args.sqlite if args.sqlite.suffix == ".sqlite" or not args.sqlite.exists()  # never advise overwriting
              else args.sqlite.with_name(args.sqlite.stem + "_export.sqlite"))          # a file of another kind
    export = f"nsys export --type sqlite -o {target} RUN.nsys-rep"
    if not args.sqlite.is_file():
        return verdict([f"{args.sqlite} does not exist; give the SQLite export of a capture (make it: {export})"])
    try:
        db = sqlite3.connect(f"file:{args.sqlite}?mode=ro", uri=True)
        missing = [f"{name} ({why})" for name, why in NEEDED.items() if name not in tables(db)]
        if missing:
            return verdict([f"{args.sqlite} has no table {', '.join(missing)}"])
        activity, launches, ranges = read_activity(db), read_launches(db), read_ranges(db)
    except sqlite3.DatabaseError as e:  # not SQLite; a column nsys's export names otherwise
        return verdict([f"{args.sqlite}: {e}; expected an nsys SQLite export (make it: {export}) with the columns analyze_nsys.py reads"])
    if not activity:
        return verdict([f"{args.sqlite} holds no GPU kernels (no rows in CUPTI_ACTIVITY_KIND_KERNEL, _MEMCPY or _MEMSET: "
                        "was the capture range empty? see capture-nsys-profile)"])
    if not ranges:
        return verdict([f"{args.sqlite} holds no {PREFIX} NVTX ranges: capture with PITHTRAIN_NVTX=1 and --trace=cuda,nvtx"])
    failures, pids = [], sorted({row[2] for row in activity})
    for pid in pids:
        r = analyse([row for row in activity if row[2] == pid], launches, ranges, args.gap_us)
        report(pid, r, args.gap_us)
        # stage 4 may be empty: with one expert rank the combine moves nothing (stage 5 reads the rows in place)
        missing = [key for key in ["stage 1", "stage 2", "stage 3", "stage 5", "optimizer"] if not r["by_stage"].get(key)]
        if missing:
            failures.append(f"process {pid}: no GPU time in {', '.join(missing)}")
        if args.min_overlap and not r["comm"]:
            failures.append(f"process {pid}: no NCCL kernels (--min-overlap {100 * args.min_overlap:g}%)")
        elif r["overlap"] < args.min_overlap:
            failures.append(f"process {pid}: NCCL overlap {100 * r['overlap']:.1f}% < {100 * args.min_overlap:g}%")
    return verdict(failures, f"{len(pids)} process(es) with GPU time in layer stages 1, 2, 3, 5 and the optimizer"
                   + (f", NCCL overlap >= {100 * args.min_overlap:g}%" if args.min_overlap else ""))


if __name__ == "__main__":
    sys.exit(main())
