"""ATE-Bench's harness with the scripted stand-in agent: runner, transcript metrics, time limit, graders
(accepting right and rejecting wrong work), acceptance tests on fresh copies, the report and the CLI."""

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ate_bench import cli, grading, report, tasks, transcripts  # noqa: E402
from ate_bench.gpu import GpuSampler, utilization_reader  # noqa: E402
from ate_bench.tasks import load_tasks  # noqa: E402

STANDIN = ROOT / "ate_bench" / "standin.py"
PY = sys.executable
TASKS = {t.id: t for t in load_tasks()}
MESH_ANSWER = ("The mesh is built by init_mesh in pithtrain/parallel/mesh.py with dimensions (pp, dp, cp, ep), outer "
               "to inner. Dense weights are sharded over the dense group dp x cp x ep, expert weights over dp x cp; "
               "the ep_group carries the all-to-all.")


def script(tmp_path, name, **body) -> Path:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(body))
    return path


def fake_framework(tmp_path, name="fw") -> Path:
    d = tmp_path / name
    (d / "src").mkdir(parents=True)
    (d / "src" / "core.py").write_text("x = 1\n")
    (d / "pyproject.toml").write_text(f'[project]\nname = "{name}"\n')  # what marks a checkout
    return d


def run(args, capsys) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def result(out: Path, fw: str, task: str, r: int = 0) -> dict:
    return json.loads((out / fw / task / f"r{r}" / "result.json").read_text())


# ---- tasks and keys ----

@pytest.mark.fast
def test_task_suite_shape():
    by_cat = {c: [t for t in TASKS.values() if t.category == c] for c in ("understand", "operate", "extend")}
    assert [len(v) for v in by_cat.values()] == [12, 4, 4]
    assert all("pithtrain" in t.keys for t in by_cat["understand"])
    assert all("pithtrain" in t.verifier for t in by_cat["operate"])
    assert all("pithtrain" in t.acceptance and "pithtrain" in t.interface for t in by_cat["extend"])


@pytest.mark.fast
def test_pithtrain_keys_name_real_code():
    """Every identifier-like phrasing in PithTrain's answer keys (a file, a dotted field, a snake_case
    or CamelCase name) names a file or occurs in the code or docs, so the keys cannot go stale silently."""
    files = [*(ROOT / "pithtrain").rglob("*.py"), *(ROOT / ".agents").rglob("*.py"), *(ROOT / "docs").glob("*.md")]
    text = grading.normalize("\n".join(p.read_text() for p in files))
    paths = [p.relative_to(ROOT).as_posix() for p in files]
    for task in TASKS.values():
        for alts in task.keys.get("pithtrain", []):
            names = [a for a in alts if " " not in a and re.search(r"[._]|[A-Z]", a)]
            found = [a for a in names if (any(p.endswith(a) for p in paths) if a.endswith(".py") else grading.normalize(a) in text)]
            assert found or not names, (task.id, alts)


@pytest.mark.fast
def test_fact_grader_accepts_right_and_rejects_wrong_answers():
    facts = TASKS["qa_device_mesh"].keys["pithtrain"]
    assert grading.grade_facts(MESH_ANSWER, facts)["grade"] == "pass"
    wrong = ("The mesh is a ParallelDims built in torchtitan/distributed/parallel_dims.py with dims dp_replicate, "
             "dp_shard, cp, tp, pp; FSDP shards over dp_shard.")
    g = grading.grade_facts(wrong, facts)
    assert g["grade"] == "fail" and g["score"] < 0.5 and "init_mesh" in g["note"]
    partial = MESH_ANSWER.replace("init_mesh", "a helper")
    assert grading.grade_facts(partial, facts)["grade"] == "fail"


# ---- transcripts ----

@pytest.mark.fast
def test_transcript_parsers():
    claude = [{"type": "system", "subtype": "init"},
              {"type": "assistant", "message": {"id": "m1", "content": [{"type": "text", "text": "looking"}],
                                                "usage": {"input_tokens": 10, "cache_read_input_tokens": 900, "output_tokens": 5}}},
              {"type": "assistant", "message": {"id": "m1", "content": [{"type": "tool_use"}],
                                                "usage": {"input_tokens": 10, "cache_read_input_tokens": 900, "output_tokens": 40}}},
              {"type": "user", "message": {"content": [{"type": "tool_result", "content": "ok"}]}},
              {"type": "assistant", "message": {"id": "m2", "content": [{"type": "text", "text": "final"}],
                                                "usage": {"input_tokens": 4, "cache_creation_input_tokens": 100,
                                                          "cache_read_input_tokens": 950, "output_tokens": 60}}},
              {"type": "result", "subtype": "success", "is_error": False, "num_turns": 3, "result": "THE ANSWER",
               "duration_ms": 2500, "usage": {"output_tokens": 101}}]
    text = "warning: not json\n" + "\n".join(json.dumps(e) for e in claude)
    t = transcripts.parse("claude-stream-json", text)
    assert (t.turns, t.output_tokens, t.context_tokens, t.answer, t.is_error, t.reported_seconds) == \
        (2, 101, [910, 1054], "THE ANSWER", False, 2.5)
    one = transcripts.parse("claude-json", json.dumps(claude[-1]))
    assert (one.turns, one.output_tokens, one.answer) == (3, 101, "THE ANSWER")
    assert transcripts.parse("claude-json", json.dumps(claude)).turns == 2  # --verbose: the events as an array
    codex = [{"type": "thread.started", "thread_id": "t"}, {"type": "turn.started"},
             {"type": "item.completed", "item": {"id": "0", "type": "reasoning", "text": "hmm"}},
             {"type": "item.completed", "item": {"id": "1", "type": "command_execution", "command": "ls"}},
             {"type": "item.completed", "item": {"id": "2", "type": "agent_message", "text": "done: 42"}},
             {"type": "turn.completed", "usage": {"input_tokens": 5000, "cached_input_tokens": 4000, "output_tokens": 300}}]
    c = transcripts.parse("codex-json", "\n".join(json.dumps(e) for e in codex))
    assert (c.turns, c.output_tokens, c.context_tokens, c.answer, c.is_error) == (2, 300, [5000], "done: 42", False)
    assert transcripts.parse("codex-json", json.dumps({"type": "turn.failed", "error": {"message": "x"}})).is_error
    g = transcripts.parse("generic-jsonl", '{"type": "turn", "context_tokens": 7, "output_tokens": 3}\n{"type": "answer", "text": "a"}')
    assert (g.turns, g.output_tokens, g.context_tokens, g.answer) == (1, 3, [7], "a")
    half = transcripts.parse("generic-jsonl", '{"type": "answer", "text": "cut \\ud83d"}')  # a lone surrogate: answer.txt takes it
    assert half.answer.encode() == b"cut ?"
    odd = [{"type": "turn", "context_tokens": "abc", "output_tokens": None}, {"type": "turn", "output_tokens": 1e400},
           {"type": "answer", "text": None}, {"type": "item.completed", "item": ["x"]},
           {"type": "item.completed", "item": {"type": "agent_message", "text": 7}}, {"type": "turn.completed", "usage": [1]},
           {"type": "turn.completed", "usage": {"input_tokens": "x", "output_tokens": float("nan")}},
           {"type": "assistant", "message": "str"}, {"type": "assistant", "message": {"id": ["x"], "usage": [1]}},
           {"type": "assistant", "message": {"id": "a", "content": [{"type": "text", "text": 5}], "usage": {"input_tokens": None}}},
           {"type": "result", "result": {"a": 1}, "duration_ms": "5", "num_turns": "x", "usage": [1]}]
    for fmt in transcripts.FORMATS:  # the agent's stdout, fields of other types: taken as absent, not a crash of the run
        t = transcripts.parse(fmt, "\n".join(json.dumps(e) for e in odd) + '\n{"a": ' + "[" * 100000)
        assert isinstance(t.answer, str) and all(isinstance(n, int) for n in [t.turns, t.output_tokens, *t.context_tokens]), t


@pytest.mark.fast
def test_gpu_sampler():
    with GpuSampler(interval=0.02, reader=lambda: {0: 50.0, 1: 100.0}) as s:
        start = time.monotonic()
        time.sleep(0.3)
    elapsed = time.monotonic() - start
    assert s.gpus == 2 and 1.5 * elapsed * 0.8 < s.busy_seconds < 1.5 * elapsed * 1.3
    if utilization_reader()[0] is None:  # this machine has no GPU: zero, not an error
        with GpuSampler(interval=0.02) as s:
            time.sleep(0.05)
        assert s.busy_seconds == 0 and s.source == "none"


# ---- the runner with the stand-in agent ----

def test_runner_metrics_grades_failures_and_report(tmp_path, capsys):
    """Two frameworks (a fork graded with PithTrain's keys), transcripts in two formats, a right and a
    wrong answer, an agent that exits 1, one that overruns the time limit, the judge; then the report."""
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    script(scripts, "pithtrain", format="claude-stream-json", turns=[[1000, 50], [3000, 80]], answer=MESH_ANSWER,
           actions=[{"write": "src/core.py", "text": "x = 2\n"}])
    script(scripts, "fork", format="codex-json", turns=[[2000, 100], [4000, 100], [6000, 100]], answer="it is in src/core.py")
    pit, fork = fake_framework(tmp_path, "pit"), fake_framework(tmp_path, "fork")
    out = tmp_path / "results"
    agent = f"{PY} {STANDIN} {scripts}/${{ATE_FRAMEWORK}}.json {{prompt_file}}"  # ${...}: the shell's
    code, stdout, _ = run(["run", "--framework", f"pithtrain={pit}", "--framework", f"fork={fork}", "--keys", "fork=pithtrain",
                           "--tasks", "qa_device_mesh", "--agent", agent, "--format", "claude-stream-json", "--out", out], capsys)
    assert code == 0, stdout
    good = result(out, "pithtrain", "qa_device_mesh")
    assert (good["status"], good["grade"], good["turns"], good["output_tokens"], good["context_tokens"]) == \
        ("ok", "pass", 2, 130, [1000, 3000])
    assert good["mean_context_tokens"] == 2000 and good["gpu_seconds"] >= 0
    assert "x = 2" in (out / "pithtrain" / "qa_device_mesh" / "r0" / "changes.diff").read_text()
    assert (pit / "src" / "core.py").read_text() == "x = 1\n"  # the checkout itself is never touched
    # the fork's agent printed codex events, parsed here as claude's: no turns; its answer is wrong anyway
    assert result(out, "fork", "qa_device_mesh")["grade"] == "fail"

    code, _, _ = run(["run", "--framework", f"fork={fork}", "--keys", "fork=pithtrain", "--tasks", "qa_device_mesh",
                      "--agent", agent, "--format", "codex-json", "--out", out, "--overwrite"], capsys)
    bad = result(out, "fork", "qa_device_mesh")
    assert (bad["grade"], bad["turns"], bad["output_tokens"], bad["context_tokens"]) == ("fail", 3, 300, [12000])
    assert "missing" in bad["note"]

    # this agent also edits the original checkout ($ATE_CHECKOUT), which every later session copies: flagged
    failing = script(tmp_path, "failing", answer="I could not", exit=1, actions=[{"run": 'echo y = 2 >> "$ATE_CHECKOUT/src/core.py"'}])
    _, _, err = run(["run", "--framework", f"pithtrain={pit}", "--tasks", "qa_logging", "--agent", f"{PY} {STANDIN} {failing} {{prompt}}",
                     "--format", "claude-stream-json", "--out", out], capsys)
    r = result(out, "pithtrain", "qa_logging")
    assert (r["status"], r["exit_code"], r["grade"]) == ("agent_error", 1, "fail")
    assert r["checkout_changed"] == ["src/core.py"] and "checkout_changed" not in good
    assert err.count("\n") == 1 and err.startswith(f"warning: pithtrain/qa_logging/r0: {pit} changed during the session (src/core.py)"), err

    pid_file = tmp_path / "child.pid"
    slow = script(tmp_path, "slow", actions=[{"run": f"echo $$ > {pid_file}; sleep 60"}], answer="late")
    start = time.monotonic()
    run(["run", "--framework", f"pithtrain={pit}", "--tasks", "qa_compile_boundaries", "--agent",
         f"{PY} {STANDIN} {slow} {{prompt}}", "--format", "claude-stream-json", "--time-limit", "3", "--out", out], capsys)
    r = result(out, "pithtrain", "qa_compile_boundaries")
    assert r["status"] == "timeout" and r["grade"] == "fail" and 3 <= r["session_seconds"] < 15
    assert time.monotonic() - start < 30
    child = int(pid_file.read_text())
    time.sleep(0.2)
    assert not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2]

    # no key for "other": ungraded, or graded by the judge
    other = fake_framework(tmp_path, "other")
    plain = script(tmp_path, "plain", answer="the mesh lives in src/core.py")
    base = ["run", "--framework", f"other={other}", "--tasks", "qa_device_mesh", "--agent", f"{PY} {STANDIN} {plain} {{prompt}}",
            "--format", "claude-stream-json", "--out", out]
    run(base, capsys)
    assert result(out, "other", "qa_device_mesh")["grade"] == "ungraded"
    base.append("--overwrite")
    run(base + ["--judge", "grep -q core.py {answer_file} && echo score=0.8"], capsys)
    assert (result(out, "other", "qa_device_mesh")["grade"], result(out, "other", "qa_device_mesh")["score"]) == ("pass", 0.8)
    run(base + ["--judge", "grep -q init_mesh {answer_file}"], capsys)
    assert result(out, "other", "qa_device_mesh")["grade"] == "fail"

    code, stdout, _ = run(["report", out], capsys)
    assert code == 0 and (out / "report.png").stat().st_size > 1000
    assert "| qa_compile_boundaries | understand | fail (timeout) | - | - |" in stdout
    # means over its ok and timeout sessions: the agent_error one (1 turn, 100 tokens) is left out
    assert "| understand | pithtrain | 1 | 65 | 1,000 |" in stdout and "| 3 (1 agent_error) |" in stdout
    # ratios over the tasks both ran (qa_device_mesh): 3/2 turns, 300/130 tokens, 12000/2000 context
    ratio = re.search(r"\| understand \| fork \| ([0-9.]+) \| ([0-9.]+) \| ([0-9.]+) \|", stdout.split("## Ratios")[1])
    assert ratio and ratio.groups() == ("1.50", "2.31", "6.00")
    assert "- pithtrain / qa_logging / r0: the checkout changed during the session (src/core.py);" in stdout
    code, stdout, _ = run(["report", out, "--baseline", "fork"], capsys)
    assert code == 0 and "| understand | pithtrain | 0.67 |" in stdout


# ---- extend: acceptance tests on fresh copies ----

def test_acceptance_tests_reject_unmodified_and_broken_checkouts_and_accept_a_feature(tmp_path, capsys):
    tests = [t.acceptance["pithtrain"] for t in TASKS.values() if t.category == "extend"]
    plain = tmp_path / "plain"
    shutil.copytree(ROOT, plain, ignore=grading.COPY_IGNORE)
    for test in tests:
        shutil.copy(test, plain / test.name)
    # one process for the four files (each import of torch costs seconds); every file must fail
    p = subprocess.run([PY, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", "--continue-on-collection-errors",
                        *[t.name for t in tests]], cwd=plain, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(plain)})
    for test in tests:
        assert re.search(rf"^(FAILED|ERROR) {test.name}", p.stdout, re.M), (test.name, p.stdout[-3000:])

    # the stand-in implements MoBA (a fixed edit), once cleanly and once breaking the checkout as well
    out = tmp_path / "results"
    moba = script(tmp_path, "moba", answer="added pithtrain/ops/moba.py",
                  actions=[{"copy": str(ROOT / "tests" / "ate_fixtures" / "moba.py"), "to": "pithtrain/ops/moba.py"}])
    breaks = script(tmp_path, "breaks", answer="added it",
                    actions=[{"copy": str(ROOT / "tests" / "ate_fixtures" / "moba.py"), "to": "pithtrain/ops/moba.py"},
                             {"write": "pithtrain/ops/core.py", "text": "raise ImportError('broken by the agent')\n"}])
    for name, agent in (("pithtrain", moba), ("broken", breaks)):
        code, _, _ = run(["run", "--framework", f"{name}={ROOT}", "--keys", f"{name}=pithtrain", "--tasks", "feat_moba",
                          "--agent", f"{PY} {STANDIN} {agent} {{prompt}}", "--format", "claude-stream-json", "--out", out], capsys)
        assert code == 0
    assert result(out, "pithtrain", "feat_moba")["grade"] == "pass"
    assert result(out, "broken", "feat_moba")["grade"] == "fail"
    assert "Interface (a test will check it)" in (out / "pithtrain" / "feat_moba" / "r0" / "prompt.txt").read_text()
    assert not (ROOT / "pithtrain" / "ops" / "moba.py").exists()


# ---- operate: verifiers over the artifacts ----

STANDIN_TRAIN = """
import sys
import numpy as np
from pithtrain.train.data import write_dataset
rng = np.random.default_rng(3)
write_dataset("ate_out/data", [list(rng.integers(1, 64, 60)) for _ in range(60)], vocab_size=64, eos_id=0)
"""
TINY_RUN = """
from pithtrain.config import DataConfig, OptimConfig, RunConfig, TrainConfig
from pithtrain.models.qwen3_moe import Qwen3MoeConfig
CONFIG = RunConfig(
    model=Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
                         mlp_only_layers=[], max_position_embeddings=64, rope_theta=10000.0),
    data=DataConfig(path="ate_out/data", seq_len=16), optim=OptimConfig(lr=3e-3, warmup_steps=1),
    train=TrainConfig(steps=3, global_batch_size=4, micro_batch_size=2, tensorboard=False, profile_step=3))
"""


def test_operate_loss_and_profile_verifiers_with_a_real_tiny_run(tmp_path, capsys):
    command = f"OMP_NUM_THREADS=1 PYTHONPATH=. {PY} -m pithtrain train ate_out/tiny.py --out \"$ATE_RUN_DIR\"\n"
    read_loss = f"{PY} -c \"import json; print([json.loads(l) for l in open('ate_out/loss/metrics.jsonl')][2]['loss'])\""
    agent = script(tmp_path, "train", answer="The loss at step 3 is LOSS_AT_STEP_3={loss}.", actions=[
        {"write": "ate_out/make_data.py", "text": STANDIN_TRAIN}, {"write": "ate_out/tiny.py", "text": TINY_RUN},
        {"write": "ate_out/loss_command.sh", "text": command},
        {"run": f"PYTHONPATH=. {PY} ate_out/make_data.py && ATE_RUN_DIR=ate_out/loss bash ate_out/loss_command.sh"},
        {"run": read_loss, "capture": "loss"}])
    out = tmp_path / "results"
    code, _, _ = run(["run", "--framework", f"pithtrain={ROOT}", "--tasks", "op_loss_at_step", "--agent",
                      f"{PY} {STANDIN} {agent} {{prompt}}", "--format", "claude-stream-json", "--out", out], capsys)
    r = result(out, "pithtrain", "op_loss_at_step")
    assert code == 0 and r["grade"] == "pass", r["note"]
    run_dir = out / "pithtrain" / "op_loss_at_step" / "r0"
    work, verifier = run_dir / "work", TASKS["op_loss_at_step"].verifier["pithtrain"]
    claimed = float(re.search(r"=([0-9.]*[0-9])", r["answer"]).group(1))
    wrong = tmp_path / "wrong.txt"
    wrong.write_text(f"LOSS_AT_STEP_3={claimed * 1.01:.6f}")
    g = grading.run_verifier(verifier, work, wrong, ROOT, timeout=300)
    assert g["grade"] == "fail" and "logged" in g["note"]

    # the same run profiled step 3: its trace serves the profile verifier
    (work / "ate_out" / "profile_run").symlink_to(work / "ate_out" / "loss")
    trace = json.loads((work / "ate_out" / "loss" / "profile" / "rank0.json").read_text())
    stage3_ms = sum(e["dur"] for e in trace["traceEvents"] if e.get("name") == "pithtrain::stage3") / 1000
    answer = tmp_path / "profile.txt"
    for value, want in ((stage3_ms, "pass"), (stage3_ms * 3, "fail")):
        answer.write_text(f"EXPERT_MS={value:.3f}")
        g = grading.run_verifier(TASKS["op_profile_stage"].verifier["pithtrain"], work, answer, ROOT, timeout=120)
        assert g["grade"] == want, g


def write_run(run: Path, losses, parallel: dict, ranks: int):
    (run / "checkpoints" / "step_00000003").mkdir(parents=True)
    for r in range(ranks):
        (run / "checkpoints" / "step_00000003" / f"__{r}_0.distcp").write_bytes(b"")
    (run / "run_config.json").write_text(json.dumps({"parallel": parallel}))
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": i + 1, "loss": v}) + "\n" for i, v in enumerate(losses)))


def test_two_meshes_verifier(tmp_path):
    verifier, work, answer = TASKS["op_two_meshes"].verifier["pithtrain"], tmp_path / "work", tmp_path / "answer.txt"
    a, b = [4.1, 4.0, 3.9], [4.1, 4.0 * (1 + 2e-6), 3.9]
    write_run(work / "ate_out" / "mesh_a", a, {"ep": 1}, 1)
    write_run(work / "ate_out" / "mesh_b", b, {"ep": 2}, 2)

    def verdict(text):
        answer.write_text(text)
        return grading.run_verifier(verifier, work, answer, ROOT, timeout=60)

    assert verdict("SAME=yes MAX_REL_DIFF=2e-6")["grade"] == "pass"
    assert verdict("**SAME=yes**, **MAX_REL_DIFF**: `2e-6`.")["grade"] == "pass"  # Markdown was read as part of the value
    assert verdict('SAME: "yes"\nNOT_SAME=no\nMAX_REL_DIFF=**2.0e-06**')["grade"] == "pass"
    assert verdict("SAME=yes MAX_REL_DIFF=0.01")["grade"] == "fail"  # a number not read from the runs
    assert verdict("SAME=yes MAX_REL_DIFF=nan")["grade"] == "fail"  # passed: nan > tolerance is False
    assert verdict("SAME=no MAX_REL_DIFF=2e-6")["grade"] == "fail"
    spec = importlib.util.spec_from_file_location("ate_verifiers_common", verifier.parent / "common.py")  # in-process
    spec.loader.exec_module(common := importlib.util.module_from_spec(spec))
    answer_number, answer_value = common.answer_number, common.answer_value
    assert answer_number("LOSS=1,234.5 and X=2", "LOSS") == 1234.5 and answer_number("**LOSS**: `12,345`, ok", "LOSS") == 12345
    assert answer_value("SAME=yes,MAX_REL_DIFF=2e-6", "SAME") == "yes"
    for unreadable in ("LOSS=3,14", "LOSS=1,23,4"):  # were read as 3 and 1
        with pytest.raises(SystemExit):
            answer_number(unreadable, "LOSS")
    write_run(work / "ate_out" / "mesh_c", b, {"ep": 1}, 1)
    shutil.rmtree(work / "ate_out" / "mesh_b")
    (work / "ate_out" / "mesh_c").rename(work / "ate_out" / "mesh_b")
    assert "same mesh" in verdict("SAME=yes MAX_REL_DIFF=2e-6")["note"]
    shutil.rmtree(work / "ate_out" / "mesh_b")
    write_run(work / "ate_out" / "mesh_b", [4.1, 4.2, 3.9], {"ep": 2}, 2)
    assert verdict("SAME=yes MAX_REL_DIFF=0.05")["grade"] == "fail"  # the losses differ


def test_memory_verifier(tmp_path):
    verifier, answer = TASKS["op_memory_fit"].verifier["pithtrain"], tmp_path / "answer.txt"
    answer.write_text("FITS=no")  # no PEAK_GIB: rejected before the estimate runs
    assert "PEAK_GIB" in grading.run_verifier(verifier, tmp_path, answer, ROOT, timeout=60)["note"]
    answers = {"pass": "It needs about PEAK_GIB=150 per GPU, so FITS=no.", "fail": "PEAK_GIB=70 FITS=yes"}
    for name, text in answers.items():
        (tmp_path / f"{name}.txt").write_text(text)
    with ThreadPoolExecutor(2) as pool:
        grades = dict(zip(answers, pool.map(lambda n: grading.run_verifier(verifier, tmp_path, tmp_path / f"{n}.txt", ROOT, 300), answers)))
    assert grades["pass"]["grade"] == "pass" and grades["fail"]["grade"] == "fail", grades


# ---- the CLI's bad input ----

@pytest.mark.fast
@pytest.mark.parametrize("line,code,score", [
    ("score=0.8", 0, 0.8), ("score = 5e-1", 1, 0.5), ("score=1.2.3", 0, 1.0), ("score=.", 1, 0.0),  # were ValueErrors
    ("score=7", 0, 1.0), ("score=nan", 1, 0.0), ("score=-0.5", 0, 1.0), ("looks fine", 0, 1.0),
])
def test_judge_score_line(tmp_path, line, code, score):
    (tmp_path / "answer.txt").write_text("a")
    g = grading.run_judge(f"echo {line!r}; exit {code}", TASKS["qa_logging"], "x", tmp_path, tmp_path / "answer.txt", 10)
    assert g["grade"] == ("pass" if code == 0 else "fail") and g["score"] == score, g


def test_acceptance_replaces_a_grade_link_the_agent_made(tmp_path):
    """An agent's ../grade symlink ended the run ("Cannot call rmtree on a symbolic link"); what it points to is kept."""
    work, mine, test = tmp_path / "r0" / "work", tmp_path / "mine", tmp_path / "test_ok.py"
    (work / "src").mkdir(parents=True)
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    test.write_text("def test_ok():\n    pass\n")
    (tmp_path / "r0" / "grade").symlink_to(mine)
    (work / "ate_acceptance").symlink_to(mine)  # the test was copied through it, and the log through its link
    (tmp_path / "r0" / "acceptance.log").symlink_to(mine / "log")
    g = grading.run_acceptance(test, work, tmp_path / "r0" / "grade", 120)
    assert g["grade"] == "pass" and (mine / "notes.txt").read_text() == "keep" and list(mine.iterdir()) == [mine / "notes.txt"], g


@pytest.mark.fast
def test_a_grader_past_its_timeout_ends_with_what_it_started(tmp_path):
    """Only the judge/verifier itself was killed: a training rerun it started went on beside the next agent runs."""
    (tmp_path / "answer.txt").write_text("a")
    g = grading.run_judge(f"sleep 30 & echo $! > {tmp_path}/pid; wait", TASKS["qa_logging"], "x", tmp_path, tmp_path / "answer.txt", 1)
    assert g == {"grade": "fail", "score": 0.0, "note": "judge timed out"}
    pid = int((tmp_path / "pid").read_text())
    time.sleep(0.2)
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]


@pytest.mark.fast
def test_graders_take_output_that_is_not_utf8(tmp_path):
    """A judge or verifier printing bytes that are not UTF-8 (an agent's file, a binary) ended the run with a UnicodeDecodeError."""
    (tmp_path / "answer.txt").write_text("a")
    g = grading.run_judge("printf 'bad \\xff\\n' >&2; printf 'ok \\xfe\\n'", TASKS["qa_logging"], "x", tmp_path, tmp_path / "answer.txt", 10)
    assert g["grade"] == "pass" and g["note"] == "judge: ok \ufffd", g
    (tmp_path / "v.py").write_text("import sys; sys.stdout.buffer.write(b'FAIL: \\xff'); sys.exit(1)")
    g = grading.run_verifier(tmp_path / "v.py", tmp_path, tmp_path / "answer.txt", tmp_path, 30)
    assert g["grade"] == "fail" and g["note"] == "FAIL: \ufffd", g


@pytest.mark.fast
@pytest.mark.parametrize("args,flag", [
    (["--framework", "pithtrain"], "--framework"),
    (["--framework", "pithtrain=/no/such/dir"], "--framework"),
    (["--framework", "pithtrain=.", "--keys", "ghost=pithtrain"], "--keys"),
    (["--framework", "pithtrain=.", "--agent", "claude -p"], "--agent"),
    (["--framework", "pithtrain=.", "--tasks", "qa_nothing"], "--tasks"),
    (["--framework", "pithtrain=.", "--out", "AGENTS.md"], "--out"),
    (["--framework", "pithtrain=.", "--out", "pithtrain"], "--out"),  # someone's directory: never written into
    (["--framework", "a=.", "--framework", "a=ate_bench"], "--framework a=...: given twice"),
    (["--framework", "a=.", "--framework", "b=.", "--keys", "b=pithtrain", "--keys", "b=a"], "--keys b=...: given twice"),
    (["--framework", "pithtrain=ate_bench"], "does not look like a source checkout"),
    (["--framework", "..=."], "--framework ..=.: the name must be"),
    (["--framework", "fork=.", "--keys", "fork=pithtrian"], "--keys fork=pithtrian: no task has keys for pithtrian"),
    (["--framework", "pithtrain=.", "--time-limit", "nan"], "--time-limit nan: must be"),  # waited for ever
    (["--framework", "pithtrain=.", "--grade-timeout", "-1"], "--grade-timeout -1: must be"),  # every grade failed
    (["--framework", "pithtrain=.", "--grade-timeout", "1e7"], "--grade-timeout 1e+07: must be"),  # OverflowError at grading
    (["--framework", "pithtrain=.", "--repeats", "0"], "--repeats 0: must be"),  # was OUT/../<task>/r0: outside --out
    (["--framework", "a/b=."], "--framework a/b=.: the name must be"),
    (["--framework", "pithtrain=.", "--repeats", "two"], "run: argument --repeats: invalid int value: 'two' (see "),  # was usage + error
    (["--framework", "pithtrain=.", "--format", "json"], "argument --format: invalid choice: 'json'"),
    (["--framework", "pithtrain=.", "--agnet", "x"], "unrecognized arguments: --agnet x (see python -m ate_bench --help)"),
    (["--framework", "report.md=."], "--framework report.md=.: the name is one of --out's own files"),  # failed after the run
    (["--framework", "Ate_Bench.json=."], "e.g. --framework Ate_Bench_json=."),  # one file on a case-insensitive disk  # no .git, pyproject.toml, setup.py
    (["--framework", "pithtrain=.", "--agent", "x {prompt_files}"], "--agent: unknown placeholder {prompt_files}; the known"),
    (["--framework", "pithtrain=.", "--agent", "x {prompt} ${HOME} {HOME} {0}"], "unknown placeholder {0}, {HOME};"),
    (["--framework", "pithtrain=.", "--agent", "x ${prompt}"], "--agent: the command must contain {prompt}"),
    (["--framework", "pithtrain=.", "--judge", "j {answer}"], "--judge: unknown placeholder {answer}"),
    (["--framework", "pithtrain=.", "--agent", "claude -p '{prompt}'"], "--agent: {prompt} is in quotes; write it bare"),
    (["--framework", "pithtrain=.", "--agent", 'claude -p "{prompt}"'], "--agent: {prompt} is in quotes; write it bare"),
    (["--framework", "pithtrain=.", "--judge", "j '{answer_file}' {task}"], "--judge: {answer_file} is in quotes"),
])
def test_cli_bad_input_is_one_line(tmp_path, capsys, args, flag):
    base = {"--agent": "x {prompt}", "--format": "generic-jsonl", "--out": str(tmp_path / "o")}
    for i in range(0, len(args), 2):
        base.pop(args[i], None)
    extra = [s for kv in base.items() for s in kv]
    code, _, err = run(["run", *args, *extra], capsys)
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: ") and flag in err, err
    assert not (tmp_path / "o").exists()  # refused before anything is made
    code, _, err = run(["report", str(tmp_path)], capsys)
    assert code == 2 and "result.json" in err and err.count("\n") == 1


def test_readme_run_with_out_inside_the_checkout_blank_tasks_and_a_bad_result(tmp_path, capsys, monkeypatch):
    """As README writes it: --framework pithtrain=$PWD --out ate_runs/NAME from the checkout. The results
    directory is not copied into the agent's copy (it was, into itself, until the path was too long);
    `--tasks ' '` names no task; `report` on a damaged result.json is one line, not a traceback."""
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    script(scripts, "pithtrain", format="claude-stream-json", turns=[[1000, 50]], answer=MESH_ANSWER)
    checkout = fake_framework(tmp_path, "checkout")
    monkeypatch.chdir(checkout)
    agent = f"{PY} {STANDIN} {scripts}/$ATE_FRAMEWORK.json {{prompt_file}}"
    base = ["run", "--framework", f"pithtrain={checkout}", "--agent", agent, "--format", "claude-stream-json"]
    for args in (["--out", "ate_runs/first"], ["--out", "ate_runs/second"]):  # the second finds the first's results there
        code, stdout, err = run([*base, "--tasks", "qa_device_mesh", *args], capsys)
        assert code == 0, stdout + err
    work = checkout / "ate_runs" / "second" / "pithtrain" / "qa_device_mesh" / "r0" / "work"
    assert (work / "src" / "core.py").is_file() and not (work / "ate_runs").exists()
    assert result(checkout / "ate_runs" / "second", "pithtrain", "qa_device_mesh")["grade"] == "pass"

    code, _, err = run([*base, "--tasks", " ", "--out", "ate_runs/third"], capsys)
    assert code == 2 and err.count("\n") == 1 and "--tasks" in err and "names no task" in err, err
    assert not (checkout / "ate_runs" / "third").exists()

    results = checkout / "ate_runs" / "first"
    path = results / "pithtrain" / "qa_device_mesh" / "r0" / "result.json"
    good = path.read_text()
    edits = [{"turns": "many"}, {"grade": None}, {"framework": ["x"]}, {"turns": float("nan")}, {"status": 1}, {"repeat": "0"}]
    huge = good.replace('"turns": 1,', '"turns": 1' + "0" * 400 + ",", 1)  # an int past float's range
    assert huge != good
    for bad in ("{not json", json.dumps({"task": "qa_device_mesh"}), huge, *(json.dumps(dict(json.loads(good), **e)) for e in edits)):
        path.write_text(bad)
        code, _, err = run(["report", results], capsys)
        assert code == 2 and err.count("\n") == 1 and str(path) in err and "Traceback" not in err, err
    path.write_text(good)
    shutil.copytree(path.parent, path.parent.with_name("r0.old"), ignore=shutil.ignore_patterns("work"))  # a copy kept by hand
    assert len(report.load_results(results)) == 1
    for bad in ("{bad", "[1]", '{"frameworks": [1]}'):  # a hand-edited ate_bench.json: one line, for report and run
        (results / "ate_bench.json").write_text(bad)
        for args in (["report", results], [*base, "--tasks", "qa_logging", "--out", results]):
            code, _, err = run(args, capsys)
            assert code == 2 and err.count("\n") == 1 and "ate_bench.json: not an ATE-Bench manifest" in err, err
    assert not (results / "pithtrain" / "qa_logging").exists()


GOOD_TASK = 'category = "understand"\nprompt = "Where?"\n[keys.pithtrain]\nfacts = ["mesh.py", ["init_mesh", "Mesh"]]\n'


@pytest.mark.fast
def test_task_files_are_checked_field_by_field(tmp_path, capsys, monkeypatch):
    """A bad field of a task file is one line naming the file and the field, at `list` and at `run` before
    anything is made, not a fact per character, a grade that always fails or a traceback after the session."""
    monkeypatch.setattr(tasks, "TASKS_DIR", tmp_path / "tasks")
    task = tmp_path / "tasks" / "qa_x.toml"
    task.parent.mkdir()
    task.write_text(GOOD_TASK)
    assert run(["list"], capsys)[0] == 0 and tasks.load_tasks()[0].keys == {"pithtrain": [["mesh.py"], ["init_mesh", "Mesh"]]}
    qa = 'category = "understand"\nprompt = "q"\n'
    bad = {qa + '[keys.pithtrain]\nfacts = "parallel/mesh.py"\n': "keys.pithtrain.facts must",
           qa + '[keys.pithtrain]\nfacts = [[1, 2]]\n': "keys.pithtrain.facts[0] must",
           qa + '[keys.pithtrain]\nfacts = []\n': "keys.pithtrain.facts must",
           qa + '[keys.pithtrain]\nfacts = [["mesh.py"], ["()"]]\n': "keys.pithtrain.facts[1] must",  # would match anything
           qa + '[keys.pithtrain]\nfact = [["mesh.py"]]\n': "keys.pithtrain must",
           qa + "keys = 3\n": "keys must",
           qa + "[interface]\npithtrain = 5\n": "interface.pithtrain must",
           qa + '[verifier]\npithtrain = "v.py"\n': "[verifier] grades operate tasks only",
           'category = "operate"\nprompt = "q"\n[verifier]\npithtrain = 1\n': "verifier.pithtrain must",
           'category = "learn"\nprompt = "q"\n': "category must",
           'category = "understand"\nprompt = " "\n': "prompt must",
           qa + 'promt = "q"\n': "unknown field promt",
           'category = "understand"\nprompt = "q\xe9"\n'.encode("latin-1"): "not UTF-8"}
    out = tmp_path / "out"
    for text, want in bad.items():
        task.write_bytes(text if isinstance(text, bytes) else text.encode())
        for args in (["list"], ["run", "--framework", f"pithtrain={ROOT}", "--agent", "x {prompt}", "--format", "generic-jsonl", "--out", out]):
            code, _, err = run(args, capsys)
            assert code == 2 and err.count("\n") == 1 and f"error: {task}: {want}" in err, (text, err)
    assert not out.exists()


@pytest.mark.fast
def test_command_templates_fill_known_names_and_leave_the_shell_its_braces():
    t = "a {prompt} ${HOME} $PATH {} {a,b} awk '{print $1}' {{prompt}}"
    assert grading.placeholders(t) == {"prompt"}
    assert grading.fill(t, prompt="'P'") == "a 'P' ${HOME} $PATH {} {a,b} awk '{print $1}' {prompt}"


def test_special_files_are_left_out_and_earlier_sessions_kept(tmp_path, capsys):
    fw = fake_framework(tmp_path)
    os.mkfifo(fw / "src" / "pipe")
    agent = script(tmp_path, "a", answer=MESH_ANSWER)
    out, session = tmp_path / "results", tmp_path / "results" / "pithtrain" / "qa_device_mesh" / "r0"
    args = ["run", "--framework", f"pithtrain={fw}", "--tasks", "qa_device_mesh", "--agent", f"{PY} {STANDIN} {agent} {{prompt}}",
            "--format", "claude-stream-json", "--out", out]
    code, _, err = run(args, capsys)
    assert code == 0 and f"note: --framework pithtrain={fw}: special files not copied: src/pipe" in err, err
    assert (session / "work" / "src" / "core.py").is_file() and not (session / "work" / "src" / "pipe").exists()
    assert result(out, "pithtrain", "qa_device_mesh")["not_copied"] == ["src/pipe"]
    (session / "mine.txt").write_text("notes")
    code, _, err = run(args + ["--repeats", "2"], capsys)
    assert code == 2 and err.count("\n") == 1 and "pithtrain/qa_device_mesh/r0); pass --resume" in err, err
    assert (session / "mine.txt").exists() and not (session.parent / "r1").exists()
    shutil.copytree(session, session.parent / "r1")  # r1 as Ctrl-C leaves it: no result.json
    (session.parent / "r1" / "result.json").unlink()
    code, stdout, _ = run(args + ["--repeats", "3", "--resume"], capsys)  # more repeats: r0 is kept, r1 redone, r2 run
    assert code == 0 and (session / "mine.txt").exists() and " r0 " not in stdout and " r1 " in stdout and " r2 " in stdout, stdout
    assert result(out, "pithtrain", "qa_device_mesh", 1)["grade"] == "pass"
    assert run(args + ["--resume", "--overwrite"], capsys)[0] == 2
    code, _, _ = run(args + ["--overwrite"], capsys)
    assert code == 0 and not (session / "mine.txt").exists() and result(out, "pithtrain", "qa_device_mesh")["grade"] == "pass"


@pytest.mark.fast
def test_a_checkout_that_cannot_be_copied_is_one_line(tmp_path, capsys, monkeypatch):
    fw, out = fake_framework(tmp_path), tmp_path / "results"

    def fails(src, dst, **kw):  # what copytree raises for unreadable files (root reads them all)
        Path(dst).mkdir(parents=True)
        raise shutil.Error([(f"{src}/secret", f"{dst}/secret", "[Errno 13] Permission denied"), (f"{src}/b", f"{dst}/b", "x")])
    monkeypatch.setattr(grading.shutil, "copytree", fails)
    code, _, err = run(["run", "--framework", f"pithtrain={fw}", "--tasks", "qa_device_mesh", "--agent", "x {prompt}",
                        "--format", "generic-jsonl", "--out", out], capsys)
    assert code == 2 and err.count("\n") == 1, err
    fw = fw.resolve()
    assert err.startswith(f"error: --framework pithtrain={fw}: cannot copy {fw}/secret ([Errno 13] Permission denied) and 1 more;")
    assert not (out / "pithtrain" / "qa_device_mesh" / "r0").exists()  # the half-made session is not left behind


def test_a_missing_agent_command_stops_the_run(tmp_path, capsys):
    fw, out = fake_framework(tmp_path), tmp_path / "results"
    for agent, want in (("no-such-agent-7 -p {prompt}", "no-such-agent-7: command not found"),
                        ("PATH=/nowhere:$PATH ./no-agent.sh {prompt_file}", "./no-agent.sh: No such file or directory")):
        code, stdout, err = run(["run", "--framework", f"pithtrain={fw}", "--tasks", "qa_device_mesh,qa_logging", "--repeats", "2",
                                 "--agent", agent, "--format", "claude-stream-json", "--out", out], capsys)
        assert code == 2 and err.count("\n") == 1 and err.startswith(f"error: --agent: {want}; install it"), err
        assert stdout == "" and not list(out.glob("*/*/r*"))  # stopped at the first agent run, which is not kept


def test_an_agent_that_deletes_its_files_is_graded_and_the_run_goes_on(tmp_path, capsys):
    """An agent removing its transcript or its working directory ended the whole run with FileNotFoundError; one
    committing its work left an empty changes.diff; the runner wrote result.json, answer.txt, changes.diff and the
    report through symlinks the agent put in their place, outside --out."""
    fw, out, outside = fake_framework(tmp_path), tmp_path / "results", tmp_path / "outside"
    outside.mkdir()
    links = "".join(f"ln -s {outside}/$ATE_TASK.{n} ../{n}; " for n in ("result.json", "answer.txt", "changes.diff"))
    agent = (links + f"ln -sf {outside}/report.md ../../../../report.md; ln -sf {outside}/m.json ../../../../ate_bench.json; "
             "sleep 30 & echo $! > ../../left.pid; echo y > src/new.py; git add -A; git -c user.name=a -c user.email=a@b "
             "commit -qm mine; rm -f ../transcript.jsonl ../agent.stderr; cd /; "
             "[ $ATE_TASK = qa_logging ] || rm -rf {workdir}; : {prompt}")
    code, stdout, err = run(["run", "--framework", f"pithtrain={fw}", "--tasks", "op_memory_fit,qa_logging", "--agent", agent,
                             "--format", "generic-jsonl", "--out", out], capsys)
    assert code == 0, err
    assert result(out, "pithtrain", "op_memory_fit")["note"] == "the agent removed its working directory"
    assert result(out, "pithtrain", "qa_logging")["grade"] == "fail"
    assert "+++ b/src/new.py" in (out / "pithtrain" / "qa_logging" / "r0" / "changes.diff").read_text()  # committed by the agent
    time.sleep(0.2)
    for pid in (int(p.read_text()) for p in out.glob("pithtrain/*/left.pid")):  # what the agent left running ends with it
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
    assert len(list(out.glob("pithtrain/*/left.pid"))) == 2
    assert list(outside.iterdir()) == []
    assert "warning: " in err and "is a symlink the runner did not make" in err, err
    # --resume with every session done writes only ate_bench.json and the report, both links of the agent's
    manifest = '{"frameworks": ["pithtrain"]}'
    (outside / "m.json").write_text(manifest)
    assert run(["run", "--framework", f"pithtrain={fw}", "--tasks", "op_memory_fit,qa_logging", "--agent", agent,
                "--format", "generic-jsonl", "--out", out, "--resume"], capsys)[0] == 0
    written = [out / "report.md", out / "ate_bench.json", out / "pithtrain" / "qa_logging" / "r0" / "changes.diff",
               *(out / "pithtrain" / t / "r0" / n for t in ("op_memory_fit", "qa_logging") for n in ("result.json", "answer.txt"))]
    assert list(outside.iterdir()) == [outside / "m.json"] and (outside / "m.json").read_text() == manifest
    assert all(p.is_file() and not p.is_symlink() for p in written)


@pytest.mark.fast
def test_ctrl_c_is_one_line(tmp_path, capsys, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("ate_bench.runner.run_one", interrupted)
    code, _, err = run(["run", "--framework", f"pithtrain={fake_framework(tmp_path)}", "--tasks", "qa_logging", "--agent",
                        "x {prompt}", "--format", "generic-jsonl", "--out", tmp_path / "o"], capsys)
    assert code == 130 and err.count("\n") == 1 and err.startswith("error: interrupted; the sessions finished so far"), err


@pytest.mark.fast
def test_report_leaves_agent_errors_out_of_the_cost_means():
    def session(fw, status, turns, grade):
        return {"task": "qa_x", "category": "understand", "framework": fw, "repeat": 0, "status": status, "grade": grade,
                "note": "", "turns": turns, "output_tokens": 10 * turns, "mean_context_tokens": 100 * turns,
                "session_seconds": 1.0, "gpu_seconds": 0.0}
    results = [session("a", "ok", 4, "pass"), session("a", "agent_error", 0, "fail"), session("a", "timeout", 8, "fail"),
               session("b", "agent_error", 0, "fail")]
    md = report.markdown(results)
    assert "| understand | a | 6 | 60 | 600 | 1 | 0 | 33% of 3 | 3 (1 agent_error) |" in md
    assert "| understand | b | - | - | - | - | - | 0% of 1 | 1 (1 agent_error) |" in md
    assert "| understand | b | - | - | - | - | - |" in md.split("## Ratios")[1]
