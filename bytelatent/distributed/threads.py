"""CPU thread counts that do not oversubscribe a machine.

torch's default intra-op pool takes every core, in every process: a trainer, its data-loading
worker and a local eval job each take all of them, and on a busy 2-core machine 40 debug steps
took 2:25 against 20.6 s with one thread. The defaults here split the cores instead; an explicit
`num_threads` or an exported OMP_NUM_THREADS (torchrun exports 1 for several processes) wins.
"""

from __future__ import annotations

import os


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity, e.g. a SLURM allocation)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def trainer_cpu_threads(
    num_threads: int | None, local_world_size: int, loader_workers: int
) -> int | None:
    """Threads for a CPU training process: `num_threads`, else None when OMP_NUM_THREADS is set
    (torch already follows it), else its share of the cores less one per data-loading worker."""
    if num_threads:
        return num_threads
    if os.environ.get("OMP_NUM_THREADS"):
        return None
    local = int(os.environ.get("LOCAL_WORLD_SIZE", local_world_size))  # processes on this machine
    return max(1, available_cores() // max(1, local) - loader_workers)
