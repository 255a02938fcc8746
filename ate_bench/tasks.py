"""Tasks as data: one TOML file per task in ate_bench/tasks/ (the runner lists the folder).

  category = "understand" | "operate" | "extend"
  prompt = "..."                        # what the agent is asked, framework-neutral
  [keys.<framework>]                    # understand: the required facts of that framework's answer
  facts = [["parallel/mesh.py"], ["init_mesh", "Mesh"]]   # each fact: any one of its phrasings
  [verifier]                            # operate: a script per framework that checks the artifacts
  <framework> = "verifiers/op_loss.py"
  [acceptance]                          # extend: a pytest file per framework, run on a fresh copy
  <framework> = "acceptance/test_moba.py"
  [interface]                           # extend: the names the acceptance test uses, appended to the
  <framework> = "..."                   # prompt for that framework
A framework with no key, verifier or acceptance test for a task is graded by `--judge`, or ungraded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser as a package
    import tomli as tomllib

TASKS_DIR = Path(__file__).parent / "tasks"
CATEGORIES = ("understand", "operate", "extend")


@dataclass
class Task:
    id: str
    category: str
    prompt: str
    path: Path
    keys: dict[str, list[list[str]]] = field(default_factory=dict)
    verifier: dict[str, Path] = field(default_factory=dict)
    acceptance: dict[str, Path] = field(default_factory=dict)
    interface: dict[str, str] = field(default_factory=dict)

    def prompt_for(self, keyset: str) -> str:
        extra = self.interface.get(keyset)
        return self.prompt + (f"\n\nInterface (a test will check it): {extra.strip()}" if extra else "")


class TaskError(ValueError):
    pass


def load_task(path: Path) -> Task:
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise TaskError(f"{path}: {e}; fix the TOML") from e
    category, prompt = data.get("category"), data.get("prompt")
    if category not in CATEGORIES or not isinstance(prompt, str) or not prompt.strip():
        raise TaskError(f"{path}: needs category (one of {', '.join(CATEGORIES)}) and a non-empty prompt")
    keys = {fw: [[f] if isinstance(f, str) else list(f) for f in key.get("facts", [])]
            for fw, key in data.get("keys", {}).items()}
    files = {}
    for table in ("verifier", "acceptance"):
        files[table] = {fw: path.parent / rel for fw, rel in data.get(table, {}).items()}
        for fw, file in files[table].items():
            if not file.is_file():
                raise TaskError(f"{path}: [{table}] {fw} = {file} does not exist; fix the path (relative to the task file)")
    return Task(path.stem, category, prompt.strip(), path, keys, files["verifier"], files["acceptance"],
                dict(data.get("interface", {})))


def load_tasks(select: list[str] | None = None, folder: Path = TASKS_DIR) -> list[Task]:
    """All tasks of `folder`, or those named in `select` (task ids, or categories)."""
    tasks = [load_task(p) for p in sorted(folder.glob("*.toml"))]
    if not select:
        return tasks
    known = {t.id for t in tasks} | set(CATEGORIES)
    unknown = [s for s in select if s not in known]
    if unknown:
        raise TaskError(f"--tasks: unknown task or category {', '.join(unknown)}; see `python -m ate_bench list`")
    return [t for t in tasks if t.id in select or t.category in select]
