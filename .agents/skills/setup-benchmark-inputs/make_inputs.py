"""Write a dataset the benchmarks or a run need, then verify it; ends with PASS or FAIL.

  python .agents/skills/setup-benchmark-inputs/make_inputs.py random --family qwen3 --tokens 50000000 --out data/random_qwen3
  python .agents/skills/setup-benchmark-inputs/make_inputs.py stdlib [--max-bytes 20000000] [--vocab-size 4096] --out data/stdlib_20m
  python .agents/skills/setup-benchmark-inputs/make_inputs.py corpus DIR [--vocab-size 4096] --out data/mine
  python .agents/skills/setup-benchmark-inputs/make_inputs.py check --out DIR [--vocab V]   (verify only)

random: uniform token ids at the family's real vocabulary (that of its example config, FAMILIES),
one document, no EOS: what benchmarks/train_throughput.py writes for itself. It refuses an --out that
holds anything unless --overwrite (which replaces a dataset, never other files).
stdlib / corpus: `pithtrain tokenize` with a byte-level BPE trained on the text.
"""

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "_common"))
import runs  # noqa: E402  (the helpers the skill scripts share: argument types)

FAMILIES = {"qwen3": "qwen3_30b_a3b.py", "qwen3_5": "qwen3_5_35b_a3b.py", "deepseek_v2": "deepseek_v2_lite.py",
            "deepseek_v3": "deepseek_v3_671b.py", "moonlight": "moonlight_16b_a3b.py", "gpt_oss": "gpt_oss_20b.py"}


def family_vocab(family: str) -> int:
    """The vocabulary of the family's real-size example config (examples/, as train_throughput.py's family_config)."""
    from pithtrain.config import load_run_config

    return load_run_config(ROOT / "examples" / FAMILIES[family]).model.vocab_size


def write_random(out: str, family: str, tokens: int, seed: int, overwrite: bool) -> int | str:
    """The vocabulary written, or why --out is refused (before any token is drawn)."""
    from pithtrain.train.data import check_output_dir, dtype_for_vocab, write_dataset

    try:
        check_output_dir(out)
    except FileExistsError as e:
        return f"--out: {e}"
    if Path(out).is_dir() and any(Path(out).iterdir()) and not overwrite:
        return f"--out {out} already holds a dataset; choose a new directory, or pass --overwrite to replace it"
    vocab = family_vocab(family)
    parent = next(p for p in Path(os.path.abspath(out)).parents if p.exists())
    need = {"memory": 8 * tokens, "disk": dtype_for_vocab(vocab).itemsize * tokens}  # drawn as int64, stored narrow
    have = {"memory": os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "disk": shutil.disk_usage(parent).free}
    if short := next((k for k in need if need[k] > have[k]), None):
        return (f"--tokens {tokens:,}: needs {need[short] / 2**30:.1f} GiB of {short}, this machine has "
                f"{have[short] / 2**30:.1f}{f' free under {parent}' if short == 'disk' else ''}; ask for fewer tokens")
    ids = np.random.default_rng(seed).integers(0, vocab, size=tokens, dtype=np.int64)
    write_dataset(out, [ids], vocab, eos_id=None)
    return vocab


def tokenize(out: str, inputs: list[str], vocab: int, overwrite: bool) -> bool:
    cmd = [sys.executable, "-m", "pithtrain", "tokenize", *inputs, "--train-tokenizer", "--vocab-size", str(vocab), "--out", out]
    cmd += ["--overwrite"] if overwrite else []
    print("$", " ".join(cmd), flush=True)
    return subprocess.run(cmd).returncode == 0


def verify(out: str, vocab: int | None, tokens: int | None, tokenizer: bool) -> list[str]:
    """Open the dataset as training does; return the problems found (empty: usable)."""
    from pithtrain.train.data import TokenDataset

    try:
        data = TokenDataset(out)
        data.check_vocab(vocab or data.vocab_size)  # scans tokens.bin: its max id against meta and the vocabulary
    except Exception as e:  # noqa: BLE001 - every failure to open is the finding
        return [f"{type(e).__name__}: {e}"]
    print(f"{data!r}, dtype {data.tokens.dtype}, max token id {data.max_token_id}, eos_id {data.eos_id}")
    problems = []
    if vocab is not None and data.vocab_size != vocab:
        problems.append(f"vocab_size {data.vocab_size}, expected {vocab}")
    if tokens is not None and data.num_tokens != tokens:
        problems.append(f"{data.num_tokens} tokens, expected {tokens}")
    if data.num_tokens < 2:
        problems.append("fewer than 2 tokens: no training window fits")
    if tokenizer and data.tokenizer_file is None:
        problems.append("no tokenizer.json in the dataset (eval and HF export need it)")
    return problems


@runs.interruptible
def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=["random", "stdlib", "corpus", "check"])
    parser.add_argument("corpus", nargs="*", help="corpus: text files, directories or .jsonl files")
    parser.add_argument("--out", required=True, help="dataset directory (new, or a dataset to replace)")
    parser.add_argument("--family", choices=list(FAMILIES), help="random: the vocabulary's family")
    parser.add_argument("--tokens", type=runs.number(int, low=2), help="random: how many tokens (seq+1 per sample and step)")
    parser.add_argument("--seed", type=runs.number(int, low=0), default=0)
    parser.add_argument("--vocab-size", type=runs.COUNT, help="stdlib/corpus: the BPE's vocabulary (default 4096)")
    parser.add_argument("--max-bytes", type=runs.COUNT, default=20_000_000, help="stdlib: how much source text")
    parser.add_argument("--vocab", type=runs.COUNT, help="check: the vocabulary to expect")
    parser.add_argument("--overwrite", action="store_true", help="replace a dataset at --out (never other files)")
    args = parser.parse_args()
    vocab, tokens, tokenizer = args.vocab, None, args.kind in ("stdlib", "corpus")
    if args.corpus and args.kind != "corpus":  # else ignored: `check DIR --out OTHER` would verify OTHER
        parser.error(f"{args.kind} takes no DIR or files (got {' '.join(args.corpus)}); " + (
            "the dataset to verify is --out DIR: `check --out DIR`" if args.kind == "check" else "drop them, or use corpus"))
    own = {"random": ("family", "tokens", "seed", "overwrite"), "stdlib": ("max_bytes", "vocab", "overwrite"),
           "corpus": ("vocab", "overwrite"), "check": ("vocab",)}[args.kind]
    if stray := next((name for name in ("family", "tokens", "seed", "max_bytes", "vocab", "overwrite")
                      if name not in own and getattr(args, name) != parser.get_default(name)), None):
        parser.error(f"{args.kind} takes no --{stray.replace('_', '-')} (it would be ignored); drop it")
    if args.vocab_size is not None and not tokenizer:
        parser.error(f"--vocab-size is stdlib's and corpus's (a BPE's size); {args.kind} takes "
                     + ("its family's vocabulary (--family)" if args.kind == "random" else "--vocab to expect one"))
    if args.kind == "random":
        if not args.family or not args.tokens:
            parser.error("random needs --family and --tokens (>= 2)")
        vocab, tokens = write_random(args.out, args.family, args.tokens, args.seed, args.overwrite), args.tokens
        if isinstance(vocab, str):
            return runs.verdict(False, vocab)
        print(f"wrote {args.out}: {tokens:,} random tokens in [0, {vocab}) ({args.family})")
    elif args.kind in ("stdlib", "corpus"):
        if args.kind == "corpus" and not args.corpus:
            parser.error("corpus takes DIR or files (the texts to tokenize)")
        inputs = args.corpus if args.kind == "corpus" else ["--stdlib", "--max-bytes", str(args.max_bytes)]
        if not tokenize(args.out, inputs, args.vocab_size or 4096, args.overwrite):
            print("FAIL: pithtrain tokenize did not finish (its message is above)")
            return 1
    problems = verify(args.out, vocab, tokens, tokenizer)
    for p in problems:
        print("problem:", p)
    checked = "".join([f", vocab {vocab}" * (vocab is not None), f", {tokens} tokens" * (tokens is not None),
                       ", its tokenizer.json" * tokenizer])
    print(f"PASS: {args.out} opens as training does, ids within its vocabulary{checked}" if not problems
          else f"FAIL: {args.out} is not a usable dataset")
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
