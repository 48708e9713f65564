"""The run's device mesh: pipeline stages x data-parallel replicas x data-parallel shards x
tensor-parallel ranks (torch.distributed.device_mesh), the one object every parallel wrapping takes
its process groups from. Rank numbering is row-major over (pp, dp_replicate, dp_shard, tp), as
Degrees.dp_rank and Layout.dp_rank assume."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from llmtrain.config.derived import Degrees

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


def build_mesh(degrees: Degrees, device: torch.device) -> DeviceMesh | None:
    """The mesh over the run's processes; None for one process (nothing to split)."""
    if degrees.world == 1:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (degrees.pp, degrees.dp_replicate, degrees.dp_shard, degrees.tp),
                            mesh_dim_names=DIMS)


def data_shard_mesh(mesh: DeviceMesh, degrees: Degrees) -> DeviceMesh:
    """What FSDP2 shards over: the shard dimension, or replicas x shards (HSDP: fully_shard with a
    2-D mesh replicates across the first dimension and shards across the second)."""
    return mesh["dp_replicate", "dp_shard"] if degrees.dp_replicate > 1 else mesh["dp_shard"]
