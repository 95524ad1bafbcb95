"""The `checkpoint:` section of TrainArgs (torch-free: a config is checked before torch loads)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt


class SaveEvery(BaseModel):
    model_config = ConfigDict(extra="forbid")

    every: int = Field(default=1000, ge=0)  # 0: never save checkpoints of this kind
    keep: int = 0  # keep the newest `keep` checkpoints of this kind; <= 0 keeps all


class CheckpointArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    dump: SaveEvery = SaveEvery()
    eval: SaveEvery = SaveEvery()
    # Also save at exactly these steps (T5X's checkpoint_steps); retention never removes them.
    steps: list[PositiveInt] = Field(default_factory=list)
    # None -> dump_dir/checkpoints (filled in by TrainArgs).
    path: str | None = None
    # Warm start: model weights only, from a DCP step folder or a consolidated folder/file.
    init_ckpt_path: str | None = None
    # With init_ckpt_path: resume model + optimizer + train state from it (a DCP folder) instead.
    continue_training_from_init: bool = False
    s3_profile: str | None = None
    # Write DCP data in a background thread; the marker and retention follow when it completes.
    async_save: bool = False
    init_ckpt_strict: bool = True
    # Checkpoint key prefix -> model key prefix, applied when warm starting (longest prefix wins).
    init_ckpt_rename: dict[str, str] | None = None
    # Resume from this step folder instead of the newest complete one under `path`.
    load_path: str | None = None
    # What resuming checks against the manifests of the checkpoint it loads: sizes and CRC32s
    # (reads every file once more; a bit flip is caught), or file sizes only (truncation only).
    # Cost: bench/checkpoint_verify.py, bench/RESULTS_reliability.md.
    verify: Literal["size", "checksum"] = "checksum"
