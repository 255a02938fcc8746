"""One op's kernels under Nsight Compute: achieved TFLOP/s and bandwidth against the H200 roofline; PASS/FAIL.

    python .agents/skills/profile-kernel/profile_kernel.py OP [--experts 128 --rows 1024 --hidden 2048 --out-dim 1536]
        [--tokens 4096] [--peaks measured|spec] [--min-efficiency 0.5]
    python .agents/skills/profile-kernel/profile_kernel.py --train CONFIG --range stage3 [--step 3] [--train-args ...]
    python .agents/skills/profile-kernel/profile_kernel.py --csv NCU.csv [--flops F --min-bytes B --dtype bf16]

OP is one of OPS below, at Qwen3-30B-A3B-like shapes by default. The script runs
`ncu --csv --profile-from-start off --metrics ... python profile_kernel.py --driver OP`: the driver
builds the inputs, warms the op up (Triton compiles, cuBLAS handles) and runs it once between
torch.cuda.profiler.start() and stop(), so ncu measures exactly that call's kernels. FLOPs and the
least bytes the op must move come from its shape, the DRAM bytes and times from ncu. The op reaches
min(peak FLOP/s, intensity x peak bandwidth) at best (the roofline, intensity = FLOPs / DRAM bytes);
PASS when it achieves at least --min-efficiency of that.

--train profiles the kernels a training step launches inside one NVTX range of PithTrain
(`pithtrain::<range>`, PITHTRAIN_NVTX=1; the step through PITHTRAIN_PROFILE_STEPS): their FLOPs
are not known, so each kernel is judged by ncu's speed of light, the busier of SM and DRAM
throughput as a share of its peak; FAIL when a kernel with 5% or more of the range's time is
under --min-efficiency.
"""

import argparse
import csv
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))
import runs  # noqa: E402  (argument types)
from timeline import verdict  # noqa: E402

# H200 SXM: the data sheet's dense figures, and what this project measured on one
PEAKS = {
    "spec": {"bf16": 989e12, "fp8": 1979e12, "hbm": 4.8e12},
    "measured": {"bf16": 785e12, "fp8": 1440e12, "hbm": 4.17e12},  # 8192^3 matmul, _scaled_mm, device copy
}
METRICS = ("gpu__time_duration.sum", "dram__bytes_read.sum", "dram__bytes_write.sum",
           "sm__throughput.avg.pct_of_peak_sustained_elapsed", "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed")
UNITS = {"nsecond": 1e-9, "usecond": 1e-6, "msecond": 1e-3, "second": 1.0, "byte": 1.0, "Kbyte": 1e3,
         "Mbyte": 1e6, "Gbyte": 1e9, "%": 1.0, "": 1.0,  # to seconds and bytes; below: the short names
         "ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0, "B": 1.0, "KB": 1e3, "MB": 1e6, "GB": 1e9}  # ncu 2025 on the H200 prints "ns"
OPS = ("grouped_mm", "fp8_grouped_mm", "swiglu", "permute")


def read_ncu_csv(text: str) -> list[dict]:
    """ncu's --csv output (one row per kernel and metric, after any ==PROF== lines) -> per kernel
    launch: {"name", metric: value in seconds, bytes or percent}, in launch order."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        return []
    kernels = {}
    for row in csv.DictReader(line for line in lines[start:] if line.startswith('"')):
        unit, value = row["Metric Unit"], row["Metric Value"].replace(",", "")
        if value in ("", "n/a"):
            continue
        if unit not in UNITS:
            raise ValueError(f"unknown ncu unit {unit!r} of {row['Metric Name']}")
        k = kernels.setdefault(row["ID"], {"name": row["Kernel Name"]})
        try:
            k[row["Metric Name"]] = float(value) * UNITS[unit]
        except ValueError:
            raise ValueError(f"{row['Metric Name']}={value!r} of kernel {row['Kernel Name'][:40]!r} is not a number") from None
    for k in kernels.values():  # what every report reads
        if missing := [m for m in METRICS[:3] if m not in k]:
            raise ValueError(f"kernel {k['name'][:40]!r} has no {', '.join(missing)}; profile with this script's metrics")
        if not k[METRICS[0]] > 0:
            raise ValueError(f"kernel {k['name'][:40]!r}: {METRICS[0]}={k[METRICS[0]]}, not a duration")
    return list(kernels.values())


def roofline(flops: float, dram_bytes: float, seconds: float, dtype: str, peaks: dict) -> dict:
    """Achieved rates, the intensity, and the best the H200 allows at that intensity."""
    peak, bw = peaks[dtype], peaks["hbm"]
    intensity = flops / dram_bytes if dram_bytes else float("inf")
    bound = min(peak, intensity * bw)
    achieved = flops / seconds
    memory_bound = intensity < peak / bw
    return {"tflops": achieved / 1e12, "gbps": dram_bytes / seconds / 1e9, "intensity": intensity,
            "ridge": peak / bw, "bound": "memory" if memory_bound else "compute", "roof_tflops": bound / 1e12,
            # a memory-bound op with no FLOPs to speak of (a copy) is judged by its bandwidth
            "efficiency": (dram_bytes / seconds / bw) if memory_bound else achieved / bound}


def report(kernels: list[dict], flops: float, min_bytes: float, dtype: str, peaks: dict, min_efficiency: float) -> int:
    if not kernels:
        return verdict(["ncu measured no kernel (did the driver run the op between the profiler start and stop?)"])
    print(f"{'ms':>9} {'DRAM read MB':>13} {'write MB':>9} {'SM %':>6} {'DRAM %':>7}  kernel")
    for k in kernels:
        sm, dram_pct = k.get(METRICS[3], float("nan")), k.get(METRICS[4], float("nan"))  # nan: not measured
        print(f"{k['gpu__time_duration.sum'] * 1e3:9.4f} {k['dram__bytes_read.sum'] / 1e6:13.2f} "
              f"{k['dram__bytes_write.sum'] / 1e6:9.2f} {sm:6.1f} {dram_pct:7.1f}  {k['name'][:70]}")
    seconds = sum(k["gpu__time_duration.sum"] for k in kernels)
    dram = sum(k["dram__bytes_read.sum"] + k["dram__bytes_write.sum"] for k in kernels)
    r = roofline(flops, dram, seconds, dtype, peaks)
    print(f"op: {len(kernels)} kernel(s), {seconds * 1e3:.4f} ms, {flops / 1e9:.2f} GFLOP, DRAM {dram / 1e6:.2f} MB "
          f"({dram / min_bytes:.2f}x the {min_bytes / 1e6:.2f} MB it must move)")
    print(f"achieved {r['tflops']:.1f} TFLOP/s ({dtype} peak {peaks[dtype] / 1e12:.0f}), {r['gbps']:.0f} GB/s "
          f"(HBM peak {peaks['hbm'] / 1e9:.0f}); intensity {r['intensity']:.1f} FLOP/byte ({flops / min_bytes:.1f} at "
          f"the minimum bytes), ridge {r['ridge']:.1f}: {r['bound']}-bound, roofline {r['roof_tflops']:.1f} TFLOP/s, "
          f"efficiency {100 * r['efficiency']:.1f}%")
    if r["efficiency"] >= min_efficiency:
        return verdict([], f"efficiency {100 * r['efficiency']:.1f}% >= {100 * min_efficiency:.0f}% of the {r['bound']}-bound roofline")
    hint = ("memory-bound: moves {:.1f}x its minimum bytes; better reuse (tiling) or fusing it with its neighbour "
            "saves the round trip".format(dram / min_bytes) if r["bound"] == "memory"
            else "compute-bound below the roof: retile (block sizes, stages, warps) or check the tensor-core path")
    return verdict([f"efficiency {100 * r['efficiency']:.1f}% < {100 * min_efficiency:.0f}% ({hint})"])


def report_run(kernels: list[dict], min_efficiency: float) -> int:
    """Kernels of a training step, by name: time, launches, speed of light, bandwidth."""
    if not kernels:
        return verdict(["ncu measured no kernel: is the range name right, and did the run reach the step?"])
    by_name = {}  # name -> [launches, seconds, seconds x speed of light, DRAM bytes]
    for k in kernels:
        t = k["gpu__time_duration.sum"]
        sol = max(k.get(METRICS[3], 0.0), k.get(METRICS[4], 0.0)) / 100
        agg = by_name.setdefault(k["name"], [0, 0.0, 0.0, 0.0])
        for i, v in enumerate((1, t, t * sol, k["dram__bytes_read.sum"] + k["dram__bytes_write.sum"])):
            agg[i] += v
    total = sum(agg[1] for agg in by_name.values())
    print(f"{len(kernels)} kernel launches, {total * 1e3:.3f} ms; by kernel: ms, share, launches, speed of light, GB/s")
    low = []
    for name, (n, t, weighted, dram) in sorted(by_name.items(), key=lambda kv: -kv[1][1]):
        print(f"  {t * 1e3:9.4f} {100 * t / total:5.1f}% {n:5d}x {100 * weighted / t:5.1f}% {dram / t / 1e9:7.0f}  {name[:70]}")
        if t >= 0.05 * total and weighted / t < min_efficiency:
            low.append(f"{name[:40]} ({100 * t / total:.0f}% of the time at {100 * weighted / t:.0f}%)")
    return verdict([f"under {100 * min_efficiency:.0f}% of speed of light: " + ", ".join(low)] if low else [],
                   f"every kernel with 5% or more of the time at >= {100 * min_efficiency:.0f}% of speed of light")


def build_op(args, device: str):
    """(the call, FLOPs, the least bytes it must read and write, dtype of the roof) of OP."""
    import torch

    from pithtrain.ops import fp8, grouped_gemm, kernels

    bf16 = torch.bfloat16
    e, r, h, n, t = args.experts, args.rows, args.hidden, args.out_dim, args.tokens
    counts = torch.full((e,), r, dtype=torch.int64, device=device)
    if args.op in ("grouped_mm", "fp8_grouped_mm"):
        x, w = torch.randn(e * r, h, device=device, dtype=bf16), torch.randn(e, h, n, device=device, dtype=bf16) / h**0.5
        flops = 2.0 * e * r * h * n
        if args.op == "grouped_mm":
            return (lambda: grouped_gemm.grouped_mm(x, w, counts)), flops, 2.0 * (e * r * h + e * h * n + e * r * n), "bf16"
        (a, sa), (b, sb) = fp8.quantize(x), fp8._quantize_nd(w.transpose(1, 2).contiguous())  # b: [E, N, K]
        return ((lambda: fp8.grouped_mm(a, sa, b, sb, counts, bf16)), flops,
                e * r * h + e * h * n + 2.0 * e * r * n + 4.0 * (e * r + e * n), "fp8")
    if args.op == "swiglu":
        gate_up = torch.randn(t * 8, n, device=device, dtype=bf16)  # [T*k, 2I], 2I = out_dim
        rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
        # silu(g) * u: about 5 FLOPs an output (exp counted as one); memory-bound whatever the count
        return (lambda: kernels.swiglu(gate_up)), 5.0 * rows * inter, 2.0 * (rows * 2 * inter + rows * inter), "bf16"
    x = torch.randn(t, h, device=device, dtype=bf16)
    index = torch.argsort(torch.rand(t * 8, device=device)) // 8  # every token to 8 rows, in expert order
    return (lambda: kernels.permute(x, index)), 0.0, 2.0 * (t * h + t * 8 * h) + 8.0 * t * 8, "bf16"


def driver(args) -> int:
    """Run OP once between the CUDA profiler's start and stop (ncu --profile-from-start off)."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the checkout's pithtrain
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    call, flops, min_bytes, dtype = build_op(args, device)
    for _ in range(3):
        call()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
    call()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
    Path(args.facts).write_text(json.dumps({"flops": flops, "min_bytes": min_bytes, "dtype": dtype}))
    return 0


@runs.interruptible
def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("op", nargs="?", choices=OPS)
    parser.add_argument("--experts", type=runs.COUNT, default=128)
    parser.add_argument("--rows", type=runs.COUNT, default=1024, help="rows per expert (grouped GEMMs)")
    parser.add_argument("--hidden", type=runs.COUNT, default=2048)
    parser.add_argument("--out-dim", type=runs.COUNT, default=1536, help="GEMM output width; swiglu's input width 2I")
    parser.add_argument("--tokens", type=runs.COUNT, default=4096, help="tokens (swiglu: x8 rows, permute: to 8 rows each)")
    parser.add_argument("--peaks", choices=PEAKS, default="measured", help="the roof: measured H200 figures or the data sheet's")
    parser.add_argument("--min-efficiency", type=runs.FRACTION, default=0.5, help="FAIL below this share of the roofline")
    parser.add_argument("--train", metavar="CONFIG", help="profile a training step's kernels in --range instead of OP")
    parser.add_argument("--range", default="stage3", help="--train: the PithTrain NVTX range (stage1..5, stage3.wgrad, "
                        "dispatch, combine, optimizer; kernels in ranges nested in it count)")
    parser.add_argument("--step", type=runs.COUNT, default=3, help="--train: the step to profile (after warm-up)")
    parser.add_argument("--train-args", default="", help="--train: extra `pithtrain train` arguments")
    parser.add_argument("--set", action="append", default=[], help="--train: config overrides")
    parser.add_argument("--csv", type=Path, help="analyse this ncu --csv output: an op's with --flops and --min-bytes, "
                        "else a run's")
    parser.add_argument("--flops", type=runs.NON_NEGATIVE)
    parser.add_argument("--min-bytes", type=runs.POSITIVE)
    parser.add_argument("--dtype", choices=("bf16", "fp8"), default="bf16")
    parser.add_argument("--driver", action="store_true", help=argparse.SUPPRESS)  # the process ncu profiles
    parser.add_argument("--facts", help=argparse.SUPPRESS)
    parser.add_argument("--device", help=argparse.SUPPRESS)
    args = parser.parse_args()
    peaks = PEAKS[args.peaks]
    if args.driver:
        return driver(args)
    if args.csv is not None:
        if ignored := [f for f, given in (("OP", args.op), ("--train", args.train), ("--min-bytes without --flops",
                                                                                    args.flops is None and args.min_bytes)) if given]:
            parser.error(f"{', '.join(ignored)}: --csv analyses an existing ncu file (an op's with --flops and --min-bytes); drop it")
        try:
            text = args.csv.read_text()
            kernels = read_ncu_csv(text)
        except (OSError, UnicodeDecodeError, ValueError, KeyError) as e:  # KeyError: a column ncu writes is missing
            return verdict([f"--csv {args.csv}: cannot be read ({getattr(e, 'strerror', None) or e}); give the file "
                            "`ncu --csv --log-file` wrote"])
        if not any(line.startswith('"ID"') for line in text.splitlines()):
            return verdict([f"--csv {args.csv}: no ncu table in it (no \"ID\" header line); give the file "
                            "`ncu --csv --log-file` wrote"])
        if args.flops is None:
            return report_run(kernels, args.min_efficiency)
        if args.min_bytes is None:
            parser.error("--csv with --flops needs --min-bytes (the least bytes the op moves)")
        return report(kernels, args.flops, args.min_bytes, args.dtype, peaks, args.min_efficiency)
    if args.op is None and args.train is None:
        parser.error("give OP, --train CONFIG or --csv")
    if shutil.which("ncu") is None:
        return verdict(["ncu is not on PATH: it comes with the CUDA toolkit (e.g. /usr/local/cuda/bin/ncu); add that to PATH"])
    work = Path(tempfile.mkdtemp(prefix="ncu-"))
    cmd = ["ncu", "--csv", "--print-units", "base", "--profile-from-start", "off", "--clock-control", "none",
           "--metrics", ",".join(METRICS), "--log-file", str(work / "ncu.csv")]
    env = dict(os.environ)
    if args.train:  # the step's kernels launched inside the range (NVTX push/pop ranges end in '/')
        env.update(PITHTRAIN_NVTX="1", PITHTRAIN_PROFILE_STEPS=f"{args.step}:{args.step}")
        cmd += ["--nvtx", "--nvtx-include", f"pithtrain::{args.range}/", sys.executable, "-m", "pithtrain", "train",
                args.train, "--out", str(work / "run"), "--steps", str(args.step), *shlex.split(args.train_args)]
        cmd += [a for s in args.set for a in ("--set", s)]
        print(f"$ PITHTRAIN_NVTX=1 PITHTRAIN_PROFILE_STEPS={args.step}:{args.step} {shlex.join(cmd)}", flush=True)
    else:
        shape = ["--experts", args.experts, "--rows", args.rows, "--hidden", args.hidden, "--out-dim", args.out_dim,
                 "--tokens", args.tokens]
        cmd += [sys.executable, __file__, args.op, "--driver", "--facts", str(work / "facts.json"), *map(str, shape)]
        print("$", shlex.join(cmd), flush=True)
    run = subprocess.run(cmd, capture_output=True, text=True, env=env)
    log = (work / "ncu.csv").read_text() if (work / "ncu.csv").is_file() else ""
    if "ERR_NVGPUCTRPERM" in run.stdout + run.stderr + log:
        return verdict(["ncu may not read the GPU's performance counters here (ERR_NVGPUCTRPERM): run as root, or load "
                        "the driver with NVreg_RestrictProfilingToAdminUsers=0"])
    if run.returncode != 0 or not (args.train or (work / "facts.json").is_file()):
        print(run.stdout[-3000:] + run.stderr[-3000:])
        return verdict([f"the profiled program failed (exit {run.returncode}); ncu's log: {work / 'ncu.csv'}"])
    if args.train:
        return report_run(read_ncu_csv(log), args.min_efficiency)
    facts = json.loads((work / "facts.json").read_text())
    return report(read_ncu_csv(log), facts["flops"], facts["min_bytes"], facts["dtype"], peaks, args.min_efficiency)


if __name__ == "__main__":
    sys.exit(main())
