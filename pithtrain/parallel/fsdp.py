"""Expert sharding and FSDP2: dense weights sharded over dp x cp x ep, expert weights over dp x cp.

Gradient semantics: every rank backpropagates its share of the GLOBAL mean loss (its token cross-entropy sum divided by
the global token count), so the true gradient is the SUM over ranks. FSDP2 averages by default; we set the divide factor
to 1 (with sum reduction forced, since gloo has no PREMUL_SUM). Expert gradients first gather every EP rank's tokens
through the combine/dispatch all-to-all backward, then are summed over dp x cp: no ep-fold error.

With `hsdp`, weights are replicated over dp and sharded within (cp x ep) for dense weights and within cp for experts."""

from __future__ import annotations

import math
import warnings

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from pithtrain.ops.grouped_gemm import accumulate_grad
from pithtrain.ops.kernels import add_into
from pithtrain.parallel.mesh import Mesh
from pithtrain.protocol import all_layers

_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)  # the new name since torch 2.13


def expert_modules(model: torch.nn.Module):
    """Modules named `experts`: all their parameters are stacked with the expert index in dim 0."""
    return [m for name, m in model.named_modules() if name.split(".")[-1] == "experts"]


@torch.no_grad()
def keep_local_experts(model: torch.nn.Module, ep_rank: int, ep: int) -> None:
    """Slice every expert parameter to this EP rank's contiguous block of experts."""
    if ep == 1:
        return
    for module in expert_modules(model):
        for name, p in list(module.named_parameters(recurse=False)):
            per_rank = p.shape[0] // ep
            local = p[ep_rank * per_rank : (ep_rank + 1) * per_rank].clone()
            setattr(module, name, torch.nn.Parameter(local, requires_grad=p.requires_grad))


def shard_model(model: torch.nn.Module, mesh: Mesh, bf16_params: bool, reshard_after_forward: bool = True) -> None:
    """fully_shard the expert modules, each decoder layer, then the root. The pipeline passes
    reshard_after_forward=False (as torchtitan does under pipelining): with many micro-batches
    in flight, gathering once per forward instead of again in backward halves the all-gathers
    for the price of keeping this chunk's dense weights unsharded between the two."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    # Stage outputs include views (flattened tokens); we never modify them in place.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16_params else MixedPrecisionPolicy()
    dense, expert = _fsdp_meshes(mesh)
    units, ignored = [], set()

    def shard(module, over, ignored_params=None):
        units.append(fully_shard(module, mesh=over, mp_policy=policy, reshard_after_forward=reshard_after_forward,
                                 ignored_params=ignored_params))

    for module in expert_modules(model):
        if expert.size() == 1:  # one rank per expert shard group (e.g. ep = world size): nothing to
            # shard, so the experts stay plain local tensors (cast to bf16 once per step by
            # grouped_gemm.compute_weight, gradients added in place): no FSDP copies or hooks
            ignored.update(module.parameters())
            continue
        shard(module, expert)
    for layer in all_layers(model).values():
        if hasattr(layer, "shared_head"):  # an MTP layer's head norm runs outside its stages: its own unit
            shard(layer.shared_head, dense)
        shard(layer, dense, ignored or None)
        # the engine calls the stages, not forward(): let FSDP gather the weights around them
        register_fsdp_forward_method(layer, "stage1")
        register_fsdp_forward_method(layer, "stage5")
    shard(model, dense, ignored or None)
    for unit in units:
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)


def _fsdp_meshes(mesh: Mesh):
    if not mesh.hsdp:
        return mesh.dense_mesh, mesh.expert_mesh
    dm = mesh.device_mesh
    dm["cp", "ep"]._flatten("cp_ep")
    with warnings.catch_warnings():  # torch 2.13 announces a change to this slicing; the GPU image's 2.11 has no other
        warnings.filterwarnings("ignore", message="Slicing a flattened dim")
        return dm["dp", "cp_ep"], dm["dp", "cp"]


@torch.no_grad()
def global_grad_norm(params, mesh: Mesh) -> float:
    """sqrt of the sum of squares of every gradient element counted once across the mesh."""
    local, grads = torch.zeros((), dtype=torch.float64, device=mesh.device), _local_grads(params)
    if grads:  # one fused norm kernel per tensor (fp32 accumulation), summed in float64
        local += torch.stack(torch._foreach_norm(grads)).double().pow(2).sum()
    if mesh.world > 1:
        dist.all_reduce(local)
        # every element lives on exactly one rank of each pipeline stage... except replicas:
        local /= mesh.dp if mesh.hsdp else 1
    return math.sqrt(local.item())


def clip_coefficient(max_norm: float, total_norm: float) -> float:
    """What gradient clipping multiplies the gradients by (1.0: no clipping; max_norm 0: never)."""
    return max_norm / (total_norm + 1e-6) if 0 < max_norm < total_norm else 1.0


@torch.no_grad()
def clip_grads(params, max_norm: float, total_norm: float) -> None:
    scale = clip_coefficient(max_norm, total_norm)
    if scale != 1.0 and (grads := _local_grads(params)):
        torch._foreach_mul_(grads, scale)


def _local_grads(params) -> list[torch.Tensor]:
    """This rank's gradient tensors (the local shards of DTensor gradients)."""
    return [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params if p.grad is not None]


@torch.no_grad()
def add_grad(param: torch.nn.Parameter, full_grad: torch.Tensor) -> None:
    """Add a gradient computed for the whole local parameter (e.g. a deferred expert weight
    gradient) to `param.grad`, reduce-scattering (SUM) over the FSDP shards when `param` is a
    DTensor sharded on dim 0, and summing over replicas under HSDP."""
    if not isinstance(param, DTensor):
        accumulate_grad(param, full_grad)
        return
    mesh, placements = param.device_mesh, param.placements
    local_shape = param.to_local().shape
    for dim, placement in enumerate(placements):
        if mesh.size(dim) == 1:  # e.g. experts under ep = world size: nothing to exchange
            continue
        group = mesh.get_group(dim)
        full_grad = full_grad.to(param.dtype)  # reduce in the parameter's dtype (fp32)
        if isinstance(placement, Replicate):
            dist.all_reduce(full_grad, group=group)
        elif isinstance(placement, Shard) and placement.dim == 0:
            n = mesh.size(dim)
            chunk = -(-full_grad.shape[0] // n)  # FSDP2 pads dim 0 to n equal chunks
            padded = full_grad.new_zeros((chunk * n, *full_grad.shape[1:]))
            padded[: full_grad.shape[0]] = full_grad
            out = full_grad.new_empty((chunk, *full_grad.shape[1:]))
            _reduce_scatter(out, padded, group=group)
            full_grad = out[: local_shape[0]]
        else:
            raise NotImplementedError(f"deferred gradient for placement {placement}")
    if param.grad is not None:
        add_into(param.grad.to_local(), full_grad)  # in place, in one pass
        return
    local = add_into(full_grad.new_empty(full_grad.shape, dtype=param.dtype), full_grad, assign=True)
    param.grad = DTensor.from_local(local, mesh, placements, shape=param.shape, stride=param.stride())
