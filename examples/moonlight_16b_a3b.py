"""Moonlight-16B-A3B (Moonshot AI) at its real architecture: a DeepSeek-V3 model (HF model_type deepseek_v3)
with 27 layers, hidden 2048, MLA without q-LoRA (kv_lora_rank 512), 64 routed experts top-6 plus 2 shared,
the first layer dense, sigmoid noaux_tc routing (one group) with routed_scaling_factor 2.446, plain RoPE.

The fields are those of the published config.json of moonshotai/Moonlight-16B-A3B (checked on
2026-12-02 against a public copy of it: every architecture field, rms_norm_eps 1e-5, bos/eos 163584/163586,
max_position_embeddings 8192). With the checkpoint at hand, `pithtrain convert` reads its config.json
and needs none of this file.

Run on GPUs (about 16B parameters in all, 3B active per token); 8 H200s at ep8 fit with data.seq_len=4096
(estimate-memory: 95.5 GiB per GPU), not at 8192 (140.7 GiB):
    pithtrain train examples/moonlight_16b_a3b.py --out runs/moonlight --set data.path=/data/my_corpus --nproc 8 --ep 8
To continue pretraining the released weights, point train.init_from at the HF directory.
"""

from pithtrain.config import DataConfig, OptimConfig, RunConfig, TrainConfig
from pithtrain.models.deepseek_v2 import DeepseekV3Config

CONFIG = RunConfig(
    model=DeepseekV3Config(
        vocab_size=163840,
        hidden_size=2048,
        intermediate_size=11264,
        moe_intermediate_size=1408,
        num_hidden_layers=27,
        num_attention_heads=16,
        num_key_value_heads=16,
        q_lora_rank=None,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_routed_experts=64,
        n_shared_experts=2,
        num_experts_per_tok=6,
        first_k_dense_replace=1,
        moe_layer_freq=1,
        topk_method="noaux_tc",
        n_group=1,
        topk_group=1,
        scoring_func="sigmoid",
        norm_topk_prob=True,
        routed_scaling_factor=2.446,
        rms_norm_eps=1e-5,
        rope_theta=50000.0,
        rope_scaling=None,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        bos_token_id=163584,
        eos_token_id=163586,
    ),
    data=DataConfig(path="data/corpus", seq_len=4096),
    optim=OptimConfig(lr=3e-4, min_lr_ratio=0.1, schedule="cosine", warmup_steps=2000, weight_decay=0.1, grad_clip=1.0),
    train=TrainConfig(steps=100_000, global_batch_size=512, micro_batch_size=1, checkpoint_every=1000),
)
