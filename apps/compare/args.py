"""`CompareArgs`: the comparison recipe's YAML (`configs/compare_*.yaml`), validated up front."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from bytelatent.launch.args import SlurmArgs

PATCHINGS = ("entropy", "space", "static")


class RowArgs(BaseModel):
    """One row of the table: a training config, overrides, and the knob the FLOPs sizing turns."""

    model_config = ConfigDict(extra="forbid")

    config: str = Field(description="a `python -m bytelatent.train` config file")
    overrides: list[str] = Field(default_factory=list, description="key=value for that trainer")
    patching: Literal["entropy", "space", "static"] | None = Field(
        None,
        description="BLT rows: the patching the recipe sets (entropy: threshold picked for "
        "bytes_per_patch; static: patches of bytes_per_patch bytes; space: after each space-like "
        "byte); null for the other architectures",
    )
    size_key: str | None = Field(
        None, description="the key the sizing sets to match the reference's FLOPs per byte"
    )
    size_values: list[int] = Field(
        default_factory=list, description="candidate values of size_key (the closest one wins)"
    )
    lrs: list[float] | None = Field(
        None, description="this row's learning-rate sweep (default: the recipe's lrs)"
    )

    @model_validator(mode="after")
    def _check_size(self) -> RowArgs:
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
    val_file: str | None = Field(
        None,
        description="held-out documents (JSONL or Parquet with a text column) split into tune and "
        "test; default: the corpus's own <source>.val.jsonl",
    )
    ood_files: list[str] = Field(
        default_factory=lambda: ["{python}/LICENSE.txt", "/usr/share/common-licenses/*"],
        description="out-of-domain text (globs; {python} is the Python standard library folder); "
        "the files found are read as one document each",
    )
    ood_bytes: int = Field(200_000, ge=1000, description="at most this many out-of-domain bytes")
    bytes_per_patch: float = Field(
        4.0, gt=1.0, description="the BLTs' mean patch size and the H-Nets' overall target N"
    )
    row_bytes: int = Field(256, ge=16, description="bytes per training row, every architecture")
    blt_patch_headroom: float = Field(
        1.25,
        ge=1.0,
        description="the BLT's rows hold row_bytes bytes in at most headroom * row_bytes / "
        "(mean patch) patches",
    )
    batch_size: int = Field(4, ge=1, description="rows per step, every architecture")
    steps: int = Field(300, ge=1, description="training steps of each run")
    warmup: int = Field(20, ge=0, description="optim.warmup of every run")
    evals: int = Field(
        4, ge=1, description="validations per run (evenly spaced, the last at the end)"
    )
    val_batches: int = Field(25, ge=1, description="batches per validation split and evaluation")
    flops_tolerance: float = Field(
        0.03, gt=0.0, lt=1.0, description="largest |FLOPs per byte / reference - 1| accepted"
    )
    reference: str = Field("lm", description="the row whose FLOPs per byte the others match")
    calibration_rounds: int = Field(
        2,
        ge=0,
        description="phase 2: times a row off the reference's real FLOPs per byte is sized "
        "again from its runs' real counts and swept again (0: report it off)",
    )
    threads: int = Field(1, ge=1, description="OMP_NUM_THREADS of each training subprocess")
    parallel: int = Field(1, ge=1, description="training runs at a time (local launcher)")
    nice: int = Field(0, ge=0, le=19, description="niceness of each training subprocess")
    lrs: list[float] = Field(
        default_factory=lambda: [1e-3, 2e-3, 4e-3],
        min_length=1,
        description="the learning-rate sweep (seeds[0]); the best on the tune split wins",
    )
    seeds: list[int] = Field(
        default_factory=lambda: [0, 1, 2],
        min_length=1,
        description="seeds of the chosen rate; seeds[0] also runs the sweep",
    )
    repeat_check: bool = Field(
        True, description="train the reference's first run again and compare bpb (determinism)"
    )
    launcher: Literal["local", "slurm"] = Field(
        "local", description="local subprocesses, or one SLURM job array per phase"
    )
    slurm: SlurmArgs = Field(
        default_factory=lambda: SlurmArgs(time="01:00:00", requeue=False),
        description="launcher: slurm: the array's resources (bytelatent/launch/args.py)",
    )
    poll_s: float = Field(10.0, gt=0, description="launcher: slurm: seconds between checks")
    expected_flops_per_s: float = Field(
        5e9, gt=0, description="dry_run: achieved training FLOP/s per run, for the time estimate"
    )
    dry_run: bool = Field(
        False, description="size the rows, print the plan and time; train nothing"
    )
    status: bool = Field(False, description="list the finished runs so far; train nothing")
    entropy: EntropyArgs = Field(default_factory=EntropyArgs)
    rows: dict[str, RowArgs] = Field(description="the rows of the table, in order")

    @model_validator(mode="after")
    def _check(self) -> CompareArgs:
        if self.reference not in self.rows:
            raise ValueError(f"reference: {self.reference!r} is not a row ({', '.join(self.rows)})")
        if self.rows[self.reference].size_key is not None:
            raise ValueError(f"rows.{self.reference}: the reference is not sized; drop size_key")
        if self.steps % self.evals:
            raise ValueError(
                f"steps ({self.steps}) must be a multiple of evals ({self.evals}): the last "
                "validation is at the last step"
            )
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds: {self.seeds} repeats a seed")
        for name, row in self.rows.items():
            if not name.replace("_", "").isalnum():
                raise ValueError(f"rows.{name}: a row name is letters, digits and _")
            if row.patching == "static" and self.bytes_per_patch != int(self.bytes_per_patch):
                raise ValueError(
                    f"rows.{name}: static patching needs an integer bytes_per_patch "
                    f"(got {self.bytes_per_patch})"
                )
        return self

    @property
    def eval_every(self) -> int:
        return self.steps // self.evals

    def row_lrs(self, name: str) -> list[float]:
        return self.rows[name].lrs or self.lrs
