"""Which torch releases bytelatent runs on, and a clear refusal for older ones.

setup.py pins the torch we test on CPU (2.13). GPU images ship their own torch (the lent H200 has
2.11). Every torch API bytelatent uses was checked against the 2.11 sources (bench/gpu/README.md
lists them): none is newer than 2.11, so 2.11 needs no fallback. Below `MIN_TORCH` some of them
are missing (FSDP2's `fully_shard` in `torch.distributed.fsdp`, `get_total_norm`,
`distribute_tensor(src_data_rank=)`), and the entry points refuse to start with one line.
"""

from __future__ import annotations

import re

import torch

from bytelatent.errors import ConfigError

MIN_TORCH = (2, 6)
TESTED = ("2.11", "2.13")  # 2.13: CI on CPU; 2.11: the GPU image (bench/gpu/check.py)

# (what, how it is reached): probed at run time by `report()`, on the device too.
APIS = (
    ("fully_shard", lambda: __import__("torch.distributed.fsdp", fromlist=["fully_shard"]).fully_shard),
    ("get_total_norm", lambda: torch.nn.utils.get_total_norm),
    ("DeviceMesh._flatten", lambda: __import__("torch.distributed.device_mesh", fromlist=["x"]).DeviceMesh._flatten),
    ("dcp.async_save", lambda: __import__("torch.distributed.checkpoint", fromlist=["x"]).async_save),
    ("_set_pg_timeout", lambda: __import__("torch.distributed.distributed_c10d", fromlist=["x"])._set_pg_timeout),
    ("flash_attention_for_cpu_backward", lambda: torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default),
    ("create_selective_checkpoint_contexts", lambda: __import__("torch.utils.checkpoint", fromlist=["x"]).create_selective_checkpoint_contexts),
    ("flex_attention", lambda: __import__("torch.nn.attention.flex_attention", fromlist=["x"]).create_block_mask),
    ("get_autocast_dtype", lambda: torch.get_autocast_dtype),
    ("_disable_dynamo", lambda: torch._disable_dynamo),
)  # fmt: skip


def eager_only(fn):
    """`torch.compiler.disable(fn)` without importing torch._dynamo now (~1 s of start-up in
    every trainer process): torch's own lazy form (in every torch >= MIN_TORCH, probed in APIS),
    which imports it on the first call and which dynamo recognises when it traces a caller."""
    return torch._disable_dynamo(fn)


def torch_version(text: str | None = None) -> tuple[int, int]:
    match = re.match(r"(\d+)\.(\d+)", text or torch.__version__)
    return (int(match.group(1)), int(match.group(2))) if match else (0, 0)


def check_torch(version: str | None = None) -> None:
    """Refuse a torch older than MIN_TORCH in one line (a ConfigError: exit 2)."""
    found = torch_version(version)
    if found < MIN_TORCH:
        raise ConfigError(
            f"torch {version or torch.__version__} is too old: bytelatent needs torch >= "
            f"{MIN_TORCH[0]}.{MIN_TORCH[1]} (FSDP2 fully_shard, get_total_norm); tested on "
            f"{' and '.join(TESTED)}"
        )


def report() -> dict:
    """torch's version and whether each version-sensitive API resolves (for bench/gpu/check.py)."""
    missing = []
    for name, get in APIS:
        try:
            get()
        except (AttributeError, ImportError, RuntimeError):
            missing.append(name)
    return {"torch": torch.__version__, "min": ".".join(map(str, MIN_TORCH)),
            "supported": torch_version() >= MIN_TORCH, "missing_apis": missing}  # fmt: skip
