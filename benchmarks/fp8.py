"""FP8 GEMM choices on the GPU: the expert grouped GEMM (bf16 torch._grouped_mm vs our Triton FP8
kernel, forward / input gradient / weight gradient, with and without the quantization of the
activations) and dense projections by recipe (bf16, row-wise `torch._scaled_mm`, 1x128/128x128
block-wise `F.scaled_mm`), and the weight cache's quantization into both layouts (the old
per-layout path with a transposed fp32 copy vs the one-pass kernel; `--wquant`: only that).
`--sweep` times the grouped kernel's tile configurations (with --wquant: the weight kernel's).
`--head`: only the LM head and its loss (train.fp8_head against bf16: logits, cross-entropy, backward;
and the quantization of the head's [tokens x vocabulary] gradient alone, in GB/s).

    PYTHONPATH=. python benchmarks/fp8.py [--tokens 16384 --experts 128 --topk 8 --hidden 2048 --inter 768] [--sweep]
    PYTHONPATH=. python benchmarks/fp8.py --wquant [--sweep]
    PYTHONPATH=. python benchmarks/fp8.py --head [--tokens 16384 --hidden 2048 --vocab 151936]
    PYTHONPATH=. python benchmarks/fp8.py --glu [--tokens 16384 --topk 8 --inter 768]
    PYTHONPATH=. python benchmarks/fp8.py --rows [--tokens 16384]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import median_ms  # noqa: E402
from results import record  # noqa: E402

from pithtrain.ops import fp8, kernels  # noqa: E402
from pithtrain.ops.grouped_gemm import grouped_mm, grouped_weight_grad  # noqa: E402

BF16 = torch.bfloat16


def tflops(flops, ms):
    return flops / (ms * 1e-3) / 1e12


def grouped(args, sweep: bool):
    rows = args.tokens * args.topk
    counts = torch.full((args.experts,), rows // args.experts, device="cuda", dtype=torch.int32)
    rows = int(counts.sum())
    out = {}
    for k, m, label in ((args.hidden, 2 * args.inter, "gate_up"), (args.inter, args.hidden, "down")):
        x = torch.randn(rows, k, device="cuda", dtype=BF16)
        w = torch.randn(args.experts, k, m, device="cuda", dtype=BF16) * 0.02
        dy = torch.randn(rows, m, device="cuda", dtype=BF16)
        xq, xs = fp8.quantize(x)
        dyq, dys = fp8.quantize(dy)
        wf = fp8.quantize_reference(w.transpose(-1, -2).contiguous())
        wb = fp8.quantize_reference(w)
        xt, xts = fp8.quantize_t(x, counts)
        dyt, dyts = fp8.quantize_t(dy, counts)
        flops = 2 * rows * k * m
        cases = {
            "fwd_bf16": lambda: grouped_mm(x, w, counts),
            "fwd_fp8": lambda: fp8.grouped_mm(xq, xs, *wf, counts, BF16),
            "fwd_fp8_with_quant": lambda: fp8.grouped_mm(*fp8.quantize(x), *wf, counts, BF16),
            "dgrad_bf16": lambda: grouped_mm(dy, w.transpose(-1, -2), counts),
            "dgrad_fp8": lambda: fp8.grouped_mm(dyq, dys, *wb, counts, BF16),
            "wgrad_bf16": lambda: grouped_weight_grad(x, dy, counts, args.experts),
            "wgrad_fp8": lambda: fp8.grouped_wgrad(xt, xts, dyt, dyts, counts),
            "quantize_rows": lambda: fp8.quantize(x),
            "quantize_t": lambda: fp8.quantize_t(x, counts),
        }
        for name, fn in cases.items():
            ms = median_ms(fn, 20)
            out[f"{label}_{name}_ms"] = round(ms, 4)
            if not name.startswith("quantize"):
                out[f"{label}_{name}_tflops"] = round(tflops(flops, ms), 1)
            print(f"{label:8s} [{rows} x {k}] x [{args.experts} x {k} x {m}] {name:20s} {ms:8.3f} ms"
                  + ("" if name.startswith("quantize") else f" {tflops(flops, ms):6.0f} TFLOP/s"), flush=True)
        ref = fp8.grouped_mm_reference(xq[: 4 * (rows // args.experts)], xs, wf[0][:4], wf[1][:4], counts[:4].cpu(), torch.float32)
        got = fp8.grouped_mm(xq, xs, *wf, counts, torch.float32)[: ref.shape[0]]
        print(f"{label} fp8 kernel vs reference: max rel err {((got - ref).abs().max() / ref.abs().max()).item():.2e}")
        kept = fp8.GMM_PERSISTENT
        for per_sm in (0, 1, 2):  # fp8.GMM_PERSISTENT: programs an SM (0: one a tile)
            fp8.GMM_PERSISTENT = per_sm
            for name in ("fwd_fp8", "dgrad_fp8"):
                ms = median_ms(cases[name], 20)
                out[f"{label}_{name}_persistent{per_sm}_tflops"] = round(tflops(flops, ms), 1)
                persistent_out = cases[name]()
                fp8.GMM_PERSISTENT = 0
                same = torch.equal(persistent_out, cases[name]())
                fp8.GMM_PERSISTENT = per_sm
                print(f"{label:8s} {name:9s} persistent, {per_sm} a SM: {ms:8.3f} ms {tflops(flops, ms):6.0f} TFLOP/s"
                      f" (bit for bit the one-tile kernel's: {same})", flush=True)
        fp8.GMM_PERSISTENT = kept
        if sweep:  # each config's TFLOP/s (fwd, dgrad, wgrad) into the line; equal loads (training's are not: check there)
            tried = {}
            for bm, bn, bk, warps, stages in ((128, 128, 128, 8, 3), (128, 128, 128, 8, 4), (128, 256, 128, 8, 3),
                                              (128, 256, 64, 8, 4), (64, 256, 128, 4, 4), (128, 128, 64, 4, 4),
                                              (256, 128, 128, 8, 3), (128, 128, 128, 4, 3), (128, 128, 128, 4, 4),
                                              (128, 64, 128, 4, 4), (64, 128, 128, 4, 4), (128, 256, 128, 8, 2),
                                              (128, 128, 256, 8, 2), (64, 256, 128, 8, 3)):
                cfg = dict(BM=bm, BN=bn, BK=bk, num_warps=warps, num_stages=stages)
                fp8._GMM_CONFIG.clear(), fp8._GMM_CONFIG.update(cfg)
                fp8._WGRAD_CONFIG.clear(), fp8._WGRAD_CONFIG.update(cfg)
                try:
                    f, d, g = (median_ms(fn, 10) for fn in (cases["fwd_fp8"], cases["dgrad_fp8"], cases["wgrad_fp8"]))
                    tried[str(tuple(cfg.values()))] = [round(tflops(flops, t)) for t in (f, d, g)]
                    print(f"  sweep {cfg}: fwd {tflops(flops, f):5.0f} dgrad {tflops(flops, d):5.0f} wgrad {tflops(flops, g):5.0f} TFLOP/s", flush=True)
                except Exception as e:  # a config the compiler rejects (shared memory)
                    print(f"  sweep {cfg}: failed ({type(e).__name__})")
            out[f"{label}_sweep_tflops"] = tried  # "(BM, BN, BK, num_warps, num_stages)": [fwd, dgrad, wgrad]
    return out


def dense(shapes):
    out = {}
    for m, k, n in shapes:
        a, b = torch.randn(m, k, device="cuda", dtype=BF16), torch.randn(n, k, device="cuda", dtype=BF16)
        aq, sa = fp8.quantize(a)
        bq, sb = fp8.quantize(b)
        flops = 2 * m * k * n
        cases = {"bf16": lambda: a @ b.t(), "rowwise": lambda: fp8.scaled_mm(aq, sa, bq, sb, BF16),
                 "rowwise_with_quant": lambda: fp8.scaled_mm(*fp8.quantize(a), bq, sb, BF16)}
        try:
            from torch.nn.functional import ScalingType, scaled_mm

            a_blk = torch.rand(m, k // 128, device="cuda").t().contiguous().t()  # column-major scales
            b_blk = torch.rand(k // 128, n // 128, device="cuda").t().contiguous().t()  # as torch 2.11 asks
            cases["blockwise"] = lambda: scaled_mm(aq, bq.t(), a_blk, ScalingType.BlockWise1x128, b_blk,
                                                   ScalingType.BlockWise128x128, output_dtype=BF16)
        except Exception as e:
            print(f"block-wise scaled_mm unavailable: {type(e).__name__}: {e}")
        for name, fn in cases.items():
            try:
                ms = median_ms(fn, 20)
            except Exception as e:
                print(f"dense [{m}x{k}]x[{k}x{n}] {name}: failed ({type(e).__name__}: {str(e)[:120]})")
                continue
            out[f"dense_{m}x{k}x{n}_{name}_tflops"] = round(tflops(flops, ms), 1)
            print(f"dense [{m} x {k}] x [{k} x {n}] {name:20s} {ms:8.3f} ms {tflops(flops, ms):6.0f} TFLOP/s", flush=True)
    return out


def weight_quant(shapes, sweep: bool):
    """cached_weight's refresh of both FP8 layouts of fp32 weights, old path vs the one-pass kernel and that
    kernel from the AdamW's maxima: ms, and GB/s of the traffic the one-pass kernel moves (two reads of w, both FP8
    layouts written). --sweep: the tiles of its two kernels on the first weight first, then the best."""
    out = {}
    for shape in shapes:
        w = torch.randn(shape, device="cuda") * 0.02
        cache = fp8.quantize_both(w)
        one_pass = lambda: fp8.quantize_both(w, cache)  # noqa: E731
        tag = "x".join(map(str, shape))
        if sweep and shape == shapes[0]:
            for cfg, tiles in ((fp8._AMAX_CONFIG, ((128, 128, 8), (64, 128, 4), (128, 256, 8), (256, 128, 8), (32, 256, 4))),
                               (fp8._QUANT_BOTH_CONFIG, ((64, 64, 4), (64, 128, 4), (128, 64, 4), (128, 128, 8), (32, 128, 4)))):
                timings = []
                for br, bc, warps in tiles:
                    cfg.update(BR=br, BC=bc, num_warps=warps)
                    timings.append((median_ms(one_pass, 10), dict(cfg)))
                    print(f"  sweep {cfg}: {timings[-1][0]:.3f} ms", flush=True)
                ms, best = min(timings, key=lambda t: t[0])
                cfg.update(best)
                print(f"  best {best}: {ms:.3f} ms (kept for what follows)", flush=True)

        def old():  # the previous cached_weight: each layout by the row kernel, then copied in place
            new = (*fp8._quantize_nd(w), *fp8._quantize_nd(w.transpose(-1, -2).contiguous()))
            for o, n in zip((*cache[0], *cache[1]), new):
                o.copy_(n)

        def timed(name, fn):
            ms = median_ms(fn, 20)
            gbs = (2 * w.numel() * w.element_size() + 2 * w.numel()) / (ms * 1e-3) / 1e9
            out[f"wquant_{tag}_{name}_ms"], out[f"wquant_{tag}_{name}_gbs"] = round(ms, 4), round(gbs)
            print(f"weight {tag:16s} {name:24s} {ms:8.3f} ms {gbs:6.0f} GB/s", flush=True)

        timed("old_two_layouts", old)
        ref = [t.clone() for t in (*cache[0], *cache[1])]
        timed("one_pass", one_pass)
        same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip((*cache[0], *cache[1]), ref))
        print(f"weight {tag:16s} one pass bit-identical to the old path: {same}")
        # the maxima taken by the Triton AdamW (train/optim): its pass with and without them, then one read of w
        amax = torch.cat([w.abs().reshape(-1, *shape[-2:]).amax(-1).flatten(), w.abs().reshape(-1, *shape[-2:]).amax(-2).flatten()])
        timed("given_amax", lambda: fp8.quantize_both(w, cache, amax))
        same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip((*cache[0], *cache[1]), ref))
        print(f"weight {tag:16s} from the optimizer's maxima bit-identical to the old path: {same}")
        p, g, m, v = w.clone(), torch.randn_like(w), torch.zeros_like(w), torch.zeros_like(w)
        copy, buf, kept = p.to(BF16), torch.empty_like(amax), dict(kernels.ADAMW_AMAX_TILE)
        for name, c, a in (("adamw", None, None), ("adamw_copy", copy, None)):
            ms = median_ms(lambda: kernels.adamw(p, g, m, v, c, 1e-4, 0.9, 0.95, 1e-8, 0.1, 10, 1.0, a), 20)
            out[f"wquant_{tag}_{name}_ms"] = round(ms, 4)
            print(f"weight {tag:16s} {name:24s} {ms:8.3f} ms", flush=True)
        for br, bc, steps in ((16, 128, 8), (4, 512, 32), (8, 256, 16), (2, 512, 64), (32, 128, 4)):  # the amax tiles
            kernels.ADAMW_AMAX_TILE.update(BR=br, BC=bc, STEPS=steps)
            for name, c in (("adamw_with_amax", None), ("adamw_copy_with_amax", copy)):
                ms = median_ms(lambda: kernels.adamw(p, g, m, v, c, 1e-4, 0.9, 0.95, 1e-8, 0.1, 10, 1.0, buf), 20)
                out[f"wquant_{tag}_{name}_{br}x{bc}x{steps}_ms"] = round(ms, 4)
                print(f"weight {tag:16s} {name:24s} {ms:8.3f} ms  tile {br} x {bc}, {steps} steps", flush=True)
        kernels.ADAMW_AMAX_TILE.update(kept)
        out[f"wquant_{tag}_config"] = f"{fp8._AMAX_CONFIG} {fp8._QUANT_BOTH_CONFIG}"
        del w, cache, ref
    return out


def head(tokens: int, hidden: int, vocab: int) -> dict:
    """One micro-batch's LM head and loss, forward and backward, as the training step runs it (autocast
    bf16, fp32 master weight, the Triton cross-entropy): bf16 vs train.fp8_head."""
    from pithtrain.ops.grouped_gemm import head_logits
    from pithtrain.ops.kernels import cross_entropy_sum

    w = torch.nn.Parameter(torch.randn(vocab, hidden, device="cuda") * 0.02)
    x = torch.randn(tokens, hidden, device="cuda", dtype=BF16, requires_grad=True)
    labels = torch.randint(0, vocab, (tokens,), device="cuda")
    out, flops = {}, 3 * 2 * tokens * hidden * vocab

    def step(fp8_head):
        with torch.autocast("cuda", BF16):
            loss = cross_entropy_sum(head_logits(x, w, fp8_head), labels)
        loss.backward()

    for name, on in (("bf16", False), ("fp8_head", True)):
        ms = median_ms(lambda: step(on), 10)
        out[f"head_{name}_ms"], out[f"head_{name}_gemm_tflops"] = round(ms, 3), round(tflops(flops, ms), 1)
        print(f"head [{tokens} x {hidden}] x [{hidden} x {vocab}] + loss, fwd+bwd, {name:9s} {ms:8.3f} ms "
              f"({tflops(flops, ms):5.0f} TFLOP/s of GEMM work)", flush=True)
    g = torch.randn(tokens // 4, vocab, device="cuda", dtype=BF16)
    ms = median_ms(lambda: fp8.quantize(g), 20)
    out["head_grad_quant_gbs"] = round(g.numel() * 3 / (ms * 1e-3) / 1e9)
    print(f"quantize [{tokens // 4} x {vocab}] bf16: {ms:.3f} ms, {out['head_grad_quant_gbs']} GB/s", flush=True)
    return out


def glu_tiles(rows: int, inter: int) -> dict:
    """The experts' activation kernels that also write an FP8 copy (fp8.glu_quantized's forward, kernels.glu_bwd_quantized)
    at each tile (whole rows a program, up to `values` values; num_warps), against the plain bf16 ones (the bytes they
    move are the floor: the FP8 copy adds a byte a value). ms a call, medians of 20."""
    h = (torch.randn(rows, 2 * inter, device="cuda") * 2).to(BF16)
    dy = torch.randn(rows, inter, device="cuda").to(BF16)
    q = torch.empty(h.shape, dtype=fp8.FP8, device="cuda")
    out = {"glu_fwd_bf16_ms": round(median_ms(lambda: kernels._glu_fwd(h, 1.0, 0.0, False), 20), 4),
           "glu_bwd_bf16_ms": round(median_ms(lambda: kernels._glu_bwd(h, dy, 1.0, 0.0, False), 20), 4)}
    fwd, bwd = dict(fp8.GLU_QUANT_TILE), dict(kernels.GLU_BWD_QUANT_TILE)
    for name, tile, run in (("fwd", fp8.GLU_QUANT_TILE, lambda: fp8._glu_quantize_cuda(h, 1.0, 0.0, False)),
                            ("bwd", kernels.GLU_BWD_QUANT_TILE, lambda: kernels.glu_bwd_quantized(h, dy, 1.0, 0.0, False, q))):
        default = f"{tile['values']}/{tile['num_warps']}"
        timings = {}
        for values in (1024, 2048, 4096, 8192, 16384):
            for warps in (2, 4, 8):
                tile.update(values=values, num_warps=warps)
                timings[f"{values}/{warps}"] = round(median_ms(run, 20), 4)
        out[f"glu_{name}_fp8_ms_by_tile"] = timings  # "values/num_warps": ms
        best = min(timings, key=timings.get)
        print(f"glu {name} [{rows} x {2 * inter}] with its FP8 copy: default {default} {timings[default]} ms, best {best} "
              f"{timings[best]} ms; bf16 without it {out[f'glu_{name}_bf16_ms']} ms", flush=True)
    fp8.GLU_QUANT_TILE.update(fwd), kernels.GLU_BWD_QUANT_TILE.update(bwd)
    return out


def inductor_rows(tokens: int) -> dict:
    """Stage 1's FP8 quantizations as Inductor compiles them (train/loop.PERSISTENT_ROWS: 0, Inductor's looped
    kernels past 1,024 values a row, against persistent ones up to 8,192): the norm and the qkv input's FP8 copy
    (2,048 wide), the o projection's input from the attention's [B, S, H, D] (4,096), the q, k, v gradients' copy
    (5,120); each also by the eager Triton row kernel from a materialized input. ms a call, medians of 50."""
    import torch._inductor.config as inductor_config

    from pithtrain.ops import core
    from pithtrain.train import loop

    inductor_config.force_disable_caches = True  # each width setting compiles anew
    x, w = torch.randn(tokens, 2048, device="cuda", dtype=BF16), torch.rand(2048, device="cuda", dtype=BF16) + 0.5
    o = torch.randn(4, tokens // 4, 32, 128, device="cuda", dtype=BF16)
    q, k, v = (torch.randn(tokens, n, device="cuda", dtype=BF16) for n in (4096, 512, 512))
    cases = {"norm_quant_2048": (lambda x, w: fp8.quantize(core.rms_norm(x, w, 1e-6)), (x, w)),
             "quant_4096": (lambda o: fp8.quantize(o.reshape(-1, 4096)), (o,)),
             "cat_quant_5120": (lambda q, k, v: fp8.quantize(torch.cat([q, k, v], -1)), (q, k, v))}
    out, kept = {}, loop.PERSISTENT_ROWS
    loop._persistent_rows()
    for rows in (0, 8192):
        loop.PERSISTENT_ROWS = rows
        torch._dynamo.reset()
        for name, (fn, inputs) in cases.items():
            compiled = torch.compile(fn, fullgraph=True)
            ms = median_ms(lambda: compiled(*inputs), 50)
            out[f"rows_{name}_persistent{rows}_ms"] = round(ms, 4)
            print(f"inductor {name:16s} PERSISTENT_ROWS={rows:<5d} {ms:8.4f} ms", flush=True)
    loop.PERSISTENT_ROWS = kept
    for name, x in (("quant_4096", o.reshape(-1, 4096)), ("cat_quant_5120", torch.cat([q, k, v], -1))):
        ms = median_ms(lambda: fp8._quantize_cuda(x), 50)
        out[f"rows_{name}_triton_ms"] = round(ms, 4)
        print(f"triton   {name:16s} eager row kernel    {ms:8.4f} ms", flush=True)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("tokens", 16384), ("experts", 128), ("topk", 8), ("hidden", 2048), ("inter", 768)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--sweep", action="store_true", help="the tiles too (the grouped GEMMs'; with --wquant its kernels')")
    only = parser.add_mutually_exclusive_group()
    only.add_argument("--wquant", action="store_true", help="only the weight quantization into both layouts")
    only.add_argument("--head", action="store_true", help="only the LM head and loss, bf16 vs train.fp8_head")
    parser.add_argument("--vocab", type=int, default=151936)
    only.add_argument("--glu", action="store_true", help="only the activation kernels with their FP8 copy, by tile")
    only.add_argument("--rows", action="store_true", help="only stage 1's FP8 quantizations as Inductor compiles them")
    args = parser.parse_args()
    if args.sweep and (args.head or args.glu or args.rows):
        parser.error("--sweep times the grouped GEMMs' (or with --wquant, the weight kernels') tiles; --head and --rows have none, "
                     "--glu sweeps its own")
    if min(args.tokens, args.experts, args.topk, args.hidden, args.inter) < 1:
        parser.error("--tokens, --experts, --topk, --hidden and --inter must be at least 1")
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (it times the GPU kernels); run it on the GPU machine")
    if args.rows:
        return record({"benchmark": "fp8_inductor_rows", "tokens": args.tokens, **inductor_rows(args.tokens)})
    if args.glu:
        return record({"benchmark": "fp8_glu_tiles", "rows": args.tokens * args.topk, "inter": args.inter,
                       **glu_tiles(args.tokens * args.topk, args.inter)})
    if args.head:
        return record({"benchmark": "fp8_head", "tokens": args.tokens, "hidden": args.hidden, "vocab": args.vocab,
                       **head(args.tokens, args.hidden, args.vocab)})
    w_shapes = [(128, 2048, 1536), (128, 768, 2048), (4096, 2048)]  # Qwen3 experts' gate_up and down, a dense one
    if args.wquant:
        return record({"benchmark": "fp8_weight_quant", **weight_quant(w_shapes, args.sweep)})
    figures = grouped(args, args.sweep)
    t, h = args.tokens, args.hidden
    figures.update(dense([(t, h, 4096), (t, 4096, h), (t, h, 512)]))
    figures.update(weight_quant(w_shapes, False))
    record({"benchmark": "fp8_gemms", "tokens": t, "experts": args.experts, "topk": args.topk, "hidden": h,
            "inter": args.inter, **figures})


if __name__ == "__main__":
    main()
