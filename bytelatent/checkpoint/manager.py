"""Training checkpoints: DCP save/load that is atomic, resumable, retained, local or s3://.

On-disk layout (compatible with the reference; `.complete` is ours):

    {path}/{step:010d}/
        .metadata, __{rank}_0.distcp      DCP of {"model": model_sd, "optim": optim_sd}
        train_state_{dp_rank:05d}.json    one per DP rank (written by its TP rank 0)
        params.json                       full config (global rank 0)
        manifest_{rank:05d}.json          sizes + CRC32s of each rank's shards (checkpoint/verify.py)
        manifest.json                     sizes + CRC32s of the small files (rank 0, before the marker)
        .complete                         JSON {"step", "kinds", "dp_size", "world_size", "time"},
                                          written last by rank 0 once every rank has finished

A folder holding a reader lease (a file named `.lease.*`, e.g. `.lease.eval` while an async eval
reads it) is never deleted by retention; it is retained again once the reader removes its lease.

A folder without `.complete` is a partial save (killed, crashed, or still being written): it is
never resumed from automatically and is deleted by rank 0 after a later successful save.
On resume the newest complete folder is verified against its manifests (sizes; CRC32s with
`checkpoint.verify=checksum`); one that fails is renamed `{step}.corrupt-{time}` (kept, never
deleted, ignored from then on) and the next newest is tried.
Retention classifies folders by the kinds recorded in `.complete`, not by `step % every`, so it
stays correct when `every` changes between runs.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from pydantic import BaseModel, ConfigDict, Field, PositiveInt
from torch import nn
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from bytelatent.checkpoint import fs as cfs
from bytelatent.checkpoint.consolidate import (
    METADATA_FILE,
    PARAMS_FILE,
    find_consolidated_file,
    load_consolidated_state_dict,
    require_dcp_dir,
)
from bytelatent.checkpoint.verify import (
    ManifestWriter,
    VerifyReport,
    verify_step_folder,
    write_folder_manifest,
)
from bytelatent.errors import CheckpointError, ConfigError

logger = logging.getLogger(__name__)

# DCP reports failures as CheckpointException, a BaseException (not an Exception) subclass.
DCP_ERRORS = (Exception, CheckpointException)

MARKER_FILE = ".complete"
LEASE_PREFIX = ".lease."  # a reader's lease: retention keeps the folder while one exists
KINDS = ("dump", "eval", "final", "preempt", "step")
DUMP_KINDS = frozenset({"dump", "final", "preempt"})
KEPT_KINDS = frozenset({"step"})  # saves at `checkpoint.steps`: asked for by step, never retired


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
    # What resuming checks against the manifests: file sizes, or sizes and CRC32s (reads every file).
    verify: Literal["size", "checksum"] = "size"


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


@dataclass
class InitLoadReport:
    """Result of `load_init`: which keys were loaded and which were skipped (non-strict mode)."""

    path: str
    format: str  # "dcp" or "consolidated"
    loaded: list[str] = field(default_factory=list)
    # Model keys the checkpoint did not provide, and checkpoint keys with no model key.
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)


def step_folder_name(step: int) -> str:
    return f"{step:010d}"


def parse_step(name: str) -> int | None:
    name = str(name).rstrip("/").rsplit("/", 1)[-1]
    return int(name) if len(name) == 10 and name.isdigit() else None


def train_state_name(dp_rank: int) -> str:
    return f"train_state_{dp_rank:05d}.json"


def _normalize_kinds(kind: str | Sequence[str]) -> list[str]:
    kinds = [kind] if isinstance(kind, str) else list(kind)
    bad = [k for k in kinds if k not in KINDS]
    if not kinds or bad:
        raise ValueError(
            f"checkpoint kind must be one or more of {KINDS}, got {kind!r}"
        )
    return sorted(set(kinds))


def _rename_key(key: str, rename: dict[str, str] | None) -> str:
    for old in sorted(rename or {}, key=len, reverse=True):
        if key.startswith(old):
            return rename[old] + key[len(old) :]
    return key


def _short(keys: Sequence[str], limit: int = 5) -> str:
    keys = sorted(keys)
    more = f" (+{len(keys) - limit} more)" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


class _PendingSave:
    """An async DCP save in flight; `finalize` (rank 0) writes the marker and applies retention once."""

    def __init__(
        self, step: int, folder: str, future: Future, finalize_fn: Any, kinds: list[str]
    ) -> None:
        self.step, self.folder, self.future, self.kinds = step, folder, future, kinds
        self._finalize_fn = finalize_fn
        self._lock = threading.Lock()
        self._done = False
        self.error: BaseException | None = None

    def finalize(self) -> None:
        with self._lock:
            if self._done:
                return
            self._done = True
            try:
                if self.future.exception() is None:
                    self._finalize_fn()
            except BaseException as e:  # re-raised by wait() on the main thread
                self.error = e
                logger.exception("finalizing checkpoint %s failed", self.folder)


class CheckpointManager:
    """Saves, retains and loads training checkpoints for one rank; every rank makes the same calls."""

    def __init__(
        self,
        args: CheckpointArgs,
        dump_dir: str | None = None,
        dp_rank: int = 0,
        dp_size: int = 1,
        is_tp_rank0: bool = True,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        if args.path is None and dump_dir is None:
            raise ConfigError(
                "checkpoint.path: not set and no dump_dir to default it to (dump_dir/checkpoints)"
            )
        self.args = args
        self.path = str(args.path or cfs.join(str(dump_dir), "checkpoints")).rstrip("/")
        self.dp_rank, self.dp_size, self.is_tp_rank0 = dp_rank, dp_size, is_tp_rank0
        self.process_group = process_group
        self.fs = cfs.get_fs(self.path, args.s3_profile)
        self._options = cfs.storage_options(self.path, args.s3_profile)
        self.distributed = dist.is_available() and dist.is_initialized()
        self.is_rank0 = not self.distributed or dist.get_rank() == 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        self.group_rank = dist.get_rank(process_group) if self.distributed else 0
        self.group_size = dist.get_world_size(process_group) if self.distributed else 1
        self._pending: _PendingSave | None = None
        self._last_saved_step: int | None = None
        self.last_load: LoadInfo | None = None
        # Called as on_complete(step, folder, kinds) on every rank once a save is complete
        # (marker visible), e.g. to launch an async eval of it.
        self.on_complete: Any = None
        # Background DCP collectives must not interleave with the training loop's collectives on
        # the same group, so async saves get their own gloo group (collective: all ranks build it).
        self._async_group: dist.ProcessGroup | None = None
        if args.async_save and self.distributed:
            ranks = (
                dist.get_process_group_ranks(process_group)
                if process_group is not None
                else None
            )
            self._async_group = dist.new_group(ranks=ranks, backend="gloo")

    # ------------------------------------------------------------------ listing

    def step_folder(self, step: int) -> str:
        return cfs.join(self.path, step_folder_name(step))

    def _marker(self, folder: str) -> dict[str, Any] | None:
        """Contents of the folder's completion marker, or None if the save never completed."""
        marker = cfs.join(folder, MARKER_FILE)
        if not cfs.exists(self.fs, marker):
            return None
        try:
            info = json.loads(cfs.read_text(self.fs, marker))
        except (json.JSONDecodeError, UnicodeDecodeError):
            info = {}
        return info if isinstance(info, dict) else {}

    def _scan(self) -> list[tuple[int, str, dict[str, Any] | None]]:
        """(step, folder, marker or None) for every step folder under `path`, oldest first."""
        found = []
        for name in cfs.listdir(self.fs, self.path):
            step = parse_step(name)
            if step is not None:
                folder = cfs.join(self.path, name)
                found.append((step, folder, self._marker(folder)))
        return sorted(found)

    def complete_checkpoints(self) -> list[tuple[int, str, list[str]]]:
        """(step, folder, kinds) of every complete step folder, oldest first."""
        return [(s, f, list(m.get("kinds", []))) for s, f, m in self._scan() if m is not None]

    def latest_complete(self) -> str | None:
        """Newest step folder whose save completed (has the marker); partial folders are ignored."""
        complete = [folder for _, folder, marker in self._scan() if marker is not None]
        return complete[-1] if complete else None

    def resume_path(self) -> str | None:
        """Where a (re)started run resumes from: load_path, else the newest complete save, else
        init_ckpt_path when continue_training_from_init; None means start fresh (maybe `load_init`)."""
        if self.args.load_path:
            self._require_verified(self.args.load_path)
            return self.args.load_path
        latest = self.latest_verified()
        if latest is not None:
            return latest
        if self.args.init_ckpt_path and self.args.continue_training_from_init:
            return self.args.init_ckpt_path
        return None

    def verify(self, folder: str) -> VerifyReport:
        """Check `folder` against its manifests; collective (ranks split the rank manifests)."""
        report = verify_step_folder(
            folder,
            checksum=self.args.verify == "checksum",
            fs=self.fs,
            shard=(self.group_rank, self.group_size),
        )
        if self.distributed:
            gathered: list[Any] = [None] * self.group_size
            mine = (report.problems, report.verified, report.n_files)
            dist.all_gather_object(gathered, mine, group=self.process_group)
            report.problems = [p for problems, _, _ in gathered for p in problems]
            report.verified = all(verified for _, verified, _ in gathered)
            report.n_files = sum(n for _, _, n in gathered)
        return report

    def latest_verified(self) -> str | None:
        """Newest complete folder that passes verification; failing ones are set aside (renamed)."""
        complete = [folder for _, folder, marker in self._scan() if marker is not None]
        for folder in reversed(complete):
            report = self.verify(folder)
            if not report.verified:
                logger.warning("%s has no manifest (saved by an older version): not verified", folder)
                return folder
            if report.ok:
                return folder
            if self.is_rank0:
                aside = self._set_aside(folder)
                more = f" (+{len(report.problems) - 3} more)" if len(report.problems) > 3 else ""
                logger.error(
                    "checkpoint %s fails verification: %s%s; moved it to %s (kept, not deleted); "
                    "resuming from the previous checkpoint instead",
                    folder, "; ".join(report.problems[:3]), more, aside,
                )  # fmt: skip
            self._barrier()  # the rename is visible before any rank lists the folder again
        return None

    def _require_verified(self, folder: str) -> None:
        report = self.verify(folder)
        if not report.ok:
            raise CheckpointError(
                f"{folder}: fails verification ({'; '.join(report.problems[:3])}); "
                "unset checkpoint.load_path to resume from the newest good checkpoint"
            )

    def _set_aside(self, folder: str) -> str:
        aside = f"{folder}.corrupt-{time.strftime('%Y%m%dT%H%M%S')}"
        n = 1
        while cfs.exists(self.fs, aside if n == 1 else f"{aside}-{n}"):
            n += 1
        aside = aside if n == 1 else f"{aside}-{n}"
        self.fs.mv(folder, aside, recursive=True)
        cfs._refresh(self.fs, folder)  # s3fs caches listings
        return aside

    # ------------------------------------------------------------------ saving

    def _barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.process_group)

    def _state_dict(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None
    ) -> dict[str, Any]:
        if optimizer is None:
            return {"model": get_model_state_dict(model)}
        model_sd, optim_sd = get_state_dict(model, optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def save(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        train_state: dict[str, Any],
        params: dict[str, Any] | None = None,
        kind: str | Sequence[str] = "dump",
    ) -> str:
        """Write checkpoint `step` and return its folder; a step that is already saved is a no-op.

        `kind` ("dump", "eval", "final", "preempt", or several of them for a step that is both a
        dump and an eval step) drives retention. With `async_save` this returns once the state is
        copied to CPU; `wait()` (called by the next save/load/close) finishes it.
        """
        kinds = _normalize_kinds(kind)
        self.wait()
        folder = self.step_folder(step)
        if step == self._last_saved_step or self._marker(folder) is not None:
            logger.info("checkpoint %s already saved; skipping", folder)
            return folder
        if self.is_rank0 and cfs.exists(self.fs, folder):
            # Leftover of an interrupted save of this same step: start from an empty folder.
            logger.warning(
                "removing partial checkpoint %s before saving it again", folder
            )
            cfs.rm(self.fs, folder)
        self._barrier()
        try:
            self._write_small_files(folder, train_state, params)
        except OSError as e:
            raise CheckpointError(self._save_failed(folder, e)) from e
        state = self._state_dict(model, optimizer)
        writer = ManifestWriter(folder, self.group_rank, self.fs, **self._options)

        def finalize() -> None:
            try:
                write_folder_manifest(self.fs, folder, self.group_size)
                self._write_marker(folder, step, kinds)
            except OSError as e:
                raise CheckpointError(self._save_failed(folder, e)) from e
            self._apply_retention(step)

        if self.args.async_save:
            group = self._async_group if self.distributed else None
            with _quiet_single_process():
                future = dcp.async_save(
                    state,
                    storage_writer=writer,
                    process_group=group,
                    no_dist=not self.distributed,
                )
            pending = _PendingSave(step, folder, future, finalize, kinds)
            self._pending = pending
            if self.is_rank0:
                # Rank 0's DCP future resolves only after every rank reported its files written
                # (DCP gathers the write results to write .metadata), so no extra barrier is needed.
                future.add_done_callback(lambda _: pending.finalize())
            return folder
        try:
            with _quiet_single_process():
                dcp.save(
                    state,
                    storage_writer=writer,
                    process_group=self.process_group,
                    no_dist=not self.distributed,
                )
        except DCP_ERRORS as e:
            raise CheckpointError(self._save_failed(folder, e)) from e
        self._barrier()  # every rank has finished writing before the marker appears
        try:
            if self.is_rank0:
                finalize()
        finally:
            self._barrier()  # on return the marker is visible to every rank (even if rank 0 failed)
        self._last_saved_step = step
        if self.on_complete is not None:
            self.on_complete(step, folder, kinds)
        return folder

    def _save_failed(self, folder: str, error: BaseException) -> str:
        """The one line for a failed save; rank 0 removes the partial folder (frees the space)."""
        if self.is_rank0:
            try:
                cfs.rm(self.fs, folder)
            except OSError:
                pass  # the next successful save removes older partial folders anyway
        try:
            previous = self.latest_complete()
        except OSError:
            previous = None
        kept = f"the newest complete checkpoint {previous} is intact" if previous else (
            "no earlier checkpoint exists"
        )
        return (
            f"{folder}: cannot write the checkpoint ({_first_line(error)}); {kept}; free space or fix "
            "permissions under checkpoint.path and run again to resume"
        )

    def _write_small_files(
        self, folder: str, train_state: dict[str, Any], params: dict[str, Any] | None
    ) -> None:
        # Written first and synchronously (also for async saves): the marker never precedes them.
        cfs.makedirs(self.fs, folder)
        if self.is_tp_rank0:
            text = json.dumps(train_state, indent=2)
            cfs.write_text_atomic(
                self.fs, cfs.join(folder, train_state_name(self.dp_rank)), text
            )
        if self.is_rank0 and params is not None:
            text = json.dumps(params, indent=2, default=str)
            cfs.write_text_atomic(self.fs, cfs.join(folder, PARAMS_FILE), text)

    def wait(self) -> None:
        """Block until the in-flight async save (if any) is written, marked complete and retained.

        Collective like `save`: on return the marker is visible to every rank.
        """
        pending, self._pending = self._pending, None
        if pending is None:
            return
        error: CheckpointError | None = None
        try:
            pending.future.result()
        except DCP_ERRORS as e:  # DCP raises on every rank, so all ranks agree here
            error = CheckpointError(self._save_failed(pending.folder, e))
            error.__cause__ = e
        if self.is_rank0 and error is None:
            pending.finalize()
            if pending.error is not None:
                error = CheckpointError(
                    f"{pending.folder}: finalizing failed ({pending.error})"
                )
                error.__cause__ = pending.error
        if self._async_group is not None:
            # Other ranks must not look for the marker (load, resave) before rank 0 wrote it.
            dist.barrier(group=self._async_group)
        if error is not None:
            raise error
        self._last_saved_step = pending.step
        if self.on_complete is not None:
            self.on_complete(pending.step, pending.folder, pending.kinds)

    def close(self) -> None:
        self.wait()

    def _write_marker(self, folder: str, step: int, kinds: list[str]) -> None:
        info = {
            "step": step,
            "kinds": kinds,
            "dp_size": self.dp_size,
            "world_size": self.world_size,
            "time": time.time(),
        }
        cfs.write_text_atomic(self.fs, cfs.join(folder, MARKER_FILE), json.dumps(info))

    def _delete(self, folder: str) -> None:
        # Marker first: a deletion cut short leaves an "incomplete" folder that is cleaned later,
        # never a folder that claims to be complete with files missing.
        cfs.rm(self.fs, cfs.join(folder, MARKER_FILE), recursive=False)
        cfs.rm(self.fs, folder)

    def _apply_retention(self, just_saved: int) -> None:
        """Rank 0, after `just_saved` is complete: drop old periodic/eval saves and stale partial ones."""
        entries = self._scan()
        complete = [
            (step, folder, marker)
            for step, folder, marker in entries
            if marker is not None
        ]
        newest = complete[-1][0] if complete else None
        delete_votes: dict[int, list[bool]] = {step: [] for step, _, _ in complete}
        for kinds_of_group, keep in (
            (DUMP_KINDS, self.args.dump.keep),
            ({"eval"}, self.args.eval.keep),
        ):
            members = [
                step
                for step, _, marker in complete
                if kinds_of_group & set(marker.get("kinds", []))
            ]
            kept = set(members[-keep:]) if keep > 0 else set(members)
            for step in members:
                delete_votes[step].append(step not in kept)
        for step, folder, marker in entries:
            if marker is None:
                # Only older partial folders: a newer one may be the next save starting on another rank.
                if step < just_saved:
                    logger.info("removing partial checkpoint %s", folder)
                    self._delete(folder)
            elif (
                step != newest
                and not KEPT_KINDS & set(marker.get("kinds", []))
                and delete_votes[step]
                and all(delete_votes[step])
            ):
                if self._leased(folder):
                    logger.info("retention: keeping %s while a reader holds a lease", folder)
                    continue
                logger.info("retention: removing checkpoint %s", folder)
                self._delete(folder)

    def retain(self) -> None:
        """Apply retention now (rank 0), e.g. once a reader released its lease; not while an
        async save is in flight (its own finalize applies retention then)."""
        if not self.is_rank0 or self._pending is not None:
            return
        complete = self.complete_checkpoints()
        if complete:
            self._apply_retention(complete[-1][0])

    def _leased(self, folder: str) -> bool:
        return any(name.startswith(LEASE_PREFIX) for name in cfs.listdir(self.fs, folder))

    # ------------------------------------------------------------------ loading

    def _read_train_state(self, path: str) -> tuple[dict[str, Any], LoadInfo]:
        marker = self._marker(path) or {}
        names = cfs.listdir(self.fs, path)
        saved_dp_size = marker.get("dp_size")
        if saved_dp_size is None:
            # Unmarked (e.g. reference) checkpoint: count the per-rank files.
            saved_dp_size = (
                sum(
                    name.startswith("train_state_") and name.endswith(".json")
                    for name in names
                )
                or None
            )
        source_rank = self.dp_rank if train_state_name(self.dp_rank) in names else 0
        file = cfs.join(path, train_state_name(source_rank))
        if train_state_name(source_rank) not in names:
            raise CheckpointError(
                f"{path}: no {train_state_name(self.dp_rank)} nor {train_state_name(0)}; not a training checkpoint"
            )
        try:
            train_state = json.loads(cfs.read_text(self.fs, file))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{file}: not valid JSON ({e})") from e
        info = LoadInfo(
            path=path,
            step=parse_step(path),
            saved_dp_size=saved_dp_size,
            dp_size_changed=(saved_dp_size not in (None, self.dp_size))
            or source_rank != self.dp_rank,
            train_state_rank=source_rank,
        )
        if info.dp_size_changed:
            logger.warning(
                "%s was saved with dp_size=%s, now %d: returning %s; its data-loader state must be re-derived",
                path, saved_dp_size, self.dp_size, train_state_name(source_rank),
            )  # fmt: skip
        return train_state, info

    def _dcp_load(self, state: dict[str, Any], path: str, failure: str) -> None:
        """DCP-load `state` in place from `path`; a failure is one CheckpointError line."""
        try:
            with _quiet_single_process():
                dcp.load(
                    state,
                    storage_reader=FsspecReader(path, **self._options),
                    process_group=self.process_group,
                )
        except DCP_ERRORS as e:
            raise CheckpointError(f"{path}: {failure} ({_first_line(e)})") from e

    def load(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        path: str | None = None,
    ) -> dict[str, Any]:
        """Restore model (+ optimizer) from `path` (default: `resume_path()`); returns this DP rank's train state.

        Works across sharding changes (FSDP/TP layouts, DP sizes). See `self.last_load` for the
        folder, step and whether the DP size changed.
        """
        self.wait()
        path = str(path or self.resume_path() or "").rstrip("/")
        if not path:
            raise CheckpointError(
                f"{self.path}: no complete checkpoint to resume from (a step folder needs {MARKER_FILE}); "
                "set checkpoint.load_path to load a specific folder"
            )
        require_dcp_dir(path, self.args.s3_profile)
        if self._marker(path) is None:
            logger.warning(
                "%s has no %s marker (older format or partial save); loading it as asked",
                path,
                MARKER_FILE,
            )
        train_state, info = self._read_train_state(path)
        state = self._state_dict(model, optimizer)
        self._dcp_load(state, path, "cannot load into this model/optimizer")
        if optimizer is None:
            set_model_state_dict(model, state["model"])
        else:
            set_state_dict(
                model,
                optimizer,
                model_state_dict=state["model"],
                optim_state_dict=state["optim"],
            )
        self.last_load = info
        logger.info("loaded checkpoint %s", path)
        return train_state

    def load_init(
        self,
        model: nn.Module,
        path: str | None = None,
        strict: bool | None = None,
        rename: dict[str, str] | None = None,
    ) -> InitLoadReport:
        """Warm start: model weights only, from a DCP step folder or a consolidated folder/.pth file.

        `rename` maps checkpoint key prefixes to model key prefixes. Call after `init_weights()`:
        non-persistent buffers (RoPE tables) are not in checkpoints and keep their initialised values.
        """
        path = str(path or self.args.init_ckpt_path or "").rstrip("/")
        if not path:
            raise ConfigError(
                "checkpoint.init_ckpt_path: load_init called without a path"
            )
        strict = self.args.init_ckpt_strict if strict is None else strict
        rename = self.args.init_ckpt_rename if rename is None else rename
        fs = cfs.get_fs(path, self.args.s3_profile)
        if cfs.exists(fs, cfs.join(path, METADATA_FILE)):
            report = self._load_init_dcp(model, path, strict, rename)
        elif find_consolidated_file(path, self.args.s3_profile) is not None:
            report = self._load_init_consolidated(model, path, strict, rename)
        else:
            raise CheckpointError(
                f"{path}: neither a DCP folder (.metadata) nor a consolidated checkpoint (consolidated.pth)"
            )
        if report.missing or report.unexpected:
            logger.warning(
                "warm start from %s: missing %s; unexpected %s",
                path,
                _short(report.missing),
                _short(report.unexpected),
            )
        return report

    def _match_keys(
        self,
        path: str,
        fmt: str,
        model_shapes: dict[str, torch.Size],
        ckpt_shapes: dict[str, torch.Size],
        strict: bool,
        rename: dict[str, str] | None,
    ) -> tuple[dict[str, str], InitLoadReport]:
        """Map checkpoint keys to model keys; raise on shape mismatches, and on missing/extra keys if strict."""
        mapping = {ckpt_key: _rename_key(ckpt_key, rename) for ckpt_key in ckpt_shapes}
        matched = {c: m for c, m in mapping.items() if m in model_shapes}
        report = InitLoadReport(
            path=path,
            format=fmt,
            loaded=sorted(matched.values()),
            missing=sorted(set(model_shapes) - set(matched.values())),
            unexpected=sorted(c for c, m in mapping.items() if m not in model_shapes),
        )
        for ckpt_key, model_key in matched.items():
            if tuple(ckpt_shapes[ckpt_key]) != tuple(model_shapes[model_key]):
                raise CheckpointError(
                    f"{path}: {ckpt_key} has shape {tuple(ckpt_shapes[ckpt_key])} but model key {model_key} "
                    f"needs {tuple(model_shapes[model_key])}; check the model config matches the checkpoint"
                )
        if strict and (report.missing or report.unexpected):
            raise CheckpointError(
                f"{path}: keys do not match the model (missing: {_short(report.missing) or '-'}; "
                f"unexpected: {_short(report.unexpected) or '-'}); fix checkpoint.init_ckpt_rename or set "
                "checkpoint.init_ckpt_strict=false"
            )
        return matched, report

    def _load_init_dcp(
        self, model: nn.Module, path: str, strict: bool, rename: dict[str, str] | None
    ) -> InitLoadReport:
        metadata = FsspecReader(path, **self._options).read_metadata()
        planner_paths = metadata.planner_data or {}
        nested = any(
            planner_paths.get(k, (None,))[0] == "model"
            for k in metadata.state_dict_metadata
        )
        ckpt_shapes: dict[str, torch.Size] = {}
        for flat_key, md in metadata.state_dict_metadata.items():
            obj_path = planner_paths.get(flat_key, (flat_key,))
            if nested and (obj_path[0] != "model" or len(obj_path) != 2):
                continue  # optimizer state and anything else outside "model"
            if hasattr(md, "size"):
                ckpt_shapes[obj_path[1] if nested else flat_key] = md.size
        model_sd = get_model_state_dict(model)
        matched, report = self._match_keys(
            path,
            "dcp",
            {k: v.shape for k, v in model_sd.items()},
            ckpt_shapes,
            strict,
            rename,
        )
        targets = {
            ckpt_key: model_sd[model_key] for ckpt_key, model_key in matched.items()
        }
        state = {"model": targets} if nested else targets
        self._dcp_load(state, path, "warm start failed")
        loaded = state["model"] if nested else state
        set_model_state_dict(
            model,
            {matched[c]: t for c, t in loaded.items()},
            options=StateDictOptions(strict=False),
        )
        return report

    def _load_init_consolidated(
        self, model: nn.Module, path: str, strict: bool, rename: dict[str, str] | None
    ) -> InitLoadReport:
        ckpt = load_consolidated_state_dict(path, self.args.s3_profile)
        model_sd = get_model_state_dict(model)
        matched, report = self._match_keys(
            path,
            "consolidated",
            {k: v.shape for k, v in model_sd.items()},
            {k: v.shape for k, v in ckpt.items()},
            strict,
            rename,
        )
        full = {model_key: ckpt[ckpt_key] for ckpt_key, model_key in matched.items()}
        # full_state_dict=True: every rank holds the whole tensors and FSDP/TP slice out their shard.
        set_model_state_dict(
            model, full, options=StateDictOptions(full_state_dict=True, strict=False)
        )
        return report


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    """Silence DCP's "assuming a single process" warning: without a process group that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _first_line(error: BaseException) -> str:
    """`Type: message` of the root cause, unwrapping DCP's multi-rank CheckpointException."""
    if isinstance(error, CheckpointException) and error.failures:
        rank, (cause, _trace) = min(error.failures.items(), key=lambda item: item[0])
        return f"rank {rank}: {_first_line(cause)}"
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"
