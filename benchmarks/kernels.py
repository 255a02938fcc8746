"""Time each Triton kernel of pithtrain.ops.kernels against its plain-PyTorch reference on one GPU.

    python benchmarks/kernels.py [--repeats 30] [--only cross_entropy_sum,qk_norm_rope]

Per op: forward, and forward + backward, median milliseconds over the repeats (CUDA events, after
warm-up, which includes the Triton compiles), and the peak memory the forward + backward allocates.
Shapes are those of one micro-batch of 4096 tokens of Qwen3-30B-A3B and GPT-OSS-20B sized layers.
`weighted_combine` (stages 4-5 fused) is timed against what it replaced: the unpermute kernel into
[T, k, H] and the compiled weighted sum; `swiglu_fp8` (fp8.glu_quantized: the activation and its FP8 copy
in one kernel) against the SwiGLU kernel, then fp8.quantize; `expand` (LocalDispatch's, at 16384 tokens)
against the Triton gather it replaced, and `weighted_combine` at that size too (the rows outgrow the L2);
the dispatch's stable sorts with narrow keys (`core.stable_argsort_ids`) against int64's; the routers' `topk_ids`
against torch.topk; `qk_norm_rope` against what Inductor compiles from its
reference, at several tiles; `cross_entropy_sum`'s backward alone at several chunks a program (kernels.CE_BWD_TILES), with and without the FP8 head's
copy. `--only a,b` times those ops alone. One benchmarks/results.jsonl line with every op's figures.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, installed or not

from pithtrain.ops import core, fp8, kernels  # noqa: E402
from results import record  # noqa: E402


def median_ms(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def peak_mib(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def forward_backward(fn, inputs):
    """fn and fn + backward on the floating-point inputs, as closures over fresh leaves."""
    leaves = [x.detach().requires_grad_(x.is_floating_point()) for x in inputs]
    out = fn(*inputs)
    grad_out = torch.randn_like(out) if out.dim() else None  # a scalar loss takes the implicit 1

    def fwd():
        with torch.no_grad():
            fn(*inputs)

    def fwd_bwd():
        out = fn(*leaves)
        out.backward(grad_out)
        for x in leaves:
            x.grad = None

    return fwd, fwd_bwd


def cases():
    dev, bf16 = "cuda", torch.bfloat16
    tokens = 4096
    ids8 = torch.rand(tokens, 128, device=dev).topk(8, dim=1).indices  # Qwen3-30B-A3B: 128 experts, top-8
    order = torch.argsort(ids8.flatten(), stable=True)
    counts = torch.bincount(torch.rand(tokens, 32, device=dev).topk(4, dim=1).indices.flatten(), minlength=32)
    gate_up = torch.randn(tokens * 8, 2 * 768, device=dev, dtype=bf16)
    gate_up_oss = torch.randn(tokens * 4, 2 * 2880, device=dev, dtype=bf16) * 4
    x = torch.randn(tokens, 2048, device=dev, dtype=bf16)
    rows = torch.randn(tokens * 8, 2048, device=dev, dtype=bf16)
    rows_oss = torch.randn(tokens * 4, 2880, device=dev, dtype=bf16)
    bias = torch.randn(32, 2880, device=dev, dtype=bf16)
    labels = torch.randint(0, 151936, (8192,), device=dev)
    labels_oss = torch.randint(0, 201088, (8192,), device=dev)
    weights = torch.rand(tokens, 8, device=dev)
    weighted_sum = torch.compile(lambda combined, w: (combined * w.to(combined.dtype).unsqueeze(-1)).sum(1), fullgraph=True)
    yield ("swiglu", "[32768, 1536] bf16", core.swiglu, kernels.swiglu, [gate_up])
    yield ("clamped_swiglu", "[16384, 5760] bf16", lambda t: kernels.clamped_swiglu_reference(t, 1.702, 7.0),
           lambda t: kernels.clamped_swiglu(t, 1.702, 7.0), [gate_up_oss])
    def swiglu_then_quantize(t):  # what fp8.glu_quantized replaced: two kernels, the second reading the first's output
        a = kernels.swiglu(t)
        fp8.quantize(a.detach())
        return a

    yield ("swiglu_fp8", "[32768, 1536] bf16 -> FP8", swiglu_then_quantize, lambda t: fp8.glu_quantized(t)[0], [gate_up])
    yield ("permute", "4096x2048 -> 32768 rows", kernels.permute_reference, kernels.permute, [x, order // 8])
    # LocalDispatch's expand against the gather it replaced, at a training micro-batch (its rows outgrow the L2)
    order16 = torch.argsort(torch.rand(16384, 128, device=dev).topk(8, dim=1).indices.flatten(), stable=True)
    yield ("expand", "16384x2048 -> 131072 rows", lambda t: kernels.permute(t, order16 // 8),
           lambda t: kernels.expand(t, order16, 8), [torch.randn(16384, 2048, device=dev, dtype=bf16)])
    yield ("weighted_combine", "131072 x 2048 bf16 -> 16384", lambda y, w: weighted_sum(  # the backward's token programs
        kernels.unpermute(y, order16, 16384 * 8).view(16384, 8, 2048), w), lambda y, w: kernels.weighted_combine(y, order16, w),
           [torch.randn(16384 * 8, 2048, device=dev, dtype=bf16), torch.rand(16384, 8, device=dev)])
    yield ("unpermute", "32768 x 2048 bf16", lambda y: kernels.unpermute_reference(y, order, tokens * 8),
           lambda y: kernels.unpermute(y, order, tokens * 8), [rows])
    yield ("weighted_combine", "32768 x 2048 bf16 -> 4096", lambda y, w: weighted_sum(
        kernels.unpermute(y, order, tokens * 8).view(tokens, 8, 2048), w),
           lambda y, w: kernels.weighted_combine(y, order, w), [rows, weights])
    yield ("expert_bias_add", "[16384, 2880] bf16, E=32", kernels.expert_bias_add_reference, kernels.expert_bias_add,
           [rows_oss, bias, counts])
    yield ("cross_entropy_sum", "[8192, 151936] bf16", core.cross_entropy_sum, kernels.cross_entropy_sum,
           [torch.randn(8192, 151936, device=dev, dtype=bf16), labels])
    yield ("cross_entropy_sum", "[8192, 201088] bf16", core.cross_entropy_sum, kernels.cross_entropy_sum,
           [torch.randn(8192, 201088, device=dev, dtype=bf16), labels_oss])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--only", help="comma-separated ops to time (e.g. cross_entropy_sum,qk_norm_rope; default all)")
    args = parser.parse_args()
    ops = ["cross_entropy_sum" if n == "cross_entropy" else n for n in args.only.split(",")] if args.only else None
    want = lambda op: ops is None or op in ops  # noqa: E731
    if not torch.cuda.is_available() or not kernels._TRITON_INSTALLED:
        sys.exit("benchmarks/kernels.py needs a CUDA GPU and Triton")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, median of {args.repeats} (ms)")
    head = f"{'op':<18} {'shape':<26} {'ref fwd':>8} {'tri fwd':>8} {'x':>5} {'ref f+b':>8} {'tri f+b':>8} {'x':>5}" \
           f" {'ref MiB':>8} {'tri MiB':>8}"
    print(head + "\n" + "-" * len(head))
    figures = []
    for name, shape, ref, fast, inputs in cases():
        if not want(name):
            continue
        ref_fwd, ref_fb = forward_backward(ref, inputs)
        fast_fwd, fast_fb = forward_backward(fast, inputs)
        t = [median_ms(f, args.repeats) for f in (ref_fwd, fast_fwd, ref_fb, fast_fb)]
        mem = [peak_mib(f) for f in (ref_fb, fast_fb)]
        print(f"{name:<18} {shape:<26} {t[0]:8.3f} {t[1]:8.3f} {t[0] / t[1]:5.2f} {t[2]:8.3f} {t[3]:8.3f}"
              f" {t[2] / t[3]:5.2f} {mem[0]:8.0f} {mem[1]:8.0f}")
        figures.append({"op": name, "shape": shape, "ref_fwd_ms": round(t[0], 4), "fwd_ms": round(t[1], 4),
                        "ref_fwd_bwd_ms": round(t[2], 4), "fwd_bwd_ms": round(t[3], 4),
                        "ref_peak_mib": round(mem[0]), "peak_mib": round(mem[1])})
    # the dispatch plan has no backward; its reference syncs with the host (nonzero) twice
    for tokens, ep in ((4096, 8), (16384, 64)) if want("dispatch_plan") else ():
        ids = torch.rand(tokens, 256, device="cuda").topk(8, dim=1).indices
        ref_t = median_ms(lambda: kernels.dispatch_plan_reference(ids, 256 // ep, ep), args.repeats)
        fast_t = median_ms(lambda: kernels.dispatch_plan(ids, 256 // ep, ep), args.repeats)
        shape = f"T={tokens} k=8 E=256 ep={ep}"
        print(f"{'dispatch_plan':<18} {shape:<26} {ref_t:8.3f} {fast_t:8.3f} {ref_t / fast_t:5.2f}")
        figures.append({"op": "dispatch_plan", "shape": shape, "ref_fwd_ms": round(ref_t, 4), "fwd_ms": round(fast_t, 4)})
    # the stable sorts of a micro-batch's dispatch (expert ids) and permute backward (token ids): int64 keys
    # against core.stable_argsort_ids' narrow ones (a radix pass per key byte)
    for what, n, bound in (("expert order", 16384 * 8, 128), ("token order", 16384 * 8, 16384)) if want("stable_argsort_ids") else ():
        ids = torch.randint(0, bound, (n,), device="cuda")
        ref_t = median_ms(lambda: torch.argsort(ids, stable=True), args.repeats)
        fast_t = median_ms(lambda: core.stable_argsort_ids(ids, bound), args.repeats)
        shape = f"{what} N={n} < {bound}"
        print(f"{'stable_argsort':<18} {shape:<26} {ref_t:8.3f} {fast_t:8.3f} {ref_t / fast_t:5.2f}")
        figures.append({"op": "stable_argsort_ids", "shape": shape, "ref_fwd_ms": round(ref_t, 4), "fwd_ms": round(fast_t, 4)})
    # the routers' selection at a micro-batch of 16384 tokens (no backward)
    probs = torch.randn(16384, 128, device="cuda").softmax(-1)
    for op, shape, ref, fast in (("topk_ids", "[16384, 128] fp32, k=8", lambda: torch.topk(probs, 8, dim=-1),
                                  lambda: kernels.topk_ids(probs, 8)),) if want("topk_ids") else ():
        ref_t, fast_t = median_ms(ref, args.repeats), median_ms(fast, args.repeats)
        print(f"{op:<18} {shape:<26} {ref_t:8.3f} {fast_t:8.3f} {ref_t / fast_t:5.2f}")
        figures.append({"op": op, "shape": shape, "ref_fwd_ms": round(ref_t, 4), "fwd_ms": round(fast_t, 4)})
    figures += qk_norm_rope_tiles(args.repeats) if want("qk_norm_rope") else []
    figures += ce_backward_tiles(args.repeats) if want("cross_entropy_sum") else []
    record({"benchmark": "kernels", "repeats": args.repeats, "only": args.only, "ops": figures})


def ce_backward_tiles(repeats: int) -> list[dict]:
    """The cross-entropy backward alone (in place, as training runs it) at one micro-batch of Qwen3's vocabulary,
    [16384, 151936] bf16, at each chunk a program (kernels.CE_BWD_TILES), and with the FP8 copy (the FP8 head)."""
    rows, vocab = 16384, 151936
    logits = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16)
    labels = torch.randint(0, vocab, (rows,), device="cuda")
    _, lse, amax = kernels._ce_fwd_amax(logits, labels)
    grad = torch.ones(1, device="cuda")
    q = torch.empty(rows, vocab, device="cuda", dtype=torch.float8_e4m3fn)
    s = torch.empty(rows, device="cuda")
    default, figures = dict(kernels.CE_BWD_TILES), []
    for block_v, warps in ((1024, 4), (2048, 4), (2048, 8), (4096, 8), (8192, 8), (8192, 16)):
        kernels.CE_BWD_TILES = dict(BLOCK_V=block_v, num_warps=warps)
        work = logits.clone()  # written in place: a copy per tile, timed over the same values each repeat
        plain = median_ms(lambda: kernels._launch_ce_bwd(work, labels, lse, grad, work), repeats)
        with_fp8 = median_ms(lambda: kernels._launch_ce_bwd(work, labels, lse, grad, work, (amax, q, s)), repeats)
        name = f"bwd BLOCK_V={block_v} warps={warps}"
        print(f"{'cross_entropy_sum':<18} {name:<26} {plain:8.3f} with FP8 copy {with_fp8:8.3f} "
              f"({2 * logits.numel() * 2 / plain / 1e9:5.0f} GB/s)")
        figures.append({"op": "cross_entropy_bwd", "shape": f"[16384, 151936] bf16 {name}", "ms": round(plain, 4),
                        "fp8_copy_ms": round(with_fp8, 4)})
        del work
    kernels.CE_BWD_TILES = default
    return figures


def qk_norm_rope_tiles(repeats: int) -> list[dict]:
    """Qwen3's attention inputs at one micro-batch (4 x 4096 tokens, 32 + 4 + 4 heads of 128): what Inductor
    compiles from the reference against kernels.qk_norm_rope at each tile (rows a program, warps), forward
    alone and forward + backward (the output gradients as cuDNN's attention backward hands them)."""
    b, s, heads, kv, d = 4, 4096, 32, 4, 128
    qkv = torch.randn(b, s, (heads + 2 * kv) * d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    wq, wk = (torch.randn(d, device="cuda", requires_grad=True) for _ in range(2))
    cos, sin = core.rope_cos_sin(torch.arange(s, device="cuda").expand(b, s),
                                 1.0 / 1e6 ** (torch.arange(0, d, 2, device="cuda") / d), dtype=torch.bfloat16)
    douts = [torch.randn(b, n, s, d, device="cuda", dtype=torch.bfloat16) for n in (heads, kv, kv)]
    inductor = torch.compile(lambda x, a, c: kernels.qk_norm_rope_reference(
        *x.split([heads * d, kv * d, kv * d], -1), a, c, cos, sin, 1e-6), fullgraph=True)

    def timed(fn):
        def fwd_bwd():  # the gradients returned, not added into .grad: no accumulation pass in the timing
            torch.autograd.grad(fn(qkv, wq, wk), (qkv, wq, wk), douts)
        with torch.no_grad():
            fwd = median_ms(lambda: fn(qkv, wq, wk), repeats)
        return fwd, median_ms(fwd_bwd, repeats)

    rows = [("inductor", *timed(inductor))]
    default = {k: dict(v) for k, v in kernels.QK_NORM_ROPE_TILES.items()}
    fused = lambda x, a, c: kernels.qk_norm_rope(x, a, c, cos, sin, heads, kv, 1e-6)  # noqa: E731
    for block_t, warps in ((16, 2), (16, 4), (32, 4), (32, 8), (64, 4), (64, 8), (128, 8)):
        kernels.QK_NORM_ROPE_TILES = {k: dict(BLOCK_T=block_t, num_warps=warps) for k in default}
        rows.append((f"BLOCK_T={block_t} warps={warps}", *timed(fused)))
    kernels.QK_NORM_ROPE_TILES = default
    figures = []
    for name, fwd, fwd_bwd in rows:
        print(f"{'qk_norm_rope':<18} {name:<26} fwd {fwd:8.3f} f+b {fwd_bwd:8.3f}")
        figures.append({"op": "qk_norm_rope", "shape": f"[4, 4096, 5120] bf16 {name}", "fwd_ms": round(fwd, 4),
                        "fwd_bwd_ms": round(fwd_bwd, 4)})
    return figures


if __name__ == "__main__":
    main()
