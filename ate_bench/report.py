"""The report of a results directory: per category and framework the mean metrics side by side,
pass rates, the ratio of each framework to the baseline (the first framework, or --baseline),
each task's grades; written as report.md (Markdown) and report.png (bar charts)."""

from __future__ import annotations

import io
import json
import math
import re
from collections import defaultdict
from pathlib import Path

from ate_bench.grading import write_file
from ate_bench.tasks import CATEGORIES, UsageError

METRICS = (  # (result key, column title): the cost of a session, lower is cheaper
    ("turns", "turns"),
    ("output_tokens", "output tokens"),
    ("mean_context_tokens", "context tokens / turn"),
    ("session_seconds", "session s"),
    ("gpu_seconds", "GPU s"),
)


GRADES = ("pass", "fail", "ungraded")
STATUSES = ("ok", "agent_error", "timeout")
REQUIRED = ("task", "category", "framework", "repeat", "status", "grade") + tuple(m for m, _ in METRICS)


def _finite(x) -> bool:
    try:
        return isinstance(x, (int, float)) and math.isfinite(x)
    except OverflowError:  # an int past float's range
        return False


def load_results(out: Path) -> list[dict]:
    """Every session's result.json; one that does not read, or lacks a field the report uses, is a
    ValueError naming it."""
    results = []
    for path in sorted(out.glob("*/*/r*/result.json")):
        if not re.fullmatch(r"r\d+", path.parent.name):  # a copy kept by hand (r0.old, r0-backup) counted twice
            continue
        try:
            result = json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"{path} is not valid JSON ({e}); rerun that session or move it away") from None
        missing = [k for k in REQUIRED if not isinstance(result, dict) or k not in result]
        # a hand-edited field of the wrong type (a null grade, a list as framework, 1e400 turns) crashed the report
        missing += [m for m, _ in METRICS if m not in missing and not _finite(result[m])]
        missing += [k for k in ("task", "framework", "status", "grade") if k not in missing and not isinstance(result[k], str)]
        missing += [k for k, ok in (("grade", GRADES), ("status", STATUSES)) if k not in missing and result[k] not in ok]
        if "repeat" not in missing and not isinstance(result["repeat"], int):
            missing.append("repeat")
        if missing or result["category"] not in CATEGORIES:
            raise ValueError(f"{path} is not a result of `ate_bench run` (missing or bad: {', '.join(missing) or 'category'}); "
                             "rerun that session or move it away")
        results.append(result)
    return results


def _mean(values) -> float | None:
    values = list(values)
    return sum(values) / len(values) if values else None


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def summarize(results: list[dict]) -> dict:
    """{(framework, category): {metric: mean, "pass_rate": ..., "graded": n, "runs": n, "agent_errors": n}},
    categories plus "all". The cost means leave out agent_error sessions (the agent failed, e.g. an API error:
    not what the framework cost); the pass rate counts them as the fails they are graded."""
    cells = defaultdict(list)
    for r in results:
        cells[(r["framework"], r["category"])].append(r)
        cells[(r["framework"], "all")].append(r)
    summary = {}
    for key, rs in cells.items():
        graded = [r for r in rs if r["grade"] != "ungraded"]
        row = {m: _mean(r[m] for r in rs if r["status"] != "agent_error") for m, _ in METRICS}
        row.update(pass_rate=_mean(r["grade"] == "pass" for r in graded), graded=len(graded), runs=len(rs),
                   agent_errors=sum(r["status"] == "agent_error" for r in rs))
        summary[key] = row
    return summary


def manifest_frameworks(out: Path) -> list[str]:
    """The frameworks of OUT/ate_bench.json in the order first run ([] without one); a damaged one is a
    UsageError naming it (it was a JSONDecodeError/AttributeError traceback)."""
    path = out / "ate_bench.json"
    if not path.exists():
        return []
    try:
        data = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError):
        data = None
    names = data.get("frameworks") if isinstance(data, dict) else None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise UsageError(f'{path}: not an ATE-Bench manifest; write {{"frameworks": ["NAME", ...]}} into it '
                         "(the frameworks in the report's order)")
    return names


def framework_order(results: list[dict], out: Path | None = None) -> list[str]:
    """The order the frameworks were first run in (ate_bench.json), then any others."""
    first = manifest_frameworks(out) if out else []
    present = {r["framework"] for r in results}
    return [f for f in first if f in present] + sorted(present - set(first))


def changed_line(paths, checkout: str = "the checkout") -> str:
    """One line for a session whose agent changed the framework checkout (runner.fingerprint)."""
    paths = [str(p) for p in paths] if isinstance(paths, list) else [str(paths)]
    return (f"{checkout} changed during the session ({', '.join(paths[:3])}{', ...' if len(paths) > 3 else ''}); the "
            "sessions after it copied the changed framework: restore it and rerun them with --overwrite")


def markdown(results: list[dict], baseline: str | None = None, frameworks: list[str] | None = None) -> str:
    frameworks = frameworks or framework_order(results)
    base = baseline or frameworks[0]
    summary = summarize(results)
    cats = [c for c in CATEGORIES if any(r["category"] == c for r in results)] + ["all"]
    lines = ["# ATE-Bench report", "", f"{len(results)} sessions; frameworks: {', '.join(frameworks)}; "
             f"ratios are framework / {base} (below 1: cheaper than {base}). The cost means leave out sessions whose "
             "agent exited with an error (agent_error; graded fail in the pass rate).", "",
             "## Cost and grade per category (means over tasks and repeats)", "",
             "| category | framework | " + " | ".join(t for _, t in METRICS) + " | pass rate | runs |",
             "|---|---|" + "---|" * (len(METRICS) + 2)]
    for cat in cats:
        for fw in frameworks:
            row = summary.get((fw, cat))
            if row is None:
                continue
            rate = "-" if row["pass_rate"] is None else f"{row['pass_rate']:.0%} of {row['graded']}"
            runs = f"{row['runs']}" + (f" ({row['agent_errors']} agent_error)" if row["agent_errors"] else "")
            lines.append(f"| {cat} | {fw} | " + " | ".join(_fmt(row[m]) for m, _ in METRICS) + f" | {rate} | {runs} |")
    others = [fw for fw in frameworks if fw != base]
    if others:
        lines += ["", f"## Ratios to {base} (over the tasks both ran)", "", "| category | framework | " + " | ".join(t for _, t in METRICS) + " |",
                  "|---|---|" + "---|" * len(METRICS)]
        for fw in others:  # over the tasks both ran, so that a partial run does not skew the ratio
            both = {r["task"] for r in results if r["framework"] == fw} & {r["task"] for r in results if r["framework"] == base}
            paired = summarize([r for r in results if r["task"] in both and r["framework"] in (fw, base)])
            for cat in cats:
                row, ref = paired.get((fw, cat)), paired.get((base, cat))
                if row and ref:
                    ratio = [f"{row[m] / ref[m]:.2f}" if ref[m] and row[m] is not None else "-" for m, _ in METRICS]
                    lines.append(f"| {cat} | {fw} | " + " | ".join(ratio) + " |")
    lines += ["", "## Grades per task", "", "| task | category | " + " | ".join(frameworks) + " |",
              "|---|---|" + "---|" * len(frameworks)]
    by_task = defaultdict(lambda: defaultdict(list))
    for r in results:
        by_task[(r["category"], r["task"])][r["framework"]].append(r)
    for (cat, task), per_fw in sorted(by_task.items(), key=lambda kv: (CATEGORIES.index(kv[0][0]), kv[0][1])):
        cells = []
        for fw in frameworks:
            rs = per_fw.get(fw, [])
            cells.append(", ".join(r["grade"] + ("" if r["status"] == "ok" else f" ({r['status']})") for r in rs) or "-")
        lines.append(f"| {task} | {cat} | " + " | ".join(cells) + " |")
    notes = [f"- {r['framework']} / {r['task']} / r{r['repeat']}: {r['note']}" for r in results if r["grade"] != "pass" and r.get("note")]
    if notes:
        lines += ["", "## Notes on sessions that did not pass", ""] + notes
    changed = [f"- {r['framework']} / {r['task']} / r{r['repeat']}: {changed_line(r['checkout_changed'])}"
               for r in results if r.get("checkout_changed")]
    if changed:
        lines += ["", "## Checkout changed by the agent", ""] + changed
    return "\n".join(lines) + "\n"


def plot(results: list[dict], path: Path, frameworks: list[str] | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    frameworks = frameworks or framework_order(results)
    summary = summarize(results)
    cats = [c for c in CATEGORIES if any(r["category"] == c for r in results)]
    fig, axes = plt.subplots(1, len(METRICS) + 1, figsize=(3.2 * (len(METRICS) + 1), 3.4))
    width = 0.8 / len(frameworks)
    for ax, (key, title) in zip(axes, list(METRICS) + [("pass_rate", "pass rate")]):
        for i, fw in enumerate(frameworks):
            values = [(summary.get((fw, c)) or {}).get(key) or 0.0 for c in cats]
            ax.bar([x + i * width for x in range(len(cats))], values, width, label=fw)
        ax.set_xticks([x + width * (len(frameworks) - 1) / 2 for x in range(len(cats))], cats, fontsize=8)
        ax.set_title(title, fontsize=9)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=110)
    plt.close(fig)
    write_file(path, png.getvalue())


def write_report(out: Path, baseline: str | None = None) -> tuple[Path, Path | None]:
    results = load_results(out)
    if not results:
        raise FileNotFoundError(f"{out} holds no */*/r*/result.json; pass the --out directory of `ate_bench run`")
    frameworks = framework_order(results, out)
    if baseline and baseline not in frameworks:
        raise FileNotFoundError(f"--baseline {baseline}: no sessions of it in {out}; use one of {', '.join(frameworks)}")
    md = out / "report.md"
    write_file(md, markdown(results, baseline, frameworks))
    try:
        png = out / "report.png"
        plot(results, png, frameworks)
    except ImportError:  # matplotlib is the optional `plot` extra
        png = None
    return md, png
