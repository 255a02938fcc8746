"""FP8 against bf16 on a real corpus: the same model, data and initialisation trained twice on one GPU.

A Qwen3-MoE of ~137M active parameters (10 layers, hidden 1024, 32 experts, top 4) on the Python
standard library's sources (byte-level BPE, 8192 tokens), seq 1024, 16 samples a step. Prints both
curves, the relative gap of their last-100-step means (target: within 1%), writes a plot and a
JSON line to benchmarks/results.jsonl.

    PYTHONPATH=. python benchmarks/fp8_loss.py --steps 500 --plot docs/fp8_loss.png
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from results import record  # noqa: E402

from pithtrain.config import DataConfig, OptimConfig, RunConfig, TrainConfig  # noqa: E402
from pithtrain.models.qwen3_moe import Qwen3MoeConfig  # noqa: E402
from pithtrain.train.loop import train  # noqa: E402


def model_config() -> Qwen3MoeConfig:
    return Qwen3MoeConfig(vocab_size=8192, hidden_size=1024, intermediate_size=3072, moe_intermediate_size=768,
                          num_hidden_layers=10, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                          num_experts=32, num_experts_per_tok=4, max_position_embeddings=2048, rope_theta=10000.0)


def active_params(cfg: Qwen3MoeConfig) -> int:
    h, d = cfg.hidden_size, cfg.dim_per_head
    attn = h * d * (cfg.num_attention_heads * 2 + cfg.num_key_value_heads * 2)
    experts = cfg.num_experts_per_tok * 3 * h * cfg.moe_intermediate_size + cfg.num_experts * h
    return cfg.num_hidden_layers * (attn + experts) + 2 * cfg.vocab_size * h


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--plot", help="write a PNG of both curves here")
    parser.add_argument("--curves", help="write both curves (JSON) here")
    parser.add_argument("--fp8", default="rowwise", choices=["rowwise", "rowwise_bf16_wgrad"], help="the recipe against bf16")
    parser.add_argument("--fp8-head", action="store_true", help="train.fp8_head: the LM head in FP8 too")
    args = parser.parse_args()
    cfg = model_config()
    print(f"active parameters: {active_params(cfg) / 1e6:.0f}M", flush=True)
    curves = {}
    with tempfile.TemporaryDirectory() as tmp:
        data = f"{tmp}/stdlib"
        subprocess.run([sys.executable, "-m", "pithtrain", "tokenize", "--stdlib", "--train-tokenizer",
                        "--vocab-size", "8192", "--out", data], check=True)
        for fp8 in ("off", args.fp8):
            run = RunConfig(model=model_config(), data=DataConfig(path=data, seq_len=1024, seed=1234),
                            optim=OptimConfig(lr=1e-3, warmup_steps=50, schedule="cosine"),
                            train=TrainConfig(steps=args.steps, global_batch_size=16, micro_batch_size=8, seed=0,
                                              lb_coef=1e-2, tensorboard=False, checkpoint_every=-1, log_every=50,
                                              compile=True, fp8=fp8, fp8_head=args.fp8_head and fp8 != "off"))
            history = train(run, f"{tmp}/{fp8}", echo=True)
            curves[fp8] = [m["loss"] for m in history]
            curves[fp8 + "_tokens_per_s"] = sorted(m["tokens_per_s"] for m in history[2:])[len(history[2:]) // 2]
    bf16, fp8 = curves["off"], curves[args.fp8]
    tail = min(100, len(bf16))
    mean_bf16, mean_fp8 = sum(bf16[-tail:]) / tail, sum(fp8[-tail:]) / tail
    gap = (mean_fp8 - mean_bf16) / mean_bf16
    worst = max(abs(a - b) / b for a, b in zip(fp8[-tail:], bf16[-tail:]))
    finite = all(math.isfinite(x) for x in fp8)
    print(f"last {tail} steps: bf16 {mean_bf16:.4f}, fp8 {mean_fp8:.4f}, gap {gap:+.3%}, worst step {worst:.3%}, "
          f"finite {finite}; {'PASS' if abs(gap) <= 0.01 and finite else 'FAIL'}")
    record({"benchmark": "fp8_loss", "family": "qwen3", "active_params": active_params(cfg), "steps": args.steps,
            "seq": 1024, "global_batch": 16, "loss_bf16_last100": mean_bf16, "loss_fp8_last100": mean_fp8,
            "relative_gap": gap, "worst_step_gap": worst, "tokens_per_s_bf16": curves["off_tokens_per_s"],
            "tokens_per_s_fp8": curves[args.fp8 + "_tokens_per_s"], "fp8": args.fp8, "fp8_head": args.fp8_head})
    if args.curves:
        Path(args.curves).write_text(json.dumps({"bf16": bf16, f"fp8_{args.fp8}": fp8}))
    if args.plot:
        title = f"Qwen3-MoE {active_params(cfg) / 1e6:.0f}M active, stdlib corpus: last-100 gap {gap:+.2%}"
        plot_losses(args.plot, {"bf16": bf16, f"FP8 {args.fp8}" + (" + FP8 head" if args.fp8_head else ""): fp8}, title)


def plot_losses(path: str, curves: dict, title: str) -> None:
    """Training-loss curves ({label: losses by step}) on a log scale, as a PNG (muon_loss.py too)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, curve in curves.items():
        ax.plot(range(1, len(curve) + 1), curve, label=label, lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)

if __name__ == "__main__":
    main()
