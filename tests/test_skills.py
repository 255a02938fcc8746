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


def test_capture_profile_overlap_measure(tmp_path):
    # two NCCL kernels (10 + 10 us), compute kernels covering 5 us of the first and all of the second
    events = [
        {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_SendRecv", "ts": 0, "dur": 10},
        {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_SendRecv", "ts": 20, "dur": 10},
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 5, "dur": 5},
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 18, "dur": 14},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 40},
    ]
    trace = tmp_path / "rank0.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    script = ".agents/skills/capture-profile/profile_step.py"
    ok = subprocess.run([sys.executable, script, "--trace", str(trace), "--min-overlap", "0.7"], capture_output=True, text=True)
    assert "overlapped with compute: 75.0%" in ok.stdout and ok.stdout.strip().endswith("PASS")
    low = subprocess.run([sys.executable, script, "--trace", str(trace), "--min-overlap", "0.8"], capture_output=True, text=True)
    assert low.returncode == 1 and low.stdout.strip().endswith("FAIL: overlap 75.0% < 80%")
    assert "19.00 ms  matmul" not in ok.stdout and "0.02 ms  matmul" in ok.stdout  # 19 us of gemm kernels
    # an all-gather (20 us) nobody overlaps: 15 of 40 us in total, the all-to-alls alone still 75%
    events.append({"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllGather_RING_LL", "ts": 40, "dur": 20})
    trace.write_text(json.dumps({"traceEvents": events}))
    kind = subprocess.run([sys.executable, script, "--trace", str(trace), "--min-overlap", "0.7", "--kind", "all-to-all/p2p"],
                          capture_output=True, text=True)
    assert "overlapped with compute: 37.5%" in kind.stdout and kind.stdout.strip().endswith("PASS"), kind.stdout
    assert "all-gather          0.02 ms,   0.0% overlapped" in kind.stdout, kind.stdout
    assert "all-to-all/p2p      0.02 ms,  75.0% overlapped" in kind.stdout, kind.stdout


def test_add_new_model_parity_script(tmp_path):
    config = {"model_type": "qwen3_moe", "vocab_size": 101, "hidden_size": 36, "intermediate_size": 40,
              "moe_intermediate_size": 20, "num_hidden_layers": 2, "num_attention_heads": 6, "num_key_value_heads": 2,
              "head_dim": 10, "num_experts": 5, "num_experts_per_tok": 2, "max_position_embeddings": 64,
              "mlp_only_layers": [1], "attention_bias": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    result = subprocess.run([sys.executable, ".agents/skills/add-new-model/check_parity.py", str(tmp_path / "config.json")],
                            capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip().endswith("PASS"), result.stdout + result.stderr
    assert result.stdout.count("ok   ") == 5
