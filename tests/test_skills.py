"""The skills' PASS/FAIL scripts decide correctly on known inputs."""

import json
import subprocess
import sys

SCRIPT = ".agents/skills/validate-correctness/compare_runs.py"


def write(path, losses):
    path.write_text("".join(json.dumps({"step": i + 1, "loss": l, "lb_loss": 1.0, "grad_norm": 0.5}) + "\n"
                            for i, l in enumerate(losses)))


def test_validate_correctness_script(tmp_path):
    write(tmp_path / "a.jsonl", [5.0, 4.5, 4.2])
    write(tmp_path / "b.jsonl", [5.0, 4.5 * (1 + 2e-6), 4.2])
    write(tmp_path / "c.jsonl", [5.0, 4.5 * (1 + 1e-3), 4.2])
    same = subprocess.run([sys.executable, SCRIPT, "--metrics", str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")],
                          capture_output=True, text=True)
    assert same.returncode == 0 and same.stdout.strip().endswith("PASS")
    differ = subprocess.run([sys.executable, SCRIPT, "--metrics", str(tmp_path / "a.jsonl"), str(tmp_path / "c.jsonl")],
                            capture_output=True, text=True)
    assert differ.returncode == 1 and differ.stdout.strip().endswith("FAIL")
