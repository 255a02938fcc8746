"""Append one benchmark result to benchmarks/results.jsonl: date, machine, commit, command and figures.

The GPU machine gets a copy of the working tree whose git, if any, may name an older commit than the files
hold: pass this machine's `git rev-parse --short HEAD` there as PITHTRAIN_COMMIT (not a rev-parse run there); write
elsewhere with PITHTRAIN_RESULTS (e.g. $OUT/results.jsonl, appended to the repository's file after).
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import torch


def machine() -> str:
    if torch.cuda.is_available():
        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    return f"cpu ({os.cpu_count()} cores)"


def commit() -> str:
    if os.environ.get("PITHTRAIN_COMMIT"):
        return os.environ["PITHTRAIN_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True, cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def record(figures: dict) -> None:
    line = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": machine(), "commit": commit(), "command": " ".join(["python", *sys.argv]),
            "torch": torch.__version__, **figures}
    path = Path(os.environ.get("PITHTRAIN_RESULTS", Path(__file__).parent / "results.jsonl"))
    with path.open("a") as f:
        f.write(json.dumps(line) + "\n")
