"""`pithtrain plot`: loss (and eval loss), learning rate and tokens/s of one or several runs in one PNG."""

from __future__ import annotations

import os
from pathlib import Path

from pithtrain.config import UserError, disk_error
from pithtrain.train.metrics import read_metrics

PANELS = (("loss", "loss (dashed: eval_loss)"), ("lr", "learning rate"), ("tokens_per_s", "tokens/s"))


def _rows(run: Path) -> list[dict]:
    if not (path := run if run.is_file() else run / "metrics.jsonl").is_file():
        raise UserError(f"{run}: {'no metrics.jsonl there' if run.exists() else 'does not exist'}; pass run directories "
                        "written by pithtrain train")
    fix = "pass a metrics.jsonl of pithtrain train"
    rows = read_metrics(path, numbered=True, fix=fix)  # each row a dict with an integer "step"
    for number, m in rows:
        if bad := next((k for k in ("loss", "eval_loss", "lr", "tokens_per_s") if k in m and type(m[k]) not in (int, float)), None):
            raise UserError(f"{path}: line {number}: {bad}={m[bad]!r} is not a number; {fix}")
    if not rows:
        raise UserError(f"{path}: no metrics rows (the run logged no step yet); {fix}")
    return [m for _, m in rows]


def _made_by_matplotlib(path: Path) -> bool:
    """An image matplotlib wrote (an earlier plot's, replaced without asking): PNG and SVG name it near their
    start, PDF near its end."""
    with open(path, "rb") as f:
        head = f.read(4096)
        f.seek(max(0, os.fstat(f.fileno()).st_size - 4096))
        return b"atplotlib" in head + f.read()


def run_plot(args) -> int:
    """`pithtrain plot`: the runs' metrics.jsonl drawn into --out (default: metrics.png in the first run)."""
    runs = [Path(run) for run in args.runs]
    real = [run.resolve() for run in runs]  # each resolved once
    if twice := next((run for i, run in enumerate(runs) if real[i] in real[:i]), None):
        raise UserError(f"pithtrain plot: {twice} is named twice; give each run once")
    rows = [(run, _rows(run)) for run in runs]  # every input is checked before anything is drawn
    out = Path(args.out) if args.out else (runs[0] if runs[0].is_dir() else runs[0].parent) / "metrics.png"
    if not out.parent.is_dir() or not os.access(out.parent, os.W_OK):
        raise UserError(f"--out {out}: {out.parent} " + ("is not a writable directory" if out.parent.exists() else
                                                          "does not exist") + "; choose another path")
    if out.is_dir():
        raise UserError(f"--out {out} is a directory; name the PNG file to write, e.g. {out / 'metrics.png'}")
    out = out if out.suffix else out.with_name(out.name + ".png")  # as matplotlib names it
    if out.is_file() and not _made_by_matplotlib(out):
        raise UserError(f"--out {out} exists and is not an image an earlier plot wrote; choose another path (or move "
                        "that file away)")
    try:
        import matplotlib
    except ImportError:
        raise UserError("pithtrain plot needs matplotlib: pip install matplotlib (or the `plot` extra)") from None
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 4))
    for i, (run, ms) in enumerate(rows):
        color, label = f"C{i % 10}", str(run)
        for ax, (key, title) in zip(axes, PANELS):
            # rows may lack a key (eval-only rows, older runs): each line takes the rows that have it
            if points := [(m["step"], m[key]) for m in ms if key in m]:
                ax.plot(*zip(*points), color=color, label=label, marker="." if len(points) == 1 else None)  # one: a dot
            ax.set(title=title, xlabel="step")
        if evals := [(m["step"], m["eval_loss"]) for m in ms if "eval_loss" in m]:
            axes[0].plot(*zip(*evals), color=color, linestyle="--", marker=".",  # named when it is the run's only loss line
                         label=None if any("loss" in m for m in ms) else label)
    axes[0].legend(fontsize="small")
    fig.tight_layout()
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}{out.suffix}")  # renamed over `out` once whole
    try:
        fig.savefig(tmp)
        os.replace(tmp, out)
    except ValueError as e:  # a format matplotlib does not write (nothing written)
        raise UserError(f"--out {out}: {e}; name a .png file") from None
    except OSError as e:
        raise disk_error(e, out, then="plot again") or e
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)  # a partial image; an earlier `out` is kept
    print(f"wrote {out}")
    return 0
