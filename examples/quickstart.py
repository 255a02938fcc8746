"""The embedded default job (`make train`): no download, end to end in a few minutes on 2 CPU cores.
`--data-only` (`make data`) builds step 2's dataset alone (data/stdlib, the examples' data) and stops.

1. corpus: the Python standard library's sources (every Python install has them);
2. a byte-level BPE tokenizer trained on it, and the corpus tokenized into a dataset (data/stdlib:
   tokens, the tokenizer, and held-out eval tokens from other stdlib files in data/stdlib/eval.npy);
3. examples/qwen3_tiny.py trained for a few hundred steps (GPU when present), with checkpoints;
4. the final checkpoint exported in HF format and loaded with transformers.AutoModelForCausalLM;
5. eval loss of PithTrain and of transformers on held-out stdlib files, side by side.
Ends with PASS when the loss is well below the unigram entropy and the two eval losses agree.
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from pithtrain.config import load_run_config
from pithtrain.tools.hf import evaluate, load_model, write_hf_dir
from pithtrain.tools.tokenize import (
    iter_documents,
    stdlib_corpus_files,
    tokenize_to_dataset,
    train_bpe,
    unigram_entropy,
)
from pithtrain.train.checkpoint import resolve_checkpoint
from pithtrain.train.data import TokenDataset
from pithtrain.train.loop import train

ROOT = Path(__file__).resolve().parent.parent
TRAIN_BYTES = 10_000_000
EVAL_BYTES = 1_000_000


def build_data(data_dir: Path, vocab_size: int) -> None:
    """Tokenize the stdlib into data_dir (once) and write held-out eval tokens to data_dir/eval.npy."""
    if (data_dir / "meta.json").is_file() and (data_dir / "eval.npy").is_file():
        print(f"[data] using {data_dir} (delete it to rebuild)")
        return
    if data_dir.exists() and (not data_dir.is_dir() or any(data_dir.iterdir())):  # never replace what is not ours
        sys.exit(f"error: --data {data_dir} exists and is no finished quickstart dataset (it has no eval.npy): "
                 "delete it to rebuild, or give --data another path")
    files = stdlib_corpus_files(TRAIN_BYTES + EVAL_BYTES)
    sizes = np.cumsum([Path(f).stat().st_size for f in files])
    split = int(np.searchsorted(sizes, TRAIN_BYTES))
    train_files, eval_files = files[:split], files[split:]
    print(f"[data] corpus: {len(train_files)} stdlib files for training, {len(eval_files)} held out for eval")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:  # the dataset keeps its own copy of the tokenizer
        tokenizer_file = train_bpe(iter_documents(train_files), vocab_size, str(Path(scratch) / "tokenizer.json"))
        print(f"[data] trained a byte-level BPE of {vocab_size} tokens in {time.perf_counter() - t0:.1f}s")
        tokenize_to_dataset(train_files, tokenizer_file, str(data_dir))
    tokenizer_file = str(data_dir / "tokenizer.json")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_file)
    eos = [TokenDataset(data_dir).eos_id]  # documents end with EOS, as in the training data
    ids = np.concatenate([np.array(tok.encode(t, add_special_tokens=False).ids + eos) for t in iter_documents(eval_files)])
    seq = 129
    rows = min(32, len(ids) // seq)
    np.save(data_dir / "eval.npy", ids[: rows * seq].reshape(rows, seq).astype(np.int64))


@torch.no_grad()
def transformers_eval(hf_dir: Path, tokens: torch.Tensor, device: str) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).to(device).eval()
    total, count = 0.0, 0
    for i in range(0, tokens.shape[0], 8):
        chunk = tokens[i : i + 8].to(device)
        logits = model(chunk[:, :-1]).logits.float()
        total += torch.nn.functional.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum").item()
        count += chunk[:, 1:].numel()
    return total / count


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "examples/qwen3_tiny.py"))
    parser.add_argument("--data", default=str(ROOT / "data/stdlib"))
    parser.add_argument("--out", default=str(ROOT / "runs/quickstart"))
    parser.add_argument("--steps", type=int, help="override train.steps")
    parser.add_argument("--data-only", action="store_true", help="build the dataset (--data) and stop (`make data`)")
    args = parser.parse_args()
    started = time.perf_counter()

    config = load_run_config(args.config)
    data_dir = Path(args.data)
    build_data(data_dir, config.model.vocab_size)
    if args.data_only:
        print(f"[data] {data_dir}: {TokenDataset(data_dir).num_tokens:,} training tokens, held-out eval tokens in "
              f"{data_dir / 'eval.npy'} | {time.perf_counter() - started:.0f}s")
        return 0
    config.data.path = str(data_dir)
    entropy = unigram_entropy(TokenDataset(data_dir))
    print(f"[data] unigram entropy of the training tokens: {entropy:.4f} nats/token")

    out = Path(args.out)  # the demo trains from scratch: it replaces only its own runs (the default --out, or marked)
    if out.exists() and out.resolve() != Path(parser.get_default("out")).resolve() and not (out / ".quickstart").is_file():
        sys.exit(f"error: --out {out} exists and is not a quickstart run: give another --out, or delete it")
    shutil.rmtree(out, ignore_errors=True)
    print(f"[train] {args.config} -> {out}")
    history = train(config, out, steps=args.steps)
    (out / ".quickstart").touch()
    final_loss = float(np.mean([m["loss"] for m in history[-10:]]))

    ckpt = resolve_checkpoint(out)
    hf_dir = write_hf_dir(load_model(ckpt), out / "hf", TokenDataset(data_dir))
    print(f"[export] {ckpt} -> {hf_dir} (HF format)")

    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokens = torch.from_numpy(np.load(data_dir / "eval.npy"))
    ours, count = evaluate(load_model(ckpt), tokens, device=device)
    theirs = transformers_eval(hf_dir, tokens, device)
    rel = abs(ours - theirs) / abs(theirs)
    print(f"[eval] held-out tokens: {count}")
    print(f"[eval] PithTrain eval loss     {ours:.6f}")
    print(f"[eval] transformers eval loss  {theirs:.6f}   (relative difference {rel:.2e})")
    print(f"[summary] unigram entropy {entropy:.4f} | final train loss {final_loss:.4f} (mean of last 10 steps) | "
          f"eval loss {ours:.4f} | {time.perf_counter() - started:.0f}s")
    ok = final_loss < entropy - 1.0 and rel <= 1e-4 and math.isfinite(ours)
    print("PASS" if ok else "FAIL: loss not well below the unigram entropy, or PithTrain and transformers disagree")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
