"""Checkpoint folders without a model: names, completion markers, listing, leases, setting aside.

Nothing here reads or writes DCP data, so all of it is testable with plain files:

    {path}/{step:010d}/             one step folder per save
        .complete                   JSON {"step", "kinds", ...}, written last (atomically)
        .lease.*                    a reader's lease: retention keeps the folder while one exists
    {path}/{step:010d}.corrupt-*    set aside after failing verification (kept, ignored)

A `.complete` that is not a JSON object (damaged, hand-edited) does not count as complete: the
folder is never resumed from and retention treats it as a partial save. Which folders are
deleted is `retention.py`'s decision; this module only lists and deletes them.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fsspec import AbstractFileSystem

from bytelatent.checkpoint import fs as cfs

logger = logging.getLogger(__name__)

MARKER_FILE = ".complete"
PARAMS_FILE = "params.json"  # the config a checkpoint was saved with (TrainArgs as JSON)
LEASE_PREFIX = ".lease."  # a reader's lease: retention keeps the folder while one exists
KINDS = ("dump", "eval", "final", "preempt", "step")
DUMP_KINDS = frozenset({"dump", "final", "preempt"})
KEPT_KINDS = frozenset({"step"})  # saves at `checkpoint.steps`: asked for by step, never retired

# (step, folder, kinds) -> why the folder must stay (e.g. its eval is owed), or None
HoldFn = Callable[[int, str, list[str]], "str | None"]


def step_folder_name(step: int) -> str:
    return f"{step:010d}"


def parse_step(name: str) -> int | None:
    name = str(name).rstrip("/").rsplit("/", 1)[-1]
    return int(name) if len(name) == 10 and name.isdigit() else None


def train_state_name(dp_rank: int) -> str:
    return f"train_state_{dp_rank:05d}.json"


def normalize_kinds(kind: str | Sequence[str]) -> list[str]:
    kinds = [kind] if isinstance(kind, str) else list(kind)
    bad = [k for k in kinds if k not in KINDS]
    if not kinds or bad:
        raise ValueError(f"checkpoint kind must be one or more of {KINDS}, got {kind!r}")
    return sorted(set(kinds))


# ---------------------------------------------------------------------- markers


def _parse_marker(fs: AbstractFileSystem, folder: str) -> tuple[dict[str, Any] | None, str | None]:
    """(marker contents, None) for a valid marker, else (None, why it does not mark completion)."""
    marker = cfs.join(folder, MARKER_FILE)
    cfs._refresh(fs, marker)  # s3fs caches listings: another rank may have just written it
    try:
        info = json.loads(cfs.read_text(fs, marker))
    except (FileNotFoundError, NotADirectoryError):
        return None, f"no {MARKER_FILE} marker (partial save)"
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None, f"{MARKER_FILE}: not valid JSON (damaged marker)"
    if not isinstance(info, dict):
        return None, f"{MARKER_FILE}: not a JSON object (damaged marker)"
    kinds = info.get("kinds", [])
    if not isinstance(kinds, list) or not all(isinstance(k, str) for k in kinds):
        return None, f"{MARKER_FILE}: 'kinds' is not a list of names (damaged marker)"
    return info, None


def marker_problem(fs: AbstractFileSystem, folder: str) -> str | None:
    """Why `folder`'s marker does not mark a complete save (missing, damaged), or None."""
    return _parse_marker(fs, folder)[1]


def read_marker(fs: AbstractFileSystem, folder: str) -> dict[str, Any] | None:
    """The folder's completion marker, or None if the save never completed (or the marker is damaged)."""
    info, problem = _parse_marker(fs, folder)
    if problem is not None and "damaged" in problem:
        logger.warning("%s: %s; treating it as an incomplete save", folder, problem)
    return info


def write_marker(fs: AbstractFileSystem, folder: str, info: dict[str, Any]) -> None:
    cfs.write_text_atomic(fs, cfs.join(folder, MARKER_FILE), json.dumps(info))


# ---------------------------------------------------------------------- listing


@dataclass(frozen=True, order=True)
class StepFolder:
    step: int
    path: str = field(compare=False)
    marker: dict[str, Any] | None = field(compare=False, default=None)  # None: incomplete

    @property
    def complete(self) -> bool:
        return self.marker is not None

    @property
    def kinds(self) -> list[str]:
        return list((self.marker or {}).get("kinds", []))


class FolderStore:
    """The step folders under one checkpoint path: list, lease-check, delete, set aside."""

    def __init__(self, fs: AbstractFileSystem, path: str) -> None:
        self.fs = fs
        self.path = str(path).rstrip("/")

    def step_folder(self, step: int) -> str:
        return cfs.join(self.path, step_folder_name(step))

    def scan(self) -> list[StepFolder]:
        """Every step folder under `path` (complete or not), oldest first."""
        found = []
        for name in cfs.listdir(self.fs, self.path):
            step = parse_step(name)
            if step is not None:
                folder = cfs.join(self.path, name)
                found.append(StepFolder(step, folder, read_marker(self.fs, folder)))
        return sorted(found)

    def complete(self) -> list[StepFolder]:
        return [entry for entry in self.scan() if entry.complete]

    def leased(self, folder: str) -> bool:
        return any(name.startswith(LEASE_PREFIX) for name in cfs.listdir(self.fs, folder))

    def delete(self, folder: str) -> None:
        # Marker first: a deletion cut short leaves an "incomplete" folder that is cleaned later,
        # never a folder that claims to be complete with files missing.
        cfs.rm(self.fs, cfs.join(folder, MARKER_FILE), recursive=False)
        cfs.rm(self.fs, folder)

    def set_aside(self, folder: str) -> str:
        """Rename a failing folder `{folder}.corrupt-{time}` (kept, never listed as a step again)."""
        aside = f"{folder}.corrupt-{time.strftime('%Y%m%dT%H%M%S')}"
        n = 1
        while cfs.exists(self.fs, aside if n == 1 else f"{aside}-{n}"):
            n += 1
        aside = aside if n == 1 else f"{aside}-{n}"
        self.fs.mv(folder, aside, recursive=True)
        cfs._refresh(self.fs, folder)  # s3fs caches listings
        return aside
