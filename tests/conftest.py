"""Shared fixtures: a small synthetic token dataset and a tiny Qwen3-MoE run config."""

import numpy as np
import pytest
import torch

from pithtrain.config import DataConfig, OptimConfig, RunConfig, TrainConfig
from pithtrain.models.qwen3_moe import Qwen3MoeConfig
from pithtrain.train.data import write_dataset

torch.set_num_threads(2)


def markov_docs(rng, vocab: int, n_docs: int, length=(20, 120)):
    """Documents from a random sparse Markov chain: learnable structure, so the loss can fall."""
    nxt = rng.integers(1, vocab, size=(vocab, 3))
    docs = []
    for _ in range(n_docs):
        tok = int(rng.integers(1, vocab))
        doc = []
        for _ in range(int(rng.integers(*length))):
            doc.append(tok)
            tok = int(nxt[tok, rng.integers(0, 3)])
        docs.append(doc)
    return docs


@pytest.fixture(scope="session")
def dataset_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "markov"
    write_dataset(path, markov_docs(np.random.default_rng(7), 64, 400), vocab_size=64, eos_id=0)
    return path


def tiny_config(data_path, **train) -> RunConfig:
    model = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                           num_experts=4, num_experts_per_tok=2, mlp_only_layers=[], max_position_embeddings=128,
                           rope_theta=10000.0)
    defaults = dict(steps=6, global_batch_size=8, micro_batch_size=4, lb_coef=0.01, tensorboard=False, log_every=1)
    defaults.update(train)
    return RunConfig(model=model, data=DataConfig(path=str(data_path), seq_len=32),
                     optim=OptimConfig(lr=3e-3, warmup_steps=2), train=TrainConfig(**defaults))
