"""The debugging skills (debug-divergence, debug-memory) on real tiny CPU runs, and the norm log they read."""

import json
import sys

import pytest

from cli_util import run_script
from conftest import tiny_config, write_run_file

DIVERGENCE = ".agents/skills/debug-divergence/debug_divergence.py"
MEMORY = ".agents/skills/debug-memory/debug_memory.py"


@pytest.mark.fast
def test_norm_log_records_every_stage_forward_and_backward_of_the_chosen_steps(tmp_path, dataset_dir, monkeypatch):
    """PITHTRAIN_DEBUG_NORMS=2: only step 2; forward outputs of every layer's stages 1, 3, 5, the
    gradients reaching them, and parameter gradients whose norms make the step's logged grad norm
    (computed by fsdp.global_grad_norm)."""
    import math

    from pithtrain.train.loop import train

    monkeypatch.setenv("PITHTRAIN_DEBUG_NORMS", "2")
    history = train(tiny_config(dataset_dir, steps=2, checkpoint_every=-1), tmp_path, echo=False)
    rows = [json.loads(line) for line in (tmp_path / "norms_rank0.jsonl").read_text().splitlines()]
    assert {r["step"] for r in rows} == {2}
    names = {(r["tensor"], r["kind"]) for r in rows}
    for layer in (0, 1):
        for stage in ("stage1.residual", "stage1.moe_input", "stage3", "stage5"):
            assert (f"layer{layer}.{stage}", "forward") in names and (f"layer{layer}.{stage}", "backward") in names
    assert ("embed_tokens", "forward") in names and ("norm", "backward") in names
    grads = [r for r in rows if r["kind"] == "param_grad"]
    assert len(grads) == len(list(tiny_config(dataset_dir).model.build_model().parameters()))
    assert math.sqrt(sum(r["norm"] ** 2 for r in grads)) == pytest.approx(history[1]["grad_norm"], rel=1e-6)
    # order: a step's forward outputs come before the gradients reaching them
    kinds = [r["kind"] for r in rows]
    assert kinds.index("backward") > kinds.index("forward") and kinds[-1] == "param_grad"


def test_debug_divergence_finds_the_first_bad_step_and_tensor_of_a_real_blow_up(tmp_path, dataset_dir):
    """A learning rate of 1e5 without clipping: step 2 is non-finite for real. The script names the
    step, the first non-finite tensor (the NaN appears in backward), and that fp32 -> bf16 does not
    cure it; FAIL."""
    config = write_run_file(tmp_path / "run.py", dataset_dir)
    out = run_script(DIVERGENCE, config, "--steps", 4, "--set", "optim.lr=1e5", "--set", "optim.warmup_steps=0",
                     "--set", "optim.grad_clip=0", "--factors", "dtype,triton", "--work", tmp_path / "w")
    said = out.stdout
    assert out.returncode == 1, said + out.stderr
    assert "first bad step: 2 (the run stopped: non-finite loss or grad norm)" in said, said
    assert "step 2, rank 0, first tensor non-finite: embed_tokens (backward): norm nan" in said, said
    assert "factor triton: does not apply" in said
    assert said.strip().splitlines()[-1].startswith("FAIL: divergence at step 2; no single factor removes it"), said
    # the same run, its metrics read back: a non-finite step is the one after the last logged
    again = run_script(DIVERGENCE, config, "--run", tmp_path / "w" / "run", "--steps", 4, "--set", "optim.lr=1e5",
                       "--set", "optim.warmup_steps=0", "--set", "optim.grad_clip=0", "--factors", "triton",
                       "--work", tmp_path / "w2")
    assert "first bad step: 2 (the run stopped after step 1 of 4" in again.stdout, again.stdout + again.stderr
    assert "first tensor non-finite: embed_tokens (backward)" in again.stdout
    assert again.stdout.strip().splitlines()[-1] == ("FAIL: divergence at step 2; no factor was tested: none of "
                                                     "--factors applies here (see 'does not apply' above)"), again.stdout


@pytest.mark.fast
def test_debug_divergence_scan_names_a_loss_jump():
    sys.path.insert(0, ".agents/skills/_common")
    import runs

    scan = runs.skill_script("debug-divergence/debug_divergence.py").first_bad_step
    steps = [{"step": i + 1, "loss": l, "grad_norm": 1.0} for i, l in enumerate([5.0, 4.0, 3.5, 3.4, 12.0, 3.0])]
    assert scan(steps, 3.0) == (5, "loss 12 > 3 x the median 3.75 of the steps before")
    assert scan(steps, 4.0) is None
    steps[2]["grad_norm"] = float("nan")
    assert scan(steps, 4.0) == (3, "grad_norm is nan")
    mtp = [{**m, "grad_norm": 1.0, "loss": 3.0, "mtp_loss": 4.0} for m in steps]  # DeepSeek-V3's MTP metric blows up first
    mtp[3]["mtp_loss"] = 40.0
    assert scan(mtp, 4.0) == (4, "mtp_loss 40 > 4 x the median 4 of the steps before")
    mtp[1]["mtp_loss"] = float("inf")
    assert scan(mtp, 4.0) == (2, "mtp_loss is inf")


def test_debug_divergence_bisect_names_the_factor_that_changes_the_run(tmp_path, dataset_dir):
    """No divergence; --bisect: fp32 -> bf16 really changes the metrics beyond 1e-5 on the CPU: the
    script names the dtype and FAILs; without --bisect the healthy run PASSes."""
    config = write_run_file(tmp_path / "run.py", dataset_dir)
    out = run_script(DIVERGENCE, config, "--steps", 2, "--factors", "mesh,dtype", "--bisect", "--work", tmp_path / "w")
    said = out.stdout
    assert out.returncode == 1, said + out.stderr
    lines = said.splitlines()
    assert "factor mesh: does not apply (one process already)" in lines, said
    assert any(line.startswith("dtype    fp32 -> bf16") and line.rstrip().endswith("NO") for line in lines), said
    assert lines[-1] == "FAIL: no step diverged; the metrics change beyond --rtol with: dtype (fp32 -> bf16)", said
    healthy = run_script(DIVERGENCE, config, "--run", tmp_path / "w" / "run", "--steps", 2)
    assert healthy.returncode == 0 and healthy.stdout.strip().splitlines()[-1].startswith("PASS: no step diverged")
    mismatch = run_script(DIVERGENCE, config, "--run", tmp_path / "w" / "run", "--steps", 3)  # not the run's schedule
    assert mismatch.returncode == 1 and "FAIL: --steps 3: the run's train.steps is 2" in mismatch.stdout, mismatch.stdout
    other = run_script(DIVERGENCE, config, "--run", tmp_path / "w" / "run", "--steps", 2, "--set", "optim.lr=0.5")  # was: PASS
    assert other.returncode == 1 and other.stdout.splitlines()[-1].startswith(f"FAIL: --run {tmp_path / 'w' / 'run'}: its "
                                                                              "run_config.json differs"), other.stdout
    assert " vs 0.5; pass those of the run" in other.stdout and "$ " not in other.stdout, other.stdout
    # as a run of 4 steps that stopped after 2 (--stop-after, a kill): its re-run goes on, so no divergence
    stored = tmp_path / "w" / "run" / "run_config.json"
    stored.write_text(json.dumps({**json.loads(stored.read_text()), "train": {**json.loads(stored.read_text())["train"], "steps": 4}}))
    stopped = run_script(DIVERGENCE, config, "--run", tmp_path / "w" / "run", "--steps", 4, "--factors", "dtype")
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert stopped.stdout.strip().splitlines()[-1] == ("PASS: no divergence: the run stopped after step 2 of 4, and its "
                                                       "re-run goes through step 3 with finite, steady losses"), stopped.stdout


@pytest.mark.fast
def test_debug_divergence_refuses_what_it_cannot_diagnose_before_any_run(tmp_path, dataset_dir, capsys):
    """A --run that is no run directory, or logged no step, or holds a line that is no metrics line; a mesh
    `pithtrain train` refuses (the run's or a factor's): one FAIL line, nothing trained. An unknown factor
    and a --jump that is not a finite number > 1: argparse's error."""
    config = write_run_file(tmp_path / "run.py", dataset_dir)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "metrics.jsonl").write_text("oops\n")
    for args, says in [(["--run", tmp_path / "none"], f"--run {tmp_path / 'none'}: no metrics.jsonl (not a run directory)"),
                       (["--run", tmp_path / "empty"], f"--run {tmp_path / 'empty'}: metrics.jsonl logs no step; nothing to diagnose"),
                       (["--run", tmp_path / "empty" / "metrics.jsonl"], f"--run {tmp_path / 'empty'}: metrics.jsonl logs no"),
                       (["--run", tmp_path / "text"], f"--run: {tmp_path / 'text' / 'metrics.jsonl'} line 1 is not JSON (Expecting value)"),
                       (["--args", "--nproc 3 --ep 2"], "the run (--nproc 3 --ep 2): mesh pp=1 x cp=1 x ep=2 = 2 does not divide")]:
        out = run_script(DIVERGENCE, config, "--steps", 300, "--factors", "dtype", "--work", tmp_path / "w", *args)
        assert out.returncode == 1 and out.stdout.strip().startswith(f"FAIL: {says}"), (args, out.stdout)
        assert "$ " not in out.stdout and not (tmp_path / "w").exists(), out.stdout  # nothing ran
    for flag, value in (("--factors", "dtype,foo"), ("--jump", 1), ("--jump", 0), ("--jump", "nan"), ("--steps", 0)):
        assert run_script(DIVERGENCE, config, "--steps", 3, flag, value).returncode == 2
        assert f"argument {flag}: " in capsys.readouterr().err, (flag, value)


@pytest.mark.fast
def test_debug_divergence_one_process_variant_of_a_mesh():
    """The mesh factor drops every mesh flag (and its value) and keeps the rest."""
    import argparse

    from pithtrain.config import RunConfig

    sys.path.insert(0, ".agents/skills/_common")
    import runs

    tool = runs.skill_script("debug-divergence/debug_divergence.py")
    config = RunConfig.__new__(RunConfig)
    config.train = type("T", (), {"dtype": "auto", "compile": False})()
    args = argparse.Namespace(args="--nproc 4 --pp 2 --ep 2 --hsdp --set train.seed=3",
                              factors=tool.factor_list("mesh,compile,dtype,triton"))
    found = {v[0]: v[1:] for v in tool.variants(args, config, cuda=True)}
    assert found["mesh"][1] == "--set train.seed=3 --nproc 1"
    assert found["compile"][2] == ["train.compile=True"] and found["dtype"][2] == ["train.dtype=fp32"]
    assert found["triton"][3] == {"PITHTRAIN_TRITON": "0"}


def test_debug_memory_on_a_real_cpu_step(tmp_path, dataset_dir):
    """Step 2 of a tiny run recorded on the CPU (profiler allocation events): the tables name the
    layer stages and call sites; the peak is the profiler's own running total's maximum; PASS within
    a margin wide enough for the CPU (fp32, tiny tensors), FAIL with a margin of zero. One process's
    combine (stage 4) allocates nothing: stage 5 reads the expert-grouped rows where they are. The script's
    main() runs here (it imports torch: 4 s a process); its training run is a process of its own."""
    config = write_run_file(tmp_path / "run.py", dataset_dir)
    out = run_script(MEMORY, config, "--step", 2, "--margin", 5, "--work", tmp_path / "w")
    said = out.stdout
    assert out.returncode == 0 and said.strip().splitlines()[-1].startswith("PASS: peak"), said + out.stderr
    stages = said.split("by layer stage")[1].split("by call site")[0]
    for stage in ("stage 1 forward", "stage 2 dispatch", "stage 3 forward", "stage 5 forward", "backward"):
        assert stage in stages, said
    assert "pithtrain/ops/grouped_gemm.py" in said.split("by call site")[1], said
    record = tmp_path / "w" / "run" / "memory" / "rank0.json"
    events = json.loads(record.read_text())["traceEvents"]
    totals = [e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]" and e["args"]["Device Type"] == 0]
    peak = float(said.split("\npeak ")[1].split(" GiB")[0])
    assert peak == pytest.approx(max(totals) / 2**30, abs=1e-4), (peak, max(totals))
    tight = run_script(MEMORY, config, "--snapshot", record, "--margin", 0)
    assert tight.returncode == 1 and tight.stdout.strip().splitlines()[-1].startswith("FAIL: peak"), tight.stdout + tight.stderr
    bad = run_script(MEMORY, config, "--nproc", 3, "--ep", 2)
    assert bad.returncode == 1 and bad.stdout.startswith("FAIL:") and "ep" in bad.stdout, bad.stdout
    # a record is judged against the run that wrote it (RUN/run_config.json, the ranks' records), not other arguments
    fake = tmp_path / "fake" / "memory"
    fake.mkdir(parents=True)
    (fake / "rank0.json").write_text("{")
    for args, says in [(["--set", "model.num_hidden_layers=3"], "model.num_hidden_layers 2 vs 3"),
                       (["--nproc", 2, "--ep", 2], "parallel.ep 1 vs 2; 1 rank records vs --nproc 2"),
                       (["--snapshot", tmp_path / "none.json"], "none.json: no such file"),
                       (["--snapshot", fake / "rank0.json"], f"no {tmp_path / 'fake' / 'run_config.json'}")]:
        out = run_script(MEMORY, config, "--snapshot", record, *args)
        assert out.returncode == 1 and out.stdout.startswith("FAIL: --snapshot ") and says in out.stdout, (args, out.stdout)
        assert len(out.stdout.splitlines()) == 1, out.stdout
    (fake.parent / "run_config.json").write_text((record.parent.parent / "run_config.json").read_text())
    text = run_script(MEMORY, config, "--snapshot", fake / "rank0.json")
    assert text.stdout.strip() == f"FAIL: {fake / 'rank0.json'} is not JSON (Expecting property name enclosed in double " \
        "quotes: line 1 column 2 (char 1))", text.stdout
    (fake / "rank0.pickle").write_bytes(b"\x80\x04K\x01garbage")  # a pickle protocol header, then junk
    (fake / "rank0.json").unlink()
    junk = run_script(MEMORY, config, "--snapshot", fake / "rank0.pickle")
    assert junk.stdout.startswith(f"FAIL: {fake / 'rank0.pickle'} is not a CUDA allocator snapshot"), junk.stdout
    for margin in ("-1", "nan"):
        assert run_script(MEMORY, config, "--snapshot", record, "--margin", margin).returncode == 2


@pytest.mark.fast
def test_debug_memory_replays_a_cuda_allocator_snapshot():
    """A synthetic allocator snapshot: one block (weights) live before the step, then the step's
    history: the peak and the blocks live there, attributed by their Python stacks."""
    sys.path.insert(0, ".agents/skills/_common")
    import runs

    tool = runs.skill_script("debug-memory/debug_memory.py")
    frame = lambda f, line, name: {"filename": f, "line": line, "name": name}  # noqa: E731
    s1 = [frame("/x/pithtrain/ops/core.py", 20, "rms_norm"), frame("/x/pithtrain/models/qwen3_moe.py", 221, "stage1")]
    s3 = [frame("/x/pithtrain/ops/grouped_gemm.py", 31, "grouped_mm"), frame("/x/pithtrain/models/qwen3_moe.py", 230, "stage3")]
    opt = [frame("/x/torch/optim/adamw.py", 5, "_multi_tensor_adamw")]
    trace = [
        {"action": "alloc", "addr": 100, "size": 40, "frames": s1},
        {"action": "free_requested", "addr": 100, "size": 40, "frames": []},
        {"action": "free_completed", "addr": 100, "size": 40, "frames": []},
        {"action": "alloc", "addr": 200, "size": 30, "frames": s3},
        {"action": "alloc", "addr": 300, "size": 25, "frames": []},  # backward, on autograd's thread
        {"action": "free_completed", "addr": 200, "size": 30, "frames": []},
        {"action": "free_completed", "addr": 300, "size": 25, "frames": []},
        {"action": "alloc", "addr": 400, "size": 10, "frames": opt},  # still live at the snapshot
    ]
    segments = [{"device": 0, "address": 0, "blocks": [{"address": 0, "size": 64, "state": "active_allocated", "frames": []},
                                                          {"address": 400, "size": 10, "state": "active_allocated", "frames": opt},
                                                          {"address": 500, "size": 50, "state": "inactive", "frames": []}]}]
    peak, blocks = tool.cuda_peak({"segments": segments, "device_traces": [trace]})
    assert peak == 64 + 30 + 25  # weights + stage 3's output + the backward block, after stage 1's was freed
    stages = {tool.stage_of(frames): size for size, frames, _ in blocks}
    assert stages == {"before the step (weights, optimizer state, caches)": 64, "stage 3 forward": 30,
                      tool.NO_STACK: 25}
    assert tool.call_site(blocks[1][1], None) == "pithtrain/ops/grouped_gemm.py(31): grouped_mm"


@pytest.mark.fast
def test_debug_memory_places_a_compiled_stage_by_its_calling_line():
    """A compiled stage's allocations carry Inductor's frames, not the stage's: the calling line
    of protocol.run_layer (CUDA stacks give the current line of each frame) places them."""
    import inspect

    from pithtrain import protocol

    sys.path.insert(0, ".agents/skills/_common")
    import runs

    tool = runs.skill_script("debug-memory/debug_memory.py")
    source, first = inspect.getsourcelines(protocol.run_layer)
    path = inspect.getsourcefile(protocol.run_layer)
    line = first + next(i for i, text in enumerate(source) if "layer.stage5(" in text)
    frames = ["/tmp/torchinductor_x/ab.py(12): call", f"{path}({line}): run_layer", "/x/pithtrain/models/qwen3_moe.py(280): forward"]
    assert tool.stage_of(frames) == "stage 5 forward"
    assert tool.stage_of(frames[:1] + frames[2:]) == "embedding, final norm, head (forward)"
