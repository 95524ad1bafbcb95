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

The parts: folder names, markers, leases and retention live in `layout` (no model, no DCP);
manifests in `verify`; safe DCP reading in `dcp_io`; warm starts in `warm_start`. This module
ties them to a model: `save` (a sync and an async path), `wait`, `load`, `resume_path`.

A folder holding a reader lease (`.lease.*`) is never deleted by retention, nor one that `hold`
(e.g. the async-eval launcher: an eval still owed) names a reason for.
A folder without `.complete` is a partial save (killed, crashed, or still being written): it is
never resumed from automatically and is deleted by rank 0 after a later successful save.
On resume the newest complete folder is verified against its manifests (sizes and CRC32s by
default; sizes only with `checkpoint.verify=size`); one that fails is renamed
`{step}.corrupt-{time}` (kept, never deleted, ignored from then on) and the next newest is tried.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from bytelatent.checkpoint import fs as cfs
from bytelatent.checkpoint import warm_start
from bytelatent.checkpoint.args import CheckpointArgs, SaveEvery  # noqa: F401  (re-exported)
from bytelatent.checkpoint.consolidate import PARAMS_FILE, require_dcp_dir
from bytelatent.checkpoint.dcp_io import (
    DCP_ERRORS,
    dcp_load,
    first_line,
    quiet_single_process,
)
from bytelatent.checkpoint.layout import (  # noqa: F401  (re-exported: the manager's vocabulary)
    DUMP_KINDS,
    KEPT_KINDS,
    KINDS,
    LEASE_PREFIX,
    MARKER_FILE,
    FolderStore,
    HoldFn,
    normalize_kinds,
    parse_step,
    read_marker,
    step_folder_name,
    train_state_name,
    write_marker,
)
from bytelatent.checkpoint.verify import (
    ManifestWriter,
    VerifyReport,
    verify_step_folder,
    write_folder_manifest,
)
from bytelatent.checkpoint.warm_start import InitLoadReport  # noqa: F401  (re-exported)
from bytelatent.errors import FILE_ONLY, CheckpointError, ConfigError, UserError

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
                if not isinstance(e, UserError):  # a UserError is its own one line (in wait)
                    logger.exception("finalizing checkpoint %s failed", self.folder)


def train_state_text(train_state: dict[str, Any]) -> str:
    """A train state as JSON: one top-level key per line (readable: step, tokens_seen, ...), each
    value compact. The data state's file lists were ~2/3 indentation with `indent=2` (402 KB of
    a 10,000-file state at dp=1, 140 KB like this); any JSON reader loads either."""
    lines = [
        f"  {json.dumps(key)}: {json.dumps(value, separators=(',', ':'))}"
        for key, value in train_state.items()
    ]
    return "{\n" + ",\n".join(lines) + "\n}\n" if lines else "{}\n"


def _os_error_in(error: BaseException | None, depth: int = 0) -> OSError | None:
    """The OS error behind a failed write, if any: torch's zip writer reports a full disk as
    "RuntimeError: ... unexpected pos 704 vs 598" with the ENOSPC only in `__context__`, and DCP
    wraps each rank's failure in a CheckpointException."""
    if error is None or depth > 8:
        return None
    if isinstance(error, OSError):
        return error
    if isinstance(error, CheckpointException):
        for _rank, (cause, _trace) in sorted(error.failures.items(), key=lambda kv: kv[0]):
            if (found := _os_error_in(cause, depth + 1)) is not None:
                return found
    return _os_error_in(error.__cause__ or error.__context__, depth + 1)


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
        self.folders = FolderStore(self.fs, self.path)
        self._options = cfs.storage_options(self.path, args.s3_profile)
        self.distributed = dist.is_available() and dist.is_initialized()
        self.is_rank0 = not self.distributed or dist.get_rank() == 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        self.group_rank = dist.get_rank(process_group) if self.distributed else 0
        self.group_size = dist.get_world_size(process_group) if self.distributed else 1
        self._pending: _PendingSave | None = None
        self._last_saved_step: int | None = None
        self._checksums_owed: str | None = None  # chosen by resume_path, CRC32s checked by load
        self.last_load: LoadInfo | None = None
        # Called as on_complete(step, folder, kinds) on every rank once a save is complete
        # (marker visible), e.g. to launch an async eval of it.
        self.on_complete: Any = None
        # Called by retention (rank 0) as hold(step, folder, kinds) -> reason to keep, or None.
        self.hold: HoldFn | None = None
        # Background DCP collectives must not interleave with the training loop's collectives on
        # the same group, so async saves get their own gloo group (collective: all ranks build it).
        self._async_group: dist.ProcessGroup | None = None
        if args.async_save and self.distributed:
            ranks = (
                dist.get_process_group_ranks(process_group) if process_group is not None else None
            )
            self._async_group = dist.new_group(ranks=ranks, backend="gloo")

    # ------------------------------------------------------------------ listing

    def step_folder(self, step: int) -> str:
        return self.folders.step_folder(step)

    def _marker(self, folder: str) -> dict[str, Any] | None:
        """Contents of the folder's completion marker, or None if the save never completed."""
        return read_marker(self.fs, folder)

    def complete_checkpoints(self) -> list[tuple[int, str, list[str]]]:
        """(step, folder, kinds) of every complete step folder, oldest first."""
        return [(e.step, e.path, e.kinds) for e in self.folders.complete()]

    def latest_complete(self) -> str | None:
        """Newest step folder whose save completed (has the marker); partial folders are ignored."""
        complete = self.folders.complete()
        return complete[-1].path if complete else None

    def resume_path(self) -> str | None:
        """Where a (re)started run resumes from: load_path, else the newest complete save, else
        init_ckpt_path when continue_training_from_init; None means start fresh (maybe `load_init`).

        The newest complete save is verified by sizes here; with `verify=checksum` its CRC32s are
        checked by `load` while it reads the folder (in parallel), which falls back to the previous
        checkpoint if they fail.
        """
        if self.args.load_path:
            self._require_verified(self.args.load_path)
            return self.args.load_path
        latest = self.latest_verified(checksum=False)
        if latest is not None:
            self._checksums_owed = latest if self.args.verify == "checksum" else None
            return latest
        if self.args.init_ckpt_path and self.args.continue_training_from_init:
            self._require_verified(self.args.init_ckpt_path)
            return self.args.init_ckpt_path
        return None

    def verify(self, folder: str, checksum: bool | None = None) -> VerifyReport:
        """Check `folder` against its manifests (CRC32s too unless `verify=size`, or as `checksum`
        says); collective (ranks split the rank manifests)."""
        checksum = self.args.verify == "checksum" if checksum is None else checksum
        shard = (self.group_rank, self.group_size)
        return self._gather(verify_step_folder(folder, checksum, fs=self.fs, shard=shard))

    def _gather(self, report: VerifyReport) -> VerifyReport:
        """Every rank's share of a verification, merged on every rank (collective)."""
        if self.distributed:
            gathered: list[Any] = [None] * self.group_size
            mine = (report.problems, report.verified, report.n_files)
            dist.all_gather_object(gathered, mine, group=self.process_group)
            report.problems = [p for problems, _, _ in gathered for p in problems]
            report.verified = all(verified for _, verified, _ in gathered)
            report.n_files = sum(n for _, _, n in gathered)
        return report

    def latest_verified(self, checksum: bool | None = None) -> str | None:
        """Newest complete folder that passes verification; failing ones are set aside (renamed)."""
        for entry in reversed(self.folders.complete()):
            report = self.verify(entry.path, checksum)
            if report.ok and not report.verified:
                logger.warning(
                    "%s has no manifest (saved by an older version): not verified", entry.path
                )
                return entry.path
            if report.ok:
                return entry.path
            self._set_aside_failed(entry.path, report)
        return None

    def _set_aside_failed(self, folder: str, report: VerifyReport) -> None:
        """Rank 0 renames a folder that failed verification; collective (a barrier follows)."""
        if self.is_rank0:
            aside = self.folders.set_aside(folder)
            more = f" (+{len(report.problems) - 3} more)" if len(report.problems) > 3 else ""
            logger.error(
                "checkpoint %s fails verification: %s%s; moved it to %s (kept, not deleted); "
                "resuming from the previous checkpoint instead",
                folder, "; ".join(report.problems[:3]), more, aside,
            )  # fmt: skip
        self._barrier()  # the rename is visible before any rank lists the folder again

    def _require_verified(self, folder: str) -> None:
        report = self.verify(folder)
        if not report.ok and not (not report.verified and self._foreign(folder, report)):
            raise CheckpointError(
                f"{folder}: fails verification ({'; '.join(report.problems[:3])}); "
                "unset checkpoint.load_path to resume from the newest good checkpoint"
            )

    def _foreign(self, folder: str, report: VerifyReport) -> bool:
        """No marker, no manifests (another tool's or an older folder): only the marker is missing."""
        names = cfs.listdir(self.fs, folder)
        ours = MARKER_FILE in names or any(n.startswith("manifest_") for n in names)
        return not ours and all("partial save" in p for p in report.problems)

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

        `kind` ("dump", "eval", "final", "preempt", "step", or several of them) drives retention.
        With `async_save` this returns once the state is copied to CPU; `wait()` (called by the
        next save/load/close) finishes it.
        """
        kinds = normalize_kinds(kind)
        self.wait()
        folder = self.step_folder(step)
        if step == self._last_saved_step or self._marker(folder) is not None:
            logger.info("checkpoint %s already saved; skipping", folder)
            return folder
        self._start_folder(folder, train_state, params)
        state = self._state_dict(model, optimizer)
        writer = ManifestWriter(folder, self.group_rank, self.fs, **self._options)
        if self.args.async_save:
            self._save_async(step, folder, kinds, state, writer)
        else:
            self._save_sync(step, folder, kinds, state, writer)
        return folder

    def _start_folder(
        self, folder: str, train_state: dict[str, Any], params: dict[str, Any] | None
    ) -> None:
        """An empty folder (a leftover of an interrupted save of this step is removed), small files."""
        if self.is_rank0 and cfs.exists(self.fs, folder):
            logger.warning("removing partial checkpoint %s before saving it again", folder)
            cfs.rm(self.fs, folder)
        self._barrier()
        try:
            self._write_small_files(folder, train_state, params)
        except OSError as e:
            raise CheckpointError(self._save_failed(folder, e)) from e

    def _save_sync(
        self,
        step: int,
        folder: str,
        kinds: list[str],
        state: dict[str, Any],
        writer: ManifestWriter,
    ) -> None:
        try:
            with quiet_single_process():
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
                self._finalize(step, folder, kinds)
        finally:
            self._barrier()  # on return the marker is visible to every rank (even if rank 0 failed)
        self._completed(step, folder, kinds)

    def _save_async(
        self,
        step: int,
        folder: str,
        kinds: list[str],
        state: dict[str, Any],
        writer: ManifestWriter,
    ) -> None:
        group = self._async_group if self.distributed else None
        with quiet_single_process():
            future = dcp.async_save(
                state, storage_writer=writer, process_group=group, no_dist=not self.distributed
            )
        pending = _PendingSave(
            step, folder, future, lambda: self._finalize(step, folder, kinds), kinds
        )
        self._pending = pending
        if self.is_rank0:
            # Rank 0's DCP future resolves only after every rank reported its files written
            # (DCP gathers the write results to write .metadata), so no extra barrier is needed.
            future.add_done_callback(lambda _: pending.finalize())

    def _finalize(self, step: int, folder: str, kinds: list[str]) -> None:
        """Rank 0, once every rank's data is written: folder manifest, marker, retention."""
        try:
            write_folder_manifest(self.fs, folder, self.group_size)
            self._write_marker(folder, step, kinds)
        except OSError as e:
            raise CheckpointError(self._save_failed(folder, e)) from e
        self._apply_retention(step)

    def _completed(self, step: int, folder: str, kinds: list[str]) -> None:
        self._last_saved_step = step
        if self.on_complete is not None:
            self.on_complete(step, folder, kinds)

    def _save_failed(self, folder: str, error: BaseException) -> str:
        """The one line for a failed save (also logged: train.log keeps it); rank 0 removes the
        partial folder (frees the space)."""
        if self.is_rank0:
            try:
                cfs.rm(self.fs, folder)
            except OSError:
                pass  # the next successful save removes older partial folders anyway
        try:
            previous = self.latest_complete()
        except OSError:
            previous = None
        kept = (
            f"the newest complete checkpoint {previous} is intact"
            if previous
            else ("no earlier checkpoint exists")
        )
        line = (
            f"{folder}: cannot write the checkpoint ({first_line(_os_error_in(error) or error)}); "
            f"{kept}; free space or fix "
            "permissions under checkpoint.path and run again to resume"
        )
        # train.log only: the console gets the line once, from the CheckpointError that ends the run
        logger.error("checkpoint error: %s", line, extra=FILE_ONLY)
        return line

    def _write_small_files(
        self, folder: str, train_state: dict[str, Any], params: dict[str, Any] | None
    ) -> None:
        # Written first and synchronously (also for async saves): the marker never precedes them.
        cfs.makedirs(self.fs, folder)
        if self.is_tp_rank0:
            text = train_state_text(train_state)
            cfs.write_text_atomic(self.fs, cfs.join(folder, train_state_name(self.dp_rank)), text)
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
            if isinstance(pending.error, CheckpointError):
                error = pending.error  # already the one line (a full disk writing the marker)
            elif pending.error is not None:
                error = CheckpointError(f"{pending.folder}: finalizing failed ({pending.error})")
                error.__cause__ = pending.error
        if self._async_group is not None:
            # Other ranks must not look for the marker (load, resave) before rank 0 wrote it.
            dist.barrier(group=self._async_group)
        if error is not None:
            raise error
        self._completed(pending.step, pending.folder, pending.kinds)

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
        write_marker(self.fs, folder, info)

    # ------------------------------------------------------------------ retention

    def _apply_retention(self, just_saved: int) -> None:
        """Rank 0, after `just_saved` is complete: drop old periodic/eval saves and stale partial ones."""
        self.folders.apply_retention(
            just_saved, self.args.dump.keep, self.args.eval.keep, hold=self.hold
        )

    def retain(self) -> None:
        """Apply retention now (rank 0), e.g. once a reader released its lease; not while an
        async save is in flight (its own finalize applies retention then)."""
        if not self.is_rank0 or self._pending is not None:
            return
        complete = self.folders.complete()
        if complete:
            self._apply_retention(complete[-1].step)

    # ------------------------------------------------------------------ loading

    def _read_train_state(self, path: str) -> tuple[dict[str, Any], LoadInfo]:
        marker = self._marker(path) or {}
        names = cfs.listdir(self.fs, path)
        saved_dp_size = marker.get("dp_size")
        if saved_dp_size is None:
            # Unmarked (e.g. reference) checkpoint: count the per-rank files.
            saved_dp_size = (
                sum(name.startswith("train_state_") and name.endswith(".json") for name in names)
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
        """DCP-load `state` in place from `path` (metadata unpickled safely); one CheckpointError line."""
        dcp_load(state, path, failure, self._options, self.process_group)

    def load(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        path: str | None = None,
    ) -> dict[str, Any]:
        """Restore model (+ optimizer) from `path` (default: `resume_path()`); returns this DP rank's train state.

        Works across sharding changes (FSDP/TP layouts, DP sizes). See `self.last_load` for the
        folder, step and whether the DP size changed. The folder `resume_path` chose has its
        CRC32s checked while it is read; if they fail it is set aside and the previous one loaded.
        """
        self.wait()
        path = str(path or self.resume_path() or "").rstrip("/")
        if not path:
            raise CheckpointError(
                f"{self.path}: no complete checkpoint to resume from (a step folder needs {MARKER_FILE}); "
                "set checkpoint.load_path to load a specific folder"
            )
        owed, self._checksums_owed = self._checksums_owed == path, None
        if not owed:
            return self._load_folder(model, optimizer, path)
        with ThreadPoolExecutor(1, thread_name_prefix="ckpt-crc32") as pool:
            shard = (self.group_rank, self.group_size)
            check = pool.submit(verify_step_folder, path, True, self.fs, shard)
            train_state = self._load_folder(model, optimizer, path)
            report = self._gather(check.result())
        if report.ok:
            return train_state
        self._set_aside_failed(path, report)
        return self.load(model, optimizer)  # the previous checkpoint (sizes, then CRC32s again)

    def _load_folder(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None, path: str
    ) -> dict[str, Any]:
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

        `rename` maps checkpoint key prefixes to model key prefixes (see `warm_start`).
        """
        path = str(path or self.args.init_ckpt_path or "").rstrip("/")
        if not path:
            raise ConfigError("checkpoint.init_ckpt_path: load_init called without a path")
        return warm_start.load_init(
            model,
            path,
            self.args.init_ckpt_strict if strict is None else strict,
            self.args.init_ckpt_rename if rename is None else rename,
            self.args.s3_profile,
            self.process_group,
        )
