"""The docs against the code: README's "Using it" commands run as written (tiny corpus, smaller model),
the examples name commands and make targets that exist, and `make clean` removes only what make made."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
# appended to the README's `pithtrain train`: a smaller model and batch, a few steps (later flags win)
TINY = ("--steps 3 --set model.num_hidden_layers=2 --set model.hidden_size=64 --set data.seq_len=32 "
        "--set train.global_batch_size=4 --set train.micro_batch_size=2 --set train.tensorboard=false")


def readme_block() -> str:
    """The ```bash block after the `<!-- readme-test -->` marker."""
    text = (ROOT / "README.md").read_text()
    return re.search(r"<!-- readme-test -->\s*```bash\n(.*?)\n```", text, re.S).group(1)


def test_readme_commands_run_as_written(tmp_path):
    words = "the model reads text and learns which word comes next in a sentence of plain words".split()
    for folder, n in (("my_texts", 12), ("my_held_out", 2)):
        (tmp_path / folder).mkdir()
        for i in range(n):
            (tmp_path / folder / f"{i}.txt").write_text(" ".join(words[(i + j) % len(words)] for j in range(300)))
    (tmp_path / "examples").symlink_to(ROOT / "examples")  # the README runs in a clone of the repository
    wrapper = f"""set -euo pipefail
pithtrain() {{
  case "$1" in
    train) {sys.executable} -m pithtrain "$@" {TINY} ;;
    *) {sys.executable} -m pithtrain "$@" ;;
  esac
}}
python() {{ {sys.executable} "$@"; }}
"""
    result = subprocess.run(["bash", "-c", wrapper + readme_block()], cwd=tmp_path, capture_output=True, text=True,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "step 3/3" in result.stdout and "eval loss" in result.stdout
    assert (tmp_path / "runs/mine_hf/tokenizer.json").is_file() and "no tokenizer" not in result.stderr
    assert any(line.startswith("The ") for line in result.stdout.splitlines())  # the generated sample
    assert (tmp_path / "runs/mine/metrics.png").is_file() and not list(tmp_path.glob("*.png"))  # nothing in the checkout's root


@pytest.mark.fast
def test_examples_name_commands_that_exist():
    makefile = (ROOT / "Makefile").read_text()
    commands = {"train", "tokenize", "convert", "eval", "plot"}
    for path in [*ROOT.glob("examples/*.py"), ROOT / "README.md", ROOT / "AGENTS.md"]:
        text = path.read_text()
        for target in re.findall(r"`make (\w[\w-]*)", text):
            assert re.search(rf"^{target}:", makefile, re.M), (path.name, f"make {target}")
        for command in re.findall(r"\bpithtrain (\w+)", text):
            assert command in commands or command == "pithtrain", (path.name, f"pithtrain {command}")


@pytest.mark.fast
def test_make_clean_removes_only_what_make_made(tmp_path):
    made = [".venv/bin/python", "runs/quickstart/metrics.jsonl", "data/stdlib/eval.npy", "data/stdlib/meta.json"]
    mine = ["runs/mine/metrics.jsonl", "data/mine/meta.json", "data/stdlib_mine/meta.json"]
    for name in made + mine:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    subprocess.run(["make", "-s", "-f", str(ROOT / "Makefile"), "clean"], cwd=tmp_path, check=True, capture_output=True)
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file()) == sorted(mine)
    assert not (tmp_path / ".venv").exists() and not (tmp_path / "data/stdlib").exists()


@pytest.mark.fast
def test_quickstart_replaces_only_its_own_data_and_runs(tmp_path, dataset_dir, monkeypatch, capsys):
    """`make train` / `make data` (examples/quickstart.py) refuse a --data that is no finished quickstart dataset
    and an --out that is not a quickstart run, before any work, and leave both as they were."""
    import importlib.util
    import shutil

    spec = importlib.util.spec_from_file_location("quickstart", ROOT / "examples/quickstart.py")
    quickstart = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(quickstart)
    monkeypatch.setattr(quickstart, "train", lambda *a, **k: pytest.fail("trained"))
    mine, ready = tmp_path / "mine", tmp_path / "ready"
    (mine / "data").mkdir(parents=True)
    (mine / "data" / "meta.json").write_text("{}")  # a user's dataset without eval.npy
    (mine / "notes.txt").write_text("keep")
    shutil.copytree(dataset_dir, ready)
    (ready / "eval.npy").touch()
    for args, said in [(["--data", mine / "data", "--data-only"], f"--data {mine / 'data'} exists and is no finished"),
                       (["--data", ready, "--out", mine], f"--out {mine} exists and is not a quickstart run")]:
        monkeypatch.setattr(sys, "argv", ["quickstart.py", *map(str, args)])
        with pytest.raises(SystemExit) as stop:
            quickstart.main()
        assert str(stop.value).startswith(f"error: {said}"), stop.value
    assert sorted(p.name for p in mine.rglob("*")) == ["data", "meta.json", "notes.txt"]
