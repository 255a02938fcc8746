"""The `pithtrain` command line: train, tokenize, convert, eval, plot."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import shlex
import signal
import sys
import warnings
from pathlib import Path

from pithtrain.config import ConfigError, UserError, config_help
from pithtrain.models import families

H200_GIB = 139.8  # what torch reports of an H200: the largest GPU the estimates are calibrated on
_joined_group = False  # this process is a launched worker that set up a process group (gloo's threads run)


def train_config(args):
    """The run config of `pithtrain train ARGS`: the file, then --set, --steps and the mesh flags."""
    from pithtrain.config import apply_override, load_run_config

    config = load_run_config(args.config)
    for assignment in args.set or []:
        try:
            apply_override(config, assignment)
        except ConfigError as e:  # a model field of another family (multi-token prediction is DeepSeek-V3's)
            field = assignment.split("=", 1)[0].strip().removeprefix("model.")
            owners = [c.__name__ for c in families() if field in {f.name for f in dataclasses.fields(c)}]
            if "unknown field" not in str(e) or not assignment.startswith("model.") or not owners:
                raise
            raise ConfigError(f"--set model.{field}: {type(config.model).__name__} has no such field; "
                              f"{' and '.join(owners)} (another model family) {'have' if len(owners) > 1 else 'has'} it") from None
    set_fields = {a.split("=", 1)[0].strip() for a in args.set or []}
    for section, name in (("train", "steps"), ("parallel", "pp"), ("parallel", "cp"), ("parallel", "ep"), ("parallel", "hsdp")):
        flag, fields = getattr(args, name), getattr(config, section)
        flag = None if flag is False else flag  # --hsdp: True or not given
        if flag is None:
            continue
        if f"{section}.{name}" in set_fields and getattr(fields, name) != flag:  # the flag silently won before
            raise UserError(f"--{name}{'' if flag is True else f' {flag}'} and --set {section}.{name}={getattr(fields, name)} "
                            "disagree; give one of them")
        setattr(fields, name, flag)
    return config


def _cmd_train(args) -> int:
    from pithtrain.config import describe, validate
    from pithtrain.launch import GracefulStop, die_with_launcher, launch_local
    from pithtrain.train.rundir import owned

    if "PITHTRAIN_LAUNCHER" in os.environ:  # a worker of launch_local
        die_with_launcher(int(os.environ["PITHTRAIN_LAUNCHER"]))
    config = train_config(args)
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ  # a worker under torchrun/srun/our launcher
    if launched:
        if not (os.environ["RANK"].isdigit() and os.environ["WORLD_SIZE"].isdigit()
                and int(os.environ["RANK"]) < int(os.environ["WORLD_SIZE"]) and os.environ.get("MASTER_PORT", "0").isdigit()):
            raise UserError(f"RANK={os.environ['RANK']!r} WORLD_SIZE={os.environ['WORLD_SIZE']!r} MASTER_PORT="
                            f"{os.environ.get('MASTER_PORT')!r}: expected integers, RANK < WORLD_SIZE; fix the launcher's environment")
        if args.nproc not in (1, int(os.environ["WORLD_SIZE"])):  # was ignored: this process joined a mesh of WORLD_SIZE
            raise UserError(f"--nproc {args.nproc}: RANK and WORLD_SIZE={os.environ['WORLD_SIZE']} are set, so another launcher "
                            "(torchrun) started the processes; drop --nproc, or unset RANK and WORLD_SIZE to launch here")
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # until the mesh is up (a rendezvous blocks Python's handlers)
    world = int(os.environ["WORLD_SIZE"]) if launched else args.nproc
    validate(config, world_size=world)  # refuse an impossible mesh before any process starts
    if args.out is not None and not args.out.strip():
        raise UserError("--out is empty; name the run directory, e.g. --out runs/mine")
    out = Path(args.out or f"runs/{config.model.model_type}")
    if args.print_config or args.dry_run:  # under another launcher every rank checks, rank 0 alone prints (one JSON)
        with contextlib.redirect_stdout(None) if os.environ.get("RANK", "0") != "0" else contextlib.nullcontext():
            return _check_only(args, config, out, world)
    # one writer per run directory: this process, our launcher (not its workers), or rank 0 under another launcher
    owner = "PITHTRAIN_LAUNCHER" not in os.environ and os.environ.get("RANK", "0") == "0"
    if owner:
        print(f"config:\n{describe(config)}", flush=True)
    with owned(out) if owner else contextlib.nullcontext():
        if not launched and args.nproc > 1:
            from pithtrain.train.loop import check_run, pick_device

            pick_device(config.train.device)
            check_run(config, out, args.stop_after, world_size=args.nproc)  # paths, data, resume: once, here
            return launch_local(args.argv, args.nproc)
        return _train_here(args, config, out, launched, GracefulStop)


def _check_only(args, config, out: Path, world: int) -> int:
    """--print-config and --dry-run: what `train` checks before it starts (config, mesh, device, run
    directory, data, resume or init_from), with the warnings it would print; then the config (JSON), or
    the startup line's sizes, the estimated memory per GPU and what it would resume from. Nothing is written."""
    import torch

    from pithtrain.config import describe, ignored_options, run_dict
    from pithtrain.train.loop import check_run, count_text, model_sizes, pick_device, size_text
    from pithtrain.train.memory import estimate
    from pithtrain.train.rundir import check_out, check_unheld

    pick_device(config.train.device)
    check_out(out)
    check_unheld(out)  # as the real run would be refused
    parent = next(p for p in (out, *out.parents) if p.exists())
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise UserError(f"--out {out}: {parent} is not a writable directory; choose another --out")
    if args.print_config:
        check_run(config, out, args.stop_after, echo=False, create=False, world_size=world)
        print(json.dumps(run_dict(config), indent=2))
        return 0
    for line in ignored_options(config, world):  # first, as the real run prints them
        print(line)
    print(f"config:\n{describe(config)}", flush=True)
    try:
        loader, _, found = check_run(config, out, args.stop_after, echo=True, create=False, world_size=world)
    except UserError as e:  # memory alone needs no data: say where to get it
        if str(e).startswith("data.path"):
            raise UserError(f"{e}; memory alone, without data: .agents/skills/estimate-memory/estimate_memory.py") from None
        raise
    p, peaks = config.parallel, [r["total"] for r in estimate(config, world)]
    stages = [f"{gib:.1f} GiB" if gib >= 1 else f"{gib * 1024:.0f} MiB" for gib in peaks]
    counts = model_sizes(config.model)
    has = torch.cuda.get_device_properties(0).total_memory / 2**30 if torch.cuda.is_available() else None
    limit, what = (has, "this machine's GPU") if has else (H200_GIB, "an H200 (no GPU here)")
    print(f"model {config.model.model_type}: {count_text(counts[0])} parameters | {size_text(config, loader, counts)}\n"
          f"estimated peak memory per GPU ({'bf16' if config.train.fp8 == 'off' else 'FP8 ' + config.train.fp8}; "
          f"the estimate-memory skill): {', '.join(stages)}"
          f"{f' (pipeline stages 0 to {len(stages) - 1})' if len(stages) > 1 else ''}\n"
          + (f"warning: the estimate exceeds {what} ({limit:.1f} GiB): see docs/guide.md, Memory planning\n"
             if max(peaks) > limit else "") +
          f"dry run ok: {world} process(es), mesh pp={p.pp} dp={world // (p.pp * p.cp * p.ep)} cp={p.cp} ep={p.ep}; "
          f"{f'would resume from {found}' if found else 'would start at step 0'} in {out}; nothing was written")
    return 0


@contextlib.contextmanager
def _rendezvous_guard(timeout_s: float, error: str):
    """torch's C++ store logs each failed try to connect (a stack of frames a try) to fd 2: held back, and
    shown only if the rendezvous succeeds (the one-line error explains a failure). A MASTER_PORT held by a
    program that takes connections but never answers blocks the connection past every timeout: after twice
    parallel.timeout_s this process ends with the error line."""
    import tempfile
    import threading

    def give_up():
        os.dup2(saved, 2)
        print(f"error: {error} (no answer in {2 * timeout_s:g} s: is MASTER_PORT another program's?)",
              file=sys.stderr, flush=True)
        os._exit(2)

    sys.stderr.flush()
    with tempfile.TemporaryFile() as held:
        saved = os.dup(2)
        os.dup2(held.fileno(), 2)
        timer = threading.Timer(2 * timeout_s, give_up)
        timer.daemon = True
        timer.start()
        try:
            yield
        finally:
            timer.cancel()
            os.dup2(saved, 2)
            os.close(saved)
        held.seek(0)
        sys.stderr.write(held.read().decode(errors="replace"))  # not reached on failure


def resume_line(argv: list[str]) -> str:
    """The command that continues a run. Under another launcher (torchrun, srun) these arguments alone would
    start one process, which the mesh may not divide: that launcher's command again."""
    line = shlex.join(["pithtrain", *argv])
    own = "PITHTRAIN_LAUNCHER" in os.environ or "RANK" not in os.environ
    return f"\nresume with: {line}" if own else f"\nresume with: the same launcher command (its ranks run: {line})"


def check_same_config(config, world: int) -> None:
    """Every rank loads the run file itself: one whose CONFIG depends on randomness, the time or RANK would
    train each rank on its own config, silently (a data seed a rank reads other batches)."""
    import torch.distributed

    from pithtrain.config import run_dict

    mine, configs = run_dict(config), [None] * world
    torch.distributed.all_gather_object(configs, mine)
    if differ := sorted({f"{s}.{k}" for c in configs for s in mine for k in mine[s] if c[s].get(k) != mine[s][k]}):
        raise ConfigError(f"the ranks' configs differ in {', '.join(differ)}; the run file must give every process the "
                          "same CONFIG (no randomness, time or RANK in it)")


def _train_here(args, config, out: Path, launched: bool, graceful) -> int:
    from pithtrain.train.loop import pick_device, train

    mesh = None
    if launched:
        import torch.distributed

        from pithtrain.parallel.mesh import init_mesh

        device = pick_device(config.train.device)
        global _joined_group
        _joined_group = True
        failed = (f"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']}: the rendezvous at "
                  f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')} failed")
        fix = "start every rank with the same MASTER_ADDR and a free MASTER_PORT, or raise parallel.timeout_s"
        try:
            with _rendezvous_guard(config.parallel.timeout_s, f"{failed}; {fix}"):
                mesh = init_mesh(config.parallel.pp, config.parallel.cp, config.parallel.ep, device.type,
                                 config.parallel.timeout_s, config.parallel.hsdp)
        except torch.distributed.DistError as e:  # DistStoreError, DistNetworkError: peers that never came, a port in use
            raise UserError(f"{failed} ({str(e).splitlines()[0]}); {fix}") from None
        check_same_config(config, mesh.world)
    stop = graceful(loud=os.environ.get("RANK", "0") == "0")
    try:
        history = train(config, out, stop_after=args.stop_after, mesh=mesh, stop=stop)
    except RuntimeError as e:  # gloo's; NCCL's watchdog aborts the process itself
        if mesh is None or "Timed out" not in str(e):
            raise
        raise UserError(f"rank {mesh.rank}: no answer in a collective within parallel.timeout_s="
                        f"{config.parallel.timeout_s:g}: another rank hangs or stopped (the first rank to exit is "
                        "blamed, maybe this one); the same command resumes from the last checkpoint") from None
    except FloatingPointError as e:  # every rank met the same all-reduced loss: one line, out before any rank ends
        if mesh is None or os.environ.get("PITHTRAIN_DEBUG"):
            raise
        if mesh.rank == 0:
            print(_error_line(e), file=sys.stderr, flush=True)
        torch.distributed.barrier()
        return 2
    finally:
        stop.restore()
    saves, none = config.train.checkpoint_every >= 0, "no checkpoint (train.checkpoint_every=-1)"
    if mesh is None or mesh.is_main:
        if stop.stopped_at:
            saved = f"checkpoint {out}/checkpoints/step_{stop.stopped_at:08d}" if saves else none
            by = signal.Signals(stop.signum).name if stop.signum else "a signal to another rank"
            print(f"stopped by {by} after step {stop.stopped_at} of {config.train.steps}; {saved}"
                  + (resume_line(args.argv) if saves else ""), flush=True)
        elif history:
            held_out = f", eval loss {history[-1]['eval_loss']:.4f}" if "eval_loss" in history[-1] else ""
            resumed = f" ({len(history)} after resuming at step {history[0]['step'] - 1})" if history[0]["step"] > 1 else ""
            kept = f"checkpoints in {out}/checkpoints" if saves else none
            argv = [a for i, a in enumerate(args.argv) if not a.startswith("--stop-after")
                    and (i == 0 or args.argv[i - 1] != "--stop-after")]  # the rest of the run: no --stop-after
            more = "" if not saves or history[-1]["step"] >= config.train.steps else resume_line(argv)
            print(f"done: step {history[-1]['step']} of {config.train.steps}{resumed}, final loss {history[-1]['loss']:.4f}"
                  f"{held_out}; metrics in {out}/metrics.jsonl, {kept}{more}")
    if mesh is not None:
        # every rank past its last collective before any tears down: a gloo peer that closes its pairs while
        # another still completes an exchange makes that one abort (seen once in ~100 CPU launches)
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return 128 + (stop.signum or signal.SIGTERM) if stop.stopped_at else 0


def _cmd_convert(args) -> int:
    from pithtrain.tools.hf import convert

    out, what = convert(args.src, args.dst, overwrite=args.overwrite, echo=lambda line: print(line, file=sys.stderr),
                        tokenizer=not args.no_tokenizer)
    print(f"wrote {out}: {what}")
    return 0


def _cmd_eval(args) -> int:
    from pithtrain.tools.hf import eval_setup, evaluate, load_model, load_tokens
    from pithtrain.train.data import TokenDataset
    from pithtrain.train.loop import pick_device

    for flag, value, least in (("--batch-size", args.batch_size, 1), ("--seq-len", args.seq_len, 2), ("--max-tokens", args.max_tokens, 2)):
        if value is not None and value < least:
            raise UserError(f"{flag} {value}: must be at least {least}")
    if args.seq_len is not None and Path(args.tokens).is_file():
        raise UserError(f"--seq-len {args.seq_len}: {args.tokens} is a .npy array, whose rows are the windows; --seq-len "
                        "cuts a dataset directory's tokens into rows")
    device = pick_device(args.device, "--device")
    seq_len, why, vocab, tokenizer, limit, packed = eval_setup(args.checkpoint, args.seq_len)
    tokens = load_tokens(args.tokens, args.max_tokens, seq_len, vocab, tokenizer)
    if tokens.shape[1] - 1 > limit:  # a .npy array's rows (a dataset's are cut to seq_len, checked in eval_setup)
        raise UserError(f"--tokens {args.tokens}: rows of {tokens.shape[1]} tokens predict {tokens.shape[1] - 1}, more than "
                        f"the model's max_position_embeddings={limit}; cut the rows to at most {limit + 1} tokens")
    if tokens.shape[1] <= seq_len and Path(args.tokens).is_dir():  # fewer tokens than one window: one row of them all
        why = f"all {tokens.shape[1]} tokens taken, fewer than the {seq_len} + 1 of {why}"
    eos = TokenDataset(args.tokens).eos_id if packed and Path(args.tokens).is_dir() else None  # documents as the run read them
    loss, count = evaluate(load_model(args.checkpoint), tokens, args.batch_size, device, eos)
    rows = f"rows of {tokens.shape[1] - 1} predicted tokens ({why if Path(args.tokens).is_dir() else 'the .npy array'})"
    rows += ", documents packed as the run trained" if eos is not None else ""
    print(json.dumps({"loss": loss, "tokens": count, "seq_len": tokens.shape[1] - 1}) if args.json
          else f"eval loss {loss:.6f} over {count} tokens in {rows}")
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors are UserErrors, so they end in the same one line as every other."""

    def error(self, message):
        from pithtrain.config import fields_named

        flag = message.split(": ", 1)[-1].split()[0] if message.startswith("unrecognized arguments") else ""
        if flag.startswith("-") and (meant := fields_named(flag)):  # Megatron's --lr, --micro-batch-size: config fields
            raise UserError(f"{self.prog}: {message}; config fields are set with --set, e.g. "
                            f"{' or '.join(f'--set {m}=VALUE' for m in meant)} "
                            f"(see {self.prog} train --help)")
        raise UserError(f"{self.prog}: {message} (see {self.prog} --help)")

    more_help = None  # a function whose text ends --help (built only when asked for: it imports the models)

    def format_help(self):
        if self.more_help:
            self.epilog = self.more_help()
        return super().format_help()


def build_parser() -> argparse.ArgumentParser:
    from pithtrain.tools.plot import run_plot
    from pithtrain.tools.tokenize import add_tokenize_args, run_tokenize

    parser = _Parser(prog="pithtrain", description="Compact Mixture-of-Experts training.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train a model from a run config file", formatter_class=argparse.RawDescriptionHelpFormatter)
    p.more_help = lambda: config_help(families())
    p.add_argument("config", help="Python file defining CONFIG = RunConfig(...)")
    p.add_argument("--out", help="run directory (metrics, checkpoints); default runs/<model_type>")
    p.add_argument("--steps", type=int, help="override train.steps")
    p.add_argument("--set", action="append", metavar="A.B=VALUE", help="override a config field (repeatable)")
    p.add_argument("--stop-after", type=int, help="stop after this step (schedule unchanged); resume later")
    p.add_argument("--nproc", type=int, default=1, help="local processes to launch (one per GPU on GPU machines)")
    p.add_argument("--pp", type=int, help="pipeline-parallel size (parallel.pp)")
    p.add_argument("--cp", type=int, help="context-parallel size (parallel.cp)")
    p.add_argument("--ep", type=int, help="expert-parallel size (parallel.ep); dp = nproc / (pp*cp*ep)")
    p.add_argument("--hsdp", action="store_true", help="replicate weights over dp, shard within cp x ep")
    p.add_argument("--print-config", action="store_true", help="check as train does, print the effective config as JSON, exit")
    p.add_argument("--dry-run", action="store_true", help="every check and warning of train (config, mesh, run directory, data, resume, init_from), "
                   "then sizes, memory per GPU, the checkpoint to resume; do not train")
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser("tokenize", help="text files, directories or JSONL -> token dataset")
    add_tokenize_args(p)
    p.set_defaults(func=run_tokenize)

    p = sub.add_parser("convert", help="HF directory <-> PithTrain checkpoint (direction from SRC)")
    p.add_argument("src", help="HF directory (config.json + safetensors), checkpoint, or run directory")
    p.add_argument("dst", help="output: a checkpoint directory (from HF) or an HF directory (from PithTrain)")
    p.add_argument("--overwrite", action="store_true", help="replace DST if it is an HF export or checkpoint (never SRC, "
                   "a directory holding it, or other files)")
    p.add_argument("--no-tokenizer", action="store_true", help="to HF: export the model alone, without the run's tokenizer")
    p.set_defaults(func=_cmd_convert)

    p = sub.add_parser("plot", help="loss, eval loss, learning rate and tokens/s of runs into one PNG")
    p.add_argument("runs", nargs="+", metavar="RUN", help="run directories (or their metrics.jsonl)")
    p.add_argument("--out", help="the PNG to write; default: metrics.png in the first RUN")
    p.set_defaults(func=run_plot)

    p = sub.add_parser("eval", help="mean next-token cross-entropy over held-out tokens")
    p.add_argument("checkpoint", help="HF directory, PithTrain checkpoint, or run directory (latest)")
    p.add_argument("--tokens", required=True, help="a dataset directory of `pithtrain tokenize` (held-out texts "
                   "tokenized with the run's tokenizer.json), or a .npy file of token ids [batch, seq]")
    p.add_argument("--max-tokens", type=int, help="at most this many tokens: a dataset's last training samples within N "
                   "(data.eval_samples x seq_len + 1: the held-out ones, whose loss the run logged as eval_loss), a "
                   ".npy's first rows")
    p.add_argument("--seq-len", type=int, help="row length for a dataset directory (default: the model's training "
                   "data.seq_len, else its config.json's seq_length or max_position_embeddings)")
    p.add_argument("--batch-size", type=int, default=8, help="rows per forward pass (default 8)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="default auto: cuda when available")
    p.add_argument("--json", action="store_true", help='print one line {"loss": ..., "tokens": ..., "seq_len": ...}')
    p.set_defaults(func=_cmd_eval)
    return parser


def main(argv: list[str] | None = None) -> None:
    if argv is None:  # the process's own command line: it ends after the command
        import pithtrain.launch
        pithtrain.launch.ENDS_PROCESS = True
    if "RANK" in os.environ:  # a worker under a launcher: its traceback goes to the launcher's error report
        from torch.distributed.elastic.multiprocessing.errors import record

        code = record(_main)(argv)
        if _joined_group:  # no interpreter teardown: gloo's threads can abort it ("terminate called without an
            logging.shutdown()  # active exception", then SIGSEGV) after the run has ended and said so, and the
            sys.stdout.flush()  # launcher then reports a crash
            sys.stderr.flush()
            os._exit(code or 0)
        sys.exit(code)
    sys.exit(_main(argv))


def _not_dcp(record: logging.LogRecord) -> bool:
    """DCP logs a traceback on the root logger when a checkpoint's metadata does not read, even if it
    then loads: dropped; a failure that matters reaches the CLI's one error line."""
    return "distributed/checkpoint" not in record.pathname


def _error_line(e: BaseException) -> str:
    return f"error: {' '.join(str(e).split())} (PITHTRAIN_DEBUG=1 shows the traceback)"


def _main(argv: list[str] | None = None) -> int:
    """Run one command. The one error path: a UserError (which ConfigError and argparse's errors
    are), a ValueError or an OSError (a bad file or value) or a diverged run ends in one line on
    stderr and exit code 2; anything else is a bug and keeps its traceback."""
    argv = sys.argv[1:] if argv is None else list(argv)
    logging.getLogger().addFilter(_not_dcp)
    formatwarning = warnings.formatwarning  # restored at the end: main() called from Python leaves its warnings as they were
    warnings.formatwarning = lambda message, *_, **__: f"warning: {message}\n"  # one line, without its source line
    from pithtrain.launch import SafeStdout

    sys.stdout = SafeStdout(sys.stdout)  # a reader that goes away (`| head -1`) must not end the run
    try:  # a Ctrl-C held while the parser's imports run: torch's C++ import of numpy would catch it (half-importing numpy)
        held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        parser = build_parser()
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
        args = parser.parse_args(argv)
        args.argv = argv
        return args.func(args)
    except (ValueError, OSError, FloatingPointError, KeyboardInterrupt) as e:
        if os.environ.get("PITHTRAIN_DEBUG"):
            raise
        if isinstance(e, KeyboardInterrupt):  # Ctrl-C outside a training step (which stops after the step, cleanly)
            print("stopped by SIGINT (Ctrl-C)", file=sys.stderr)
            return 128 + signal.SIGINT
        if not isinstance(e, ConfigError) or os.environ.get("LOCAL_RANK", "0") == "0":  # a config's error: once a node
            print(_error_line(e), file=sys.stderr)
        return 2
    finally:
        sys.stdout, warnings.formatwarning = sys.stdout.stream, formatwarning
        logging.getLogger().removeFilter(_not_dcp)
