"""The skills' PASS/FAIL scripts decide correctly on known inputs."""

import json
import os
import random
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from cli_util import run_script, write_config
from conftest import tiny_config
from pithtrain.ops import fp8

SCRIPT = ".agents/skills/validate-correctness/compare_runs.py"


def write(path, losses):
    path.write_text("".join(json.dumps({"step": i + 1, "loss": l, "lb_loss": 1.0, "grad_norm": 0.5}) + "\n"
                            for i, l in enumerate(losses)))


@pytest.mark.fast
def test_validate_correctness_script(tmp_path):
    write(tmp_path / "a.jsonl", [5.0, 4.5, 4.2])
    write(tmp_path / "b.jsonl", [5.0, 4.5 * (1 + 2e-6), 4.2])
    write(tmp_path / "c.jsonl", [5.0, 4.5 * (1 + 1e-3), 4.2])
    same = subprocess.run([sys.executable, SCRIPT, "--metrics", str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")],
                          capture_output=True, text=True)
    assert same.returncode == 0 and same.stdout.strip().splitlines()[-1].startswith("PASS: steps 1..3 agree"), same.stdout
    differ = subprocess.run([sys.executable, SCRIPT, "--metrics", str(tmp_path / "a.jsonl"), str(tmp_path / "c.jsonl")],
                            capture_output=True, text=True)
    assert differ.returncode == 1 and differ.stdout.strip().splitlines()[-1] == (
        "FAIL: loss at step 2: 4.5 vs 4.5045 (relative difference 1.0e-03 > 1e-05)"), differ.stdout
    for name, mtp in (("a", 6.0), ("b", 6.0), ("c", 6.006)):  # DeepSeek-V3's mtp_loss (not in loss) is gated as the loss
        rows = [json.loads(line) for line in (tmp_path / "a.jsonl").read_text().splitlines()]
        (tmp_path / f"m{name}.jsonl").write_text("".join(json.dumps({**r, "mtp_loss": 6.0 if r["step"] < 3 else mtp}) + "\n" for r in rows))
    out = [subprocess.run([sys.executable, SCRIPT, "--metrics", str(tmp_path / "ma.jsonl"), str(tmp_path / f"m{x}.jsonl")],
                          capture_output=True, text=True).stdout.strip().splitlines()[-1] for x in "bc"]
    assert out[0].startswith("PASS") and out[1] == "FAIL: mtp_loss at step 3: 6 vs 6.006 (relative difference 1.0e-03 > 1e-05)", out


@pytest.mark.fast
def test_validate_correctness_matches_steps_and_refuses_bad_input(tmp_path, capsys, dataset_dir):
    """Steps are matched by number: a resumed run's repeated step counts once (its last line), shifted
    steps FAIL naming them, a NaN never agrees; an unreadable file is one FAIL line naming it; a mesh
    that cannot run (the doc's old `--nproc 4 --ep 2`) is refused before either run trains."""
    def compare(*args):
        return run_script(SCRIPT, *args)

    write(tmp_path / "a.jsonl", [5.0, 4.5, 4.2])
    lines = (tmp_path / "a.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "resumed.jsonl").write_text(lines[0] + lines[1].replace("4.5", "9.9") + "".join(lines[1:]))
    resumed = compare("--metrics", tmp_path / "a.jsonl", tmp_path / "resumed.jsonl")
    assert resumed.returncode == 0 and resumed.stdout.splitlines()[-1].startswith("PASS: steps 1..3"), resumed.stdout
    (tmp_path / "shifted.jsonl").write_text("".join(json.dumps({**json.loads(line), "step": json.loads(line)["step"] + 1}) + "\n"
                                                    for line in lines))
    shifted = compare("--metrics", tmp_path / "a.jsonl", tmp_path / "shifted.jsonl")
    assert shifted.returncode == 1 and "only A [1], only B [4]" in shifted.stdout.splitlines()[-1], shifted.stdout
    write(tmp_path / "nan.jsonl", [5.0, float("nan"), 4.2])
    nan = compare("--metrics", tmp_path / "a.jsonl", tmp_path / "nan.jsonl")
    assert nan.returncode == 1 and "worst relative difference: loss nan" in nan.stdout, nan.stdout
    assert nan.stdout.splitlines()[-1].startswith("FAIL: loss at step 2: 4.5 vs nan (relative difference nan"), nan.stdout
    (tmp_path / "mtp_null.jsonl").write_text("".join(json.dumps({**json.loads(line), "mtp_loss": None if n else 6.0}) + "\n"
                                                     for n, line in enumerate(lines)))  # was: a TypeError traceback
    null = compare("--metrics", tmp_path / "mtp_null.jsonl", tmp_path / "mtp_null.jsonl")
    assert null.returncode == 1 and null.stdout.splitlines()[-1].startswith("FAIL: mtp_loss at step 2: nan vs nan"), null.stdout
    one_mtp = compare("--metrics", tmp_path / "a.jsonl", tmp_path / "mtp_null.jsonl")  # was: PASS, mtp_loss unchecked
    assert one_mtp.returncode == 1 and "only B logged mtp_loss" in one_mtp.stdout.splitlines()[-1], one_mtp.stdout
    (tmp_path / "text.jsonl").write_text(lines[0] + "oops\n")
    (tmp_path / "nolb.jsonl").write_text(json.dumps({"step": 1, "loss": 5.0, "grad_norm": 0.5}) + "\n")
    for bad, says in [(tmp_path / "none.jsonl", "none.jsonl: no such file"), (tmp_path, "a directory, not a file"),
                      (tmp_path / "text.jsonl", "text.jsonl line 2 is not JSON"), (tmp_path / "nolb.jsonl", "line 1 has no lb_loss")]:
        out = compare("--metrics", tmp_path / "a.jsonl", bad)
        assert out.returncode == 1 and out.stdout.startswith("FAIL: ") and says in out.stdout, (bad, out.stdout)
        assert len(out.stdout.splitlines()) == 1, out.stdout
    meshes = compare("examples/qwen3_tiny.py", "--steps", 4, "--a", "--nproc 1", "--b", "--nproc 4 --ep 2", "--work", tmp_path / "w")
    assert meshes.returncode == 1 and meshes.stdout.startswith("FAIL: run b (--nproc 4 --ep 2): train.global_batch_size=16 "
                                                               "is not divisible"), meshes.stdout
    assert not (tmp_path / "w").exists() and "$ " not in meshes.stdout  # nothing trained
    typo = f"--nproc 1 --set data.path={tmp_path / 'nodata'}"  # run b's dataset is missing: was found after run a trained
    missing = compare(write_config(tmp_path / "c.py", dataset_dir), "--b", typo, "--work", tmp_path / "w")
    assert missing.returncode == 1 and missing.stdout.startswith(f"FAIL: run b ({typo}): data.path="), missing.stdout
    assert not (tmp_path / "w").exists() and "$ " not in missing.stdout
    shared = compare("examples/qwen3_tiny.py", "--steps", 4, "--a", "--nproc 1 --out=x", "--b", "--nproc 1", "--work", tmp_path / "w")
    assert shared.returncode == 1 and shared.stdout.startswith("FAIL: run a (--nproc 1 --out=x): --out is the script's own")
    assert not (tmp_path / "w").exists() and not Path("x").exists()
    for given, said in ((random.choice(["--ou x", "--out x"]), "--out is the script's own"), ("--step 3", "--steps is the"),
                        ("--stop 2", "--stop-after is the"), (random.choice(["--dry", "--dry-run"]), "--dry-run trains nothing"),
                        ("--print", "--print-config trains nothing")):  # as argparse reads them: abbreviated too
        out = compare("examples/qwen3_tiny.py", "--steps", 4, "--a", "--nproc 1", f"--b={given}", "--work", tmp_path / "w")
        assert out.returncode == 1 and out.stdout.startswith(f"FAIL: run b ({given}): {said}"), out.stdout
    assert not (tmp_path / "w").exists() and not Path("x").exists()
    for bad in ("nan", "-1"):
        assert compare("--metrics", tmp_path / "a.jsonl", tmp_path / "a.jsonl", "--rtol", bad).returncode == 2
        assert "argument --rtol: " in capsys.readouterr().err
    for extra, named in ((["examples/qwen3_tiny.py"], "CONFIG"), (["--steps", 2, "--set", "optim.lr=1"], "--steps, --set")):
        assert compare(*extra, "--metrics", tmp_path / "a.jsonl", tmp_path / "a.jsonl").returncode == 2  # no longer ignored
        err = capsys.readouterr().err
        assert err.splitlines()[-1] == (f"compare_runs.py: error: {named}: for training the two runs, but --metrics A B compares "
                                        f"two existing files; drop {named}, or drop --metrics to train CONFIG twice and compare"), err


@pytest.mark.fast
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
    assert "overlapped with compute: 75.0%" in ok.stdout  # the PASS line says what was checked (was: a bare PASS)
    assert ok.stdout.strip().endswith("PASS: 1 trace(s) analysed, communication overlap >= 70% in each"), ok.stdout
    low = subprocess.run([sys.executable, script, "--trace", str(trace), "--min-overlap", "0.8"], capture_output=True, text=True)
    assert low.returncode == 1 and low.stdout.strip().endswith("FAIL: rank0: overlap 75.0% < 80%")
    assert "19.00 ms  matmul" not in ok.stdout and "0.02 ms  matmul" in ok.stdout  # 19 us of gemm kernels
    # an all-gather (20 us) nobody overlaps: 15 of 40 us in total, the all-to-alls alone still 75%
    events.append({"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllGather_RING_LL", "ts": 40, "dur": 20})
    trace.write_text(json.dumps({"traceEvents": events}))
    kind = subprocess.run([sys.executable, script, "--trace", str(trace), "--min-overlap", "0.7", "--kind", "all-to-all/p2p"],
                          capture_output=True, text=True)
    assert "overlapped with compute: 37.5%" in kind.stdout and kind.stdout.strip().endswith(
        "PASS: 1 trace(s) analysed, all-to-all/p2p overlap >= 70% in each"), kind.stdout
    assert "all-gather          0.02 ms,   0.0% overlapped" in kind.stdout, kind.stdout
    assert "all-to-all/p2p      0.02 ms,  75.0% overlapped" in kind.stdout, kind.stdout


@pytest.mark.fast
def test_capture_profile_names_what_the_host_did_while_the_gpu_idled(tmp_path):
    # kernels at 0-10 and 100-110 (a 90 us gap), 200-205 (a 90 us gap) on the main thread's host
    # calls: a sync inside a step annotation, then plain Python (no call open); another thread busy
    events = [
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 0, "dur": 10},
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 100, "dur": 10},
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 200, "dur": 5},
        {"ph": "X", "cat": "user_annotation", "name": "step", "pid": 1, "tid": 1, "ts": 0, "dur": 109},
        {"ph": "X", "cat": "cpu_op", "name": "aten::item", "pid": 1, "tid": 1, "ts": 5, "dur": 95},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "pid": 1, "tid": 1, "ts": 6, "dur": 93},
        {"ph": "X", "cat": "cpu_op", "name": "aten::add", "pid": 1, "tid": 1, "ts": 150, "dur": 5},
        {"ph": "X", "cat": "cpu_op", "name": "other_thread", "pid": 1, "tid": 2, "ts": 0, "dur": 300},
    ]
    trace = tmp_path / "rank0.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    out = subprocess.run([sys.executable, ".agents/skills/capture-profile/profile_step.py", "--trace", str(trace)],
                         capture_output=True, text=True).stdout
    assert "GPU idle (gaps >= 20 us, no kernel on any stream): 0.18 ms" in out, out
    assert "0.09 ms  cudaStreamSynchronize" in out and "0.09 ms  (no host call: Python between calls)" in out, out
    assert "gap 0.09 ms during: step > aten::item > cudaStreamSynchronize" in out, out
    assert "other_thread" not in out.split("GPU idle")[1].split("host waits")[0], out
    assert "0.09 ms      1x  step > aten::item > cudaStreamSynchronize" in out, out
    # the same analysis as train_throughput.py keeps it in its results line (ms)
    digest = _load_script("benchmarks/train_throughput.py").profile_digest(_profile_tool(), events)
    assert digest["idle_by_host_call"] == [[0.09, "cudaStreamSynchronize"], [0.09, "(between host calls)"]], digest
    assert digest["host_waits"] == [[0.09, 1, "step > aten::item > cudaStreamSynchronize"]], digest


@pytest.mark.fast
def test_capture_profile_names_ranks_and_refuses_bad_traces(tmp_path, capsys):
    """A FAIL names each rank under the bar; a trace without NCCL kernels says so; a file that is no
    Chrome trace is one FAIL line naming it; --step and --min-overlap are validated by argparse."""
    script = ".agents/skills/capture-profile/profile_step.py"
    cpu = [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 40}]
    comm = [{"ph": "X", "cat": "kernel", "name": "ncclDevKernel_SendRecv", "ts": 0, "dur": 10}]
    for name, events in (("rank0", comm), ("rank1", comm), ("cpu", cpu)):
        (tmp_path / f"{name}.json").write_text(json.dumps({"traceEvents": events}))
    (tmp_path / "text.json").write_text("not json")
    (tmp_path / "other.json").write_text(json.dumps({"events": []}))
    two = run_script(script, "--trace", tmp_path / "rank0.json", "--trace", tmp_path / "rank1.json", "--min-overlap", 0.2)
    assert two.stdout.splitlines()[-1] == "FAIL: rank0: overlap 0.0% < 20%; rank1: overlap 0.0% < 20%", two.stdout
    none = run_script(script, "--trace", tmp_path / "cpu.json", "--min-overlap", 0.2, "--kind", "all-to-all/p2p")
    assert none.stdout.splitlines()[-1] == "FAIL: cpu: no NCCL all-to-all/p2p kernels (--min-overlap 20%)", none.stdout
    for events in ([], [{"ph": "X", "name": "a", "ts": "x"}]):  # no event, or none with a numeric ts and dur
        (tmp_path / "empty.json").write_text(json.dumps({"traceEvents": events}))
        empty = run_script(script, "--trace", tmp_path / "empty.json")
        assert empty.returncode == 1 and empty.stdout.splitlines()[-1] == \
            f"FAIL: {tmp_path / 'empty.json'} holds no timed event (numeric ts and dur): give the profile_step's " \
            "RUN/profile/rank<r>.json", empty.stdout
    for odd in ({"ph": "X", "cat": "kernel", "ts": 1, "dur": 2}, {**comm[0], "dur": None}, {**comm[0], "ts": "1"}):
        (tmp_path / "odd.json").write_text(json.dumps({"traceEvents": comm + [odd]}))  # was: a KeyError or TypeError traceback
        out = run_script(script, "--trace", tmp_path / "odd.json")
        assert out.returncode == 0 and "1 complete event(s) without a name, numeric ts and dur, or args: left out" in out.stdout, out.stdout
    for bad, says in ((tmp_path / "text.json", "text.json is not JSON"), (tmp_path / "other.json", "other.json is not a Chrome trace")):
        out = run_script(script, "--trace", tmp_path / "rank0.json", "--trace", bad)
        assert out.returncode == 1 and out.stdout.startswith("FAIL: ") and says in out.stdout and len(out.stdout.splitlines()) == 1, out.stdout
    for args in (["examples/qwen3_tiny.py", "--step", 0], ["--trace", tmp_path / "cpu.json", "--min-overlap", "nan"]):
        assert run_script(script, *args).returncode == 2
        assert "error: argument --" in capsys.readouterr().err, args
    mixed = run_script(script, "examples/qwen3_tiny.py", "--trace", tmp_path / "cpu.json", "--step", 4)  # was: CONFIG ignored, PASS
    assert mixed.returncode == 2 and "error: CONFIG, --step: for a run made here, but --trace analyses an existing trace" \
        in capsys.readouterr().err


def _load_script(path: str):
    """A skill's script as a module (skills are scripts, not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(path.rsplit("/", 1)[-1].removesuffix(".py"), path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _profile_tool():
    return _load_script(".agents/skills/capture-profile/profile_step.py")


@pytest.mark.fast
def test_capture_profile_attributes_gpu_time_to_layer_stages():
    """Kernels are attributed through their launch (correlation id; a runtime or, as Triton
    launches, a driver call): inside a stage range -> that stage's forward; inside autograd's
    evaluate_function of a node whose forward op ran in stage 3 (same sequence number; the node's
    creator is the last op with that number) -> stage 3 backward, as is a `.wgrad` range; the
    optimizer range; anything else -> other."""
    main, bwd = {"pid": 1, "tid": 1}, {"pid": 1, "tid": 2}
    host = [
        {"cat": "user_annotation", "name": "pithtrain::stage1", "ts": 0, "dur": 10, **main},
        {"cat": "cuda_driver", "name": "cuLaunchKernelEx", "ts": 2, "dur": 1, "args": {"correlation": 1}, **main},
        # an op that creates no autograd node records the number the next node gets (7, created in stage 3)
        {"cat": "cpu_op", "name": "aten::view", "ts": 4, "dur": 1, "args": {"Sequence number": 7}, **main},
        {"cat": "user_annotation", "name": "pithtrain::stage3", "ts": 10, "dur": 10, **main},
        {"cat": "cpu_op", "name": "GroupedMM", "ts": 11, "dur": 8, "args": {"Sequence number": 7}, **main},
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 12, "dur": 1, "args": {"correlation": 2}, **main},
        # FSDP's pre-backward hook runs first inside the evaluation: only the node's own op has the number
        {"cat": "cpu_op", "name": "autograd::engine::evaluate_function: GroupedMMBackward", "ts": 30, "dur": 10, **bwd},
        {"cat": "user_annotation", "name": "FSDP::pre_backward", "ts": 30, "dur": 0.5, **bwd},
        {"cat": "cpu_op", "name": "GroupedMMBackward", "ts": 30.5, "dur": 9, "args": {"Sequence number": 7}, **bwd},
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 31, "dur": 1, "args": {"correlation": 3}, **bwd},
        {"cat": "user_annotation", "name": "pithtrain::stage3.wgrad", "ts": 40, "dur": 5, **main},
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 41, "dur": 1, "args": {"correlation": 4}, **main},
        {"cat": "user_annotation", "name": "Optimizer.step#AdamW.step", "ts": 50, "dur": 5, **main},
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 51, "dur": 1, "args": {"correlation": 5}, **main},
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 60, "dur": 1, "args": {"correlation": 6}, **main},
    ]
    kernels = [{"cat": "kernel", "name": f"k{c}", "ts": 100 + 10 * c, "dur": c * 100, "args": {"correlation": c}}
               for c in range(1, 7)]
    times, unit = _profile_tool().stage_times([{"ph": "X", **e} for e in host + kernels])
    assert unit == "GPU kernel"
    assert times == {"stage 1 forward": 100, "stage 3 forward": 200, "stage 3 backward": 300 + 400,
                     "optimizer": 500, "other": 600}
    by_kernel, _ = _profile_tool().stage_times([{"ph": "X", **e} for e in host + kernels], by_kernel=True)
    assert by_kernel == {("stage 1 forward", "k1"): 100, ("stage 3 forward", "k2"): 200, ("stage 3 backward", "k3"): 300,
                         ("stage 3 backward", "k4"): 400, ("optimizer", "k5"): 500, ("other", "k6"): 600}
    digest = _load_script("benchmarks/train_throughput.py").profile_digest(
        _profile_tool(), [{"ph": "X", **e} for e in host + kernels], top=1, top_kernels=1)  # train_throughput.py's results line
    assert digest["stage_kernels"] == {"optimizer": [[0.5, "k5"]], "other": [[0.6, "k6"]], "stage 1 forward": [[0.1, "k1"]],
                                       "stage 3 backward": [[0.4, "k4"]], "stage 3 forward": [[0.2, "k2"]]}, digest


@pytest.mark.fast
def test_capture_profile_stage_times_of_a_real_run(tmp_path, dataset_dir):
    """A one-process CPU run: every stage of the layer contract shows up, forward and backward, but stage 4:
    one process's combine moves no rows (stage 5 reads the expert-grouped rows where they are)."""
    import json as json_

    from pithtrain.train.loop import train

    train(tiny_config(dataset_dir, steps=2, profile_step=2), tmp_path, echo=False)
    events = json_.loads((tmp_path / "profile" / "rank0.json").read_text())["traceEvents"]
    times, unit = _profile_tool().stage_times(events)
    assert unit == "host op"
    for n in (1, 2, 3, 5):
        assert times[f"stage {n} forward"] > 0 and times[f"stage {n} backward"] > 0, (n, times)
    assert "stage 4 forward" not in times and "stage 4 backward" not in times, times
    assert times["optimizer"] > 0 and times["other"] > 0


def test_add_new_model_parity_script(tmp_path, monkeypatch):
    import tempfile

    config = {"model_type": "qwen3_moe", "vocab_size": 101, "hidden_size": 36, "intermediate_size": 40,
              "moe_intermediate_size": 20, "num_hidden_layers": 2, "num_attention_heads": 6, "num_key_value_heads": 2,
              "head_dim": 10, "num_experts": 5, "num_experts_per_tok": 2, "max_position_embeddings": 64,
              "mlp_only_layers": [1], "attention_bias": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    parity = ".agents/skills/add-new-model/check_parity.py"
    result = run_script(parity, tmp_path / "config.json")  # in this process: torch and transformers are imported
    assert result.returncode == 0 and result.stdout.strip().endswith("PASS: 5 checks"), result.stdout
    assert result.stdout.count("ok   ") == 5
    assert not list((tmp_path / "tmp").glob("parity-*"))  # its HF copies removed (no --work)
    # DeepSeek-V3 with a multi-token prediction layer (its released configs have one), which transformers does not build
    from pithtrain.models.deepseek_v2 import DeepseekV3Config

    v3 = DeepseekV3Config(vocab_size=64, hidden_size=32, intermediate_size=48,
                          moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4, q_lora_rank=16,
                          kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=4,
                          n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, n_group=2, topk_group=1,
                          max_position_embeddings=64, num_nextn_predict_layers=1)
    (tmp_path / "config.json").write_text(json.dumps(v3.to_hf()))
    result = run_script(parity, tmp_path / "config.json")
    assert result.returncode == 0 and result.stdout.strip().endswith("PASS: 5 checks"), result.stdout
    assert "num_nextn_predict_layers 1 -> 0" in result.stdout
    # an HF directory with the MTP layer's weights (a released DeepSeek-V3's, pithtrain convert's): transformers does not
    # know them, the round trip checks them
    from pithtrain.tools.hf import write_hf_dir

    torch.manual_seed(0)
    model = v3.build_model()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    write_hf_dir(model, tmp_path / "v3_mtp")
    result = run_script(parity, tmp_path / "v3_mtp")
    assert result.returncode == 0 and result.stdout.strip().endswith("PASS: 5 checks"), result.stdout
    assert "not counted: model.layers.2.*" in result.stdout, result.stdout


@pytest.mark.fast
def test_add_new_model_parity_script_refuses_bad_configs_before_building(tmp_path, capsys):
    """One FAIL line naming the file for every config it cannot check, before any model is built (a
    model_type pithtrain has no family for used to build transformers' full-size default); argparse for
    the numbers."""
    script = ".agents/skills/add-new-model/check_parity.py"
    good = {"model_type": "qwen3_moe", "vocab_size": 101, "hidden_size": 36, "intermediate_size": 40, "moe_intermediate_size": 20,
            "num_hidden_layers": 2, "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 10, "num_experts": 5,
            "num_experts_per_tok": 2, "max_position_embeddings": 64}
    cases = {"llama4.json": ({"model_type": "llama4"}, "model_type 'llama4' is not supported"),
             "abc.json": (dict(good, hidden_size="abc"), "model.hidden_size='abc'"),
             "k99.json": (dict(good, num_experts_per_tok=99), "num_experts_per_tok=99"),
             "huge.json": (dict(good, hidden_size=16384, num_hidden_layers=100, num_experts=128, moe_intermediate_size=2048),
                           "parameters need about"),
             "list.json": ([1], "holds a JSON list"),
             "nohead.json": (dict(good, head_dim=None), "transformers cannot build it (TypeError: ")}  # passes ours
    for name, (content, _) in cases.items():
        (tmp_path / name).write_text(json.dumps(content))
    (tmp_path / "bad.json").write_text("{")
    (tmp_path / "empty").mkdir()
    cases |= {"bad.json": (None, "bad.json is not JSON"), "empty": (None, "empty is no HF directory"),
              "none": (None, "none: no such file or directory")}
    for name, (_, says) in cases.items():
        out = run_script(script, tmp_path / name)
        assert out.returncode == 1 and out.stdout.startswith(f"FAIL: {tmp_path / name}") and says in out.stdout, (name, out.stdout)
        assert len(out.stdout.splitlines()) == 1, out.stdout
    for flag, value in (("--seq", 0), ("--seq", 1), ("--batch", -1), ("--std", "nan"), ("--work", tmp_path / "bad.json")):
        assert run_script(script, tmp_path / "abc.json", flag, value).returncode == 2
        assert f"argument {flag}: " in capsys.readouterr().err


def _estimator():
    return _load_script(".agents/skills/estimate-memory/estimate_memory.py")


@pytest.mark.fast
@pytest.mark.parametrize("pp, ep", [(1, 2), (2, 2), (2, 1)])
def test_estimate_memory_counts_the_parameters_each_rank_really_holds(pp, ep, dataset_dir):
    """The static terms against a real build: DualPipeV chunks of each pipeline rank, this EP
    rank's experts, dense weights sharded over the other ranks of the stage."""
    from pithtrain.parallel.fsdp import keep_local_experts
    from pithtrain.parallel.pipeline import build_chunks

    est = _estimator()
    config = tiny_config(dataset_dir, global_batch_size=8, micro_batch_size=1)
    config.model.num_hidden_layers = 6
    config.parallel.pp, config.parallel.ep = pp, ep
    world = pp * ep
    ranks = est.estimate(config, world)
    assert len(ranks) == pp
    for r in range(pp):
        chunks = build_chunks(config.model, pp, r, 0) if pp > 1 else (config.model.build_model(),)
        dense = expert = 0
        for chunk in chunks:
            keep_local_experts(chunk, 0, ep)
            for name, p in chunk.named_parameters():
                if ".experts." in name:
                    expert += p.numel()
                else:
                    dense += p.numel()
        local = dense / world * pp + expert  # dense sharded over the stage's ranks (dp x cp x ep)
        assert ranks[r]["master weights (fp32)"] * est.GIB == pytest.approx(4 * local, rel=1e-12)
        assert ranks[r]["AdamW moments (fp32)"] * est.GIB == pytest.approx(8 * local, rel=1e-12)


def test_estimate_memory_matches_the_measured_h200_peaks_and_fails_clearly():
    script = ".agents/skills/estimate-memory/estimate_memory.py"
    # (config, overrides, measured peak GiB: docs/performance.md, Memory; benchmarks/results.jsonl's lines)
    qwen, ds, oss = "benchmarks/qwen3_width.py", "examples/deepseek_v2_lite.py", "examples/gpt_oss_20b.py"
    four = ["model.num_hidden_layers=4", "train.micro_batch_size=2"]
    one_gpu = [
        (qwen, ["train.micro_batch_size=2"], 58.7),  # line 135 (H100)
        (qwen, ["train.micro_batch_size=4"], 65.7),  # line 137 (H100)
        (qwen, ["train.micro_batch_size=4", "model.num_hidden_layers=9"], 129.3),  # line 130 (H200)
        (ds, four, 43.9),  # line 138 (H100)
        (ds, ["train.micro_batch_size=4", "model.num_hidden_layers=10"], 124.6),  # line 131 (H200)
        (oss, ["train.micro_batch_size=4", "model.num_hidden_layers=6", "model.layer_types=None"], 122.9),  # line 147
    ]
    # two GPUs (ep2, 8 micro-batches per GPU): peaks of 2026-11-30, before the changes that took ~4% off the one-GPU
    # ones (the loss's gradient over the logits, the bf16 residual stream): within -10% and +20% of them
    two_gpus = [(qwen, ["train.micro_batch_size=4", "train.global_batch_size=64"], 76.2),
                (ds, four + ["train.global_batch_size=32"], 37.7),
                (oss, four + ["model.layer_types=None", "train.global_batch_size=32"], 67.2)]
    from pithtrain.config import apply_override, load_run_config

    est = _estimator()
    for world, runs in ((1, one_gpu), (2, two_gpus)):
        for path, sets, peak in runs:
            config = load_run_config(path)
            for s in sets:
                apply_override(config, s)
            config.parallel.ep = world
            total = max(r["total"] for r in est.estimate(config, world))
            if world == 1:
                assert total == pytest.approx(peak, rel=0.02), (path, sets, total, peak)
            else:
                assert 0.9 * peak <= total <= 1.2 * peak, (path, sets, total, peak)
    # Qwen3.5 width, 5 layers (4 Gated DeltaNet) at 4 x 4 on an H200: 117.0 GiB (lines 170, 174); within 5%
    hybrid = load_run_config("examples/qwen3_5_35b_a3b.py")
    for s in ("model.num_hidden_layers=5", "train.micro_batch_size=4", "train.global_batch_size=16"):
        apply_override(hybrid, s)
    assert max(r["total"] for r in est.estimate(hybrid, 1)) == pytest.approx(117.0, rel=0.05)
    ok = subprocess.run([sys.executable, script, "benchmarks/qwen3_width.py", "--set", "train.micro_batch_size=2",
                         "--set", "train.global_batch_size=8"], capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stdout.strip().splitlines()[-1].startswith("PASS: 58."), ok.stdout + ok.stderr
    small = run_script(script, "benchmarks/qwen3_width.py", "--gpu-mem", "40")  # main() here: no second process
    assert small.returncode == 1 and "FAIL:" in small.stdout and "micro_batch_size" in small.stdout
    bad = run_script(script, "benchmarks/qwen3_width.py", "--nproc", "3", "--ep", "2")
    assert bad.returncode == 1 and bad.stdout.startswith("FAIL:") and "ep" in bad.stdout, bad.stdout


@pytest.mark.fast
def test_estimate_memory_searches_deep_estimates_fp8_without_gpu_and_refuses_bad_sizes(capsys):
    """--max-layers finds depths far past the config's own (doubling, then bisecting), up to pithtrain's
    limit; an FP8 run is estimated on a machine without FP8 tensor cores (here: none) as on the GPU; a
    --gpu-mem that is not a finite positive number is argparse's error."""
    from pithtrain.config import apply_override, load_run_config

    est, script = _estimator(), ".agents/skills/estimate-memory/estimate_memory.py"
    config = load_run_config("examples/qwen3_tiny.py")  # 4 layers
    config.model.num_hidden_layers = 37
    budget = max(r["total"] for r in est.estimate(config, 1)) + 1e-6
    assert est.deepest(config, 1, budget) == 37 and est.deepest(config, 1, 0.0) is None
    est.MAX_LAYERS = 48
    assert est.deepest(config, 1, 1e9) == 48
    hybrid, mix = load_run_config("examples/qwen3_5_tiny.py"), ["full_attention", "linear_attention"] * 5
    hybrid.model.num_hidden_layers, hybrid.model.layer_types = 9, mix[:9]  # a written pattern, not the default: kept
    budget = max(r["total"] for r in est.estimate(hybrid, 1)) + 1e-6
    hybrid.model.num_hidden_layers, hybrid.model.layer_types = 4, mix[:4]
    assert est.deepest(hybrid, 1, budget) == 9 and hybrid.model.layer_types == mix[:9]
    assert "model.layer_types: ['full_attention', 'linear_attention'] repeated to each depth" in capsys.readouterr().out
    fp8 = run_script(script, "examples/qwen3_tiny.py", "--set", "train.fp8=rowwise")
    apply_override(config, "train.fp8=rowwise")
    config.model.num_hidden_layers = 4
    total = est.estimate(config, 1)[0]["total"]
    assert fp8.returncode == 0 and "FP8 weight caches" in fp8.stdout, fp8.stdout
    assert fp8.stdout.splitlines()[-1].startswith(f"PASS: {total:.1f} GiB"), fp8.stdout
    idle = run_script(script, "examples/qwen3_tiny.py", "--nproc", 4, "--pp", 4, "--set", "model.num_hidden_layers=2",
                      "--set", "train.micro_batch_size=2")  # was: PASS for a launch `pithtrain train` refuses
    assert idle.returncode == 1 and idle.stdout.startswith("FAIL: parallel.pp=4: with model.num_hidden_layers=2 pipeline "
                                                           "rank(s) 1, 2 hold no layer"), idle.stdout
    for bad in ("nan", "inf", "-5", "0"):
        assert run_script(script, "examples/qwen3_tiny.py", "--gpu-mem", bad).returncode == 2
        assert f"argument --gpu-mem: '{bad}': expected a finite number > 0" in capsys.readouterr().err


def test_validate_correctness_compares_fp8_with_full_precision(tmp_path, dataset_dir, monkeypatch):
    """The skill's FP8 procedure: the same run with and without FP8 (emulated on the CPU), PASS within
    FP8's tolerance, and a real difference (FP8 ran)."""
    import tempfile

    from conftest import write_run_file

    run = write_run_file(tmp_path / "run.py", dataset_dir)
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    out = run_script(SCRIPT, run, "--steps", "3", "--a", "--nproc 1", "--b", "--nproc 1 --set train.fp8=rowwise --set "
                     "train.fp8_emulate=true", "--rtol", "1e-2", "--rtol-aux", "5e-2")
    assert out.returncode == 0 and out.stdout.strip().splitlines()[-1].startswith("PASS: steps 1..3 agree"), out.stdout
    worst = float(out.stdout.split("worst relative difference: loss ")[1].split(",")[0])
    assert 0 < worst < 1e-2
    assert not list((tmp_path / "tmp").glob("validate-*"))  # its runs removed (no --work)


def test_resume_and_reshard_continues_the_curve_on_another_mesh(tmp_path, dataset_dir):
    """Steps 1-2 on dp1 x ep2 (two processes), 3-4 resumed on one process: PASS against one
    uninterrupted process; a resume that changes the optimisation (lr) is a FAIL from step 4 (the first loss after an update at the new lr)."""
    from conftest import write_run_file

    script = ".agents/skills/resume-and-reshard/reshard_resume.py"
    run = write_run_file(tmp_path / "run.py", dataset_dir)
    common = [str(run), "--steps", "4", "--stop-after", "2", "--set", "train.dtype=fp32"]
    mesh = run_script(script, *common, "--b", "--nproc 3 --ep 2", "--work", tmp_path / "mesh")
    assert mesh.returncode == 1 and mesh.stdout.startswith("FAIL: mesh B (--nproc 3 --ep 2): mesh pp=1 x cp=1 x ep=2"), mesh.stdout
    assert not (tmp_path / "mesh").exists()  # refused before mesh A trained
    model = run_script(script, *common, "--b", "--nproc 1 --set model.num_hidden_layers=3", "--work", tmp_path / "model")
    assert model.returncode == 1 and model.stdout.startswith("FAIL: mesh B (--nproc 1 --set model.num_hidden_layers=3): cannot "
                                                             "resume from mesh A's step-2 checkpoint: model.num_hidden_layers 2 -> 3"), model.stdout
    assert not (tmp_path / "model").exists()  # a resume's refusal too, before mesh A trained
    ok = run_script(script, *common, "--a", "--nproc 2 --ep 2", "--b", "--nproc 1", "--ref", "--nproc 1",
                    "--work", tmp_path / "ok")
    assert ok.returncode == 0 and ok.stdout.strip().splitlines()[-1].startswith("PASS: steps 1..4 agree"), ok.stdout + ok.stderr
    assert "resumed from" in ok.stdout and ok.stdout.count("step    ") == 4
    bad = run_script(script, *common, "--a", "--nproc 1", "--b", "--nproc 1 --set optim.lr=1e-2", "--work", tmp_path / "bad")
    assert bad.returncode == 1 and bad.stdout.strip().splitlines()[-1].startswith("FAIL: loss at step 4: "), bad.stdout + bad.stderr
    over = [line for line in bad.stdout.splitlines() if line.endswith("<-- over tolerance")]
    assert over and over[0].startswith("step    4      loss"), bad.stdout  # lr 1e-2 from the update of step 3 on
    none = run_script(script, *common, "--a", "--nproc 1", "--set", "train.checkpoint_every=-1", "--work", tmp_path / "none")
    assert none.returncode == 1 and none.stdout.splitlines()[-1] == (
        "FAIL: mesh A (--nproc 1): train.checkpoint_every=-1 writes no checkpoint, so mesh B would have nothing to "
        "resume; leave it out"), none.stdout
    assert not (tmp_path / "none").exists()  # refused before mesh A trained


@pytest.mark.fast
def test_a_skill_run_stopped_by_ctrl_c_ends_in_one_fail_line(tmp_path, dataset_dir, monkeypatch):
    """Ctrl-C while a skill script's `pithtrain train` runs (the run gets it too and stops after a step):
    the rest of the run's output, then one FAIL line naming the run, exit 130; no KeyboardInterrupt
    traceback. A run that does not end by itself is killed. Ctrl-C at any other point of a script: one FAIL line;
    after its verdict line (in cleanup), that line stands, exit 130."""
    from conftest import write_run_file

    run = write_run_file(tmp_path / "run.py", dataset_dir)

    class Run:  # subprocess.Popen of a run that Ctrl-C reaches after its first step
        killed = []

        def __init__(self, cmd, **kwargs):
            self.cmd, self.lines, self.code = cmd, ["step 1/4 | loss 4.1\n", KeyboardInterrupt, "stopped by SIGINT (Ctrl-C)\n"], None
            self.stdout = self

        def __iter__(self):
            return self

        def __next__(self):
            if not self.lines:
                self.code = 130 if self.code is None else self.code
                raise StopIteration
            line = self.lines.pop(0)
            if line is KeyboardInterrupt:
                raise KeyboardInterrupt
            return line

        def poll(self):
            return self.code

        def kill(self):
            Run.killed.append(self.cmd)
            self.code = -9

        def wait(self):
            return self.code

    monkeypatch.setattr(subprocess, "Popen", Run)
    for script, args, out in [(".agents/skills/resume-and-reshard/reshard_resume.py",
                               ["--steps", "4", "--stop-after", "2", "--a", "--nproc 1"], "w1/resharded"),
                              (SCRIPT, ["--steps", "4", "--a", "--nproc 1", "--b", "--nproc 1"], "w2/a")]:
        got = run_script(script, str(run), *args, "--work", tmp_path / out.split("/")[0])
        lines = got.stdout.strip().splitlines()
        assert got.returncode == 130 and lines[-2] == "  stopped by SIGINT (Ctrl-C)", got.stdout
        assert lines[-1] == (f"FAIL: interrupted (Ctrl-C) during `pithtrain train --out {tmp_path / out}` (exit 130); "
                             "no verdict (run the script again, into a new --work if you gave one)"), got.stdout
    assert not Run.killed
    monkeypatch.setattr(Run, "__next__", lambda self: (_ for _ in ()).throw(KeyboardInterrupt))  # a second Ctrl-C
    got = run_script(SCRIPT, str(run), "--steps", "4", "--a", "--nproc 1", "--b", "--nproc 1", "--work", tmp_path / "b")
    assert got.returncode == 130 and "(exit -9)" in got.stdout.splitlines()[-1] and len(Run.killed) == 1, got.stdout
    # Ctrl-C elsewhere in a script (here while it waits on subprocess.run): the same, without the run's name
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    (tmp_path / "corpus.txt").write_text("some text to tokenize\n")
    for script, args in [(".agents/skills/capture-profile/profile_step.py", [run, "--step", "2"]),
                         (".agents/skills/setup-benchmark-inputs/make_inputs.py",
                          ["corpus", tmp_path / "corpus.txt", "--vocab-size", "300", "--out", tmp_path / "ds"])]:
        got = run_script(script, *args)
        assert got.returncode == 130 and got.stdout.splitlines()[-1] == "FAIL: interrupted (Ctrl-C); no verdict", got.stdout
    runs = _load_script(".agents/skills/_common/runs.py")  # Ctrl-C in the cleanup after the verdict line: it stands

    @runs.interruptible
    def verdict_then_ctrl_c():
        runs.verdict(True)
        raise KeyboardInterrupt

    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()) as out:
        code = verdict_then_ctrl_c()
    assert code == 130 and out.getvalue() == "PASS\n", out.getvalue()


PREFLIGHT = ".agents/skills/launch-multi-node/preflight.py"


def _preflight_checks(rank, world, data, out=None):
    """The preflight's checks in this worker's process group, data.path set to `data`: (exit code, output)."""
    import contextlib
    import io
    from types import SimpleNamespace

    import torch.distributed as dist

    tool = _load_script(PREFLIGHT)
    config = tool.train_config(tool.build_parser().parse_args(["train", "examples/qwen3_tiny.py", "--set", f"data.path={data}"]))
    dist.destroy_process_group = lambda: None  # the harness ends the group itself
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        code = tool.checks(config, SimpleNamespace(out=out and str(out)), tool.pick_device("cpu"))
    return code, text.getvalue()


def test_launch_preflight_refuses_a_file_as_out_and_fails_where_no_host_has_the_data(tmp_path, capsys, monkeypatch):
    """--out naming a file (or a path through one): one FAIL line before any worker starts. A data.path that
    is a directory on no host: FAIL (every rank of the job opens it); one that is: PASS."""
    from dist_util import run_fn

    tool = _load_script(PREFLIGHT)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(tool, "launch_local", lambda *a: pytest.fail("workers started"))
    for out in ("README.md", "README.md/run"):
        assert tool.main(["examples/qwen3_tiny.py", "--nproc", "2", "--ep", "2", "--out", out]) == 1
        assert capsys.readouterr().out.strip() == (f"FAIL: --out {out}: README.md is a file, not a directory; "
                                                   "choose a directory that every node mounts")
    [(code, out)] = run_fn(1, _preflight_checks, tmp_path / "none")
    assert code == 1 and out.strip().splitlines()[-1] == (f"FAIL: data.path '{tmp_path / 'none'}' is not a directory on any "
                                                          "host (" + out.split("  rank    0  ")[1].split()[0] + "): make the "
                                                          "dataset there (setup-benchmark-inputs) or --set data.path=DIR"), out
    [(code, out)] = run_fn(1, _preflight_checks, tmp_path, tmp_path / "runs" / "big")  # an --out it creates, then removes
    assert code == 0 and out.strip().splitlines()[-1] == ("PASS: 1 rank(s) on 1 host(s): all_reduce exact, one config and "
                                                         f"torch version, data.path found, --out {tmp_path / 'runs' / 'big'} shared"), out
    assert not (tmp_path / "runs" / "big").exists() and (tmp_path / "runs").is_dir()  # runs/ was made by mkdir -p: kept
    for argv, says in ((["examples/qwen3_tiny.py", "--bogus"], "unrecognized arguments: --bogus"), ([], "required: config")):
        assert tool.main(argv) == 2
        said = capsys.readouterr().out
        assert said.startswith("FAIL: ") and says in said and len(said.splitlines()) == 1, said


def test_setup_benchmark_inputs_writes_and_verifies_each_dataset(tmp_path, capsys):
    """Random tokens at each family's real vocabulary, the stdlib corpus and a user's corpus (BPE
    trained on it) are written and PASS; a wrong expected vocabulary and a truncated file FAIL."""
    script = ".agents/skills/setup-benchmark-inputs/make_inputs.py"

    def make(*args, process=False):
        """The script in a process of its own (process=True: its exit code as a command) or its main() here."""
        if process:
            return subprocess.run([sys.executable, script, *map(str, args)], capture_output=True, text=True)
        return run_script(script, *args)

    for family, vocab in (("qwen3", 151936), ("deepseek_v2", 102400), ("gpt_oss", 201088), ("qwen3_5", 248320),
                          ("deepseek_v3", 129280), ("moonlight", 163840)):
        out = make("random", "--family", family, "--tokens", 500, "--out", tmp_path / family, process=family == "qwen3")
        assert out.returncode == 0 and out.stdout.strip().endswith(f"PASS: {tmp_path / family} opens as training does, ids "
                                                                   f"within its vocabulary, vocab {vocab}, 500 tokens"), out.stdout + out.stderr
        assert f"num_tokens=500, num_docs=1, vocab_size={vocab}" in out.stdout, out.stdout
    stdlib = make("stdlib", "--max-bytes", 50_000, "--vocab-size", 300, "--out", tmp_path / "stdlib")
    assert stdlib.returncode == 0 and stdlib.stdout.strip().endswith(f"PASS: {tmp_path / 'stdlib'} opens as training does, ids "
                                                                     "within its vocabulary, its tokenizer.json"), stdlib.stdout + stdlib.stderr
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 50)
    corpus = make("corpus", tmp_path / "text", "--vocab-size", 280, "--out", tmp_path / "mine")
    assert corpus.returncode == 0 and corpus.stdout.strip().endswith("its tokenizer.json"), corpus.stdout + corpus.stderr
    assert (tmp_path / "mine" / "tokenizer.json").is_file()
    # random tokens never replace a dataset without --overwrite (its tokenizer is not random's to delete), nor other files
    keep = make("random", "--family", "gpt_oss", "--tokens", 100, "--out", tmp_path / "mine")
    assert keep.stdout.strip() == f"FAIL: --out {tmp_path / 'mine'} already holds a dataset; choose a new directory, or pass " \
        "--overwrite to replace it" and (tmp_path / "mine" / "tokenizer.json").is_file(), keep.stdout
    other = make("random", "--family", "gpt_oss", "--tokens", 100, "--out", tmp_path / "text")
    assert other.stdout.startswith(f"FAIL: --out: {tmp_path / 'text'} already holds files that are not part of a pithtrain dataset"), other.stdout
    assert len(other.stdout.splitlines()) == 1
    again = make("random", "--family", "qwen3", "--tokens", 100, "--out", tmp_path / "qwen3_5", "--overwrite")
    assert again.returncode == 0 and "num_tokens=100, num_docs=1, vocab_size=151936" in again.stdout, again.stdout
    for bad in (["check", "--out", tmp_path / "mine", "--vocab", -1], ["random", "--family", "qwen3", "--tokens", 1, "--out", tmp_path / "x"],
                ["random", "--family", "qwen3", "--tokens", 10, "--vocab-size", 5, "--out", tmp_path / "x"]):
        assert make(*bad).returncode == 2 and not (tmp_path / "x").exists()
    for bad, says in ((["check", tmp_path / "mine", "--out", tmp_path / "x"], f"check takes no DIR or files (got {tmp_path / 'mine'}); "
                       "the dataset to verify is --out DIR: `check --out DIR`"),  # was: DIR ignored, x checked
                      (["check", "--out", tmp_path / "mine", "--overwrite"], "check takes no --overwrite (it would be ignored); drop it"),
                      (["random", "--family", "qwen3", "--tokens", 10, "--vocab", 64, "--out", tmp_path / "x"], "random takes no --vocab")):
        assert make(*bad).returncode == 2 and not (tmp_path / "x").exists()
        err = capsys.readouterr().err
        assert err.splitlines()[-1].startswith(f"make_inputs.py: error: {says}") and "Traceback" not in err, err
    small = make("check", "--out", tmp_path / "qwen3", "--vocab", 64)
    assert small.returncode == 1 and "model's vocab_size is 64" in small.stdout, small.stdout
    assert small.stdout.strip().endswith(f"FAIL: {tmp_path / 'qwen3'} is not a usable dataset"), small.stdout
    tokens = tmp_path / "gpt_oss" / "tokens.bin"
    tokens.write_bytes(tokens.read_bytes()[:-8])
    cut = make("check", "--out", tmp_path / "gpt_oss", process=True)
    assert cut.returncode == 1 and "truncated" in cut.stdout and "FAIL" in cut.stdout.splitlines()[-1], cut.stdout


def test_track_experiments_checks_every_step_is_logged(tmp_path, dataset_dir):
    """A 3-step run with TensorBoard: PASS; a metrics line lost, or the event files gone while
    --tensorboard asks for them: FAIL naming what is missing."""
    import shutil

    from pithtrain.train.loop import train

    script = ".agents/skills/track-experiments/check_run.py"
    run = tmp_path / "run"
    train(tiny_config(dataset_dir, steps=3, tensorboard=True), run, echo=False)

    def check(*args, process=False):
        """The script in a process of its own (process=True: its exit code as a command) or its main() here."""
        if process:
            return subprocess.run([sys.executable, script, str(run), *args], capture_output=True, text=True)
        return run_script(script, run, *args)

    ok = check("--tensorboard", process=True)
    assert ok.returncode == 0 and ok.stdout.strip().endswith("PASS: steps 1..3 logged"), ok.stdout + ok.stderr
    assert "tensorboard: train/loss at 3 steps" in ok.stdout
    lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    (run / "metrics.jsonl").write_text(lines[0] + lines[2])
    lost = check()
    assert lost.returncode == 1 and lost.stdout.strip().endswith("FAIL: metrics.jsonl: missing steps [2]"), lost.stdout
    (run / "metrics.jsonl").write_text("")
    empty = check()
    assert empty.returncode == 1 and empty.stdout.strip().endswith("FAIL: metrics.jsonl: missing steps [1, 2, 3]"), empty.stdout
    (run / "metrics.jsonl").write_text(lines[0] + "garbage\n" + lines[2])
    garbage = check()
    assert garbage.stdout.strip() == f"FAIL: {run / 'metrics.jsonl'} line 2 is not JSON (Expecting value)", garbage.stdout
    (run / "metrics.jsonl").write_text("".join(lines))
    config = (run / "run_config.json").read_text()
    for text, says in (("{", "run_config.json is not JSON"), ('{"model": {}}', "run_config.json holds no train.steps")):
        (run / "run_config.json").write_text(text)
        out = check()
        assert out.returncode == 1 and out.stdout.startswith("FAIL: ") and says in out.stdout and len(out.stdout.splitlines()) == 1, out.stdout
    (run / "wandb" / "offline-run-1").mkdir(parents=True)  # every step's loss in a record: only the config is judged
    (run / "wandb" / "offline-run-1" / "run-1.wandb").write_text(" ".join(json.dumps(json.loads(line)["loss"]) for line in lines))
    for model in (5, "qwen3_moe", [1]):  # was: a TypeError traceback; a string's first letter taken as a field name
        (run / "run_config.json").write_text(json.dumps({"train": {"steps": 3}, "model": model}))
        out = check("--wandb")
        assert out.returncode == 1 and out.stdout.splitlines()[-1] == (
            f"FAIL: {run / 'run_config.json'}: its \"model\" is {model!r}, not the model's fields (not a run's config?)"), out.stdout
    shutil.rmtree(run / "wandb")
    (run / "run_config.json").write_text(config)
    assert check("--steps", "0").returncode == 2  # argparse: an integer >= 1
    for where, says in ((tmp_path / "none", "no such directory"), (run / "run_config.json", "a file")):  # not a run
        out = run_script(script, where, "--steps", "3")
        assert out.stdout == f"FAIL: {where}: {says}; pass a run directory (the --out of pithtrain train)\n", out.stdout
    beyond = check("--steps", "2")
    assert "problem: tensorboard: unexpected [3]" in beyond.stdout and "[]" not in beyond.stdout, beyond.stdout
    huge = check("--steps", str(10**15))  # a run of 10**15 steps stopped early: was a set of them (MemoryError or swap)
    assert huge.stdout.strip().endswith(f"missing steps {list(range(4, 14))} (+{10**15 - 13} more) (+1 more above)"), huge.stdout
    shutil.rmtree(run / "tensorboard")
    assert check().returncode == 0  # event files are checked when present
    gone = check("--tensorboard")
    assert gone.returncode == 1 and "tensorboard is missing" in gone.stdout, gone.stdout
    short = check("--steps", "2")
    assert short.returncode == 1 and "unexpected [3]" in short.stdout, short.stdout


def test_track_experiments_reads_a_real_offline_wandb_run(tmp_path, dataset_dir, monkeypatch, request):
    """The real wandb package, offline: a 3-step run, then a resume to 4 (a second offline run): every
    step's loss and the config once per run are found: PASS. A loss that no wandb record holds
    (metrics.jsonl edited) and a run with its records gone: FAIL naming what is missing."""
    wandb = pytest.importorskip("wandb")  # in the test extra: CI has it
    from pithtrain.train.loop import train

    # wandb's service and threads stop with this test: a gloo test forked later from this pytest process
    # must not inherit them (it can hang on a lock one of them held)
    request.addfinalizer(wandb.teardown)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    script = ".agents/skills/track-experiments/check_run.py"
    run = tmp_path / "run"
    train(tiny_config(dataset_dir, steps=4, wandb_project="moe", checkpoint_every=1), run, echo=False, stop_after=3)
    train(tiny_config(dataset_dir, steps=4, wandb_project="moe", checkpoint_every=1), run, echo=False)

    def check():
        return subprocess.run([sys.executable, script, str(run), "--wandb"], capture_output=True, text=True)

    ok = check()
    assert ok.returncode == 0 and ok.stdout.strip().endswith("PASS: steps 1..4 logged"), ok.stdout + ok.stderr
    assert "wandb: 2 offline run(s)" in ok.stdout, ok.stdout
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    lines[1]["loss"] += 1e-3
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    edited = check()
    assert edited.returncode == 1 and "the loss of steps [2] is in no offline run" in edited.stdout, edited.stdout
    for f in (run / "wandb").glob("offline-run-*/run-*.wandb"):
        f.unlink()
    gone = check()
    assert gone.returncode == 1 and "no offline wandb run" in gone.stdout, gone.stdout


@pytest.mark.fast
def test_ab_test_switch_judges_gain_loss_and_noise(tmp_path, monkeypatch):
    """ab-test-switch on results lines as train_throughput.py --ab writes them: each arm's first two steps and
    its profiled last one left out; PASS only for a gain beyond twice the standard error of B/A from the arms'
    scatter and --min-gain; a loss, a gain inside the noise, a line that is no A/B run, a missing file or no
    argument: FAIL with the reason."""
    script = ".agents/skills/ab-test-switch/ab_switch.py"

    def line(a, b, **extra):  # a, b: each arm's tokens/s by step (two warm-up, three measured, one profiled)
        steps = [[2 * i + 1 + j, arm, rate] for i, pair in enumerate(zip(a, b)) for j, (arm, rate) in enumerate(zip("AB", pair))]
        median = lambda r: sorted(r[2:5])[1]  # noqa: E731
        return {"ab": "wgrad-stream", "ab_a": False, "ab_b": True, "family": "qwen3", "layers": 9, "commit": "abc1234",
                "pithtrain_tokens_per_s": median(a), "ab_b_tokens_per_s": median(b), "ab_steps": steps,
                "ab_stage_ms": {"A": {"stage 3 backward": 401.0, "gpu idle": 9.0}, "B": {"stage 3 backward": 361.0, "gpu idle": 9.5}},
                **extra}

    warm = [40_000, 70_000]
    results = tmp_path / "results.jsonl"
    cases = [line(warm + [75_000, 75_400, 75_200, 60_000], warm + [78_000, 78_300, 78_100, 61_000]),  # +3.9%
             line(warm + [75_000, 75_400, 75_200, 60_000], warm + [73_000, 73_300, 73_100, 61_000]),  # -2.8%
             line(warm + [75_000, 78_000, 75_200, 60_000], warm + [75_800, 75_900, 79_000, 61_000]),  # +0.9%, scatter 2-2.4%
             {"benchmark": "train_throughput", "pithtrain_tokens_per_s": 75_000.0}]
    results.write_text("".join(json.dumps(c) + "\n" for c in cases))
    gain = run_script(script, "--from-results", results, "--line", 1)
    assert gain.returncode == 0 and gain.stdout.splitlines()[-1] == "PASS: B is 3.9% faster (1.039x), beyond the noise (0.3%)"
    assert "[75,000, 75,400, 75,200]" in gain.stdout and "stage 3 backward 401.0 -> 361.0" in gain.stdout
    strict = run_script(script, "--from-results", results, "--line", 1, "--min-gain", 0.05)
    assert strict.returncode == 1 and strict.stdout.splitlines()[-1] == \
        "FAIL: B/A = 1.039x: beyond the noise (0.3%) but within --min-gain 5.0%; keep A", strict.stdout
    loss = run_script(script, "--from-results", results, "--line", 2)
    assert loss.returncode == 1 and loss.stdout.splitlines()[-1].startswith("FAIL: B is 2.8% slower"), loss.stdout
    noise = run_script(script, "--from-results", results, "--line", 3)
    assert noise.returncode == 1 and "within the noise (3.7%" in noise.stdout.splitlines()[-1], noise.stdout
    latest = run_script(script, "--from-results", results)  # the last line is no A/B run: the latest that is
    assert latest.stdout.splitlines()[0] == f"judging line 3 of {results}, its latest train_throughput.py --ab run", latest.stdout
    assert latest.returncode == 1 and "within the noise (3.7%" in latest.stdout.splitlines()[-1], latest.stdout
    damaged = tmp_path / "damaged.jsonl"  # a line edited by hand
    damaged.write_text(json.dumps({k: v for k, v in cases[0].items() if k != "ab_a"}) + "\n")
    for args, reason in [(["--from-results", results, "--line", 4], "line 4 is not a train_throughput.py --ab run"),
                         (["--from-results", damaged, "--line", 1], "the --ab line is damaged (KeyError: 'ab_a')"),
                         (["--from-results", results, "--line", 9], "--line 9: "),
                         (["--from-results", tmp_path / "none.jsonl"], "no such results file"),
                         ([], "give SWITCH")]:
        out = run_script(script, *args)
        assert out.returncode == 1 and out.stdout.startswith("FAIL: ") and reason in out.stdout, (args, out.stdout)
    for gain in ("-0.1", "nan"):
        assert run_script(script, "--from-results", results, "--min-gain", gain).returncode == 2  # argparse's one line
    # three arms in one run (train_throughput.py --ab fused-proj,triton-adamw): each flipped arm judged against A
    a, b, c = (warm + [75_000, 75_400, 75_200, 60_000], warm + [73_000, 73_300, 73_100, 61_000],
               warm + [78_000, 78_300, 78_100, 61_000])
    multi = {"ab": "fused-proj,triton-adamw", "ab_a": {"fused-proj": True, "triton-adamw": False},
             "ab_steps": [[3 * i + 1 + j, arm, rate] for i, rates in enumerate(zip(a, b, c)) for j, (arm, rate) in enumerate(zip("ABC", rates))],
             "pithtrain_tokens_per_s": 75_200.0, "ab_stage_ms": {arm: {"gpu idle": 9.0} for arm in "ABC"},
             "ab_arms": {"B": {"switch": "fused-proj", "runs": False, "tokens_per_s": 73_100.0},
                         "C": {"switch": "triton-adamw", "runs": True, "tokens_per_s": 78_100.0}}}
    results.write_text(json.dumps(multi) + "\n")
    arm_c = run_script(script, "--from-results", results, "--arm", "C")
    assert arm_c.returncode == 0 and arm_c.stdout.splitlines()[-1] == "PASS: C is 3.9% faster (1.039x), beyond the noise (0.3%)"
    assert "arm B (fused-proj = false): 73,100 tok/s median of [73,000, 73,300, 73,100]" in arm_c.stdout, arm_c.stdout
    arm_b = run_script(script, "--from-results", results)
    assert arm_b.returncode == 1 and arm_b.stdout.splitlines()[-1].startswith("FAIL: B is 2.8% slower"), arm_b.stdout
    arm_d = run_script(script, "--from-results", results, "--arm", "D")
    assert arm_d.stdout.splitlines()[-1] == "FAIL: --arm D: this line's arms against A are B, C", arm_d.stdout
    with monkeypatch.context() as m:  # the A/B run needs the checkout's benchmark: elsewhere one FAIL line, no traceback
        m.chdir(tmp_path)
        away = run_script(str(Path(__file__).parent.parent / script), "triton-adamw")
    assert away.returncode == 1 and away.stdout.splitlines() == [
        f"FAIL: no benchmarks/train_throughput.py under {tmp_path}: run this from the repository root (PYTHONPATH=.)"], away.stdout
    # the A/B itself needs a GPU: here the benchmark refuses in one line, and the skill says it failed
    monkeypatch.setenv("PITHTRAIN_RESULTS", str(results))
    results.write_bytes(results.read_bytes() + b"\xff\n")  # a byte that is no UTF-8: was a UnicodeDecodeError traceback
    cpu = run_script(script, "triton-adamw,fused-proj", "--", "--layers", "1")
    assert cpu.returncode == 1 and cpu.stdout.splitlines()[-1] == "FAIL: benchmarks/train_throughput.py failed (its error is above)"
    assert "--steps 18 --layers 1 --ab triton-adamw,fused-proj" in cpu.stdout.splitlines()[0]
    for args, says in ((["bogus,fused-proj"], "FAIL: bogus: not a switch of benchmarks/train_throughput.py --ab"),
                       (["fp8", "--line", "2"], "FAIL: --line 2 picks a line of --from-results FILE")):
        out = run_script(script, *args)  # before the benchmark starts
        assert out.returncode == 1 and out.stdout.startswith(says) and "$ " not in out.stdout, out.stdout
    # the arms' setters: stage5-compiled makes each layer's stage 5 a compiled wrapper or drops it, the other switch
    # flips its module flag; arms[0](None), after the run, resets the flags as arm A without a model
    bench = _load_script("benchmarks/train_throughput.py")
    args = types.SimpleNamespace(ab="stage5-compiled,fused-proj", compile=True, fp8="off", fp8_head=False,
                                 family="qwen3_moe", wgrad_config=None)
    parser = types.SimpleNamespace(error=lambda message: pytest.fail(message))
    a_values, flips, arms = bench.ab_arms(args, parser)
    assert a_values == {"stage5-compiled": True, "fused-proj": fp8.FUSED_PROJECTIONS} and len(arms) == 3, a_values
    layer = type("Layer", (), {"stage5": lambda self, x: x})()  # a method: compiled_stage5 sets an instance's
    run = types.SimpleNamespace(model=types.SimpleNamespace(layers={"0": layer}))
    for arm, compiled, fused in ((arms[1], False, a_values["fused-proj"]), (arms[2], True, not a_values["fused-proj"]),
                                 (arms[0], True, a_values["fused-proj"])):
        arm(run)
        assert ("stage5" in vars(layer)) == compiled and fp8.FUSED_PROJECTIONS == fused, (compiled, fused)
    arms[2](run)
    arms[0](None)
    assert fp8.FUSED_PROJECTIONS == a_values["fused-proj"] and bench.STAGE5.compiled


def test_compile_kernels_records_launches_and_reports_compile_failures(tmp_path, capsys):
    """compile-kernels: a launch's signature from its arguments (pointer dtypes, integer widths, a tensor
    descriptor's block, constexprs and options); the compiling process (no interpreter) compiles a good launch
    for sm90 and reports a bad one (a non-power-of-2 block) by kernel, constexprs and the compiler's message."""
    pytest.importorskip("triton.backends.nvidia")
    from triton.runtime.jit import JITFunction
    from triton.tools.tensor_descriptor import TensorDescriptor

    script = ".agents/skills/compile-kernels/compile_kernels.py"
    tool = _load_script(script)
    from pithtrain.ops import kernels

    x = torch.zeros(64, 32, dtype=torch.bfloat16)
    fn = JITFunction(kernels._wgrad_into_kernel.fn)
    desc = TensorDescriptor.from_tensor(x, [16, 32])
    args = (x, x, torch.zeros(3, dtype=torch.int32), torch.zeros(3, 32, 32), desc, desc, None, 3, 32, 2**31, 32, 32)
    sig, constexprs, options = tool.signature_of(fn, args, dict(ASSIGN=True, TMA=True, HOST=True, REDUCE=False,
                                                               PERSISTENT=False, BK=32, BM=32, BN=16, num_warps=4))
    assert sig["x_ptr"] == "*bf16" and sig["ends_ptr"] == "*i32" and sig["grad_ptr"] == "*fp32"
    assert sig["x_td"] == "tensordesc<bf16[16, 32]>" and sig["g_td"] == "constexpr" and constexprs["g_td"] is None
    assert sig["experts"] == "i32" and sig["m_dim"] == "i64" and constexprs["BN"] == 16 and options == {"num_warps": 4}
    good = {"module": "pithtrain.ops.kernels", "kernel": "_add_into_kernel", "options": {"num_warps": 8},
            "signature": {"dst_ptr": "*fp32", "src_ptr": "*bf16", "n": "i32", "ASSIGN": "constexpr", "BLOCK": "constexpr"},
            "constexprs": {"ASSIGN": False, "BLOCK": 1024}}
    bad = dict(good, constexprs={"ASSIGN": False, "BLOCK": 1000})
    launches = tmp_path / "launches.json"
    launches.write_text(json.dumps([good, bad]))
    assert tool.compile_all(str(launches), 90) == 0  # the script's second process, here: no interpreter in this one
    out = capsys.readouterr().out
    assert out.strip().endswith("failures: 1") and "_add_into_kernel {'ASSIGN': False, 'BLOCK': 1000}" in out, out
    assert "power of 2" in out
    # from another directory the checkout's interpreter cases are still found; a -k that selects none says so
    none = subprocess.run([sys.executable, os.path.abspath(script), "-k", "no_such_case"], capture_output=True, text=True,
                          cwd=tmp_path)
    assert none.returncode == 1 and none.stdout.splitlines()[-1].startswith(
        "FAIL: -k 'no_such_case' selects no interpreter case (list them: pytest --collect-only -q"), none.stdout + none.stderr
    assert run_script(script, "--arch", "9999").returncode == 2  # argparse's line, before the interpreter cases run
    expr = random.choice(["and or", "not", "(a"])  # not an expression: said so, not "the interpreter cases failed"
    bad = subprocess.run([sys.executable, script, "-k", expr], capture_output=True, text=True)
    assert bad.returncode == 1 and bad.stdout.splitlines()[-1] == f"FAIL: -k {expr!r} is not a pytest -k expression (its message " \
        "is above), e.g. -k 'cross_entropy'", bad.stdout + bad.stderr


def test_train_throughput_refuses_bad_ab_switches_before_any_gpu_work(monkeypatch, capsys):
    """benchmarks/train_throughput.py's --ab and its switch flags: one-line errors naming the flag and the fix,
    checked before it asks for a GPU (which this machine lacks: the last error is that one)."""
    tool = _load_script("benchmarks/train_throughput.py")
    cases = [("--ab ce-fp8-grad --steps 12", "--fp8 rowwise_bf16_wgrad --fp8-head"),
             ("--fp8 rowwise_bf16_wgrad --ab ce-fp8-grad --steps 12", "--fp8-head"),
             ("--ab glu-fp8-grad,expand-fp8 --steps 12", "give --fp8 rowwise_bf16_wgrad"),
             ("--ab wgrad-host,wgrad-host --steps 12", "distinct switches"),
             ("--ab wgrad-host,triton-adamw --steps 8", "needs --steps >= 12"),
             ("--fp8 rowwise_bf16_wgrad --glu-tiles 4096/4", "--glu-tiles takes FWD,BWD"),
             ("--fp8 rowwise_bf16_wgrad --glu-tiles 3072/4,2048/4", "both powers of two"),
             ("--glu-tiles 4096/4,2048/4", "give --fp8"), ("--batch 0", "--batch must be at least 1"),
             ("--fp8-head", "give --fp8 rowwise_bf16_wgrad too"), ("--mtp 1", "use --family moonlight"),
             ("--wgrad-config {}", "exactly BK, BM, BN"),
             ("--ab fp8,fused-proj --steps 18 --fp8 rowwise_bf16_wgrad", "--ab fp8 runs alone"),
             ("--ab fused-proj,triton-adamw --steps 8 --fp8 rowwise_bf16_wgrad", "needs --steps >= 12 (got 8): 3 arms"),
             ("--fp8 rowwise_bf16_wgrad --fp8-head --ab ce-fp8-grad,glu-fp8-grad,expand-fp8 --steps 20", "CUDA GPU")]
    for argv, says in cases:
        monkeypatch.setattr(sys, "argv", ["train_throughput.py", *argv.split()])
        with pytest.raises(SystemExit) as stop:
            tool.main()
        err = capsys.readouterr().err.strip().splitlines()
        assert stop.value.code == 2 and says in err[-1], (argv, err)
