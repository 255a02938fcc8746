"""Typed run configuration: dataclasses, `--set` overrides and validation with clear errors.

A run is a Python file that defines `CONFIG = RunConfig(...)`. The model part is the model family's own dataclass
(its fields are the Hugging Face `config.json` schema), so an HF config works as is. Everything is validated before
any expensive work starts."""

from __future__ import annotations

import ast
import dataclasses
import difflib
import errno
import importlib.util
import inspect
import io
import json
import math
import os
import runpy
import sys
import textwrap
import tokenize
import traceback
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class UserError(ValueError):
    """A failure the user caused and can fix (a bad file, value, path or device): its message names
    the field or file and the fix. The CLI prints it as one line and exits with code 2."""


class ConfigError(UserError):
    """A config problem; the message names the field and the fix."""


BLEND_MIN_SHARE = 1e-4  # a blend's smallest weight share (data.BLEND_PERIOD gives each dataset whole positions)
_MAX_TIMEOUT_S = 365 * 86400.0  # a collective timeout beyond any run (a larger one overflows timedelta)
# Kept on AdamW under optim.name=muon (besides any tensor that is not one matrix, or a stack of expert matrices):
# embeddings, LM head, norms, biases, router gates (Qwen3/DeepSeek `mlp.gate`, GPT-OSS `mlp.router`), attention sinks.
MUON_EXCLUDE = ("embed_tokens.*", "lm_head.*", "*norm*", "*bias", "*.mlp.gate.weight", "*.shared_expert_gate.*", "*.router.*",
                "*.sinks")
# What to do when a write fails for a reason of the disk, not of the program.
_DISK_FIXES = {errno.ENOSPC: "free space on that disk", errno.EDQUOT: "free space within your disk quota",
               errno.EFBIG: "raise the file-size limit (ulimit -f) or write to another filesystem",
               **dict.fromkeys((errno.EACCES, errno.EPERM), "make it writable (or choose another location)"),
               errno.EROFS: "the filesystem is read-only: choose a writable location"}


def os_cause(error: BaseException) -> OSError | None:
    """The OSError behind `error`: itself, one in its cause/context chain, or the errno a library's
    RuntimeError names in its text (PyTorch's writers: "file write failed", "No space left on device")."""
    seen = error
    while seen is not None:
        if isinstance(seen, OSError):
            return seen
        seen = seen.__cause__ or (None if seen.__suppress_context__ else seen.__context__)
    text = str(error)
    for code in _DISK_FIXES:
        if os.strerror(code) in text or errno.errorcode[code] in text:
            return OSError(code, os.strerror(code))
    if "write failed" in text:  # PyTorch's zip writer hides the errno: a full disk is the likely cause
        return OSError(errno.EIO, f"write failed ({text.splitlines()[0][:200]})")
    return None


def disk_error(error: BaseException, path, removed=None, then: str = "run again", within=None) -> UserError | None:
    """A UserError for a failed write of `path` (`removed`: the partial file or directory the caller
    deleted): the OS reason, its errno and the fix. None when `error` is not a disk problem, or (given
    `within`, where the writes go) is about a file outside it: an input that did not read."""
    cause = None if isinstance(error, UserError) else os_cause(error)  # a UserError says what is wrong already
    if cause is None:
        return None
    if within and isinstance(cause.filename, str):  # a file in `within`, or a folder made on the way to it
        named, where = os.path.abspath(cause.filename), os.path.abspath(within)
        if not (named.startswith(where) or where.startswith(named + os.sep)):
            return None
    code = errno.errorcode.get(cause.errno, "")
    gone = ("its folder takes no new files (a special filesystem such as /proc?): choose another location"
            if isinstance(cause.filename, str) and os.path.isdir(os.path.dirname(os.path.abspath(cause.filename)))
            else "its folder was moved or deleted during the run: put it back or choose another location")
    fix = _DISK_FIXES.get(cause.errno) or (gone if cause.errno == errno.ENOENT else "check the free space and permissions of that disk")
    return UserError(f"writing {path} failed: {cause.strerror or cause}{f' ({code})' if code else ''}"
                     f"{f'; removed {removed}' if removed else ''}; {fix}, then {then}")


@dataclass
class DataConfig:
    # a dataset directory written by `pithtrain tokenize`, or a blend of several sharing one tokenizer:
    # {"data/a": 0.7, "data/b": 0.3} or Megatron's [0.7, "data/a", 0.3, "data/b"] (the rule: train/data.py BlendLoader)
    path: str | dict | list = ""
    seq_len: int = 256  # tokens per sample
    pack_documents: bool = False  # attention restricted to each document (cu_seqlens-style)
    seed: int = 1234  # sample order
    # validation (train.eval_every): the first eval_samples windows of eval_path (a dataset; 0: as many whole
    # global batches as it holds), or, with eval_path empty, the LAST eval_samples windows of `path`, which
    # training then never reads (0: none held out, the training order of older runs)
    eval_path: str = ""  # held-out dataset for train.eval_every; '' holds out the last eval_samples of path
    eval_samples: int = 0  # held-out samples for train.eval_every (0 with eval_path: all its whole global batches)
    eval_on_train: bool = False  # allow data.eval_path to be data.path itself (its eval loss is then a training loss)


@dataclass
class OptimConfig:
    name: str = "adamw"  # adamw | muon (Muon for 2-D weight matrices, AdamW for the rest; docs/architecture.md)
    lr: float = 3e-4  # peak learning rate (after warmup)
    min_lr_ratio: float = 0.1  # final lr = lr * min_lr_ratio
    schedule: str = "cosine"  # cosine | wsd | constant
    warmup_steps: int = 0  # linear warmup from 0 to lr
    decay_fraction: float = 0.2  # wsd: share of the steps spent in the final linear decay
    weight_decay: float = 0.1  # not applied to norms, biases and embeddings
    beta1: float = 0.9  # AdamW first-moment decay
    beta2: float = 0.95  # AdamW second-moment decay
    eps: float = 1e-8  # AdamW denominator epsilon
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping
    momentum: float = 0.95  # Muon Nesterov momentum
    # Muon: parameters whose name matches one of these fnmatch patterns stay on AdamW (setting the list replaces it)
    muon_exclude: list[str] = field(default_factory=lambda: list(MUON_EXCLUDE))
    allow_switch: bool = False  # resume a checkpoint written with another optim.name or Muon optim.muon_exclude (its optimizer state is dropped)


@dataclass
class TrainConfig:
    steps: int = 100  # optimizer steps of the whole run (the schedule spans them)
    global_batch_size: int = 8  # samples per optimizer step, over all data-parallel ranks
    micro_batch_size: int = 8  # samples per forward/backward on one rank
    seed: int = 0  # parameter initialisation
    init_from: str = ""  # HF directory or PithTrain checkpoint to start from (continued pretraining)
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto (bf16 compute on GPU, fp32 on CPU) | fp32 | bf16
    lb_coef: float = 1e-3  # MoE load-balance loss coefficient; 0 disables
    mtp_coef: float = 0.3  # multi-token prediction loss weight (model.num_nextn_predict_layers > 0; DeepSeek-V3's 0.3, later 0.1); 0: logged, its layers get zero gradients (weight decay still shrinks them)
    lb_type: str = "micro"  # micro | global (over the data ranks: changes with the mesh) | seq: lb statistics scope
    log_every: int = 1  # print a metrics line every N steps (and always the first 3); metrics.jsonl gets every step
    eval_every: int = 0  # held-out loss (data.eval_path / data.eval_samples) every N steps and at the end; 0: off
    checkpoint_every: int = 0  # 0: only at the end; -1: never (benchmarks)
    keep_checkpoints: int = 2  # the newest N checkpoints are kept, older ones deleted
    tensorboard: bool = True  # scalars into OUT/tensorboard (needs tensorboard: the `tensorboard` extra, in make setup)
    wandb_project: str = ""  # Weights & Biases project to log to (needs `pip install wandb`); '': off
    compile: bool = False  # torch.compile(fullgraph=True) stages 1 and 5 of every layer
    # activations recomputed in backward instead of kept (less memory, more compute): off |
    # selective (the experts' SwiGLU output, from the kept gate/up product) | full (stages 1 and 3
    # of every layer: only their inputs are kept); docs/architecture.md "Activation recomputation"
    recompute: str = "off"
    profile_step: int = 0  # profile this step (1-based) into OUT/profile/rank<r>.json; 0: off
    # FP8 GEMMs (experts, attention and MLP projections; not the router, embeddings or head):
    # off | rowwise (e4m3, one scale per row of each operand; ops/fp8.py) | rowwise_bf16_wgrad
    # (weight gradients in bf16: the faster, 1.06x bf16 at 8 Qwen3 layers). Needs FP8 tensor
    # cores (compute capability 8.9+); on the CPU only with fp8_emulate (plain PyTorch, slow).
    fp8: str = "off"
    fp8_emulate: bool = False  # FP8 numerics in plain PyTorch on the CPU (tests; slow)
    # the LM head's forward and input-gradient GEMMs in FP8 too (its weight gradient stays bf16);
    # needs train.fp8. Off by default: docs/performance.md "FP8" has its loss check and speed
    fp8_head: bool = False


@dataclass
class ParallelConfig:
    pp: int = 1  # pipeline-parallel size (DualPipeV)
    cp: int = 1  # context-parallel size (ring attention over sequence chunks)
    ep: int = 1  # expert-parallel size (experts split over ep ranks; dp = world / (pp*cp*ep))
    hsdp: bool = False  # replicate over dp, shard within cp x ep (dense) and cp (experts)
    timeout_s: float = 600.0  # collective timeout: a hung rank fails the job after this long
    # pp = 1 with ep > 1 and >= 2 micro-batches per rank: run DualPipeV on one rank to hide each
    # micro-batch's all-to-alls behind another's compute; it holds two micro-batches' activations.
    # false: one micro-batch at a time (less memory, exposed all-to-alls)
    overlap_ep: bool = True


@dataclass
class RunConfig:
    model: Any  # a model family config dataclass, e.g. qwen3_moe.Qwen3MoeConfig
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)


SECTIONS = (("data", DataConfig), ("optim", OptimConfig), ("train", TrainConfig), ("parallel", ParallelConfig))


def field_help(cls: type) -> dict[str, str]:
    """{field: its meaning}, read from the comments of the class's source (so they are written once):
    the comment on the field's line, else the comment lines right above it."""
    source = textwrap.dedent(inspect.getsource(cls))
    lines = source.splitlines()
    comments = {t.start[0]: t.string.lstrip("#").strip()
                for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type == tokenize.COMMENT}
    out = {}
    for node in ast.parse(source).body[0].body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            row, above = node.lineno, []
            while row - 1 - len(above) in comments and lines[row - 2 - len(above)].lstrip().startswith("#"):
                above.insert(0, comments[row - 1 - len(above)])
            out[node.target.id] = comments.get(row) or " ".join(above)
    return out


def _type_name(hint: Any) -> str:
    return hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def config_help(families: tuple[type, ...]) -> str:
    """Every run config field with its type, default and meaning (`pithtrain train --help`); the model
    families' fields (`families`: their config classes, models.families()) by name and default."""
    out = ["config fields (set in the run file or with --set SECTION.FIELD=VALUE):"]
    for section, cls in SECTIONS:
        hints, meaning = typing.get_type_hints(cls), field_help(cls)
        for f in dataclasses.fields(cls):
            head = f"  {section}.{f.name}: {_type_name(hints[f.name])} = {_default(f)!r}"
            if len(head) > 46:  # a long default (optim.muon_exclude): the meaning goes below it
                out, head = out + [head], ""
            out.append(textwrap.fill(meaning[f.name], 110, initial_indent=f"{head:<46} ", subsequent_indent=" " * 47))
    out.append("\nmodel.*: the fields of the family's HF config.json (pithtrain/models/<family>.py), with defaults:")
    for cls in families:
        fields = ", ".join(f"{f.name}={_default(f)!r}" for f in dataclasses.fields(cls))
        out.append(textwrap.fill(f"{cls.model_type} ({cls.__name__}): {fields}", 110, initial_indent="  ",
                                 subsequent_indent="    "))
    return "\n".join(out)


def run_dict(config: RunConfig) -> dict:
    """The run config as plain JSON values, the model with its model_type (OUT/run_config.json)."""
    out = dataclasses.asdict(config)
    out["model"] = dict(model_type=config.model.model_type, **out["model"])
    return out


def describe(config: RunConfig) -> str:
    """The effective config, one `section.field = value` per line (values as JSON)."""
    return "\n".join(f"  {section}.{k} = {json.dumps(v)}" for section, fields in run_dict(config).items()
                     for k, v in fields.items())


def load_run_config(path: str | Path) -> RunConfig:
    if not Path(path).is_file():
        why = ("does not exist" if not str(path) or not Path(path).exists() else "is a directory" if Path(path).is_dir()
               else "is not a regular file")
        raise ConfigError(f"config file {str(path)!r} {why}; pass a run file such as examples/qwen3_tiny.py")
    path = Path(path)
    check(path.suffix.lower() not in (".toml", ".yaml", ".yml", ".json"), f"config file {path}: a run file is Python defining "
          f"CONFIG = RunConfig(...), not {path.suffix[1:].upper()}; start from examples/qwen3_tiny.py (fields: pithtrain train --help)")
    try:
        namespace = runpy.run_path(str(path))
    except (Exception, SystemExit) as e:  # a syntax, import or runtime error (or an exit) of the run file: point at its line
        lines = [f.lineno for f in traceback.extract_tb(e.__traceback__) if f.filename == str(path)]
        where = f"{path}:{lines[-1]}" if lines else str(path)
        beside = isinstance(e, ModuleNotFoundError) and (path.parent / f"{e.name}.py").is_file()  # run_path adds no folder
        fix = (f"{e.name}.py beside it is not on sys.path: put `import os, sys; sys.path.insert(0, os.path.dirname(__file__))` "
               "before that import") if beside else "fix the run file"
        raise ConfigError(f"{where}: {type(e).__name__}: {e}; {fix}") from e
    config = namespace.get("CONFIG")
    check(isinstance(config, RunConfig), f"{path} must define CONFIG = RunConfig(...) (" + (f"found {type(config).__name__})"
          if "CONFIG" in namespace else "it defines none: a script? run it with python; a run file: examples/qwen3_tiny.py)"))
    return config


def _parse_value(text: str, annotation: Any, name: str) -> Any:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        if text.lower() in ("none", "null") and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) > 1 and text[:1] in ("[", "{"):  # data.path: a blend as JSON (or a directory so named)
            value = _parse_value(text, Any, name)
            if value is text and not os.path.exists(text):
                raise ConfigError(f"--set {name}={text}: neither valid JSON (a blend: {{\"path\": weight, ...}} or "
                                  "[weight, \"path\", ...]) nor an existing directory; check the quotes and brackets")
            return value
        return _parse_value(text, inner[0], name)
    if annotation is bool:
        check(text.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"),
              f"--set {name}={text}: expected a bool (true/false)")
        return text.lower() in ("1", "true", "yes", "on")
    if annotation in (int, float, str):
        try:
            return annotation(text)
        except ValueError:
            raise ConfigError(f"--set {name}={text}: expected {annotation.__name__}") from None
    if origin in (list, tuple) or annotation is Any:
        example = '["a","b"] (double-quoted strings)' if str in args else "[0,3]"
        try:
            value = json.loads(text, object_pairs_hook=lambda pairs: _unique(pairs, name))
        except json.JSONDecodeError:
            if annotation is Any:
                return text
            raise ConfigError(f"--set {name}={text}: expected a JSON list such as {example}") from None
        if origin in (list, tuple) and not isinstance(value, list):
            raise ConfigError(f"--set {name}={text}: expected a JSON list such as {example}")
        return value
    raise ConfigError(f"--set {name}: a {getattr(annotation, '__name__', annotation)} cannot be set from the command "
                      "line; set it in the run file")


def _unique(pairs: list, name: str) -> dict:
    """A JSON object of --set whose keys are distinct: json.loads would keep the last of a repeated one."""
    keys = [k for k, _ in pairs]
    if twice := next((k for k in keys if keys.count(k) > 1), None):
        raise ConfigError(f"--set {name}: {twice!r} appears twice in its JSON object; name each key once")
    return dict(pairs)


def apply_override(config: RunConfig, assignment: str) -> None:
    """Apply one `a.b=value` override, type-checked against the dataclass field."""
    check("=" in assignment, f"--set {assignment!r}: expected the form section.field=value, e.g. train.steps=10")
    key, text = assignment.split("=", 1)
    check(key.strip(), f"--set {assignment!r}: no field named; expected section.field=value, e.g. train.steps=10")
    parts, target = key.strip().split("."), config
    for i, part in enumerate(parts):
        check(dataclasses.is_dataclass(target), f"--set {key}: {'.'.join(parts[:i])} is not a config section")
        names = [f.name for f in dataclasses.fields(target)]
        meant = fields_named(part, type(config.model)) if part not in names else []  # lr: optim.lr
        check(part in names, f"--set {key}: unknown field {part!r}"
              + (f" here (did you mean {' or '.join(meant)}?)" if meant else f"; valid fields here: {', '.join(names)}"))
        if i < len(parts) - 1:
            target = getattr(target, part)
    setattr(target, parts[-1], _parse_value(text, typing.get_type_hints(type(target))[parts[-1]], key))


def fields_named(name: str, model: type | None = None) -> list[str]:
    """The section.field names that `name` (a field's, SECTION_FIELD, or a flag: --micro-batch-size) may mean."""
    name = name.lstrip("-").replace("-", "_").split(".")[-1]
    sections = [*SECTIONS, *([("model", model)] if dataclasses.is_dataclass(model) else [])]
    return [f"{section}.{f.name}" for section, cls in sections for f in dataclasses.fields(cls)
            if name in (f.name, f"{section}_{f.name}")]


def read_json(path: str | Path, fix: str) -> Any:
    """A JSON file's content; a file that does not parse is a UserError naming it and `fix`."""
    try:
        return json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path} is not valid JSON ({e}); {fix}") from None


def _has_type(value: Any, hint: Any) -> bool:
    """Whether `value` fits the annotation `hint` (int is not bool; a float is finite; ints pass as floats)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return any(_has_type(value, a) for a in args)
    if hint is Any:
        return True
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin in (list, tuple):
        return isinstance(value, (list, tuple)) and all(_has_type(v, args[0]) for v in value if args)
    return isinstance(value, origin or hint)


def check_types(obj: Any, prefix: str = "", fix: str = "fix the run file or --set") -> None:
    """Every field of a config dataclass, nested ones included, holds a value of its annotated type.
    A run file is Python, so `steps="10"` or `lr=float("inf")` reach here without --set's parsing."""
    hints = typing.get_type_hints(type(obj))
    if unknown := sorted(set(vars(obj)) - hints.keys()):  # `CONFIG.train.stpes = 3` in a run file: a new attribute, else unread
        near = " or ".join([prefix + m for m in difflib.get_close_matches(unknown[0], hints, 1)] or fields_named(unknown[0]))
        raise ConfigError(f"{prefix}{unknown[0]}: {type(obj).__name__} has no such field"
                          f"{f' (did you mean {near}?)' if near else ''}; `pithtrain train --help` lists them; {fix}")
    for f in dataclasses.fields(obj):
        value, name = getattr(obj, f.name), prefix + f.name
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            check_types(value, name + ".", fix)
        elif not _has_type(value, hint := hints[f.name]):
            expected = "a finite float" if hint is float else _type_name(hint)
            fix = f"write it as a string, {str(value)!r}" if isinstance(value, os.PathLike) else fix  # a notebook's Path
            raise ConfigError(f"{name}={value!r} ({type(value).__name__}): expected {expected}; {fix}")


def check_positive(obj: Any, names: str, prefix: str = "model.") -> None:
    """Each field in `names` (space-separated) is > 0 where set: sizes, counts, rates and epsilons."""
    for name in names.split():
        value = getattr(obj, name)
        check(value is None or value > 0, f"{prefix}{name}={value}: must be > 0")


def check_numbers(mapping: dict, field: str, skip: str = "type") -> None:
    """Each value of a dict field (RoPE settings) is a number or None; keys containing `skip` are names."""
    if text := next((k for k, v in mapping.items() if skip not in k and not isinstance(v, (int, float, type(None)))), None):
        raise ConfigError(f"{field}['{text}']={mapping[text]!r}: must be a number")


YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
             "attention_factor", "truncate")  # what ops/core.rope_inv_freq and the models' softmax scales read


def check_yarn(rope: dict, field: str) -> None:
    """YaRN's factor (it stretches the context) and original context set and >= 1; its beta_fast/beta_slow > 0 where
    set (0, like None, is HF's default), beta_fast >= beta_slow (else the ramp between them runs backwards)."""
    for key in ("factor", "original_max_position_embeddings"):
        check(rope.get(key) is not None and rope[key] >= 1, f"{field}['{key}']={rope.get(key)}: must be set and >= 1 for YaRN")
    if bad := next((k for k in ("beta_fast", "beta_slow") if not (rope.get(k) or 1) > 0), None):
        raise ConfigError(f"{field}['{bad}']={rope[bad]}: must be > 0 (YaRN's rotation counts; unset: 32 and 1)")
    check((rope.get("beta_fast") or 32) >= (rope.get("beta_slow") or 1), f"{field}['beta_fast']={rope.get('beta_fast')} "
          f"is below beta_slow={rope.get('beta_slow')} (unset: 32 and 1); swap them")
    check(rope.get("attention_factor") is None or rope["attention_factor"] > 0, f"{field}['attention_factor']="
          f"{rope.get('attention_factor')}: must be > 0 (it scales cos/sin; 0 makes attention uniform); unset: from factor")


def hf_values(cls: type, hf: dict, nullable: frozenset = frozenset()) -> dict:
    """The config.json entries that are fields of `cls` (None dropped, except in `nullable` fields), a list of
    eos_token_id as its first."""
    known = {f.name for f in dataclasses.fields(cls)}
    values = {k: v for k, v in hf.items() if k in known and (v is not None or k in nullable)}
    if isinstance(values.get("eos_token_id"), list):
        values["eos_token_id"] = values["eos_token_id"][0]
    return values


def data_rank_count(p: ParallelConfig, world_size: int) -> int:
    """Ranks that take different samples: dp x ep (cp ranks share theirs, pp stages pass them on)."""
    return world_size // (p.pp * p.cp * p.ep) * p.ep


def runs_dualpipev(config: RunConfig, world_size: int) -> bool:
    """Whether training runs the DualPipeV pipeline: pp > 1, or pp = 1 with expert parallelism and
    at least 2 micro-batches per data rank (it overlaps them; `parallel.overlap_ep` turns that off;
    its two chunks cannot share a tied embedding yet)."""
    t, p = config.train, config.parallel
    micro_per_rank = t.global_batch_size // (t.micro_batch_size * data_rank_count(p, world_size))
    tied = getattr(config.model, "tie_word_embeddings", False)
    return p.pp > 1 or (p.ep > 1 and micro_per_rank >= 2 and p.overlap_ep and not tied)


def data_parts(path: Any, field: str = "data.path") -> list[tuple[str, float]]:
    """The datasets of data.path and their weight shares (summing to 1): [(path, 1.0)] for one dataset,
    else those of a blend {path: weight} or [weight, path, weight, path, ...] (Megatron's form)."""
    if isinstance(path, str):
        return [(path, 1.0)]
    pairs = list(path.items()) if isinstance(path, dict) else list(zip(path[1::2], path[::2])) if isinstance(path, list) else []
    good = (pairs and not (isinstance(path, list) and len(path) % 2)
            and all(isinstance(p, str) and p and _has_type(w, float) and w > 0 for p, w in pairs))
    check(good, f"{field}={path!r}: expected a dataset directory, {{path: weight, ...}} or [weight, path, ...] "
                "with weights > 0")
    check(len({os.path.realpath(p) for p, _ in pairs}) == len(pairs), f"{field}={path!r}: a dataset is named twice")
    total = sum(w for _, w in pairs)
    check(min(w for _, w in pairs) / total >= BLEND_MIN_SHARE,
          f"{field}={path!r}: every weight must be at least {BLEND_MIN_SHARE:g} of their sum; drop the tiny ones")
    return [(p, w / total) for p, w in pairs]


def fp8_tensor_cores() -> bool:
    """The visible GPU has FP8 tensor cores: compute capability 8.9 (Ada) or 9.0+ (Hopper)."""
    import torch

    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def check(cond: bool, message: str) -> None:
    """A ConfigError with `message` unless `cond` (the config's and the models' validate())."""
    if not cond:
        raise ConfigError(message)


def _wandb_can_log() -> bool:
    """wandb logs offline or disabled (WANDB_MODE), or has an API key (WANDB_API_KEY, or the ~/.netrc entry
    `wandb login` writes for WANDB_BASE_URL's host): known before any network call."""
    import netrc
    from urllib.parse import urlparse

    if os.environ.get("WANDB_MODE", "").lower() in ("offline", "disabled", "dryrun") or os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def ignored_options(config: RunConfig, world_size: int = 1) -> list[str]:
    """Warnings, one line each, for options set away from their default that cannot take effect with
    the rest of the config (the option they depend on is off); `validate` refuses the ones that would
    mislead (fp8_emulate with fp8=off, a profile_step past the last step)."""
    t, o, d, p, m = config.train, config.optim, config.data, config.parallel, config.model

    def changed(section, name):
        return getattr(section, name) != _default(next(f for f in dataclasses.fields(section) if f.name == name))

    decay = max(1, round(o.decay_fraction * t.steps))  # wsd's decay steps (train/optim.lr_at)
    dense = not any(map(m.is_moe_layer, range(m.num_hidden_layers + getattr(m, "num_nextn_predict_layers", 0))))
    found = [
        (changed(o, "decay_fraction") and o.schedule != "wsd", f"optim.decay_fraction applies only to optim.schedule=wsd (not {o.schedule})"),
        (changed(o, "min_lr_ratio") and o.schedule == "constant", "optim.min_lr_ratio has no effect with optim.schedule=constant"),
        (changed(o, "momentum") and o.name == "adamw", "optim.momentum is Muon's; optim.name=adamw does not use it"),
        (changed(o, "muon_exclude") and o.name == "adamw", "optim.muon_exclude is Muon's; optim.name=adamw does not use it"),
        (o.warmup_steps > t.steps, f"optim.warmup_steps={o.warmup_steps} > train.steps={t.steps}: the lr never reaches optim.lr"),
        (o.schedule == "wsd" and t.steps - decay < o.warmup_steps <= t.steps,
         f"optim.warmup_steps={o.warmup_steps} runs into wsd's decay (the last {decay} steps): the lr falls from its peak at once"),
        (changed(t, "lb_type") and t.lb_coef == 0, "train.lb_type has no effect with train.lb_coef=0 (no load-balance loss)"),
        *[(dense and changed(t, k) and t.lb_coef != 0, f"train.{k} has no effect: the model has no MoE layer (no router to "
           "balance)") for k in ("lb_coef", "lb_type")],
        (dense and t.recompute == "selective", "train.recompute=selective recomputes the experts' activations, and the model "
         "has no MoE layer (train.recompute=full recomputes every layer)"),
        (getattr(m, "topk_method", "noaux_tc") != "noaux_tc" and changed(m, "bias_update_speed"), "model.bias_update_speed "
         f"moves noaux_tc's routing correction bias; topk_method={getattr(m, 'topk_method', '')!r} has none"),
        (changed(t, "mtp_coef") and not getattr(config.model, "num_nextn_predict_layers", 0),
         "train.mtp_coef has no effect without multi-token prediction layers (" + ("model.num_nextn_predict_layers=0)" if
         "num_nextn_predict_layers" in {f.name for f in dataclasses.fields(config.model)} else f"{config.model.model_type} has none)")),
        (hasattr(m, "full_attention_interval") and m.layer_types is not None and changed(m, "full_attention_interval"),
         f"model.full_attention_interval={getattr(m, 'full_attention_interval', 0)} has no effect: model.layer_types is set "
         "(set model.layer_types=null to place the full-attention layers by the interval)"),
        (changed(t, "keep_checkpoints") and t.checkpoint_every == -1,
         "train.keep_checkpoints has no effect with train.checkpoint_every=-1 (no checkpoints)"),
        (changed(t, "seed") and bool(t.init_from), "train.seed initialises the weights that train.init_from replaces"),
        (bool(d.eval_path) and t.eval_every == 0, "data.eval_path is never read with train.eval_every=0"),
        (d.eval_samples > 0 and not d.eval_path and t.eval_every == 0, f"data.eval_samples={d.eval_samples} holds samples "
         "out of training that train.eval_every=0 never evaluates (set train.eval_every=N, or data.eval_samples=0 for a new run)"),
        (d.eval_on_train and not d.eval_path, "data.eval_on_train applies to data.eval_path, which is not set"),
        (p.hsdp and world_size // (p.pp * p.cp * p.ep) == 1, "parallel.hsdp has no effect with one data-parallel replica (dp=1)"),
        (not p.overlap_ep and not (p.pp == 1 and p.ep > 1), "parallel.overlap_ep applies only to pp=1 with ep > 1"),
        (t.fp8_emulate and t.fp8 != "off" and t.device != "cpu" and fp8_tensor_cores(),
         "train.fp8_emulate has no effect on a GPU with FP8 tensor cores (FP8 runs natively)"),
    ]
    return [f"warning: {text}" for cond, text in found if cond]


def check_model_common(model) -> None:
    """What every family's config must hold besides its own `validate`: token ids inside the vocabulary
    (or None), a positive finite initialisation scale."""
    vocab = model.vocab_size
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(model, name, None)
        ids = value if isinstance(value, list) else [value]
        check(value is None or all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab for i in ids),
              f"model.{name}={value!r}: a token id is in [0, vocab_size={vocab}) (or None: unset)")
    for f in dataclasses.fields(model):  # a size past 2**31 is a typo, and too big to lay out even on the meta device
        value = getattr(model, f.name)
        check(not isinstance(value, int) or value < 2**31, f"model.{f.name}={value}: at most 2**31 - 1")
    check(model.num_hidden_layers <= 1024,
          f"model.num_hidden_layers={model.num_hidden_layers}: at most 1024 (the deepest released MoE models have under 100)")
    scale = getattr(model, "initializer_range", None)
    check(scale is None or (isinstance(scale, (int, float)) and 0 < scale <= 1),
          f"model.initializer_range={scale!r}: the std of the initial weights must be in (0, 1] (HF's default 0.02)")


def validate(config: RunConfig, world_size: int = 1) -> None:
    """Refuse an invalid config before any work starts; each message names the field and the fix."""
    t, o, d, p = config.train, config.optim, config.data, config.parallel
    check(dataclasses.is_dataclass(config.model) and hasattr(config.model, "validate"),
          f"model={config.model!r}: expected a model family config such as Qwen3MoeConfig(...)")
    check_types(config)
    config.model.validate()
    check_model_common(config.model)
    check(world_size >= 1, f"--nproc {world_size}: must be at least 1")
    check(t.steps >= 1, f"train.steps={t.steps}: must be at least 1")
    check(t.micro_batch_size >= 1, f"train.micro_batch_size={t.micro_batch_size}: must be at least 1")
    check_positive(t, "global_batch_size", "train.")
    check_positive(p, "timeout_s", "parallel.")
    check(p.timeout_s <= _MAX_TIMEOUT_S, f"parallel.timeout_s={p.timeout_s}: at most {_MAX_TIMEOUT_S:.0f} s (a year)")
    check_positive(o, "eps", "optim.")
    check(d.seed >= 0, f"data.seed={d.seed}: must be >= 0")
    check(0 <= t.seed < 2**32, f"train.seed={t.seed}: must be in [0, 2**32) (seeds per parameter are derived from it)")
    check(t.device in ("auto", "cpu", "cuda"), f"train.device={t.device!r}: use auto, cpu or cuda")
    check(t.dtype in ("auto", "fp32", "bf16"), f"train.dtype={t.dtype!r}: use auto, fp32 or bf16")
    check(t.fp8 in ("off", "rowwise", "rowwise_bf16_wgrad"),
          f"train.fp8={t.fp8!r}: use off, rowwise or rowwise_bf16_wgrad")
    if t.fp8 != "off":  # FP8 needs FP8 tensor cores (compute capability 8.9+), or the emulation asked for explicitly
        import torch

        if t.device == "cpu" or not torch.cuda.is_available():
            check(t.fp8_emulate, f"train.fp8={t.fp8} on the CPU: there are no FP8 tensor cores; set train.fp8_emulate="
                  "true to emulate the numerics (slow: for tests) or train.fp8=off")
        else:
            cap = torch.cuda.get_device_capability()
            check(fp8_tensor_cores(), f"train.fp8={t.fp8}: {torch.cuda.get_device_name()} (compute capability "
                  f"{cap[0]}.{cap[1]}) has no FP8 tensor cores (8.9+ needed: Ada, Hopper or newer); set train.fp8=off")
    check(t.recompute in ("off", "selective", "full"), f"train.recompute={t.recompute!r}: use off, selective or full")
    check(t.lb_type in ("micro", "global", "seq"), f"train.lb_type={t.lb_type!r}: use micro, global or seq")
    check(t.lb_coef >= 0, f"train.lb_coef={t.lb_coef}: must be >= 0 (0 disables the load-balance loss)")
    check(t.mtp_coef >= 0 and math.isfinite(t.mtp_coef),
          f"train.mtp_coef={t.mtp_coef}: must be a finite number >= 0 (0: the MTP loss is logged, its layers get zero gradients)")
    # importable, without importing it (wandb takes seconds); an already imported module may lack a spec
    check(not t.wandb_project or sys.modules.get("wandb") is not None or importlib.util.find_spec("wandb") is not None,
          f"train.wandb_project={t.wandb_project!r}: wandb is not installed; pip install wandb, or set train.wandb_project=''")
    check(not t.wandb_project or _wandb_can_log(),
          f"train.wandb_project={t.wandb_project!r}: wandb has no credentials (no WANDB_API_KEY, no `wandb login` in "
          "~/.netrc); run `wandb login`, set WANDB_API_KEY, or log offline with WANDB_MODE=offline")
    check(t.log_every >= 1, f"train.log_every={t.log_every}: must be at least 1")
    check(t.eval_every >= 0, f"train.eval_every={t.eval_every}: must be >= 0 (0 turns evaluation off)")
    check(d.eval_samples >= 0, f"data.eval_samples={d.eval_samples}: must be >= 0")
    blend = len(data_parts(d.path)) > 1
    check(not (blend and d.eval_samples and not d.eval_path),
          f"data.eval_samples={d.eval_samples} holds out the end of one dataset, and data.path is a blend; set "
          "data.eval_path (a tokenized held-out dataset) or data.eval_samples=0")
    check(0 <= t.profile_step <= t.steps, f"train.profile_step={t.profile_step}: there is no such step of "
          f"train.steps={t.steps}; choose a step in 1..{t.steps}, or 0 (off)")
    check(not t.fp8_head or t.fp8 != "off", "train.fp8_head=true needs FP8 GEMMs: set train.fp8=rowwise_bf16_wgrad "
          "(or rowwise), or train.fp8_head=false")
    vocab, hidden = config.model.vocab_size, config.model.hidden_size
    check(not t.fp8_head or not (vocab % 16 or hidden % 16), f"train.fp8_head=true: the head's FP8 GEMMs take sizes "
          f"that are multiples of 16, and model.vocab_size={vocab}, model.hidden_size={hidden}; pad the vocabulary "
          "to a multiple of 16, or train.fp8_head=false")
    check(not t.fp8_emulate or t.fp8 != "off", "train.fp8_emulate=true has no effect with train.fp8=off; set "
          "train.fp8=rowwise (or rowwise_bf16_wgrad), or train.fp8_emulate=false")
    check(t.eval_every == 0 or d.eval_path or d.eval_samples,
          f"train.eval_every={t.eval_every} needs held-out data: set data.eval_path (a tokenized dataset) or "
          "data.eval_samples=N (the last N samples of data.path)")
    check(t.checkpoint_every >= -1, f"train.checkpoint_every={t.checkpoint_every}: use N > 0, 0 (only at the end) or -1 (never)")
    check(t.keep_checkpoints >= 1, f"train.keep_checkpoints={t.keep_checkpoints}: must be at least 1")
    for name in ("pp", "cp", "ep"):
        check(getattr(p, name) >= 1, f"parallel.{name}={getattr(p, name)}: must be at least 1")
    model_parallel = p.pp * p.cp * p.ep
    check(world_size % model_parallel == 0,
          f"mesh pp={p.pp} x cp={p.cp} x ep={p.ep} = {model_parallel} does not divide the {world_size} processes; "
          f"choose --nproc as a multiple of {model_parallel} (torchrun: its --nnodes x --nproc-per-node), or lower "
          "parallel.pp, parallel.cp or parallel.ep")
    dp, num_experts = world_size // model_parallel, config.model.num_routed_experts()
    check(num_experts % p.ep == 0, f"parallel.ep={p.ep} does not divide the {num_experts} experts; "
          f"choose ep among the divisors of {num_experts}")
    data_ranks = data_rank_count(p, world_size)
    pp_fits = lambda m: p.pp == 1 or t.global_batch_size // (m * data_ranks) >= 2 * p.pp  # noqa: E731 (the check below)
    if t.global_batch_size % (t.micro_batch_size * data_ranks):
        fits = [m for m in range(min(t.micro_batch_size, 1024), 0, -1)
                if t.global_batch_size % (m * data_ranks) == 0 and pp_fits(m)]
        raise ConfigError(f"train.global_batch_size={t.global_batch_size} is not divisible by train.micro_batch_size "
                          f"({t.micro_batch_size}) x data-parallel ranks ({data_ranks} = dp {dp} x ep {p.ep}); use a "
                          f"multiple of {t.micro_batch_size * data_ranks}" + (f", or train.micro_batch_size={fits[0]} "
                                                                           "(a resumed run keeps its global batch)" if fits else ""))
    check(not t.init_from or os.path.exists(t.init_from),  # False, not an error, for a name too long
          f"train.init_from={t.init_from}: no such HF directory or checkpoint; fix the path or set it to ''")
    # a resumed run keeps its hold-out: on another mesh the way out is a smaller micro-batch that fits both
    fit = next((m for m in range(t.micro_batch_size, 0, -1)
                if not (d.eval_samples % (m * data_ranks) or t.global_batch_size % (m * data_ranks)) and pp_fits(m)), 0)
    check(d.eval_samples % (t.micro_batch_size * data_ranks) == 0,
          f"data.eval_samples={d.eval_samples} is not divisible by train.micro_batch_size ({t.micro_batch_size}) x "
          f"data-parallel ranks ({data_ranks}); use a multiple of {t.micro_batch_size * data_ranks}"
          + (f", or train.micro_batch_size={fit} (a resumed run keeps its held-out samples)" if fit else ""))
    micro_per_rank, per_rank = t.global_batch_size // max(1, t.micro_batch_size * data_ranks), t.global_batch_size // data_ranks
    if p.pp > 1 and micro_per_rank < 2 * p.pp:
        fit = next((m for m in range(per_rank // (2 * p.pp), 0, -1) if per_rank % m == 0), None)
        raise ConfigError(f"parallel.pp={p.pp} needs at least 2*pp = {2 * p.pp} micro-batches per data rank and step, got "
                          f"{micro_per_rank}; " + (f"use train.micro_batch_size={fit} or raise train.global_batch_size" if fit
                                                   else f"set train.global_batch_size={2 * p.pp * data_ranks} or more"))
    mtp, per_chunk = config.model.num_nextn_predict_layers, max(1, config.model.num_hidden_layers // (2 * p.pp))
    check(p.pp == 1 or mtp <= per_chunk,
          f"model.num_nextn_predict_layers={mtp} with parallel.pp={p.pp}: the MTP layers run beside the head on the "
          f"last pipeline chunk, sized for about {per_chunk} decoder layer(s); more would stall the pipeline there; "
          f"use at most {per_chunk} MTP layer(s) or a smaller parallel.pp")
    check(d.seq_len >= 2, f"data.seq_len={d.seq_len}: must be at least 2")
    check(mtp < config.data.seq_len, f"model.num_nextn_predict_layers={mtp} with data.seq_len={config.data.seq_len}: "
          f"depth k predicts the token k + 1 ahead, so depth {config.data.seq_len} and deeper have no target in a "
          f"sample; use fewer MTP layers than data.seq_len")
    check(p.pp == 1 or not getattr(config.model, "tie_word_embeddings", False),
          "model.tie_word_embeddings with parallel.pp > 1 is not supported yet; untie the embeddings")
    check(not (t.compile and p.cp > 1), "train.compile with parallel.cp > 1 is not supported: ring attention "
          "communicates inside stage 1; set train.compile=false")
    max_len = config.model.max_position_embeddings
    check(d.seq_len <= max_len,
          f"data.seq_len={d.seq_len} is longer than the model supports (model.max_position_embeddings={max_len}); "
          f"lower data.seq_len or raise model.max_position_embeddings")
    fits = sorted({d.seq_len // (2 * p.cp) * 2 * p.cp or 2 * p.cp, (d.seq_len // (2 * p.cp) + 1) * 2 * p.cp})
    check(d.seq_len % (2 * p.cp) == 0 or p.cp == 1, f"data.seq_len={d.seq_len} must be divisible by 2*cp={2 * p.cp}; use "
          + " or ".join(map(str, fits)))
    check(o.lr > 0, f"optim.lr={o.lr}: must be > 0")
    check(0 <= o.min_lr_ratio <= 1, f"optim.min_lr_ratio={o.min_lr_ratio}: must be in [0, 1]")
    check(o.schedule in ("cosine", "wsd", "constant"), f"optim.schedule={o.schedule!r}: use cosine, wsd or constant")
    check(o.warmup_steps >= 0, f"optim.warmup_steps={o.warmup_steps}: must be >= 0")
    check(0 < o.decay_fraction <= 1, f"optim.decay_fraction={o.decay_fraction}: must be in (0, 1]")
    check(o.weight_decay >= 0, f"optim.weight_decay={o.weight_decay}: must be >= 0")
    check(o.grad_clip >= 0, f"optim.grad_clip={o.grad_clip}: must be >= 0 (0 disables clipping)")
    check(0 <= o.beta1 < 1 and 0 <= o.beta2 < 1, f"optim.beta1={o.beta1}, optim.beta2={o.beta2}: both must be in [0, 1)")
    check(o.name in ("adamw", "muon"), f"optim.name={o.name!r}: use adamw or muon")
    check(0 <= o.momentum < 1, f"optim.momentum={o.momentum}: must be in [0, 1)")
