"""Device mesh (dp_replicate × dp_shard × tp) and the ranks derived from it."""

from __future__ import annotations

from typing import Protocol

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from bytelatent.distributed.args import DistributedArgs
from bytelatent.distributed.world import MeshLayout, resolve_layout  # noqa: F401 (re-exported)

MESH_DIMS = ("dp_replicate", "dp_shard", "tp")


def build_mesh(args: DistributedArgs, world_size: int, device_type: str) -> DeviceMesh | None:
    """A 3-D mesh named MESH_DIMS (size-1 dims included); None for a single process unless it
    trains through FSDP on a 1-rank mesh (`single_device_fsdp`, on by default on CUDA)."""
    layout = resolve_layout(args, world_size)
    if world_size == 1 and not (args.use_single_device_fsdp(device_type) and dist.is_initialized()):
        return None  # (a tool that built no process group gets the plain single-process model)
    if not dist.is_initialized():
        raise RuntimeError("build_mesh needs the process group: call setup_distributed first")
    return init_device_mesh(
        device_type,
        (layout.dp_replicate, layout.dp_shard, layout.tp),
        mesh_dim_names=MESH_DIMS,
    )


class _MeshLike(Protocol):
    mesh_dim_names: tuple[str, ...] | None
    shape: tuple[int, ...]

    def get_coordinate(self) -> list[int] | None: ...


def dp_rank_from_coords(replicate_rank: int, shard_rank: int, shard_size: int) -> int:
    """Row-major rank over (dp_replicate, dp_shard): distinct for every data-parallel rank.

    Not the reference's formula, which collides (docs/differences.md, `dp_rank`).
    """
    return replicate_rank * shard_size + shard_rank


def _coords(mesh: _MeshLike) -> dict[str, tuple[int, int]]:
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise RuntimeError("this rank is not part of the device mesh")
    names = mesh.mesh_dim_names or ()
    return {
        name: (rank, size) for name, rank, size in zip(names, coordinate, mesh.shape, strict=True)
    }


def dp_rank_and_size(mesh: _MeshLike | None) -> tuple[int, int]:
    """(data-parallel rank, number of data-parallel ranks): which slice of the data to read."""
    if mesh is None:
        return 0, 1
    coords = _coords(mesh)
    rep_rank, rep_size = coords.get("dp_replicate", (0, 1))
    shard_rank, shard_size = coords.get("dp_shard", (0, 1))
    return dp_rank_from_coords(rep_rank, shard_rank, shard_size), rep_size * shard_size


def dp_group(mesh: DeviceMesh | None) -> dist.ProcessGroup | None:
    """The process group of all data-parallel ranks (for loss/byte-count sums); None alone."""
    if mesh is None:
        return None
    # _flatten caches by name, so repeated calls return the same group.
    return mesh["dp_replicate", "dp_shard"]._flatten("dp").get_group()


def tp_rank_and_size(mesh: _MeshLike | None) -> tuple[int, int]:
    """(tensor-parallel rank, tensor-parallel degree); ranks sharing a dp rank differ here."""
    if mesh is None:
        return 0, 1
    return _coords(mesh).get("tp", (0, 1))
