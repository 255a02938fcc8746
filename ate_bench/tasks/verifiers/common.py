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
    # a comma ends the value unless a digit follows: LOSS=1,234.5 was read as 1 (SAME=yes, X=... still ends at "yes")
    found = re.findall(rf"(?<![A-Za-z0-9_]){key}[*_`]*\s*[=:]\s*[*_`\"']*((?:[^\s`*\"',;]|,(?=\d))+)", answer)
    if not found:
        fail(f"the answer has no {key}=<value>")
    return found[-1].rstrip(".")


def answer_number(answer: str, key: str) -> float:
    text = answer_value(answer, key)
    if re.fullmatch(r"[+-]?\d{1,3}(,\d{3})+(\.\d*)?([eE][+-]?\d+)?", text):  # thousands separators: 1,234.5
        text = text.replace(",", "")
    try:
        value = float(text)
    except ValueError:  # any other comma too (3,14 or 1,23): not guessed at
        fail(f"{key}={text} is not a number" + ("; write it with a decimal point and no separators, e.g. 1234.5" if "," in text else ""))
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
