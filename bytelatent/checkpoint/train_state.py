"""A step folder's per-DP-rank train state (`train_state_{dp_rank:05d}.json`): writing and reading.

Torch-free. Which file a rank reads back, and whether its data-loader state still fits, depends on
the DP size the folder was saved with (from the marker, else by counting the files).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from fsspec import AbstractFileSystem

from bytelatent.checkpoint import fs as cfs
from bytelatent.checkpoint.layout import parse_step, read_marker, train_state_name
from bytelatent.errors import CheckpointError

logger = logging.getLogger(__name__)


@dataclass
class LoadInfo:
    """What `CheckpointManager.load` restored (read it from `manager.last_load`)."""

    path: str
    step: int | None
    saved_dp_size: int | None
    # True when the checkpoint was written with another DP size: step, acc_step and scheduler state
    # in the returned train state are valid, but its data-loader state belongs to a rank of the old
    # layout; the trainer must rebuild the data iterators from (dp_rank, dp_size) instead.
    dp_size_changed: bool
    train_state_rank: int  # whose train_state_XXXXX.json was returned


def train_state_text(train_state: dict[str, Any]) -> str:
    """A train state as JSON: one top-level key per line (readable: step, tokens_seen, ...), each
    value compact. The data state's file lists were ~2/3 indentation with `indent=2` (402 KB of
    a 10,000-file state at dp=1, 140 KB like this); any JSON reader loads either."""
    lines = [
        f"  {json.dumps(key)}: {json.dumps(value, separators=(',', ':'))}"
        for key, value in train_state.items()
    ]
    return "{\n" + ",\n".join(lines) + "\n}\n" if lines else "{}\n"


def read_train_state(
    fs: AbstractFileSystem, path: str, dp_rank: int, dp_size: int
) -> tuple[dict[str, Any], LoadInfo]:
    """This DP rank's train state in `path` (rank 0's when the folder has none for it) and what
    was read; a folder saved with another DP size is logged (its data streams are re-sharded)."""
    marker = read_marker(fs, path) or {}
    names = cfs.listdir(fs, path)
    saved_dp_size = marker.get("dp_size")
    if saved_dp_size is None:
        # Unmarked (e.g. reference) checkpoint: count the per-rank files.
        saved_dp_size = (
            sum(name.startswith("train_state_") and name.endswith(".json") for name in names)
            or None
        )
    source_rank = dp_rank if train_state_name(dp_rank) in names else 0
    file = cfs.join(path, train_state_name(source_rank))
    if train_state_name(source_rank) not in names:
        raise CheckpointError(
            f"{path}: no {train_state_name(dp_rank)} nor {train_state_name(0)}; not a training checkpoint"
        )
    try:
        train_state = json.loads(cfs.read_text(fs, file))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file}: not valid JSON ({e})") from e
    info = LoadInfo(
        path=path,
        step=parse_step(path),
        saved_dp_size=saved_dp_size,
        dp_size_changed=(saved_dp_size not in (None, dp_size)) or source_rank != dp_rank,
        train_state_rank=source_rank,
    )
    if info.dp_size_changed:
        # Not a problem: the data hooks re-shard the saved streams exactly (data/elastic.py).
        logger.info(
            "%s was saved with dp_size=%s, now %d: its data streams are re-sharded onto this "
            "run's ranks (read from every train_state file, starting with %s)",
            path, saved_dp_size, dp_size, train_state_name(source_rank),
        )  # fmt: skip
    return train_state, info
