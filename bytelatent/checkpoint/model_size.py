"""Does the model a checkpoint's params.json describes fit this machine? Asked before allocating.

A folder's params.json decides the model's shape, and with it how much memory loading takes:
`dim: 65536, n_layers: 200` asks for tens of terabytes. `require_model_fits` refuses such a model
in one line before any weight is read or any tensor allocated:

1. an analytic lower bound (transformer blocks, embedding tables, the global RoPE table, plus
   the host memory each block's module objects take), which costs nothing whatever the shape;
2. when that fits, the exact count from a build on the meta device (parameters and buffers).

Each is compared with the memory available now: the host's (MemAvailable, capped by a cgroup
limit) always, since the weights are read into host memory first, and the device's free memory
when loading onto CUDA. Only what the model needs resident is counted; the loader's transient
copies and the caller's activations are not, so passing this check is necessary, not sufficient.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from bytelatent.errors import CheckpointError
from bytelatent.model.args import block_head_counts
from bytelatent.model.layers import ffn_hidden_dim
from bytelatent.model.registry import arch_of_args

GIB = 2**30
# Host memory of one transformer block's module objects on the meta device (measured ~29 KB:
# Python objects of the modules and parameters); counted so that a shape with millions of tiny
# layers is refused before a meta build would spend minutes and gigabytes making them.
BLOCK_HOST_BYTES = 32 * 1024


def _block_params(block: Any) -> int:
    """Parameters of one TransformerBlock: q/k/v/o, SwiGLU w1/w2/w3 and its two norms."""
    head_dim, n_heads, n_kv_heads = block_head_counts(block)
    dim = block.dim
    attention = 2 * dim * n_heads * head_dim + 2 * dim * n_kv_heads * head_dim
    hidden = ffn_hidden_dim(dim, block.multiple_of, block.ffn_dim_multiplier)
    return attention + 3 * dim * hidden + 2 * dim


def _rope_values(block: Any, max_seqlen: int) -> int:
    head_dim, _, _ = block_head_counts(block)
    return max_seqlen * (head_dim // 2)  # at least one value per position and frequency


def lower_bound(args: Any) -> tuple[int, int]:
    """(values at least, blocks) of the model `args` describes, without building anything, by its
    architecture (`Sizes.lower_bound` of its spec; (0, 0) for one without).

    Never more than the real count (tests check it against meta builds): only the parts every
    variant has are counted.
    """
    bound = arch_of_args(args).sizes.lower_bound
    return bound(args) if bound is not None else (0, 0)


def exact_count(args: Any) -> int:
    """Parameters plus buffers of the model, from a build on the meta device (no memory)."""
    with torch.device("meta"):
        model = arch_of_args(args).build(args)
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return sum(t.numel() for t in tensors.values())


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
        return None if text == "max" else int(text)
    except (OSError, ValueError):
        return None


def _cgroup_available() -> int | None:
    """What this process's cgroup still allows (v2 memory.max, v1 limit_in_bytes), if limited."""
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        (
            "/sys/fs/cgroup/memory/memory.limit_in_bytes",
            "/sys/fs/cgroup/memory/memory.usage_in_bytes",
        ),
    ):
        limit, usage = _read_int(limit_file), _read_int(usage_file)
        if limit is not None and usage is not None and limit < 2**60:  # v1 "no limit" is huge
            return max(limit - usage, 0)
    return None


def available_host_bytes() -> int | None:
    """Host memory this process can still use, or None when the platform does not say."""
    known = [v for v in (_meminfo_available(), _cgroup_available()) if v is not None]
    return min(known) if known else None


def available_device_bytes(device: torch.device) -> int | None:
    """Free memory of a CUDA device; None for other devices."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return int(torch.cuda.mem_get_info(device)[0])


def _gib(n: float) -> str:
    return f"{n / GIB:,.1f} GiB"


def require_model_fits(
    args: Any, device: str | torch.device, where: str, dtype: torch.dtype | None = None
) -> int:
    """Raise a one-line CheckpointError when the model `args` describes (params.json at `where`)
    cannot fit in the host's or `device`'s available memory; returns its exact value count."""
    device = torch.device(device)
    dtype = dtype or torch.get_default_dtype()
    size = torch.empty((), dtype=dtype).element_size()
    host, dev = available_host_bytes(), available_device_bytes(device)

    def check(count: int, host_extra: int, at_least: str) -> None:
        need = count * size
        for name, free, needed in (("this host's", host, need + host_extra),
                                   (f"{device}'s", dev, need)):  # fmt: skip
            if free is not None and needed > free:
                raise CheckpointError(
                    f"{where}: the model has {at_least}{count:,} parameters and buffers "
                    f"({_gib(needed)} in {str(dtype).removeprefix('torch.')}), more than "
                    f"{name} available memory {_gib(free)}; check the model section of params.json"
                )

    try:
        bound, blocks = lower_bound(args)
        check(bound, blocks * BLOCK_HOST_BYTES, "at least ")
        count = exact_count(args)
    except (ValueError, RuntimeError, ZeroDivisionError) as err:  # shapes the model refuses
        raise CheckpointError(f"{where}: model args invalid: {err}") from None
    check(count, blocks * BLOCK_HOST_BYTES, "")
    return count
