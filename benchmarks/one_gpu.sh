#!/usr/bin/env bash
# The one-H200 runs that docs/performance.md's target table cites, most needed first: a session's device time (30
# minutes, the machine's start included) holds some seven of them. 1 FP8 + FP8 head against bf16 step by step (the
# 1.15x: 1.167x and 1.166x at 8bb0ce1, lines 156, 159); 2-3 plain FP8 + FP8 head, then plain bf16 at 9 layers (the
# same ratio from separate runs: 1.168x and 1.167x, lines 154-155, 160-161; bf16 60.1% at b3f917d, line 139); 4 the
# FP8 GPU tests (25 passed at 406e19a on an H100); 5 the persistent grouped GEMM in training (line 157); 6 compiled
# against eager stage 5 in bf16; 7 the FP8 kernels, the persistent grouped GEMM beside one tile a program (line 152);
# 8 the activation's FP8-copy kernels by tile (line 145); 9 each FP8 copy from its producer against its quantize pass
# (line 144); 10 GPT-OSS-20B at 6 layers (123 GiB; compiles ~2 min; 62.1% at eb5b802, line 147); 11 the weight
# quantization and the AdamW's amax tiles (line 158); 12 stage 1's quantizations as Inductor compiles them (line 151).
# Runs 13-25 ran on 2026-12-05 (lines 117-131), the rest not since 2026-12-04: 13 the GPU checks
# of then; 14 the DeepSeek-V3-width peer (carry .peers) and 15 the two profiles by kernel category; 16 MLA's v
# unpadded against padded; 17-18 the switches at 9 layers, several arms to a run (one compile serves them all); 19
# plain bf16 with stage_ms and its profile digest; 20 the kernels; 21 MLA's SDPA backends; 22 MLA at DeepSeek-V2-Lite
# width; 23 the Qwen3 peer at its deepest; 24 MLA with documents; 25-26 FP8 alone and the `rowwise` recipe; then the
# memory estimate's six shapes
# (Qwen3 width 4 layers at micro-batch 2 and 4, 8 and 9 layers at 4, DeepSeek-V2-Lite and GPT-OSS-20B 4 layers at
# 2: refit tools/memory's activation terms to their peaks, then tests/test_skills.py's), Muon, the GPU tests.
# Judge an A/B line with the ab-test-switch skill (`ab_switch.py --from-results FILE --line N --arm B|C|D`). Each
# run appends its line to benchmarks/results.jsonl (PITHTRAIN_RESULTS and PITHTRAIN_COMMIT redirect and stamp it on
# a machine without .git).
# One device call runs at most 10 minutes: split the plan over calls with FIRST and LAST (1-based run numbers),
# three or four 9-layer runs a call (each ~2 minutes with its compile: e.g. 1 3, then 4 6, then 14 15 carrying .peers):
#   bash benchmarks/one_gpu.sh [FIRST [LAST]]
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
T="python benchmarks/train_throughput.py --seq 4096 --compile --skip-transformers"
runs=(
    "$T --layers 9 --steps 16 --batch 4 --accum 8 --fp8 rowwise_bf16_wgrad --fp8-head --ab fp8"   # 32: >= 1.15x (1.167x / 1.166x at 8bb0ce1, lines 156, 159); arm A a 60% reading
    "$T --layers 9 --steps 7 --batch 4 --accum 8 --fp8 rowwise_bf16_wgrad --fp8-head"   # 32: FP8 alone, with run 3 the ratio from separate runs (92,682 / 92,454 at 8bb0ce1)
    "$T --layers 9 --steps 7 --batch 4 --accum 8"                                   # 32: >= 60% MFU (60.1% at b3f917d, line 139; 59.7 / 59.6% at 8bb0ce1)
    "python -m pytest -q tests/gpu/test_fp8_gpu.py tests/gpu/test_kernels_gpu.py::test_triton_adamw_matches_torchs_fused_and_writes_the_compute_copy tests/gpu/test_gpu_basics.py::test_embedding_rows_into_grad_match_nn_embedding_and_repeat tests/gpu/test_kernels_gpu.py::test_qk_norm_rope_topk_ids_and_the_combine_with_its_residual_at_qwen3_width_compiled tests/gpu/test_kernels_gpu.py::test_cross_entropy_gradient_in_place_equals_the_plain_one_without_a_second_buffer"   # passed at 406e19a (H100)
    "$T --layers 9 --steps 12 --batch 4 --accum 8 --fp8 rowwise_bf16_wgrad --fp8-head --ab gmm-persistent"   # 32: one program a tile against the persistent grouped GEMM (0.987x, line 157)
    "$T --layers 9 --steps 12 --batch 4 --accum 8 --ab stage5-compiled"              # 32: the host's cost of an eager stage 5 in bf16 (FP8 experts run it eagerly for the combine's FP8 copy)
    "python benchmarks/fp8.py"                                                       # 32: the FP8 kernels, the persistent grouped GEMM beside one tile a program (line 152); --sweep: the tiles too
    "python benchmarks/fp8.py --glu"                                                 # 32: the activation kernels with their FP8 copy by tile (fp8.GLU_QUANT_TILE, kernels.GLU_BWD_QUANT_TILE)
    "$T --layers 9 --steps 20 --batch 4 --accum 8 --fp8 rowwise_bf16_wgrad --fp8-head --ab ce-fp8-grad,combine-fp8-grad,expand-fp8"   # 32: each FP8 copy from its producer against its quantize pass (line 144: the combine's and the dispatch's kept; the cross-entropy's even, its head product since in row blocks)
    "$T --family gpt_oss --layers 6 --steps 5 --batch 4 --accum 8"                  # 18: the deepest (122.9 GiB, line 147); compiles ~2 min
    "python benchmarks/fp8.py --wquant"                                              # the weight quantization, from the AdamW's maxima too, and the AdamW's amax tiles (line 158)
    "python benchmarks/fp8.py --rows"                                                # stage 1's FP8 quantizations as Inductor compiles them, by loop.PERSISTENT_ROWS (line 151)
    "python -m pytest -q tests/gpu/test_attention_gpu.py::test_deepseek_mla_hands_v_unpadded_to_cudnn_and_matches_padded tests/gpu/test_gpu_basics.py::test_embedding_rows_into_grad_match_nn_embedding_and_repeat tests/gpu/test_kernels_gpu.py::test_fused_weight_grad_into_against_cutlass_and_float64 tests/gpu/test_kernels_gpu.py::test_cross_entropy_gradient_in_place_equals_the_plain_one_without_a_second_buffer tests/gpu/test_kernels_gpu.py::test_permute_unpermute tests/gpu/test_kernels_gpu.py::test_local_dispatch_round_trip_on_cuda_matches_the_cpu tests/gpu/test_fp8_gpu.py::test_stacked_projections_compiled_match_the_linears_alone tests/gpu/test_kernels_gpu.py::test_triton_adamw_matches_torchs_fused_and_writes_the_compute_copy tests/gpu/test_kernels_gpu.py::test_qk_norm_rope_topk_ids_and_the_combine_with_its_residual_at_qwen3_width_compiled"   # the new GPU checks, BN=32 tiles, expand and the per-token combine backward included
    "python benchmarks/peers/torchtitan.py --family deepseek_v3 --layers 10 --seq 4096 --batch 4 --accum 4 --steps 5 --timeout 330 --ours-reserve 150 --trace /tmp/dsv3"   # 32: 1.19x at 3d10b5e (line 111); carry .peers
    "python .agents/skills/capture-profile/profile_step.py --trace /tmp/dsv3/torchtitan.json --trace /tmp/dsv3/pithtrain.json"   # where each side's step goes, by kernel category
    "$T --family moonlight --layers 10 --steps 12 --batch 4 --accum 8 --ab mla-v"     # 32: DeepSeek-V3 width; A: v unpadded (cuDNN), B: padded, in one run
    "$T --layers 9 --steps 24 --batch 4 --accum 8 --ab fused-proj,wgrad-config,triton-adamw --wgrad-config {\"BK\":128,\"BM\":128,\"BN\":64,\"num_warps\":4,\"num_stages\":3}"   # 32: arms B-D against A: q/k/v as one GEMM each, the BN=64 tiles (the default before 2026-12-05), torch's fused AdamW
    "$T --layers 9 --steps 18 --batch 4 --accum 8 --fp8 rowwise_bf16_wgrad --fp8-head --ab fused-proj,triton-adamw"   # 32: under FP8 + FP8 head: the projections one GEMM each, torch's fused AdamW
    "$T --layers 9 --steps 6 --batch 4 --accum 8"                                   # 32 and 18: >= 60% MFU (the second reading), stage_ms and its profile digest
    "python benchmarks/kernels.py --repeats 20"                                      # the Triton kernels against their references
    "python benchmarks/attention.py --mla --batches 2 4 --repeats 10"                # 32: MLA v unpadded (cuDNN) against padded (FA2?)
    "$T --family deepseek_v2 --layers 10 --steps 12 --batch 4 --accum 8 --ab mla-v"   # 32 and 18: the deepest; was 63,060 tok/s (line 105)
    "python benchmarks/peers/torchtitan.py --family qwen3 --layers 9 --seq 4096 --batch 4 --accum 4 --steps 5 --timeout 300 --ours-reserve 130"   # 32: the deepest both fit at micro-batch 4 (124.3 / 134.9 GiB)
    "python benchmarks/attention.py --mla --docs 8 --batches 4 --repeats 10"        # packed documents: is unpadded v with the mask faster too (models pad it today)?
    "$T --layers 9 --steps 12 --batch 4 --accum 8 --fp8 rowwise_bf16_wgrad --ab fp8"   # 14: FP8 alone against bf16 at the same depth
    "$T --layers 9 --steps 12 --batch 4 --accum 8 --fp8 rowwise --fp8-head --ab fp8"   # 32: every GEMM's weight gradient in FP8 too (0.92x at 2d14d3e, before the fixes since)
    "$T --layers 8 --steps 5 --batch 4 --accum 8"                                   # 18 and 14: Qwen3 width, 8 layers
    "$T --layers 4 --steps 5 --batch 4 --accum 8"                                   # the memory estimate's Qwen3 4 layers at micro-batch 4
    "$T --layers 8 --steps 5 --batch 4 --accum 8 --fp8 rowwise_bf16_wgrad"          # 14
    "$T --family deepseek_v2 --layers 4 --steps 6 --batch 2 --accum 4"              # 18 and 14: the 4-layer shapes
    "$T --family deepseek_v2 --layers 4 --steps 6 --batch 2 --accum 4 --fp8 rowwise_bf16_wgrad"
    "$T --family gpt_oss --layers 4 --steps 6 --batch 2 --accum 4"
    "$T --family gpt_oss --layers 4 --steps 6 --batch 2 --accum 4 --fp8 rowwise_bf16_wgrad"
    "$T --layers 4 --steps 6 --batch 2 --accum 4 --fp8 off"
    "$T --layers 4 --steps 6 --batch 2 --accum 4 --fp8 rowwise_bf16_wgrad"
    "$T --layers 8 --steps 5 --batch 4 --accum 8 --optim muon"                      # 17: 131k tokens a step
    "$T --layers 8 --steps 5 --batch 4 --accum 16 --optim muon"                     # 17: 262k tokens a step
    "python -m pytest -q tests/gpu"
    "python benchmarks/peers/torchtitan.py --family qwen3 --layers 4 --seq 4096 --batch 2 --accum 4 --steps 6"         # 32: same-run peer vs torchtitan (needs .peers: get_torchtitan.sh; carry .peers)
    "python benchmarks/peers/torchtitan.py --family deepseek_v3 --layers 4 --seq 4096 --batch 2 --accum 4 --steps 6"   # 32: its DeepSeek-V3 at Moonlight width
    "env PYTHONPATH=.:.whl $T --family qwen3_5 --layers 5 --steps 5 --batch 4 --accum 4"   # Qwen3.5 at its deepest: MFU (51.1% at 21c0c17) and the peak against estimate-memory's 112.7 GiB (123.0 measured at 4fc665b); carry .whl (the unpacked flash-linear-attention and fla-core 0.6.0 wheels)
)
first=${1-1} last=${2-${#runs[@]}}
if (( $# > 2 )) || ! [[ $first =~ ^[1-9][0-9]*$ && $last =~ ^[1-9][0-9]*$ ]] || (( last > ${#runs[@]} || first > last )); then
    echo "one_gpu.sh: FIRST and LAST must be run numbers with 1 <= FIRST <= LAST <= ${#runs[@]} (got: $*)" >&2
    exit 2
fi
for i in $(seq "$first" "$last"); do
    cmd=${runs[$((i - 1))]}
    echo "=== run $i: $cmd"
    if [[ $cmd == *profile_step.py* ]]; then  # a report: its tables whole
        $cmd 2>&1 | grep -vE "^ +[0-9.]+ ms +(cpu_op|user_annotation|cuda_runtime|python_function|cuda_driver) "
    else
        $cmd 2>&1 | grep -E "^(pithtrain:|peer_torchtitan:|mla B=|[0-9]+ (passed|skipped|failed)|FAILED)|[Ee]rror|failed|needs a CUDA"
    fi
done
