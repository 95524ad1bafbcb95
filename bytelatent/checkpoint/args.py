"""The `checkpoint:` section of TrainArgs (torch-free: a config is checked before torch loads)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt


class SaveEvery(BaseModel):
    model_config = ConfigDict(extra="forbid")

    every: int = Field(
        default=1000, ge=0, description="save every N steps; 0: never save checkpoints of this kind"
    )
    keep: int = Field(
        0, description="keep the newest `keep` checkpoints of this kind; <= 0 keeps all"
    )


class CheckpointArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    dump: SaveEvery = Field(
        SaveEvery(), description="periodic checkpoints to resume from: frequency and retention"
    )
    eval: SaveEvery = Field(
        SaveEvery(),
        description="checkpoints for evaluation (eval.async_launch evaluates each): frequency "
        "and retention",
    )
    steps: list[PositiveInt] = Field(
        default_factory=list,
        description="also save at exactly these steps (T5X's checkpoint_steps); retention never "
        "removes them",
    )
    path: str | None = Field(
        None, description="folder of the step folders (local or s3://); null: dump_dir/checkpoints"
    )
    init_ckpt_path: str | None = Field(
        None,
        description="warm start: model weights only, from a DCP step folder or a consolidated "
        "folder/file, when no checkpoint exists under path",
    )
    continue_training_from_init: bool = Field(
        False,
        description="with init_ckpt_path: resume model, optimizer and train state from it (a "
        "DCP folder) instead",
    )
    s3_profile: str | None = Field(None, description="AWS profile for s3:// checkpoint paths")
    async_save: bool = Field(
        False,
        description="write DCP data in a background thread; the marker and retention follow "
        "when it completes",
    )
    init_ckpt_strict: bool = Field(
        True,
        description="warm start: any missing or unexpected key is an error; false: load the "
        "matching keys and report the rest",
    )
    init_ckpt_rename: dict[str, str] | None = Field(
        None,
        description="warm start: checkpoint key prefix -> model key prefix (longest prefix wins)",
    )
    load_path: str | None = Field(
        None,
        description="resume from this step folder instead of the newest complete one under path",
    )
    # Cost of checksum: bench/checkpoint_verify.py, bench/RESULTS_reliability.md.
    verify: Literal["size", "checksum"] = Field(
        "checksum",
        description="what resuming checks against the loaded checkpoint's manifests: checksum "
        "(sizes and CRC32s, reads every file once more) or size (truncation only)",
    )
