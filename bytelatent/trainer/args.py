"""The `optim:`, `logging:` and `profiling:` sections of TrainArgs (torch-free: a config is checked
before torch loads). The parts that use them: optim.py, metrics.py, profiling.py."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from bytelatent.trainer.wandb_sink import WandbArgs


class ParamGroupArgs(BaseModel):
    """One AdamW parameter group: `params` is a glob over parameter names (fnmatch, `*` crosses dots)."""

    model_config = ConfigDict(extra="forbid")

    params: str
    lr_scale: float = Field(1.0, ge=0.0)
    weight_decay: float | None = Field(None, ge=0.0, description="None: optim.weight_decay")
    freeze_until_step: int = Field(0, ge=0, description="no updates in optimizer steps 1..N")


class OptimArgs(BaseModel):
    """Optimizer and schedule. Field names follow the reference BLT/lingua `OptimArgs`."""

    model_config = ConfigDict(extra="forbid")

    lr: float = 3e-4
    weight_decay: float = 0.1
    epsilon: float = 1e-8
    beta1: float = 0.9
    beta2: float = 0.95
    clip: float = 1.0  # max global grad norm, applied once per optimizer step; <= 0 disables
    scheduler: Literal["constant", "linear", "inv_sqrt", "cosine", "wsd"] = "cosine"
    warmup: int = 2000
    lr_min_ratio: float = 0.1
    cycle_length: float = 1.0  # cosine / wsd: cycle length as a fraction of `steps`
    cosine_theta: float = 1.0
    decay_fraction: float = 0.1  # wsd: fraction of each cycle spent decaying
    exp_factor: float = 0.5  # inv_sqrt exponent
    # None: fused AdamW on CUDA and CPU (the CPU kernel is several times faster than foreach:
    # bench/RESULTS_blt_cpu.md); False: foreach
    fused: bool | None = None
    # Non-finite guard: stop after this many consecutive skipped updates (0: never stop, only skip).
    max_skipped_steps: int = Field(5, ge=0)
    groups: list[ParamGroupArgs] = Field(default_factory=list)

    @model_validator(mode="after")
    def _check(self) -> OptimArgs:
        if self.lr <= 0:
            raise ValueError(f"optim.lr must be > 0, got {self.lr}")
        if self.warmup < 0:
            raise ValueError(f"optim.warmup must be >= 0, got {self.warmup}")
        if not 0.0 <= self.lr_min_ratio <= 1.0:
            raise ValueError(f"optim.lr_min_ratio must be in [0, 1], got {self.lr_min_ratio}")
        if self.cycle_length <= 0:
            raise ValueError(f"optim.cycle_length must be > 0, got {self.cycle_length}")
        if not 0.0 < self.decay_fraction <= 1.0:
            raise ValueError(f"optim.decay_fraction must be in (0, 1], got {self.decay_fraction}")
        return self


class LoggingArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    freq: int = Field(10, ge=1, description="log every `freq` optimizer steps")
    console: bool = True
    peak_tflops: float | None = Field(
        None,
        gt=0,
        description="per-device peak for MFU; default: known GPUs' dense bf16 peak, none on CPU",
    )
    wandb: WandbArgs | None = Field(None, description="wandb run (rank 0); unset: no wandb")


class ProfilerArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    run: bool = False
    start_step: int = Field(
        3, ge=2, description="first profiled step, counted in this process (step 1 is warm-up)"
    )
    active_steps: int = Field(2, ge=1, description="number of steps in the trace")
    memory: bool = Field(False, description="record allocations (and a CUDA memory snapshot)")
    trace_folder: str = Field("profiling", description="under dump_dir")
