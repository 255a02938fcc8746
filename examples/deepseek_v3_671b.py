"""DeepSeek-V3 (671B in all, 37B active per token) at its real architecture: 61 layers (the first 3 dense),
hidden 7168, MLA with q-LoRA (q_lora_rank 1536, kv_lora_rank 512), 128 heads, 256 routed experts top-8 plus
1 shared, sigmoid noaux_tc routing over 8 groups keeping 4 with routed_scaling_factor 2.5, YaRN (factor 40
over 4096 positions, mscale = mscale_all_dim = 1.0).

The fields are those of the published config.json of deepseek-ai/DeepSeek-V3 (the layer, width, MLA and
expert sizes checked on 2026-12-02 against a public configuration of it; the routing groups, YaRN and
vocabulary as published, not re-checked). Its multi-token-prediction module (num_nextn_predict_layers=1,
the released checkpoint's layer 61) is built, imported and exported; train.mtp_coef weights its loss. The
released weights are FP8 block-quantized (quantization_config): dequantize them to bf16 first.

For memory planning (`estimate-memory`) and the multi-node docs: 64 GPUs at ep64 estimate 696 GiB per GPU
(FAIL); 64 nodes of 8 H200s at pp32 x dp2 x ep8 (each EP group inside a node) with full recomputation
estimate 129.9 GiB (PASS; pp16 x dp4 x ep8: 139.3 GiB, FAIL):
    python .agents/skills/estimate-memory/estimate_memory.py examples/deepseek_v3_671b.py --nproc 512 --pp 32 \
        --ep 8 --set train.recompute=full
"""

from pithtrain.config import DataConfig, OptimConfig, RunConfig, TrainConfig
from pithtrain.models.deepseek_v2 import DeepseekV3Config

CONFIG = RunConfig(
    model=DeepseekV3Config(
        vocab_size=129280,
        hidden_size=7168,
        intermediate_size=18432,
        moe_intermediate_size=2048,
        num_hidden_layers=61,
        num_attention_heads=128,
        num_key_value_heads=128,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_routed_experts=256,
        n_shared_experts=1,
        num_experts_per_tok=8,
        first_k_dense_replace=3,
        moe_layer_freq=1,
        topk_method="noaux_tc",
        n_group=8,
        topk_group=4,
        scoring_func="sigmoid",
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling={
            "type": "yarn",
            "factor": 40,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        max_position_embeddings=163840,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        num_nextn_predict_layers=1,
    ),
    data=DataConfig(path="data/corpus", seq_len=4096),
    optim=OptimConfig(lr=2.2e-4, min_lr_ratio=0.1, schedule="cosine", warmup_steps=2000, weight_decay=0.1, grad_clip=1.0),
    train=TrainConfig(steps=100_000, global_batch_size=1024, micro_batch_size=1, checkpoint_every=500),
)
