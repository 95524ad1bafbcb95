"""The `distributed:` section of TrainArgs: mesh sizes and numerics (torch-free: a config is
checked before torch loads)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, model_validator

if TYPE_CHECKING:
    import torch

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # torch dtype names


class DistributedArgs(BaseModel):
    """How the model is laid out over ranks and which numerics it trains with.

    Mesh: dp_replicate × dp_shard × tp_size must equal WORLD_SIZE; one of them may be -1 to take
    whatever is left (default: dp_shard fills, i.e. plain FSDP over every rank).
    """

    model_config = ConfigDict(extra="forbid")

    dp_shard: int = -1
    dp_replicate: int = 1
    tp_size: int = 1
    # none | full (recompute each block) | selective (save matmul/attention outputs, recompute
    # the cheap element-wise ops: norms, RoPE, SiLU, residual adds).
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    # Deprecated reference name for full per-block recompute: True maps to
    # activation_checkpointing=full.
    selective_activation_checkpointing: bool = False
    compile: bool = False
    fsdp_type: Literal["no_shard", "full_shard"] = "full_shard"
    model_dtype: Literal["fp32", "bf16", "fp16"] = "bf16"
    fsdp_reduce_dtype: Literal["fp32", "bf16"] = "fp32"
    # FSDP units free their gathered params after forward (re-gathered in backward). False keeps
    # them (more memory, less communication). The last unit never reshards: its backward is next.
    reshard_after_forward: bool = True
    float8_recipe: Literal["rowwise"] | None = None
    float8_filter: str = r"layers\.[0-9]+\."
    matmul_allow_tf32: bool = False
    allow_bf16_reduced_precision_reduction: bool = True
    detect_anomaly: bool = False
    compile_cache_size_limit: int = 8
    spawn_method: Literal["fork", "spawn", "forkserver"] = "forkserver"
    # One process: FSDP2 on a 1-rank mesh, the numerics N ranks train with (params gathered in
    # model_dtype, fp32 sharded master weights and reductions) instead of autocast over fp32
    # params. None: on with CUDA (what a developer's single GPU should test), off on CPU.
    single_device_fsdp: bool | None = None
    # Bitwise-reproducible runs: torch.use_deterministic_algorithms(True) (index_add, gather and
    # index_select backward on CUDA take their deterministic kernels; an op without one raises),
    # CUBLAS_WORKSPACE_CONFIG=:4096:8, cuDNN autotuning off. Costs speed: see docs/gpu.md.
    deterministic: bool = False
    # Seconds a collective may wait for its peers before the job ends with one line naming the
    # rank and the step; first_step_timeout_s covers init and the first step (compilation).
    timeout_s: float = 600.0
    first_step_timeout_s: float = 1800.0

    @model_validator(mode="after")
    def _check(self) -> DistributedArgs:
        sizes = {
            "dp_replicate": self.dp_replicate,
            "dp_shard": self.dp_shard,
            "tp_size": self.tp_size,
        }
        for name, size in sizes.items():
            if size == 0 or size < -1:
                raise ValueError(f"{name}={size}: must be a positive integer, or -1 to fill")
        fills = [name for name, size in sizes.items() if size == -1]
        if len(fills) > 1:
            raise ValueError(
                f"only one of dp_replicate, dp_shard, tp_size may be -1 (got {', '.join(fills)})"
            )
        if self.fsdp_type == "no_shard" and self.dp_shard not in (1, -1):
            raise ValueError(
                f"fsdp_type=no_shard replicates parameters, so dp_shard must be 1 "
                f"(got {self.dp_shard}); use fsdp_type=full_shard to shard"
            )
        if self.selective_activation_checkpointing:
            if self.activation_checkpointing == "selective":
                raise ValueError(
                    "selective_activation_checkpointing=true is the deprecated name of "
                    "activation_checkpointing=full; set only activation_checkpointing"
                )
            self.activation_checkpointing = "full"
        if self.compile_cache_size_limit < 1:
            raise ValueError("compile_cache_size_limit must be >= 1")
        if self.model_dtype == "fp16":
            raise ValueError(
                "model_dtype=fp16 needs a gradient scaler (fp16 gradients underflow), which "
                "bytelatent does not have; use model_dtype=bf16 (same memory, fp32's range) or fp32"
            )
        if self.timeout_s <= 0 or self.first_step_timeout_s <= 0:
            raise ValueError("timeout_s and first_step_timeout_s must be > 0 seconds")
        return self

    def use_single_device_fsdp(self, device_type: str) -> bool:
        """Whether a one-process run on `device_type` trains through FSDP2 on a 1-rank mesh."""
        if self.single_device_fsdp is None:
            return device_type == "cuda"
        return self.single_device_fsdp

    @property
    def param_dtype(self) -> torch.dtype:
        import torch  # here: parsing a config must not load torch

        return getattr(torch, DTYPES[self.model_dtype])

    @property
    def reduce_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, DTYPES[self.fsdp_reduce_dtype])
