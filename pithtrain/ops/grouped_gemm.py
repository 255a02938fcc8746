"""Grouped GEMM for the experts: rows of `x` grouped by expert, times one weight matrix per expert.

Uses `torch._grouped_mm` where it applies (CPU fp32/bf16; CUDA bf16 on Hopper and newer, with
16-byte aligned row strides) and a per-expert loop elsewhere. Both give the same numbers.
Also the LM head's GEMM (`head_logits`), whose fp32 master weight takes its gradient the same way:
cast once per update, the gradient added into .grad by the GEMM, not cast and added by autograd; and
the token embedding (`Embedding`), whose gradient rows are added into .grad where the tokens are.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from pithtrain.protocol import stage_range
from pithtrain.ops import core, fp8, kernels
from pithtrain.ops.core import autocast_dtype
from pithtrain.ops.kernels import add_into

# The weight gradients of cast master weights added into the fp32 .grad in the GEMM's epilogue
# (kernels.wgrad_into) rather than a bf16 product and an add_into pass: +2.0% tokens/s at Qwen3 width
# on the H200, neutral at DeepSeek-V2-Lite and GPT-OSS widths (docs/performance.md, Kernels).
FUSED_WGRAD = True


def _grouped_mm_applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    if x.device.type == "cuda":
        if x.dtype != torch.bfloat16 or torch.cuda.get_device_capability(x.device)[0] < 9:
            return False
    elif x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
        return False
    item = x.element_size()
    return (x.shape[-1] * item) % 16 == 0 and (w.shape[-1] * item) % 16 == 0 and x.dtype == w.dtype


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """x: [N, K] rows grouped by expert; w: [E, K, M]; counts: [E] rows per expert (sum N). Returns [N, M]."""
    if _grouped_mm_applies(x, w):
        offs = torch.cumsum(counts, 0).to(device=x.device, dtype=torch.int32)
        return torch._grouped_mm(x, w, offs=offs)
    # Fallback: one matmul per expert (a host sync for the split sizes).
    chunks = x.split(counts.tolist())
    outs = [chunk @ w[e] for e, chunk in enumerate(chunks)]
    return torch.cat(outs) if outs else x.new_zeros(0, w.shape[-1])


def grouped_weight_grad(x: torch.Tensor, dy: torch.Tensor, counts: torch.Tensor, num_groups: int) -> torch.Tensor:
    """dW[e] = x_e^T @ dy_e for rows grouped by expert: [E, K, M]."""
    if _grouped_mm_applies(x, dy) and x.shape[0] > 0:
        offs = torch.cumsum(counts, 0).to(device=x.device, dtype=torch.int32)
        return torch._grouped_mm(x.t(), dy, offs=offs)
    out = x.new_zeros(num_groups, x.shape[1], dy.shape[1])
    for e, (xe, dye) in enumerate(zip(x.split(counts.tolist()), dy.split(counts.tolist()))):
        out[e] = xe.t() @ dye
    return out


@torch.no_grad()
def accumulate_grad(param: torch.Tensor, grad: torch.Tensor) -> None:
    """param.grad += grad in place: a bf16 product goes straight into the fp32 gradient in one pass
    (kernels.add_into), and the first one of a step is cast into a new gradient the same way."""
    if param.grad is None and grad.dtype == param.dtype and grad.is_contiguous():
        param.grad = grad  # a fresh product in the parameter's dtype: no copy
    elif param.grad is None:
        param.grad = add_into(torch.empty_like(param), grad, assign=True)
    else:
        add_into(param.grad, grad)


def mm_into_grad(param: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """param.grad (+)= a @ b in fp32 for bf16 a and b: on CUDA cuBLAS accumulates into the fp32
    gradient in the GEMM itself (beta = 1, fp32 output), so the product is never a tensor of its
    own; elsewhere (the reference) the product, then accumulate_grad."""
    grad = param.grad
    if not a.is_cuda or (grad is not None and not grad.is_contiguous()):  # the reference path
        accumulate_grad(param, a @ b)
    elif grad is None:
        param.grad = torch.mm(a, b, out_dtype=torch.float32)
    else:
        torch.addmm(grad, a, b, out_dtype=torch.float32, out=grad)


class _HeadLinear(torch.autograd.Function):
    """logits = x @ w^T with w the compute-dtype copy of the fp32 master weight `param`; the weight
    gradient goes into param.grad by mm_into_grad (autograd would cast a bf16 product to fp32 and
    add it: two passes over the vocabulary-sized gradient per micro-batch)."""

    @staticmethod
    def forward(ctx, x, param, w):
        xc = x.to(w.dtype)
        ctx.save_for_backward(xc, w)
        ctx.param, ctx.x_dtype = param, x.dtype
        return F.linear(xc, w)

    @staticmethod
    def backward(ctx, dy):
        xc, w = ctx.saved_tensors
        dy = dy.to(w.dtype)
        dx = (dy @ w).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
        dw = None
        if ctx.needs_input_grad[1]:
            dw = head_weight_grad(ctx.param, dy.reshape(-1, dy.shape[-1]), xc.reshape(-1, xc.shape[-1]))
        return dx, dw, None


def head_weight_grad(param: torch.Tensor, dy2: torch.Tensor, xc: torch.Tensor) -> torch.Tensor | None:
    """The head's weight gradient dy^T @ x (both 2-D, the compute dtype): added into an fp32 master's
    .grad by the GEMM itself (mm_into_grad; None returned), else returned for autograd (an FSDP
    compute copy, or fp32 math)."""
    if param.dtype == torch.float32 and param.is_leaf and xc.dtype != torch.float32:
        with torch.no_grad():
            mm_into_grad(param, dy2.t(), xc)
        return None
    return (dy2.t() @ xc).to(param.dtype)


def head_logits(x: torch.Tensor, param: torch.Tensor, fp8_head: bool = False) -> torch.Tensor:
    """F.linear(x, param) for the LM head. Under autocast with an fp32 master weight (not an FSDP
    compute copy, which is already bf16) the weight is cast once per update (its version counter;
    autocast casts it again every micro-batch) and its gradient accumulated by the GEMM itself.
    fp8_head (train.fp8_head): the forward and input-gradient GEMMs in FP8 (_FP8HeadLinear)."""
    dtype = autocast_dtype(x)
    trains = param.requires_grad and torch.is_grad_enabled() and not isinstance(param, DTensor)
    if fp8_head and trains and x.shape[-1] % 16 == 0 and param.shape[0] % 16 == 0:  # _scaled_mm's contractions
        w = fp8.cached_param(param)
        slot = {}  # kernels.cross_entropy_sum of these logits puts their gradient's FP8 copy here (q, s, ptr)
        logits = _FP8HeadLinear.apply(x, param, *w.fwd, *w.bwd, dtype, slot)
        logits._fp8_dgrad = slot
        return logits
    if not trains or dtype == param.dtype or param.dtype != torch.float32:
        return F.linear(x, param)
    key = (id(param), param._version, param.data_ptr(), dtype)
    hit = getattr(param, "_head_cast", None)
    if hit is None or hit[0] != key:
        hit = (key, param.detach().to(dtype))
        param._head_cast = hit  # on the parameter: a tied head shares the embedding's weight
    return _HeadLinear.apply(x, param, hit[1])


class _EmbeddingRows(torch.autograd.Function):
    """weight[ids], the weight gradient added into weight.grad by hand: dy's rows at their ids (index_put_
    with accumulate: sorted on CUDA), not autograd's dense [vocab, hidden] gradient per micro-batch, which
    it then adds into .grad (at 151,936 x 2048 in fp32: 1.2 GB written, then 3.7 GB read and written). The rows
    leave in the autocast dtype (core.ACTIVATIONS_IN_COMPUTE_DTYPE), as FSDP's bf16 weight copy gives them."""

    @staticmethod
    def forward(ctx, ids, weight):
        ctx.save_for_backward(ids)
        ctx.weight = weight
        rows = F.embedding(ids, weight)
        return rows.to(torch.get_autocast_dtype(weight.device.type)) if core.ACTIVATIONS_IN_COMPUTE_DTYPE else rows

    @staticmethod
    @torch.no_grad()
    def backward(ctx, dy):
        (ids,) = ctx.saved_tensors
        weight = ctx.weight
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        weight.grad.index_put_((ids.reshape(-1).long(),), dy.reshape(-1, dy.shape[-1]).to(weight.dtype), accumulate=True)
        return None, None


class Embedding(nn.Embedding):
    """nn.Embedding whose fp32 master weight under autocast (the compute dtype is not the weight's; a leaf: not
    an FSDP compute copy, which is bf16, nor a DTensor) takes its gradient through _EmbeddingRows, as the head's
    does through head_logits; elsewhere (fp32 math, where torch.autograd.grad must see the gradient) and with
    any of nn.Embedding's options, nn.Embedding's."""

    def forward(self, ids):
        w = self.weight
        if (w.requires_grad and torch.is_grad_enabled() and torch.is_autocast_enabled(w.device.type) and w.is_leaf
                and w.dtype == torch.float32 and not isinstance(w, DTensor) and self.padding_idx is None
                and self.max_norm is None and not self.scale_grad_by_freq and not self.sparse):
            return _EmbeddingRows.apply(ids, w)
        return super().forward(ids)


HEAD_DGRAD_ROWS = 4096  # tokens per FP8 input-gradient GEMM of the head: 0.6 GB of dy's FP8 copy at 151,936 words when
# quantized here; and cuBLAS ran the whole micro-batch's [16k x 152k] x [152k x 2k] as one product 21 ms a step
# slower than as four of 4096 rows (Qwen3 9 layers, 4 x 8 micro-batches, H200, results.jsonl line 144)


class _FP8HeadLinear(torch.autograd.Function):
    """logits = x @ w^T with x (per token) and w (per vocabulary row) in FP8, and dx = dy @ w with dy
    (per token) and w (per hidden column) in FP8: ops/fp8.py's recipe; the weight gradient
    dy^T @ x in the compute dtype from the saved x (head_weight_grad, as the bf16 head's). The logits
    leave in the compute dtype. `dgrad_slot`: where kernels.cross_entropy_sum leaves dy's FP8 copy, made by
    its backward as it wrote dy over the logits; taken when dy is that very gradient (its memory), else dy
    is quantized here."""

    @staticmethod
    def forward(ctx, x, param, wf_q, wf_s, wb_q, wb_s, dtype, dgrad_slot):
        x2 = x.reshape(-1, x.shape[-1])
        logits = fp8.scaled_mm(*fp8.quantize(x2), wf_q, wf_s, dtype)
        ctx.save_for_backward(x2.to(dtype), wb_q, wb_s)
        ctx.param, ctx.x_shape, ctx.x_dtype, ctx.slot = param, x.shape, x.dtype, dgrad_slot
        return logits.view(*x.shape[:-1], logits.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        xc, wb_q, wb_s = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        made = ctx.slot.copy()
        ctx.slot.clear()
        dx = dw = None
        if ctx.needs_input_grad[0]:  # by row blocks, even from the copy: see HEAD_DGRAD_ROWS
            if made.get("ptr") == dy2.data_ptr() and made["q"].shape == dy2.shape:
                blocks = zip(made["q"].split(HEAD_DGRAD_ROWS), made["s"].split(HEAD_DGRAD_ROWS))
            else:  # quantized a block at a time: dy's FP8 copy stays small (the step's memory peak is here)
                blocks = (fp8.quantize(block) for block in dy2.split(HEAD_DGRAD_ROWS))
            dx = torch.cat([fp8.scaled_mm(q, s, wb_q, wb_s, xc.dtype) for q, s in blocks]).view(ctx.x_shape).to(ctx.x_dtype)
        del made
        if ctx.needs_input_grad[1]:
            dw = head_weight_grad(ctx.param, dy2.to(xc.dtype), xc)
        return dx, dw, None, None, None, None, None, None


def grouped_weight_grad_into(grad: torch.Tensor, x: torch.Tensor, dy: torch.Tensor, counts: torch.Tensor,
                             assign: bool) -> torch.Tensor:
    """grad[e] += x_e^T @ dy_e (= with `assign`) for an fp32 grad [E, K, M]: on CUDA one Triton GEMM
    adding in its epilogue; elsewhere (the reference) grouped_weight_grad, then add_into."""
    if (kernels.use_triton(x) and x.dtype in (torch.bfloat16, torch.float16) and dy.dtype == x.dtype
            and grad.is_contiguous()):
        return kernels.wgrad_into(grad, x, dy, counts, assign)
    return add_into(grad, grouped_weight_grad(x, dy, counts, grad.shape[0]), assign)


class DeferredWeightGrads:
    """A queue of weight-gradient work postponed by the backward (zero-bubble "W" passes): the
    pipeline schedule runs it later, in a bubble. `add_grad(param, grad)` receives each result
    (it knows how the parameter is sharded); `plain`: for a parameter that is not a DTensor it is
    accumulate_grad (fsdp.add_grad), so the fused weight gradient may go straight into .grad."""

    def __init__(self, add_grad, plain: bool = False):
        self.work, self.add_grad = [], add_grad
        self.plain = plain or add_grad is accumulate_grad

    def run(self) -> None:
        while self.work:
            self.work.pop(0)()


@torch.no_grad()
def add_weight_grad(param, x, dy, counts, num_groups: int, queue: DeferredWeightGrads | None) -> None:
    """param.grad += x_e^T @ dy_e per expert: through queue.add_grad (or accumulate_grad without a
    queue), or with FUSED_WGRAD on CUDA, for an fp32 parameter that is not FSDP-sharded, in one GEMM."""
    grad = param.grad  # grouped_weight_grad_into picks the kernel or the reference path itself
    if (FUSED_WGRAD and (queue is None or queue.plain) and not isinstance(param, DTensor)
            and param.dtype == torch.float32 and (grad is None or grad.dtype == torch.float32)):
        param.grad = grouped_weight_grad_into(torch.empty_like(param) if grad is None else grad, x, dy, counts,
                                              assign=grad is None)
        return
    (accumulate_grad if queue is None else queue.add_grad)(param, grouped_weight_grad(x, dy, counts, num_groups))


class _GroupedMMDeferredW(torch.autograd.Function):
    """Grouped GEMM whose weight gradient goes to the parameter's .grad by hand: queued on a
    DeferredWeightGrads (zero-bubble W) or, with no queue, accumulated at once."""

    @staticmethod
    def forward(ctx, x, w, counts, queue, module, name):
        ctx.save_for_backward(x, w, counts)
        ctx.queue, ctx.module, ctx.name = queue, module, name
        return grouped_mm(x, w, counts)

    @staticmethod
    def backward(ctx, dy):
        x, w, counts = ctx.saved_tensors
        dx = grouped_mm(dy, w.transpose(-1, -2), counts)
        queue, module, name, num_groups = ctx.queue, ctx.module, ctx.name, w.shape[0]

        def weight_pass():  # needs only activations: the weights may be resharded by now
            with stage_range(3, "wgrad"):
                add_weight_grad(getattr(module, name), x, dy, counts, num_groups, queue)

        if queue is None:
            weight_pass()
        else:
            queue.work.append(weight_pass)
        return dx, None, None, None, None, None


class _FP8GroupedMM(torch.autograd.Function):
    """Expert GEMM x @ W[e] for rows grouped by expert; W [E, K, M]. The weight gradient goes into
    W.grad by hand (in the GEMM's epilogue where FUSED_WGRAD applies): deferred to a
    queue (zero-bubble W pass), or at once without one; autograd never sees it (a separate fp32
    product cast and added by autograd cost 48 ms a step at 4 Qwen3-width layers, 2 x 4 micro-batches)."""

    @staticmethod
    def forward(ctx, x, xq, xs, weight, counts, w_fwd_q, w_fwd_s, w_bwd_q, w_bwd_s, out_dtype, queue, module, name,
                fp8_wgrad, dgrad_slot):
        if xq is None:
            xq, xs = fp8.quantize(x)
        y = fp8.grouped_mm(xq, xs, w_fwd_q, w_fwd_s, counts, out_dtype)
        xtq = xts = x_hp = None
        if ctx.needs_input_grad[3] and fp8_wgrad:
            xtq, xts = fp8.quantize_t(x, counts)
        elif ctx.needs_input_grad[3]:
            x_hp = x.to(out_dtype)
        ctx.save_for_backward(xtq, xts, x_hp, counts, w_bwd_q, w_bwd_s)
        ctx.queue, ctx.module, ctx.name, ctx.x_dtype, ctx.slot = queue, module, name, x.dtype, dgrad_slot
        return y

    @staticmethod
    def backward(ctx, dy):
        xtq, xts, x_hp, counts, w_bwd_q, w_bwd_s = ctx.saved_tensors
        dy = dy.contiguous()
        made = ctx.slot.copy()  # dy's FP8 copy, if dy's producer made it (fp8.glu_quantized's backward)
        ctx.slot.clear()
        dx = None
        if ctx.needs_input_grad[0]:
            dyq, dys = (made["q"], made["s"]) if made.get("ptr") == dy.data_ptr() else fp8.quantize(dy)
            del made
            dx = fp8.grouped_mm(dyq, dys, w_bwd_q, w_bwd_s, counts, dy.dtype).to(ctx.x_dtype)
        if ctx.needs_input_grad[3]:  # the weight gradient goes into .grad by hand, as in the bf16 path
            queue, module, name, groups = ctx.queue, ctx.module, ctx.name, w_bwd_q.shape[0]
            dytq = dyts = dy_hp = None
            if x_hp is None:
                dytq, dyts = fp8.quantize_t(dy, counts)
            else:
                dy_hp = dy.to(x_hp.dtype)

            def weight_pass():  # needs only saved activations: the weights may be resharded by now
                with stage_range(3, "wgrad"):
                    param = getattr(module, name)
                    if x_hp is None:
                        (accumulate_grad if queue is None else queue.add_grad)(
                            param, fp8.grouped_wgrad(xtq, xts, dytq, dyts, counts))
                    else:  # rowwise_bf16_wgrad: may add into .grad in the GEMM (FUSED_WGRAD)
                        add_weight_grad(param, x_hp, dy_hp, counts, groups, queue)

            if queue is None:  # at once: never a separate fp32 product for autograd to cast and add
                weight_pass()
            else:
                queue.work.append(weight_pass)
        return dx, None, None, None, None, None, None, None, None, None, None, None, None, None, None


# FP8 experts take gate_up's FP8 input from LocalDispatch (the T tokens quantized, then expanded; --ab expand-fp8)
EXPAND_FP8 = True


def fp8_expert_mm(x, module, name: str, counts, out_dtype, queue=None, quantized=None):
    """x @ module.<name> per expert in FP8 (the experts' [E, K, M] weights), the weight's FP8 layouts
    from the per-version cache; with a queue, the weight gradient is deferred to it. `quantized`:
    fp8.quantize(x) already made (by x's producer), else offered by x (`_fp8_rows`, the dispatch's), else
    made here."""
    w = fp8.cached_weight(module, name, contraction_last=False)
    made_by_dispatch = x.__dict__.pop("_fp8_rows", None) if quantized is None and EXPAND_FP8 else None
    xq, xs = quantized or (made_by_dispatch() if made_by_dispatch else (None, None))
    slot = {}  # where fp8.glu_quantized's backward leaves the FP8 copy of this output's gradient
    y = _FP8GroupedMM.apply(x.contiguous(), xq, xs, getattr(module, name), counts, *w.fwd, *w.bwd, out_dtype,
                            queue, module, name, getattr(module, "fp8", "rowwise") != "rowwise_bf16_wgrad", slot)
    y._fp8_dgrad = slot
    return y


def compute_weight(module, name: str, dtype) -> torch.Tensor:
    """module.<name> in `dtype`, cast once per weight update rather than once per micro-batch (as
    autocast's cache does for nn.Linear): the cast copy is kept on the parameter (`_cast_cache`), keyed by
    its version counter, which every in-place update (optimizer step, checkpoint load) bumps; the Triton
    AdamW (train/optim.TRITON_ADAMW) writes the copy in its pass and re-keys it. The copy keeps its autograd
    link, so gradients still reach the fp32 parameter."""
    param = getattr(module, name)
    if param.dtype == dtype:
        return param
    cache = param.__dict__.setdefault("_cast_cache", {})
    key = (dtype, torch.is_grad_enabled())
    hit = cache.get(key)
    if hit is not None and hit[0] == param._version:
        return hit[1]
    cast = param.to(dtype)
    cache[key] = (param._version, cast)
    return cast


def expert_mm(x, module, name: str, counts, dtype, queue: DeferredWeightGrads | None = None, quantized=None):
    """x @ module.<name> per expert, in `dtype`; with a queue, the weight gradient is deferred.
    Experts switched to FP8 (`module.fp8`, train.fp8) run the FP8 grouped GEMMs (fp8_expert_mm),
    on `quantized` (x's row-wise FP8 (q, s), made by x's producer) where given."""
    if getattr(module, "fp8", False):
        return fp8_expert_mm(x, module, name, counts, dtype, queue, quantized)
    w = compute_weight(module, name, dtype)
    if queue is None and (w is getattr(module, name) or not w.requires_grad):
        return grouped_mm(x.to(dtype), w, counts)  # no cast in between (fp32, or FSDP's bf16 copy)
    # Cast master weights: the weight gradient is computed here and added to the fp32 .grad
    # directly, now or (with a queue) in a later W pass, instead of autograd casting it and adding.
    x = x.to(dtype)
    if not x.requires_grad and torch.is_grad_enabled():  # the weight gradient still needs a backward
        x = x.detach().requires_grad_()
    return _GroupedMMDeferredW.apply(x, w.detach(), counts, queue, module, name)


def _activation(h, clamp):
    return kernels.swiglu(h) if clamp is None else kernels.clamped_swiglu(h, *clamp)


def activation_mm(h, module, counts, dtype, queue: DeferredWeightGrads | None = None, clamp=None):
    """expert_mm(act(h), module, "down", ...): the experts' activation and down projection. act is
    SwiGLU on h [N, 2I] (gate then up), with `clamp` = (alpha, limit) GPT-OSS's clamped one.
    FP8 experts (`module.fp8`) get the activation's row-wise FP8 copy from the activation's own
    kernel (fp8.glu_quantized), so no quantize pass reads act(h) again. With `module.recompute_act`
    (train.recompute=selective), act(h), the down GEMM's input (top-k x I per token), is not kept
    for the backward but recomputed from h, which the activation's own backward keeps anyway: an
    elementwise kernel instead of a stored tensor. The recomputed tensor also feeds the deferred
    weight gradient (the W pass)."""
    quantized = None
    if getattr(module, "fp8", False):
        a, *quantized = fp8.glu_quantized(h, *(clamp or (1.0, 0.0)), clamped=clamp is not None)
    else:
        a = _activation(h, clamp)
    if not getattr(module, "recompute_act", False) or not torch.is_grad_enabled():
        return expert_mm(a, module, "down", counts, dtype, queue, quantized)

    # The hooks live as long as the saved tensors: they must not hold `a` (a closure over it kept
    # the whole activation alive on GPUs), only what identifies it.
    key = (a.data_ptr(), a.shape, a.dtype)

    def pack(t):  # a itself (or expert_mm's detached alias of it): keep a marker, not the tensor
        return (None,) if (t.data_ptr(), t.shape, t.dtype) == key else t

    def unpack(saved):
        if isinstance(saved, tuple):
            with torch.no_grad():
                return _activation(h, clamp)
        return saved

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        return expert_mm(a, module, "down", counts, dtype, queue, quantized)
