"""The `pithtrain` command line: train, tokenize, convert, eval."""

from __future__ import annotations

import argparse
import json
import os
import sys


def _cmd_train(args) -> int:
    from pithtrain.config import apply_override, load_run_config, validate
    from pithtrain.train.loop import train

    config = load_run_config(args.config)
    for assignment in args.set or []:
        apply_override(config, assignment)
    if args.steps is not None:
        config.train.steps = args.steps
    validate(config, world_size=1)
    out = args.out or f"runs/{config.model.model_type}"
    history = train(config, out, stop_after=args.stop_after)
    if history:
        print(f"done: {len(history)} steps, final loss {history[-1]['loss']:.4f}; metrics in {out}/metrics.jsonl, "
              f"checkpoints in {out}/checkpoints")
    return 0


def _cmd_tokenize(args) -> int:
    from pithtrain.tools.tokenize import run_tokenize

    return run_tokenize(args)


def _cmd_convert(args) -> int:
    from pithtrain.tools.hf import convert

    out = convert(args.src, args.dst)
    print(f"wrote {out}")
    return 0


def _cmd_eval(args) -> int:
    from pithtrain.tools.hf import evaluate, load_model, load_tokens

    tokens = load_tokens(args.tokens)
    model = load_model(args.checkpoint)
    device = args.device or ("cuda" if __import__("torch").cuda.is_available() else "cpu")
    loss, count = evaluate(model, tokens, args.batch_size, device)
    print(json.dumps({"loss": loss, "tokens": count}) if args.json else f"eval loss {loss:.6f} over {count} tokens")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from pithtrain.tools.tokenize import add_tokenize_args

    parser = argparse.ArgumentParser(prog="pithtrain", description="Compact Mixture-of-Experts training.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train a model from a run config file")
    p.add_argument("config", help="Python file defining CONFIG = RunConfig(...)")
    p.add_argument("--out", help="run directory (metrics, checkpoints); default runs/<model_type>")
    p.add_argument("--steps", type=int, help="override train.steps")
    p.add_argument("--set", action="append", metavar="A.B=VALUE", help="override a config field (repeatable)")
    p.add_argument("--stop-after", type=int, help="stop after this step (schedule unchanged); resume later")
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser("tokenize", help="text files, directories or JSONL -> token dataset")
    add_tokenize_args(p)
    p.set_defaults(func=_cmd_tokenize)

    p = sub.add_parser("convert", help="HF directory <-> PithTrain checkpoint (direction from SRC)")
    p.add_argument("src", help="HF directory (config.json + safetensors), checkpoint, or run directory")
    p.add_argument("dst", help="output: a checkpoint directory (from HF) or an HF directory (from PithTrain)")
    p.set_defaults(func=_cmd_convert)

    p = sub.add_parser("eval", help="mean next-token cross-entropy over an int array [batch, seq]")
    p.add_argument("checkpoint", help="HF directory, PithTrain checkpoint, or run directory (latest)")
    p.add_argument("--tokens", required=True, help=".npy file of token ids, shape [batch, seq]")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    p.add_argument("--json", action="store_true", help='print one line {"loss": ..., "tokens": ...}')
    p.set_defaults(func=_cmd_eval)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    from pithtrain.config import ConfigError

    try:
        code = args.func(args)
    except (ConfigError, FileNotFoundError, FileExistsError, ValueError, KeyError) as e:
        if os.environ.get("PITHTRAIN_DEBUG"):
            raise
        print(f"error: {e}\n(set PITHTRAIN_DEBUG=1 to see the traceback)", file=sys.stderr)
        code = 2
    sys.exit(code)
