"""Acceptance test of feat_lb_entropy (PithTrain): train.lb_type="entropy" computes log(E) - H(mean P)
against a float64 computation (value and gradient), passes config validation, and trains."""

import json
import math
import subprocess
import sys

import numpy as np
import torch

from pithtrain.config import ConfigError, DataConfig, OptimConfig, RunConfig, TrainConfig, validate
from pithtrain.models.qwen3_moe import Qwen3MoeConfig
from pithtrain.protocol import RoutingInfo
from pithtrain.train.balance import LoadBalance
from pithtrain.train.data import write_dataset


def test_value_and_gradient():
    torch.manual_seed(0)
    T, E = 48, 6
    logits = torch.randn(T, E, dtype=torch.float64, requires_grad=True)
    scores = torch.softmax(logits, -1)
    ids = scores.topk(2, -1).indices
    loss = LoadBalance("entropy").layer_loss(RoutingInfo(ids, scores.gather(1, ids), scores, E), batch=4, seq=12)
    ref_logits = logits.detach().clone().requires_grad_(True)
    p = torch.softmax(ref_logits, -1).mean(0)
    ref = math.log(E) + (p * p.log()).sum()
    # the framework may compute in float32 (router scores are): L is a small difference of O(1) terms
    torch.testing.assert_close(loss.double(), ref, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(torch.autograd.grad(loss, logits)[0], torch.autograd.grad(ref, ref_logits)[0], rtol=1e-4, atol=1e-7)
    balanced = torch.full((T, E), 1 / E, dtype=torch.float64)
    assert abs(float(LoadBalance("entropy").layer_loss(RoutingInfo(ids, balanced.gather(1, ids), balanced, E), 4, 12))) < 1e-6


def config(path, lb_type):
    model = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
                           mlp_only_layers=[], max_position_embeddings=64, rope_theta=10000.0)
    return RunConfig(model=model, data=DataConfig(path=str(path), seq_len=16), optim=OptimConfig(lr=3e-3, warmup_steps=1),
                     train=TrainConfig(steps=2, global_batch_size=4, micro_batch_size=2, lb_coef=0.1, lb_type=lb_type,
                                       tensorboard=False, checkpoint_every=-1))


def test_validation_and_training(tmp_path):
    rng = np.random.default_rng(0)
    write_dataset(tmp_path / "data", [list(rng.integers(1, 64, 50)) for _ in range(40)], vocab_size=64, eos_id=0)
    validate(config(tmp_path / "data", "entropy"))
    try:
        validate(config(tmp_path / "data", "bogus"))
        raise AssertionError("lb_type=bogus must be rejected")
    except ConfigError:
        pass
    (tmp_path / "run.py").write_text(
        "from pithtrain.config import *\nfrom pithtrain.models.qwen3_moe import Qwen3MoeConfig\n"
        f"CONFIG = {config(tmp_path / 'data', 'entropy')!r}\n")
    p = subprocess.run([sys.executable, "-m", "pithtrain", "train", str(tmp_path / "run.py"), "--out", str(tmp_path / "out")],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(0 <= r["lb_loss"] < math.log(4) for r in rows)
