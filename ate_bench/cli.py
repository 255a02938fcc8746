"""python -m ate_bench run | report | list  (see ate_bench/README.md)."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from ate_bench import grading, transcripts
from ate_bench.tasks import UsageError, load_tasks

OUT_FILES = ("ate_bench.json", "report.md", "report.png")  # --out's own files, beside OUT/<framework>/
CHECKOUT_MARKERS = (".git", "pyproject.toml", "setup.py", "setup.cfg")  # what a framework checkout has at its top


def _pairs(values: list[str], flag: str, example: str) -> dict[str, str]:
    out = {}
    for v in values:
        name, sep, rest = v.partition("=")
        if not sep or not name or not rest:
            raise UsageError(f"{flag} {v!r}: write NAME=VALUE, e.g. {flag} {example}")
        if name in out:
            raise UsageError(f"{flag} {name}=...: given twice ({out[name]}, {rest}); give each name once")
        out[name] = rest
    return out


def _check_template(template: str, flag: str, known: tuple[str, ...]) -> None:
    unknown = sorted(grading.placeholders(template) - set(known))
    if unknown:
        raise UsageError(f"{flag}: unknown placeholder {', '.join('{%s}' % u for u in unknown)}; the known ones are "
                         f"{', '.join('{%s}' % k for k in known)} (write shell variables as $VAR or ${{VAR}})")
    # a value is filled in shell-quoted: in quotes of the user's, '{prompt}' came out unquoted (its lines run as
    # commands, "metrics,: command not found") and "{prompt}" ran its backticks and $(...)
    quoted = sorted({m.group(2) for m in re.finditer(r"""(['"])\{(\w+)\}\1""", template) if m.group(2) in known})
    if quoted:
        raise UsageError(f"{flag}: {', '.join('{%s}' % q for q in quoted)} is in quotes; write it bare, e.g. claude -p "
                         "{prompt} (it is filled in shell-quoted)")


def cmd_run(args) -> int:
    from ate_bench.runner import AGENT_FIELDS, run_one

    frameworks = _pairs(args.framework, "--framework", "pithtrain=/path/to/PithTrain")
    if not frameworks:
        raise UsageError("--framework: give at least one, e.g. --framework pithtrain=/path/to/PithTrain")
    for name, path in frameworks.items():
        # the name is a directory of --out (OUT/<name>/<task>/r<k>, removed by --overwrite): a path in it would land elsewhere
        if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.+-]*", name):
            raise UsageError(f"--framework {name}={path}: the name must be letters, digits, _ . + - (it names a directory "
                             "of --out), e.g. --framework pithtrain=/path/to/PithTrain")
        if name.casefold() in OUT_FILES:  # its directory and the file took each other's place, failing after the sessions ran
            raise UsageError(f"--framework {name}={path}: the name is one of --out's own files ({', '.join(OUT_FILES)}); "
                             f"choose another, e.g. --framework {name.replace('.', '_')}={path}")
        if not Path(path).is_dir():
            raise UsageError(f"--framework {name}={path}: no such directory; give the framework's checkout")
        if not any((Path(path) / m).exists() for m in CHECKOUT_MARKERS):
            raise UsageError(f"--framework {name}={path}: does not look like a source checkout (none of "
                             f"{', '.join(CHECKOUT_MARKERS)} at its top); give the repository's root directory")
    keysets = _pairs(args.keys, "--keys", "myfork=pithtrain")
    for name in keysets:
        if name not in frameworks:
            raise UsageError(f"--keys {name}=...: {name} is not a --framework name; use one of {', '.join(frameworks)}")
    _check_template(args.agent, "--agent", AGENT_FIELDS)
    if not grading.placeholders(args.agent) & {"prompt", "prompt_file"}:
        raise UsageError("--agent: the command must contain {prompt} or {prompt_file}, e.g. "
                         "--agent \"claude -p {prompt} --output-format stream-json --verbose\"")
    if args.judge:
        _check_template(args.judge, "--judge", grading.JUDGE_FIELDS)
    if args.repeats < 1:
        raise UsageError(f"--repeats {args.repeats}: must be >= 1")
    for flag, value in (("--time-limit", args.time_limit), ("--grade-timeout", args.grade_timeout)):
        # nan waited forever, a negative grade timeout failed every grade, past ~2e6 s select() overflowed mid-run
        if not 0 < value <= 1e6:
            raise UsageError(f"{flag} {value:g}: must be a number of seconds in (0, 1e6], e.g. {flag} 1800")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out}: is a file; give a directory")
    if out.exists() and any(out.iterdir()) and not (out / "ate_bench.json").exists():
        raise UsageError(f"--out {out}: exists and is not an ATE-Bench results directory; choose a new directory")
    select = [s for part in args.tasks for s in part.replace(",", " ").split()] if args.tasks is not None else None
    if select == []:
        raise UsageError(f"--tasks {' '.join(map(repr, args.tasks))}: names no task; give task ids or categories "
                         "(see `python -m ate_bench list`), or leave --tasks out for all")
    tasks = load_tasks(select)
    keysets_known = {fw for t in load_tasks() for fw in (*t.keys, *t.verifier, *t.acceptance)}
    for name, keyset in keysets.items():
        if keyset not in keysets_known:  # a typo graded every session "ungraded", silently
            raise UsageError(f"--keys {name}={keyset}: no task has keys for {keyset}; use one of {', '.join(sorted(keysets_known))}")
    earlier = [f"{name}/{t.id}/r{k}" for t in tasks for name in frameworks for k in range(args.repeats)
               if (out / name / t.id / f"r{k}").exists()]
    if args.resume and args.overwrite:
        raise UsageError("--resume keeps the finished sessions, --overwrite replaces them: pass one of them")
    # --resume: after Ctrl-C, or for more --repeats; without it the only way on was --overwrite, losing the finished ones
    finished = {s for s in earlier if (out / s / "result.json").is_file()} if args.resume else set()
    if earlier and not args.overwrite and not args.resume:
        raise UsageError(f"--out {out}: already holds {len(earlier)} of these sessions ({', '.join(earlier[:3])}"
                         f"{', ...' if len(earlier) > 3 else ''}); pass --resume to keep the finished ones and run the rest, "
                         "--overwrite to replace them, or choose another --out")
    from ate_bench.report import changed_line, manifest_frameworks

    known = manifest_frameworks(out) if out.is_dir() else []
    out.mkdir(parents=True, exist_ok=True)
    manifest = out / "ate_bench.json"  # marks the directory; the frameworks in the order first run (the report's)
    grading.write_file(manifest, json.dumps({"kind": "ate-bench results", "frameworks": known + [f for f in frameworks if f not in known]}) + "\n")
    noted = set()
    for task in tasks:
        for name, path in frameworks.items():
            for k in range(args.repeats):
                if f"{name}/{task.id}/r{k}" in finished:
                    continue
                r = run_one(task, name, Path(path).resolve(), keysets.get(name, name), k, out.resolve(), args.agent,
                            args.format, args.time_limit, args.grade_timeout, args.judge)
                if r.get("not_copied") and name not in noted:
                    noted.add(name)
                    print(f"note: --framework {name}={path}: special files not copied: {', '.join(r['not_copied'])}", file=sys.stderr)
                print(f"{task.id:24s} {name:12s} r{k} {r['status']:11s} {r['grade']:8s} turns={r['turns']} "
                      f"out={r['output_tokens']} {r['session_seconds']:.1f}s  {r['note']}", flush=True)
                if r.get("checkout_changed"):
                    print(f"warning: {name}/{task.id}/r{k}: {changed_line(r['checkout_changed'], path)}", file=sys.stderr, flush=True)
    from ate_bench.report import write_report

    md, png = write_report(out)
    print(f"report: {md}" + (f", {png}" if png else " (install matplotlib for the plot)"))
    return 0


def cmd_report(args) -> int:
    from ate_bench.report import write_report

    if not Path(args.dir).is_dir():
        raise UsageError(f"report {args.dir}: no such directory; pass the --out directory of `ate_bench run`")
    try:
        md, png = write_report(Path(args.dir), args.baseline)
    except (FileNotFoundError, ValueError) as e:  # no sessions, an unknown baseline, a result.json that does not read
        raise UsageError(str(e)) from e
    print(md.read_text())
    print(f"report: {md}" + (f", {png}" if png else " (install matplotlib for the plot)"))
    return 0


def cmd_list(args) -> int:
    for t in load_tasks():
        graded = sorted(set(t.keys) | set(t.verifier) | set(t.acceptance))
        print(f"{t.id:26s} {t.category:10s} graded for: {', '.join(graded) or '(judge only)'}")
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors (a bad type or choice, a missing flag) are UsageErrors: one line like every other
    (argparse printed its usage block above it), as pithtrain's CLI does. Subparsers take this class too."""

    def error(self, message):
        raise UsageError(f"{self.prog}: {message} (see {self.prog} --help)")


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m ate_bench", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run an agent on tasks x frameworks x repeats")
    r.add_argument("--framework", action="append", default=[], metavar="NAME=PATH", help="a framework checkout (repeatable)")
    r.add_argument("--keys", action="append", default=[], metavar="NAME=KEYSET",
                   help="grade NAME with another framework's keys/verifiers/tests, e.g. a fork: myfork=pithtrain")
    r.add_argument("--tasks", action="append", metavar="IDS", help="task ids or categories, comma separated (default: all)")
    r.add_argument("--agent", required=True, help="agent command template: {prompt}, {prompt_file}, {workdir} are filled in "
                   "(shell-quoted); $VAR and ${VAR} are the shell's")
    r.add_argument("--format", required=True, choices=transcripts.FORMATS, help="the agent's transcript format (its stdout)")
    r.add_argument("--repeats", type=int, default=1)
    r.add_argument("--time-limit", type=float, default=1800.0, help="seconds per session; the agent is killed after it")
    r.add_argument("--grade-timeout", type=float, default=900.0, help="seconds for a verifier, acceptance test or judge")
    r.add_argument("--judge", help="grading command for tasks without a key for the framework: "
                   "{prompt_file} {answer_file} {workdir} {task} {framework}; exit 0 passes")
    r.add_argument("--out", required=True, help="results directory (new, or an earlier ATE-Bench one)")
    r.add_argument("--overwrite", action="store_true", help="replace sessions --out already holds for these tasks, "
                   "frameworks and repeats (refused without it)")
    r.add_argument("--resume", action="store_true", help="keep the sessions --out already finished (those with a "
                   "result.json) and run the rest: an interrupted run, or more --repeats (an unfinished session is replaced)")
    r.set_defaults(func=cmd_run)
    rep = sub.add_parser("report", help="report.md and report.png of a results directory")
    rep.add_argument("dir")
    rep.add_argument("--baseline", help="framework the ratios are taken against (default: the first)")
    rep.set_defaults(func=cmd_report)
    sub.add_parser("list", help="the tasks and the frameworks each is graded for").set_defaults(func=cmd_list)
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        args = parser().parse_args(argv)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except (UsageError, OSError) as e:  # OSError: a directory or file that could not be written or read
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C was a traceback; the agent's process group is already ended (runner.run_agent)
        where = (f"; the sessions finished so far are in {args.out} (`python -m ate_bench report {args.out}`), "
                 "the same command with --resume goes on") if args.command == "run" else ""
        print(f"error: interrupted{where}", file=sys.stderr)
        return 130
