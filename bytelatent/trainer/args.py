"""The `optim:`, `logging:` and `profiling:` sections of TrainArgs (torch-free: a config is checked
before torch loads). The parts that use them: optim.py, metrics.py, profiling.py."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from bytelatent.trainer.wandb_sink import WandbArgs


class ParamGroupArgs(BaseModel):
    """One AdamW parameter group: `params` is a glob over parameter names (fnmatch, `*` crosses dots)."""

    model_config = ConfigDict(extra="forbid")

    params: str = Field(
        ...,
        description="fnmatch glob over parameter names as in model-info.txt, e.g. "
        "'local_encoder.*'; the first matching group wins",
    )
    lr_scale: float = Field(1.0, ge=0.0, description="this group's lr: optim.lr times this")
    weight_decay: float | None = Field(None, ge=0.0, description="null: optim.weight_decay")
    freeze_until_step: int = Field(0, ge=0, description="no updates in optimizer steps 1..N")
    frozen: bool = Field(
        False,
        description="no updates for the whole run, resumes included (byteify stage 1: the "
        "backbone); excludes freeze_until_step",
    )

    @model_validator(mode="after")
    def _frozen_or_until(self) -> ParamGroupArgs:
        if self.frozen and self.freeze_until_step:
            raise ValueError(
                f"frozen=true and freeze_until_step={self.freeze_until_step} both set: frozen "
                "already means every step, drop one"
            )
        return self


class OptimArgs(BaseModel):
    """Optimizer and schedule. Field names follow the reference BLT/lingua `OptimArgs`."""

    model_config = ConfigDict(extra="forbid")

    lr: float = Field(3e-4, description="peak learning rate (> 0), reached after warmup")
    weight_decay: float = Field(0.1, description="AdamW decoupled weight decay")
    epsilon: float = Field(1e-8, description="AdamW eps")
    beta1: float = Field(0.9, description="AdamW first-moment decay")
    beta2: float = Field(0.95, description="AdamW second-moment decay")
    clip: float = Field(
        1.0,
        description="max global grad norm, applied once per optimizer step; <= 0 disables",
    )
    scheduler: Literal["constant", "linear", "inv_sqrt", "cosine", "wsd"] = Field(
        "cosine", description="lr schedule after warmup (wsd: warmup-stable-decay)"
    )
    warmup: int = Field(2000, description="optimizer steps of linear warmup from 0 to lr (>= 0)")
    lr_min_ratio: float = Field(
        0.1, description="final lr as a fraction of lr, in [0, 1] (inv_sqrt: its floor)"
    )
    cycle_length: float = Field(
        1.0, description="cosine / wsd: cycle length as a fraction of `steps` (< 1: restarts)"
    )
    cosine_theta: float = Field(
        1.0, description="cosine: exponent on the schedule progress (1: plain cosine)"
    )
    decay_fraction: float = Field(
        0.1, description="wsd: fraction of each cycle spent decaying, in (0, 1]"
    )
    exp_factor: float = Field(0.5, description="inv_sqrt: lr falls as (warmup / step) ** this")
    fused: bool | None = Field(
        None,
        description="null: fused AdamW on CUDA and CPU (several times faster than foreach on "
        "CPU: bench/RESULTS_blt_cpu.md); false: foreach",
    )
    max_skipped_steps: int = Field(
        5,
        ge=0,
        description="non-finite guard: stop after this many consecutive skipped updates "
        "(0: never stop, only skip)",
    )
    groups: list[ParamGroupArgs] = Field(
        default_factory=list,
        description="AdamW parameter groups with their own lr scale, weight decay, freezing; "
        "unmatched parameters form the default group",
    )

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
    console: bool = Field(True, description="print one line per log step on rank 0")
    peak_tflops: float | None = Field(
        None,
        gt=0,
        description="per-device peak for MFU; default: known GPUs' dense bf16 peak, none on CPU",
    )
    wandb: WandbArgs | None = Field(None, description="wandb run (rank 0); unset: no wandb")


class ProfilerArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    run: bool = Field(False, description="trace steps with torch.profiler; off: no profiler")
    start_step: int = Field(
        3, ge=2, description="first profiled step, counted in this process (step 1 is warm-up)"
    )
    active_steps: int = Field(2, ge=1, description="number of steps in the trace")
    memory: bool = Field(False, description="record allocations (and a CUDA memory snapshot)")
    trace_folder: str = Field("profiling", description="under dump_dir")
