"""The `distributed:` section of TrainArgs: mesh sizes and numerics (torch-free: a config is
checked before torch loads)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

if TYPE_CHECKING:
    import torch

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # torch dtype names


class DistributedArgs(BaseModel):
    """How the model is laid out over ranks and which numerics it trains with.

    Mesh: dp_replicate × dp_shard × tp_size must equal WORLD_SIZE; one of them may be -1 to take
    whatever is left (default: dp_shard fills, i.e. plain FSDP over every rank).
    """

    model_config = ConfigDict(extra="forbid")

    dp_shard: int = Field(
        -1, description="ranks a parameter is sharded over (FSDP); -1: fills WORLD_SIZE"
    )
    dp_replicate: int = Field(
        1, description="replicas of each shard group (HSDP); -1: fills WORLD_SIZE"
    )
    tp_size: int = Field(1, description="tensor-parallel ranks per model; -1: fills WORLD_SIZE")
    activation_checkpointing: Literal["none", "full", "selective"] = Field(
        "none",
        description="none | full (recompute each block) | selective (save matmul/attention "
        "outputs, recompute norms, RoPE, SiLU, residual adds)",
    )
    selective_activation_checkpointing: bool = Field(
        False,
        description="deprecated reference name: true means activation_checkpointing=full",
    )
    compile: bool = Field(
        False, description="torch.compile each transformer block (identical blocks share a graph)"
    )
    fsdp_type: Literal["no_shard", "full_shard"] = Field(
        "full_shard", description="full_shard: FSDP; no_shard: replicate only (dp_shard=1)"
    )
    model_dtype: Literal["fp32", "bf16", "fp16"] = Field(
        "bf16",
        description="compute dtype: FSDP gathers parameters in it, a process without FSDP "
        "autocasts to it; fp16 is refused. bf16 on a CPU without bf16 GEMMs runs fp32 kernels on "
        "bf16-rounded values (BYTELATENT_CPU_BF16=native: the bf16 kernels)",
    )
    fsdp_reduce_dtype: Literal["fp32", "bf16"] = Field(
        "fp32", description="dtype of FSDP's gradient reduce-scatter"
    )
    reshard_after_forward: bool = Field(
        True,
        description="FSDP units free their gathered params after forward (re-gathered in "
        "backward); false keeps them: more memory, less communication",
    )
    float8_recipe: Literal["rowwise"] | None = Field(
        None, description="reference key; float8 training is not implemented, must stay null"
    )
    float8_filter: str = Field(
        r"layers\.[0-9]+\.", description="reference key, unused (no float8 training)"
    )
    matmul_allow_tf32: bool = Field(
        False, description="let CUDA fp32 matmuls and convolutions use TF32"
    )
    allow_bf16_reduced_precision_reduction: bool = Field(
        True, description="let cuBLAS bf16 matmuls reduce in reduced precision"
    )
    detect_anomaly: bool = Field(
        False, description="torch.autograd anomaly detection (slow; names the op making NaNs)"
    )
    compile_cache_size_limit: int = Field(
        8, description="torch._dynamo cache_size_limit (recompilations per block), >= 1"
    )
    spawn_method: Literal["fork", "spawn", "forkserver"] = Field(
        "forkserver",
        description="torch.multiprocessing start method, set at startup unless one is set",
    )
    single_device_fsdp: bool | None = Field(
        None,
        description="one process trains through FSDP2 on a 1-rank mesh (the numerics of N "
        "ranks) instead of autocast; null: on with CUDA, off on CPU (docs/gpu.md)",
    )
    deterministic: bool = Field(
        False,
        description="bitwise-reproducible runs: deterministic torch algorithms, "
        "CUBLAS_WORKSPACE_CONFIG, no cuDNN autotuning; slower (docs/gpu.md)",
    )
    device_memory_gib: float | None = Field(
        None,
        gt=0,
        description="GiB of one GPU for the dry run's advice when its estimate does not fit; "
        "null: the CUDA device's, or 80 (an H100) when the dry run runs on CPU",
    )
    timeout_s: float = Field(
        600.0,
        description="seconds a collective waits for its peers after the first step; then the "
        "job ends with one line naming the rank and step (exit 4)",
    )
    first_step_timeout_s: float = Field(
        1800.0,
        description="the same bound for process-group init and the first step (compilation)",
    )

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
