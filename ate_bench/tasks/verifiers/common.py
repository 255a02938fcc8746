"""Shared by the PithTrain verifiers: arguments, the answer's KEY=value lines, metrics files, verdicts."""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path


def args():
    p = argparse.ArgumentParser()
    p.add_argument("--workdir", type=Path, required=True, help="the agent's final checkout")
    p.add_argument("--answer", type=Path, required=True, help="the agent's final answer (text)")
    p.add_argument("--checkout", type=Path, required=True, help="the unmodified framework, for reruns")
    return p.parse_args()


def answer_value(answer: str, key: str) -> str:
    """The value of the last `KEY=value` (or `KEY: value`) in the answer; FAIL when absent."""
    # Markdown around it (**SAME=yes**, SAME: **yes**, `X=1`) or quotes were part of the value: a right answer failed
    found = re.findall(rf"(?<![A-Za-z0-9_]){key}[*_`]*\s*[=:]\s*[*_`\"']*([^\s`*\"',;]+)", answer)
    if not found:
        fail(f"the answer has no {key}=<value>")
    return found[-1].rstrip(".")


def answer_number(answer: str, key: str) -> float:
    text = answer_value(answer, key)
    try:
        value = float(text)
    except ValueError:
        fail(f"{key}={text} is not a number")
    if not math.isfinite(value):  # nan passed the checks written as `if abs(claimed - x) > tol: fail(...)`
        fail(f"{key}={text} is not a finite number")
    return value


def losses(run_dir: Path) -> dict[int, float]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        fail(f"{path} does not exist")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {int(r["step"]): float(r["loss"]) for r in rows if "loss" in r}


def close(a: float, b: float, rtol: float) -> bool:
    return abs(a - b) <= rtol * max(abs(a), abs(b), 1e-12)


def fail(why: str):
    print(f"FAIL: {why}")
    sys.exit(1)


def ok(why: str):
    print(f"PASS: {why}")
    sys.exit(0)
