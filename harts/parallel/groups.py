"""Process groups of a parallel run: torch DeviceMesh over megatron-core's rank order.

Rank order (megatron-core's default "tp-cp-ep-dp-pp", no context parallelism): tensor-parallel
ranks are adjacent, then data-parallel, then pipeline stages,
    rank = tp_rank + tp · (dp_rank + dp · pp_rank),
i.e. the dense mesh is arange(world).view(pp, dp, tp). Experts use a second mesh over the same
ranks, arange(world).view(pp, edp, ep, etp) (megatron's expert "tp-ep-dp-pp" order, etp = the
expert-tensor-parallel size): the ep shards of a stage are adjacent ranks among its dp · tp ranks,
and the edp ranks holding the same shard (stride ep · etp) sum their expert gradients.
`rank_layout(config, rank)` is this arithmetic alone (no torch.distributed); tests compare it
with megatron-core's own `RankGenerator` for every shipped config.

Why DeviceMesh and not megatron-core's `parallel_state`: `initialize_model_parallel` does run on
gloo on CPU in 0.16.1 (checked with tp = 2, ep = 2, etp = 1 on two ranks), but importing
megatron.core takes ~15 s wall (6.5 s CPU) per process on the 2-core CI machine (it pulls in
its transformer-engine extensions and tensor_parallel layers), paid by every spawned rank, and
its groups live in process-global state. The groups here are the same rank sets. Each mesh
dimension's group gets the configured timeout (DeviceMesh's subgroups otherwise take the
backend's default, 30 min for gloo), so a dead or diverged rank fails a collective instead of
hanging the run.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from harts.parallel.config import ParallelConfig

DENSE_DIMS = ("pp", "dp", "tp")
EXPERT_DIMS = ("pp", "edp", "ep", "etp")


@dataclass(frozen=True)
class RankLayout:
    """Coordinates of one rank and the global ranks of each of its groups."""

    rank: int
    pp_rank: int
    dp_rank: int
    tp_rank: int
    ep_rank: int
    edp_rank: int
    groups: dict[str, list[int]]
    """"tp", "dp", "pp", "ep", "edp", "etp": global ranks of the group holding this rank, in group-rank order."""


def dense_mesh_ranks(config: ParallelConfig) -> np.ndarray:
    return np.arange(config.world_size).reshape(config.pp, config.dp, config.tp)


def expert_mesh_ranks(config: ParallelConfig) -> np.ndarray:
    return np.arange(config.world_size).reshape(config.pp, config.expert_dp, config.ep, config.expert_tp)


def _group_of(ranks: np.ndarray, rank: int, dim: int) -> tuple[list[int], int]:
    index = tuple(int(i) for i in np.argwhere(ranks == rank)[0])
    line = [index[:dim] + (i,) + index[dim + 1 :] for i in range(ranks.shape[dim])]
    return [int(ranks[i]) for i in line], index[dim]


def rank_layout(config: ParallelConfig, rank: int) -> RankLayout:
    if not 0 <= rank < config.world_size:
        raise ValueError(f"rank {rank} outside world of {config.world_size}")
    dense, expert = dense_mesh_ranks(config), expert_mesh_ranks(config)
    groups, coords = {}, {}
    for dim, name in enumerate(DENSE_DIMS):
        groups[name], coords[name] = _group_of(dense, rank, dim)
    for dim, name in enumerate(EXPERT_DIMS[1:], start=1):
        groups[name], coords[name] = _group_of(expert, rank, dim)
    return RankLayout(
        rank=rank, pp_rank=coords["pp"], dp_rank=coords["dp"], tp_rank=coords["tp"],
        ep_rank=coords["ep"], edp_rank=coords["edp"], groups=groups,
    )


def _backend_options(backend: str, timeout: datetime.timedelta):
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
    else:
        options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    return backend, options


@dataclass(frozen=True, eq=False)
class ParallelGroups:
    """The process groups of this rank (built collectively by every rank of the world)."""

    config: ParallelConfig
    layout: RankLayout
    device: torch.device
    tp: dist.ProcessGroup
    dp: dist.ProcessGroup
    pp: dist.ProcessGroup
    ep: dist.ProcessGroup
    edp: dist.ProcessGroup
    """Ranks holding the same expert shard: their expert gradients are summed."""

    @property
    def rank(self) -> int:
        return self.layout.rank

    @property
    def is_first_stage(self) -> bool:
        return self.layout.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.layout.pp_rank == self.config.pp - 1

    @property
    def previous_stage_rank(self) -> int:
        return self.layout.groups["pp"][self.layout.pp_rank - 1]

    @property
    def next_stage_rank(self) -> int:
        return self.layout.groups["pp"][self.layout.pp_rank + 1]


def build_groups(config: ParallelConfig, device: torch.device) -> ParallelGroups:
    """Every rank must call this, in the same order, after `init_process_group`."""
    from torch.distributed.device_mesh import DeviceMesh

    if dist.get_world_size() != config.world_size:
        raise ValueError(
            f"parallel config {config.name!r} needs {config.world_size} ranks, the process group has "
            f"{dist.get_world_size()}"
        )
    override = _backend_options(dist.get_backend(), datetime.timedelta(seconds=config.timeout_s))
    device_type = device.type
    dense = DeviceMesh(
        device_type, torch.from_numpy(dense_mesh_ranks(config)), mesh_dim_names=DENSE_DIMS,
        backend_override=(override,) * len(DENSE_DIMS),
    )
    expert = DeviceMesh(
        device_type, torch.from_numpy(expert_mesh_ranks(config)), mesh_dim_names=EXPERT_DIMS,
        backend_override=(override,) * len(EXPERT_DIMS),
    )
    layout = rank_layout(config, dist.get_rank())
    groups = ParallelGroups(
        config=config, layout=layout, device=device,
        tp=dense.get_group("tp"), dp=dense.get_group("dp"), pp=dense.get_group("pp"),
        ep=expert.get_group("ep"), edp=expert.get_group("edp"),
    )
    for name in ("tp", "dp", "pp", "ep", "edp"):
        assert dist.get_process_group_ranks(getattr(groups, name)) == layout.groups[name], name
    return groups
