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
`load_task` checks every field; a bad one is a TaskError (one line: the file, the field, what it must be).
"""

from __future__ import annotations

import re
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


class UsageError(ValueError):
    """Bad input: the CLI prints it as one line and exits with code 2."""


class TaskError(UsageError):
    pass


TABLES = {"keys": "understand", "verifier": "operate", "acceptance": "extend", "interface": None}  # table: its category
FACTS = 'a non-empty list of facts, each a list of accepted phrasings: [["parallel/mesh.py"], ["init_mesh", "Mesh"]]'


def load_task(path: Path) -> Task:
    """A task file, every field checked: a bad one is a TaskError naming the file and the field."""
    def bad(field: str, want: str, value) -> TaskError:
        return TaskError(f"{path}: {field} must be {want}, not {repr(value)[:60]}")

    def text(v) -> bool:
        return isinstance(v, str) and bool(v.strip())

    try:
        data = tomllib.loads(path.read_bytes().decode())
    except UnicodeDecodeError as e:
        raise TaskError(f"{path}: not UTF-8 (byte {e.start}); save it as UTF-8") from None
    except tomllib.TOMLDecodeError as e:
        raise TaskError(f"{path}: {e}; fix the TOML") from e
    unknown = sorted(set(data) - {"category", "prompt", *TABLES})
    if unknown:
        raise TaskError(f"{path}: unknown field {', '.join(unknown)}; the fields are category, prompt, {', '.join(TABLES)}")
    category, prompt = data.get("category"), data.get("prompt")
    if category not in CATEGORIES:
        raise bad("category", f"one of {', '.join(CATEGORIES)}", category)
    if not text(prompt):
        raise bad("prompt", "a non-empty string", prompt)
    for table, only in TABLES.items():
        if not isinstance(data.get(table, {}), dict):
            raise bad(table, f"a table of frameworks, [{table}.<framework>] or [{table}] <framework> = ...", data[table])
        if only and data.get(table) and category != only:
            raise TaskError(f"{path}: [{table}] grades {only} tasks only, this one is {category}; remove it or fix category")
    keys = {}
    for fw, key in data.get("keys", {}).items():
        if not isinstance(key, dict) or set(key) != {"facts"}:
            raise bad(f"keys.{fw}", "a table holding facts alone", key)
        if not isinstance(key["facts"], list) or not key["facts"]:
            raise bad(f"keys.{fw}.facts", FACTS, key["facts"])
        keys[fw] = [[f] if isinstance(f, str) else f for f in key["facts"]]
        for i, alts in enumerate(keys[fw]):  # a phrasing without letters or digits would match any answer
            if not isinstance(alts, list) or not alts or not all(isinstance(a, str) and re.search("[a-z0-9]", a.lower()) for a in alts):
                raise bad(f"keys.{fw}.facts[{i}]", "a list of phrasings, each a string with a letter or digit", key["facts"][i])
    files = {}
    for table in ("verifier", "acceptance"):
        files[table] = {}
        for fw, rel in data.get(table, {}).items():
            if not text(rel) or not (path.parent / rel).is_file():
                raise bad(f"{table}.{fw}", "the path of an existing file, relative to the task file", rel)
            files[table][fw] = path.parent / rel
    for fw, value in data.get("interface", {}).items():
        if not text(value):
            raise bad(f"interface.{fw}", "a non-empty string", value)
    return Task(path.stem, category, prompt.strip(), path, keys, files["verifier"], files["acceptance"],
                dict(data.get("interface", {})))


def load_tasks(select: list[str] | None = None, folder: Path | None = None) -> list[Task]:
    """All tasks of `folder` (default TASKS_DIR), or those named in `select` (task ids, or categories)."""
    tasks = [load_task(p) for p in sorted((folder or TASKS_DIR).glob("*.toml"))]
    if not select:
        return tasks
    known = {t.id for t in tasks} | set(CATEGORIES)
    unknown = [s for s in select if s not in known]
    if unknown:
        raise TaskError(f"--tasks: unknown task or category {', '.join(unknown)}; see `python -m ate_bench list`")
    return [t for t in tasks if t.id in select or t.category in select]
