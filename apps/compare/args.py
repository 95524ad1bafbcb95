"""`CompareArgs`: the comparison recipe's YAML (`configs/compare_cpu.yaml`), validated up front."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

ARCHS = ("lm", "blt", "hnet")  # the rows of the table, in this order


class RunArgs(BaseModel):
    """One architecture: a training config, overrides, and the knob the FLOPs sizing turns."""

    model_config = ConfigDict(extra="forbid")

    config: str = Field(description="a `python -m bytelatent.train` config file")
    overrides: list[str] = Field(default_factory=list, description="key=value for that trainer")
    size_key: str | None = Field(
        None, description="the key the sizing sets to match the reference's FLOPs per byte"
    )
    size_values: list[int] = Field(
        default_factory=list, description="candidate values of size_key (the closest one wins)"
    )

    @model_validator(mode="after")
    def _check_size(self) -> RunArgs:
        if (self.size_key is None) != (not self.size_values):
            raise ValueError("size_key and size_values go together: set both or neither")
        return self


class EntropyArgs(BaseModel):
    """The BLT's entropy model: trained here, or an existing consolidated folder."""

    model_config = ConfigDict(extra="forbid")

    checkpoint: str | None = Field(
        None, description="a consolidated entropy model folder to reuse (skips training)"
    )
    config: str = Field("configs/entropy_debug.yaml", description="config to train it with")
    steps: int = Field(200, ge=1, description="training steps of the entropy model")
    overrides: list[str] = Field(default_factory=list)
    sample_bytes: int = Field(
        200_000, ge=1000, description="bytes of the training corpus patch_size reads"
    )


class CompareArgs(BaseModel):
    """`python -m apps.compare config=FILE.yaml [key=value ...]`."""

    model_config = ConfigDict(extra="forbid")

    out_dir: str = Field("runs/compare", description="runs, compare.md, compare.png, compare.json")
    data_root: str = Field("data", description="data.root_dir of every run")
    source: str = Field("stdlib", description="the corpus (a source folder under data_root)")
    bytes_per_patch: float = Field(
        4.0, gt=1.0, description="H-Net target N and the BLT's mean patch size (threshold picked)"
    )
    row_bytes: int = Field(256, ge=16, description="bytes per training row, every architecture")
    blt_patch_headroom: float = Field(
        1.25,
        ge=1.0,
        description="the BLT's rows hold row_bytes bytes in at most headroom * row_bytes / N "
        "patches (full rows while patches average >= N / headroom)",
    )
    batch_size: int = Field(4, ge=1, description="rows per step, every architecture")
    steps: int = Field(300, ge=1, description="training steps of each compared run")
    evals: int = Field(
        4, ge=1, description="validations per run (evenly spaced, the last at the end)"
    )
    val_batches: int = Field(25, ge=1, description="eval.validation.max_batches of every run")
    flops_tolerance: float = Field(
        0.1, gt=0.0, lt=1.0, description="largest |FLOPs per byte / reference - 1| accepted"
    )
    reference: str = Field("hnet", description="the run whose FLOPs per byte the others match")
    threads: int = Field(1, ge=1, description="OMP_NUM_THREADS of each training subprocess")
    seed: int = 42
    entropy: EntropyArgs = Field(default_factory=EntropyArgs)
    runs: dict[str, RunArgs] = Field(description="lm, blt and hnet")

    @model_validator(mode="after")
    def _check(self) -> CompareArgs:
        if sorted(self.runs) != sorted(ARCHS):
            raise ValueError(f"runs: needs exactly {', '.join(ARCHS)} (got {', '.join(self.runs)})")
        if self.reference not in self.runs:
            raise ValueError(f"reference: {self.reference!r} is not one of {', '.join(ARCHS)}")
        if self.runs[self.reference].size_key is not None:
            raise ValueError(f"runs.{self.reference}: the reference is not sized; drop size_key")
        if self.steps % self.evals:
            raise ValueError(
                f"steps ({self.steps}) must be a multiple of evals ({self.evals}): the last "
                "validation is at the last step"
            )
        return self

    @property
    def eval_every(self) -> int:
        return self.steps // self.evals
