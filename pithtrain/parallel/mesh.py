"""The device mesh (pp, dp, cp, ep), outer to inner, and the process groups derived from it.

One `Mesh` object is built per process and passed explicitly to what needs it (no globals).
`Mesh()` (or `Mesh(device=...)`) is the one-process mesh: every group is None and every size 1.

Groups:
  ep      experts are split across it (all-to-all dispatch/combine)
  cp      a sequence is split across it
  dense   dp x cp x ep: dense weights are sharded (FSDP) over it; gradients summed over it
  expert  dp x cp: expert weights are sharded over it
  data    dp x ep: ranks that read different samples (cp ranks share theirs)"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass
class Mesh:
    world: int = 1
    rank: int = 0
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    pp_rank: int = 0
    dp_rank: int = 0
    cp_rank: int = 0
    ep_rank: int = 0
    device: torch.device = torch.device("cpu")
    device_mesh: object = None  # torch DeviceMesh with dims ("pp", "dp", "cp", "ep")
    ep_group: object = None
    cp_group: object = None
    dense_mesh: object = None  # 1-D DeviceMesh over dp x cp x ep (FSDP for dense weights)
    expert_mesh: object = None  # 1-D DeviceMesh over dp x cp (FSDP for expert weights)
    data_group: object = None
    hsdp: bool = False

    @property
    def data_ranks(self) -> int:
        return self.dp * self.ep

    @property
    def data_rank(self) -> int:
        """Which share of the global batch this rank reads."""
        return self.dp_rank * self.ep + self.ep_rank

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_mesh(pp: int, cp: int, ep: int, device_type: str, timeout_s: float, hsdp: bool = False) -> Mesh:
    """Join the process group started by the launcher (RANK/WORLD_SIZE in the environment)."""
    from torch.distributed.device_mesh import init_device_mesh

    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    if world % (pp * cp * ep):
        raise ValueError(f"world size {world} is not divisible by pp*cp*ep = {pp * cp * ep}")
    dp = world // (pp * cp * ep)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if device_type == "cuda" else torch.device("cpu")
    if device_type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend = "nccl" if device_type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s), device_id=device if device_type == "cuda" else None)
    dm = init_device_mesh(device_type, (pp, dp, cp, ep), mesh_dim_names=("pp", "dp", "cp", "ep"))
    coords = dm.get_coordinate()
    return Mesh(world=world, rank=rank, pp=pp, dp=dp, cp=cp, ep=ep, pp_rank=coords[0], dp_rank=coords[1],
                cp_rank=coords[2], ep_rank=coords[3], device=device, device_mesh=dm,
                ep_group=dm["ep"].get_group() if ep > 1 else None, cp_group=dm["cp"].get_group() if cp > 1 else None,
                dense_mesh=dm["dp", "cp", "ep"]._flatten("dense"), expert_mesh=dm["dp", "cp"]._flatten("expert"),
                data_group=dm["dp", "ep"]._flatten("data").get_group() if dp * ep > 1 else None, hsdp=hsdp)
