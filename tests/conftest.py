"""Shared fixtures: a small synthetic token dataset and a tiny Qwen3-MoE run config."""

import os

# Inductor compiles in this process instead of starting a pool of compile workers: on 2 cores the
# pool's start costs more than it saves (tests/test_compile.py and the compiled recompute test: 165 s
# of CPU cold with the pool, 118 s without, same graphs and kernels)
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# one intra-op thread in each of `make test`'s xdist workers and (OMP_NUM_THREADS) the processes they start:
# two workers of two threads each oversubscribe 2 cores and OpenMP's idle threads spin (the whole suite
# cold: 343 s with two threads, 248 s with one). The fast tier, one process, keeps two.
XDIST = "PYTEST_XDIST_WORKER" in os.environ
if XDIST:
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import pytest
import torch

from pithtrain.config import DataConfig, OptimConfig, RunConfig, TrainConfig
from pithtrain.models.qwen3_moe import Qwen3MoeConfig
from pithtrain.train.data import write_dataset

torch.set_num_threads(1 if XDIST else 2)


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


@pytest.fixture
def capture_only_compile(monkeypatch):
    """torch.compile with the aot_eager_decomp_partition backend: Dynamo's capture (fullgraph: a graph break
    raises; its guards, so a recompilation shows), inductor's decompositions and forward/backward partition
    (the graphs inductor would get), run by eager kernels. What it leaves out is inductor's C++ code
    generation for the CPU: 20-70 s per family on a cold cache (CI's), and not the code a GPU runs. (Plain
    aot_eager fails on the hybrid family: its traced softplus backward views a tensor whose runtime strides
    differ from the traced ones; the decompositions avoid that op.) test_compile.py's first test keeps
    inductor, end to end."""
    import functools

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager_decomp_partition"))


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


def tiny_deepseek_config(data_path, **train) -> RunConfig:
    """DeepSeek-V2 with MLA (q-LoRA), a shared expert, a dense first layer and V3-style sigmoid
    routing with the aux-loss-free correction bias."""
    from pithtrain.models.deepseek_v2 import DeepseekV2Config

    cfg = tiny_config(data_path, **train)
    cfg.model = DeepseekV2Config(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                                 num_hidden_layers=3, num_attention_heads=4, q_lora_rank=16, kv_lora_rank=16,
                                 qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=4,
                                 n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
                                 topk_method="noaux_tc", scoring_func="sigmoid", n_group=2, topk_group=1,
                                 norm_topk_prob=True, routed_scaling_factor=1.5, bias_update_speed=0.01,
                                 max_position_embeddings=128, rope_theta=10000.0)
    return cfg


def tiny_deepseek_v3_config(data_path, **train) -> RunConfig:
    """DeepSeek-V3 (DeepseekV3Config's switches): q-LoRA MLA, YaRN with mscale, a dense first layer,
    grouped noaux_tc routing with the correction bias, a shared expert, one multi-token prediction depth;
    four layers, so pp2 gets two each."""
    from pithtrain.models.deepseek_v2 import DeepseekV3Config

    cfg = tiny_config(data_path, **train)
    cfg.model = DeepseekV3Config(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                                 num_hidden_layers=4, num_attention_heads=4, q_lora_rank=16, kv_lora_rank=16,
                                 qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=4,
                                 n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, n_group=2,
                                 topk_group=1, routed_scaling_factor=2.5, bias_update_speed=0.01,
                                 rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                                               "mscale": 1.0, "mscale_all_dim": 1.0},
                                 max_position_embeddings=128, rope_theta=10000.0, num_nextn_predict_layers=1)
    return cfg


def tiny_gpt_oss_config(data_path, **train) -> RunConfig:
    """GPT-OSS with sinks, alternating sliding-window/full attention and clamped SwiGLU."""
    from pithtrain.models.gpt_oss import GptOssConfig

    cfg = tiny_config(data_path, **train)
    cfg.model = GptOssConfig(vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                             num_experts_per_tok=2, sliding_window=8, swiglu_limit=3.0,
                             max_position_embeddings=128)
    return cfg


def tiny_qwen3_5_config(data_path, **train) -> RunConfig:
    """Qwen3.5-MoE: Gated DeltaNet and gated full attention layers alternating (each pipeline
    chunk of pp2 gets one), grouped value heads, partial rotary, a shared expert."""
    from pithtrain.models.qwen3_5_moe import Qwen3_5MoeConfig

    cfg = tiny_config(data_path, **train)
    cfg.model = Qwen3_5MoeConfig(vocab_size=64, hidden_size=32, num_hidden_layers=4,
                                 layer_types=["linear_attention", "full_attention"] * 2, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=8, partial_rotary_factor=0.5, rope_theta=10000.0,
                                 linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                                 linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
                                 moe_intermediate_size=16, shared_expert_intermediate_size=16, max_position_embeddings=128)
    return cfg


def hf_grads(hf, ids, labels, dtype=torch.float64):
    """(loss, gradients) of the mean next-token cross-entropy of a copy of HF model `hf` in `dtype`, the
    gradients under the keys HF saves (its fused in-memory experts split per expert)."""
    model = type(hf)(hf.config).to(dtype)
    model.load_state_dict(hf.state_dict())
    loss = torch.nn.functional.cross_entropy(model(ids).logits.flatten(0, 1), labels.flatten())
    loss.backward()
    return loss, per_expert_grads(model)


def per_expert_grads(model) -> dict:
    """The .grad of every parameter of an HF model under the keys it saves: fused `experts.gate_up_proj`
    [E, 2I, H] and `experts.down_proj` [E, H, I] split into experts.{e}.gate_proj/up_proj/down_proj.weight."""
    out = {}
    for n, p in model.named_parameters():
        if n.endswith("experts.gate_up_proj"):
            for e, g in enumerate(p.grad):
                out[f"{n[:-12]}{e}.gate_proj.weight"], out[f"{n[:-12]}{e}.up_proj.weight"] = g.chunk(2, 0)
        elif n.endswith("experts.down_proj"):
            for e, g in enumerate(p.grad):
                out[f"{n[:-9]}{e}.down_proj.weight"] = g
        else:
            out[n] = p.grad
    return out


RUN_FILE = """from pithtrain.config import DataConfig, OptimConfig, RunConfig, TrainConfig
from pithtrain.models.qwen3_moe import Qwen3MoeConfig

CONFIG = RunConfig(
    model=Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         num_experts=4, num_experts_per_tok=2, mlp_only_layers=[], max_position_embeddings=128,
                         rope_theta=10000.0),
    data=DataConfig(path={data!r}, seq_len=32),
    optim=OptimConfig(lr=3e-3, warmup_steps=1),
    train=TrainConfig(steps=2, global_batch_size=8, micro_batch_size=4, tensorboard=False),
)
"""


def write_run_file(path, data_path, extra: str = ""):
    """A run file (`CONFIG = RunConfig(...)`) of a tiny Qwen3-MoE on `data_path`, then `extra` lines."""
    path.write_text(RUN_FILE.format(data=str(data_path)) + extra)
    return path


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """`-n N` without --dist schedules by file (`--dist loadfile`, as `make test` passes), not xdist's default
    `load`: that one deals a file's tests out to every worker, and each worker then builds the file's module
    fixtures (tests/test_parallel.py's single-process references and mesh launches, 144 s of work instead of
    86 s on 2 workers). An explicit --dist is kept. Runs before xdist's own hook (a conftest's tryfirst hook
    is called before an installed plugin's), which turns an unset --dist into `load`."""
    if getattr(config.option, "numprocesses", None) and config.option.dist == "no":
        config.option.dist = "loadfile"


def pytest_collection_modifyitems(config, items):
    """Tests marked `slow` run only with PITHTRAIN_SLOW=1 or when `-m` names them."""
    if os.environ.get("PITHTRAIN_SLOW") == "1" or "slow" in (config.option.markexpr or ""):
        return
    skip = pytest.mark.skip(reason="slow: set PITHTRAIN_SLOW=1 or pass -m slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
