"""Per-step metrics: one JSON object per line in OUT/metrics.jsonl, one readable line on stdout,
TensorBoard scalars when tensorboard is installed, Weights & Biases when `train.wandb_project` is set."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import threading
import uuid
from pathlib import Path

import torch

from pithtrain.config import UserError, disk_error


def reset_peak_memory(device: torch.device) -> None:
    """Start a step's peak: the allocator's on CUDA, the process's resident set on Linux ("5" to clear_refs resets
    VmHWM; where refused, the peak stays the process's lifetime one)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        with contextlib.suppress(OSError):
            Path("/proc/self/clear_refs").write_text("5")


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    with contextlib.suppress(OSError, StopIteration, ValueError):
        return int(next(line for line in open("/proc/self/status") if line.startswith("VmHWM:")).split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def model_sizes(cfg) -> tuple[int, int]:
    """(parameters, parameters active per token: every MoE layer's top-k of its routed experts), counted
    on the meta device (no memory)."""
    with torch.device("meta"):
        named = list(cfg.build_model().named_parameters())
    routed = sum(p.numel() for name, p in named if ".experts." in name)  # [experts, ...] per layer
    total = sum(p.numel() for _, p in named)
    return total, total - routed + routed // max(cfg.num_routed_experts(), 1) * cfg.num_experts_per_tok


def flops_per_token(cfg, seq: int) -> float:
    """Model FLOPs a token of a training step: 6 x active non-embedding parameters (routed experts counted k/E;
    the LM head in, once a multi-token prediction depth) + causal attention (Qwen3.5's linear layers: the gated
    delta rule's chunked FLOPs). What `tflops_per_gpu` and the benchmarks' MFU count."""
    from pithtrain.ops.delta_rule import chunked_flops

    active = model_sizes(cfg)[1] - cfg.vocab_size * cfg.hidden_size  # the embedding is a lookup, not a matmul
    active += cfg.num_nextn_predict_layers * cfg.hidden_size * cfg.vocab_size
    if cfg.model_type in ("deepseek_v2", "deepseek_v3"):
        d_qk, d_v = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    else:
        d_qk = d_v = getattr(cfg, "head_dim", None) or cfg.dim_per_head
    attn = 0.0
    for i in range(cfg.num_hidden_layers + cfg.num_nextn_predict_layers):
        if cfg.model_type == "qwen3_5_moe_text" and cfg.layer_type(i) == "linear_attention":
            attn += chunked_flops(1, seq, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim) / seq
            continue
        sliding = cfg.model_type == "gpt_oss" and cfg.layer_type(i) == "sliding_attention"
        ctx = min(cfg.sliding_window, seq / 2) if sliding else seq / 2  # mean keys seen per query
        attn += 2 * ctx * cfg.num_attention_heads * (d_qk + d_v)  # QK^T and AV per token, forward
    return 6 * active + 3 * attn


def duration(seconds: float) -> str:
    """45s, 3m05s, 2h03m, 12d16h."""
    s = int(max(seconds, 0) + 0.5)
    return (f"{s}s" if s < 60 else f"{s // 60}m{s % 60:02d}s" if s < 3600 else f"{s // 3600}h{s // 60 % 60:02d}m"
            if s < 86400 else f"{s // 86400}d{s // 3600 % 24:02d}h")


def format_line(m: dict, total_steps: int, elapsed: float | None = None, eta: float | None = None) -> str:
    tps = m["tokens_per_s"]
    tps_text = f"{tps / 1e6:.2f}M" if tps >= 1e6 else f"{tps / 1e3:.1f}k" if tps >= 1e3 else f"{tps:.0f}"
    progress = "" if elapsed is None else f" | {duration(elapsed)} elapsed" + ("" if eta is None else f", ETA {duration(eta)}")
    return (f"step {m['step']}/{total_steps} | loss {m['loss']:.4f}"
            + (f" | eval {m['eval_loss']:.4f}" if "eval_loss" in m else "")
            + (f" | mtp {m['mtp_loss']:.4f}" if "mtp_loss" in m else "")
            + f" | lb {m['lb_loss']:.4f} | lr {m['lr']:.2e} | gnorm {m['grad_norm']:.3f} | {tps_text} tok/s"
            + (f" | {m['tflops_per_gpu']:.4g} TFLOP/s/GPU" if "tflops_per_gpu" in m else "")
            + f" | {m['step_time_s']:.3f} s/step | mem {m['peak_mem_bytes'] / 2**30:.2f} GiB"
            + (f" | ep balance {m['ep_load_balance']:.2f}" if "ep_load_balance" in m else "") + progress)


class MetricsLog:
    def __init__(self, out_dir: str | Path, tensorboard: bool, enabled: bool = True, wandb_project: str = "",
                 config: dict | None = None, start: int = 0):
        """`start`: the step the run resumes from; the steps after it replace an interrupted attempt's."""
        self.enabled, self.path = enabled, Path(out_dir) / "metrics.jsonl"
        self.writer = self.wandb = None
        if enabled and tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                # purge_step: TensorBoard hides the earlier event files' steps from here on (a killed attempt's)
                hook = threading.excepthook  # its writer thread's failed write: raised by the next call, said there
                if not hasattr(hook, "quiet_tensorboard"):  # once: not one more wrapper each run of a process
                    threading.excepthook = lambda a: None if isinstance(a.exc_value, OSError) and \
                        type(a.thread).__module__.startswith("tensorboard") else hook(a)
                    threading.excepthook.quiet_tensorboard = True
                self.writer = SummaryWriter(str(Path(out_dir) / "tensorboard"), purge_step=start + 1)
            except OSError as e:
                raise disk_error(e, Path(out_dir) / "tensorboard", then="run again (or set train.tensorboard=false)") or e
            except ImportError:
                print("note: tensorboard is not installed (pip install tensorboard, or make setup); "
                      "train.tensorboard=false silences this", flush=True)
        if enabled and wandb_project:
            try:
                self.wandb = _wandb_run(wandb_project, Path(out_dir), config)
            except Exception as e:  # wandb's own errors (no network, a rejected key), before the first step
                reason = " ".join(str(e).split())[:300]
                raise UserError(f"train.wandb_project={wandb_project!r}: wandb did not start ({type(e).__name__}: {reason}); "
                                "check the network and `wandb login`, or log offline with WANDB_MODE=offline") from None

    def log(self, metrics: dict, total_steps: int, echo: bool = True, elapsed: float | None = None,
            eta: float | None = None) -> None:
        if not self.enabled:
            return
        size = self.path.stat().st_size if self.path.exists() else 0
        try:
            with open(self.path, "a") as f:
                f.write(json.dumps(metrics) + "\n")  # json writes floats with full precision (repr)
        except OSError as e:  # no half line left behind: a resume reads every line
            with contextlib.suppress(OSError):  # nothing to cut when the file did not open
                os.truncate(self.path, size)
            raise disk_error(e, self.path, then="run again to resume from the last checkpoint") or e
        if echo:
            print(format_line(metrics, total_steps, elapsed, eta), flush=True)
        if self.writer is not None:
            with self._tensorboard():
                for k, v in metrics.items():
                    if k not in ("step", "time") and isinstance(v, (int, float)):  # eval_loss as eval/loss
                        self.writer.add_scalar("eval/loss" if k == "eval_loss" else f"train/{k}", v, metrics["step"])
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in metrics.items() if k != "step"}, step=metrics["step"])

    @contextlib.contextmanager
    def _tensorboard(self):
        try:
            yield
        except OSError as e:  # a full disk, a deleted directory: what its writer thread met
            raise disk_error(e, self.writer.log_dir, then="run again (or set train.tensorboard=false)") or e

    def close(self, failed: bool = False) -> None:
        if self.writer is not None:
            with self._tensorboard():
                self.writer.close()
        if self.wandb is not None:  # a failed run shows as failed there, not as finished
            self.wandb.finish(exit_code=1) if failed else self.wandb.finish()


WANDB_ID = "wandb_id"  # in the run directory: every attempt of the run logs to this one wandb run


def _wandb_run(project: str, out_dir: Path, config: dict | None):
    """A wandb run named after the run directory, the same one across resumes (its id kept in OUT/wandb_id; wandb drops
    re-logged steps, which a bit-exact resume logs with the same values); WANDB_MODE (offline, disabled) and the other
    WANDB_* variables act as wandb documents. `validate` refused a missing package before training."""
    import wandb

    id_file = out_dir / WANDB_ID
    run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:12]
    id_file.write_text(run_id + "\n")
    return wandb.init(project=project, name=out_dir.resolve().name, dir=str(out_dir), config=config, id=run_id,
                      resume="allow")


def read_metrics(path: str | Path, numbered: bool = False, fix: str = "") -> list:
    """The rows of a metrics.jsonl (`numbered`: as (line number, row)); a last line without its newline was cut
    short by a killed run: dropped. A line that is not JSON is a ValueError naming its number; with a `fix`, a
    UserError naming the file and `fix`, as is then a row without an integer "step"."""
    rows = []
    for number, line in enumerate(Path(path).read_text(errors="replace").split("\n")[:-1], 1):
        try:
            rows += [(number, json.loads(line))] if line.strip() else []
        except ValueError as e:
            error = f"line {number} is not JSON ({e.msg})"
            raise (UserError(f"{path}: {error}; {fix}") if fix else ValueError(error)) from None
    if fix and (bad := next((n for n, m in rows if not isinstance(m, dict) or not isinstance(m.get("step"), int)), None)):
        raise UserError(f'{path}: line {bad} has no integer "step"; {fix}')
    return rows if numbered else [row for _, row in rows]
