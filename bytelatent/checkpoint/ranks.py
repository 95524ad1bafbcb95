"""Who this rank is in a checkpoint's collectives: the facts the saver and the resume policy share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import torch.distributed as dist

T = TypeVar("T")


@dataclass(frozen=True)
class Ranks:
    """This rank's place in the job and in the checkpoint's process group (one per manager)."""

    distributed: bool
    is_rank0: bool  # global rank 0: writes the marker, folder manifest and params; renames, retains
    world_size: int
    group_rank: int  # rank in `process_group` (its rank manifest, its share of a verification)
    group_size: int
    dp_rank: int
    dp_size: int
    is_tp_rank0: bool  # writes its DP rank's train state
    process_group: dist.ProcessGroup | None = None

    @classmethod
    def current(
        cls,
        dp_rank: int = 0,
        dp_size: int = 1,
        is_tp_rank0: bool = True,
        process_group: dist.ProcessGroup | None = None,
    ) -> Ranks:
        distributed = dist.is_available() and dist.is_initialized()
        return cls(
            distributed=distributed,
            is_rank0=not distributed or dist.get_rank() == 0,
            world_size=dist.get_world_size() if distributed else 1,
            group_rank=dist.get_rank(process_group) if distributed else 0,
            group_size=dist.get_world_size(process_group) if distributed else 1,
            dp_rank=dp_rank,
            dp_size=dp_size,
            is_tp_rank0=is_tp_rank0,
            process_group=process_group,
        )

    @property
    def shard(self) -> tuple[int, int]:
        """(rank, size) in the group: how ranks split the files of one verification."""
        return self.group_rank, self.group_size

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.process_group)

    def all_gather(self, mine: T) -> list[T]:
        """Every rank's `mine`, in group rank order (collective; just `[mine]` on one process)."""
        if not self.distributed:
            return [mine]
        gathered: list[T] = [None] * self.group_size  # type: ignore[list-item]
        dist.all_gather_object(gathered, mine, group=self.process_group)
        return gathered
