"""A/B a switch in training on one GPU, both settings alternating step by step in one run, and judge it;
ends with PASS (B is faster beyond the noise) or FAIL (slower, or within the noise). The noise: twice the
standard error of B/A - 1 from each arm's step-to-step scatter about its median (about 95% confidence).

  python .agents/skills/ab-test-switch/ab_switch.py SWITCH[,SWITCH...] [--arm B] [--min-gain 0.005] [-- ARGS]
  python .agents/skills/ab-test-switch/ab_switch.py --from-results FILE [--line N] [--arm B] [--min-gain 0.005]

SWITCH is one of benchmarks/train_throughput.py's --ab choices; several, comma-separated, run in one process as
arms B, C, ... (each flips its switch against arm A: one compile for all), and --arm names the one to judge (the
others' ratios are printed). The run is `train_throughput.py --seq 4096 --compile --skip-transformers --steps
6 x arms --ab SWITCH...` plus the arguments after `--` (e.g. `--layers 9 --batch 4 --accum 8`); its line goes where
the benchmark writes (PITHTRAIN_RESULTS, else benchmarks/results.jsonl) and is judged from there. --from-results
judges a line already written (default: the file's latest --ab line).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "_common"))
import runs  # noqa: E402

BENCHMARK = "benchmarks/train_throughput.py"


def arm_steps(line: dict) -> dict[str, list[float]]:
    """Each arm's measured tokens/s: its steps after its first two, less its profiled last one (ab_stage_ms)."""
    out = {}
    for arm in sorted({a for _, a, _ in line["ab_steps"]}):
        rates = [tps for _, a, tps in line["ab_steps"] if a == arm][2:]
        out[arm] = rates[:-1] if "ab_stage_ms" in line and len(rates) > 1 else rates
    return out


def arm_figures(line: dict) -> dict[str, dict]:
    """Each arm's switch, setting, median tokens/s, MFU and peak GiB: a multi-arm line's ab_arms, or a two-arm
    line's ab_b_* keys (lines written before ab_arms existed)."""
    arms = {"A": {"switch": line["ab"], "runs": line["ab_a"], "tokens_per_s": line["pithtrain_tokens_per_s"],
                  "mfu": line.get("pithtrain_mfu"), "peak_mem_gib": line.get("pithtrain_peak_mem_gib")}}
    return arms | (line.get("ab_arms") or {"B": {"switch": line["ab"], "runs": line["ab_b"], "tokens_per_s": line["ab_b_tokens_per_s"],
                                                 "mfu": line.get("ab_b_mfu"), "peak_mem_gib": line.get("ab_b_peak_mem_gib")}})


def judge(line: dict, min_gain: float, arm: str = "B") -> tuple[bool, str]:
    """Print the arms and the largest stage changes; (`arm` beats A beyond the noise and min_gain, why)."""
    steps, figures = arm_steps(line), arm_figures(line)
    if arm not in figures or arm == "A":
        return False, f"--arm {arm}: this line's arms against A are {', '.join(sorted(set(figures) - {'A'}))}"
    if not steps.get("A") or not steps.get(arm):
        return False, "an arm has no measured step (run more steps: 6 an arm give each three)"
    spread = {a: (max(r) - min(r)) / statistics.median(r) for a, r in steps.items() if r}
    scatter = {a: statistics.fmean((x / statistics.median(r) - 1) ** 2 for x in r) for a, r in steps.items() if r}
    ratio = figures[arm]["tokens_per_s"] / figures["A"]["tokens_per_s"]
    print(f"switch {line['ab']}: A = {json.dumps(line['ab_a'])}"
          f" ({line.get('family', '?')}, {line.get('layers', '?')} layers, commit {line.get('commit', '?')})")
    for a, f in figures.items():
        shown = ", ".join(f"{r:,.0f}" for r in steps.get(a, []))
        print(f"  arm {a}" + (f" ({f['switch']} = {json.dumps(f['runs'])})" if a != "A" else "")
              + f": {f['tokens_per_s']:,.0f} tok/s median of [{shown}] (spread {spread.get(a, 0):.1%})"
              + (f", {f['tokens_per_s'] / figures['A']['tokens_per_s']:.3f}x A" if a != "A" else "")
              + (f", MFU {f['mfu']:.1%}" if f.get("mfu") else "") + (f", peak {f['peak_mem_gib']:.1f} GiB" if f.get("peak_mem_gib") else ""))
    stages = line.get("ab_stage_ms")
    if stages and {"A", arm} <= set(stages):
        keys = sorted(set(stages["A"]) | set(stages[arm]), key=lambda k: -abs(stages[arm].get(k, 0) - stages["A"].get(k, 0)))
        print(f"  GPU ms of the profiled step, largest changes {arm} - A: " + ", ".join(
            f"{k} {stages['A'].get(k, 0):.1f} -> {stages[arm].get(k, 0):.1f}" for k in keys[:6]))
    noise = 2 * sum(scatter[a] / len(steps[a]) for a in ("A", arm)) ** 0.5
    gain = ratio - 1
    if gain >= max(min_gain, noise):
        return True, f"{arm} is {gain:.1%} faster ({ratio:.3f}x), beyond the noise ({noise:.1%})"
    if gain <= -max(min_gain, noise):
        return False, f"{arm} is {-gain:.1%} slower ({ratio:.3f}x): keep A"
    if abs(gain) > noise:
        return False, f"{arm}/A = {ratio:.3f}x: beyond the noise ({noise:.1%}) but within --min-gain {min_gain:.1%}; keep A"
    return False, (f"{arm}/A = {ratio:.3f}x, within the noise ({noise:.1%}; --min-gain {min_gain:.1%}): "
                   "no verdict; run more steps or keep A")


def is_ab(line) -> bool:
    return isinstance(line, dict) and "ab" in line and "ab_steps" in line


def read_line(path: Path, number: int | None) -> dict | str:
    """The results line to judge (`number`, 1-based; None: the latest --ab line), or a one-line reason it
    cannot be read."""
    if not path.is_file():
        return f"{path}: no such results file" + (" (a folder)" if path.is_dir() else "")
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    if not lines:
        return f"{path} is empty"
    if number is None:
        for index in range(len(lines), 0, -1):
            try:
                line = json.loads(lines[index - 1])
            except json.JSONDecodeError:
                continue
            if is_ab(line):
                print(f"judging line {index} of {path}, its latest train_throughput.py --ab run")
                return line
        return f"{path} holds no train_throughput.py --ab run in its {len(lines)} lines"
    if number > len(lines):
        return f"--line {number}: {path} has lines 1..{len(lines)}"
    try:
        line = json.loads(lines[number - 1])
    except json.JSONDecodeError as e:
        return f"{path} line {number} is not JSON ({e.msg})"
    if not is_ab(line):
        return f"{path} line {number} is not a train_throughput.py --ab run"
    return line


@runs.interruptible
def main() -> int:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("switch", nargs="?", help="train_throughput.py --ab choices, comma-separated (fp8 runs alone "
                        "and needs --fp8 after --)")
    parser.add_argument("--arm", default="B", help="the arm to judge against A (B, C, ...: one a switch, in order)")
    parser.add_argument("--from-results", type=Path, help="judge a line already in this results file")
    parser.add_argument("--line", type=runs.COUNT, help="with --from-results: its line number (1-based; default the "
                        "latest --ab line)")
    parser.add_argument("--min-gain", type=runs.NON_NEGATIVE, default=0.005, help="the smallest B/A - 1 worth a PASS "
                        "(a fraction, default 0.005: 0.5%%)")
    args = parser.parse_args(argv)
    if (args.switch is None) == (args.from_results is None):
        return runs.verdict(False, "give SWITCH (to run the A/B on this GPU) or --from-results FILE, one of them")
    if args.line is not None and args.from_results is None:
        return runs.verdict(False, f"--line {args.line} picks a line of --from-results FILE; give that file too")
    if args.switch is not None and not Path(BENCHMARK).is_file():
        return runs.verdict(False, f"no {BENCHMARK} under {Path.cwd()}: run this from the repository root (PYTHONPATH=.)")
    if args.switch is not None:  # the benchmark's own list, checked here before it starts (its usage runs 17 lines)
        sys.path.append(str(Path(BENCHMARK).resolve().parent))  # after site-packages (its `kernels`)
        from train_throughput import AB_SWITCHES

        unknown = [s for s in args.switch.split(",") if s not in AB_SWITCHES]
        if unknown:
            return runs.verdict(False, f"{','.join(unknown)}: not a switch of {BENCHMARK} --ab (one of {', '.join(AB_SWITCHES)})")
    if args.from_results is None:
        results = Path(os.environ.get("PITHTRAIN_RESULTS", BENCHMARK.replace("train_throughput.py", "results.jsonl")))
        before = len(results.read_text(errors="replace").splitlines()) if results.is_file() else 0  # as read_line reads it
        steps = 6 * (1 + len(args.switch.split(",")))
        cmd = [sys.executable, BENCHMARK, "--seq", "4096", "--compile", "--skip-transformers", "--steps", str(steps),
               *extra, "--ab", args.switch]
        print("$ " + " ".join(cmd), flush=True)
        if subprocess.run(cmd).returncode != 0:
            return runs.verdict(False, f"{BENCHMARK} failed (its error is above)")
        if not results.is_file() or len(results.read_text(errors="replace").splitlines()) <= before:
            return runs.verdict(False, f"{BENCHMARK} wrote no line to {results}")
        args.from_results, args.line = results, None
    line = read_line(args.from_results, args.line)
    if isinstance(line, str):
        return runs.verdict(False, line)
    try:
        return runs.verdict(*judge(line, args.min_gain, args.arm))
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:  # a line edited or cut by hand
        return runs.verdict(False, f"{args.from_results}: the --ab line is damaged ({type(e).__name__}: {e}); judge a "
                                   "line train_throughput.py wrote")


if __name__ == "__main__":
    sys.exit(main())
