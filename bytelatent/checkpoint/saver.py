"""Writing one checkpoint step folder, synchronously or in the background, behind one interface.

    handle = saver.save(step, model, optimizer, train_state, params, kinds)  # returns a SaveHandle
    saver.wait()                                                            # collective

A sync save returns once the folder is complete; an async save (`checkpoint.async_save`) returns
once the state is staged on CPU, and `wait()` (called by the next save, a load or `close`) finishes
it. Either way the order on disk is the same: small files (train state, params) first, then DCP
data with per-rank manifests, then rank 0 writes the folder manifest and the `.complete` marker,
and applies retention. A save that cannot write is one `CheckpointError` line naming the OS error
and the newest complete checkpoint; the partial folder is removed.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from fsspec import AbstractFileSystem
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

from bytelatent.checkpoint import fs as cfs
from bytelatent.checkpoint.consolidate import PARAMS_FILE
from bytelatent.checkpoint.dcp_io import DCP_ERRORS, first_line, quiet_single_process
from bytelatent.checkpoint.layout import FolderStore, read_marker, train_state_name, write_marker
from bytelatent.checkpoint.ranks import Ranks
from bytelatent.checkpoint.train_state import train_state_text
from bytelatent.checkpoint.verify import ManifestWriter, write_folder_manifest
from bytelatent.errors import FILE_ONLY, CheckpointError, UserError

logger = logging.getLogger(__name__)

# The DCP state of a checkpoint: {"model": model state dict} (+ {"optim": optimizer state dict}).
DcpState = dict[str, dict[str, Any]]


def dcp_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> DcpState:
    """What a step folder's DCP files hold: model (and optimizer) state, for saving or loading into."""
    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


class SaveHandle:
    """One save. Sync: complete when `save` returns. Async: its DCP `future` is in flight and
    `finalize` (rank 0, once) writes the marker and applies retention when it resolves."""

    def __init__(
        self,
        step: int,
        folder: str,
        kinds: list[str],
        future: Future | None = None,
        finalize_fn: Callable[[], None] | None = None,
    ) -> None:
        self.step, self.folder, self.kinds, self.future = step, folder, kinds, future
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
                if self._finalize_fn is not None and (
                    self.future is None or self.future.exception() is None
                ):
                    self._finalize_fn()
            except BaseException as e:  # re-raised by wait() on the main thread
                self.error = e
                if not isinstance(e, UserError):  # a UserError is its own one line (in wait)
                    logger.exception("finalizing checkpoint %s failed", self.folder)


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


class Saver:
    """Writes step folders for one rank (every rank makes the same calls), sync or async."""

    def __init__(
        self,
        fs: AbstractFileSystem,
        folders: FolderStore,
        ranks: Ranks,
        storage_options: dict[str, Any],
        async_save: bool = False,
        retain: Callable[[int], object] | None = None,
        on_saved: Callable[[SaveHandle], None] | None = None,
    ) -> None:
        self.fs, self.folders, self.ranks = fs, folders, ranks
        self._options = storage_options
        self.async_save = async_save
        self._retain = retain  # rank 0, once a save is marked complete: retention(step)
        self._on_saved = on_saved  # every rank, once a save is complete (marker visible)
        self.pending: SaveHandle | None = None
        self._started: dict[int, float] = {}  # step -> when its save began (for the saved line)
        self.last_saved_step: int | None = None
        # Background DCP collectives must not interleave with the training loop's collectives on
        # the same group, so async saves get their own gloo group (collective: all ranks build it).
        self._async_group: dist.ProcessGroup | None = None
        if async_save and ranks.distributed:
            group = ranks.process_group
            ranks_in = dist.get_process_group_ranks(group) if group is not None else None
            self._async_group = dist.new_group(ranks=ranks_in, backend="gloo")

    def save(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        train_state: dict[str, Any],
        params: dict[str, Any] | None,
        kinds: list[str],
    ) -> SaveHandle:
        """Write step folder `step` (a step already saved is a no-op); see the module docstring."""
        self.wait()
        folder = self.folders.step_folder(step)
        if step == self.last_saved_step or read_marker(self.fs, folder) is not None:
            logger.info("checkpoint %s already saved; skipping", folder)
            return SaveHandle(step, folder, kinds)
        self._started[step] = time.perf_counter()
        self._start_folder(folder, train_state, params)
        state = dcp_state(model, optimizer)
        writer = ManifestWriter(folder, self.ranks.group_rank, self.fs, **self._options)
        if self.async_save:
            return self._save_async(step, folder, kinds, state, writer)
        return self._save_sync(step, folder, kinds, state, writer)

    def wait(self) -> None:
        """Block until the in-flight async save (if any) is written, marked complete and retained.

        Collective like `save`: on return the marker is visible to every rank.
        """
        pending, self.pending = self.pending, None
        if pending is None:
            return
        assert pending.future is not None
        error: CheckpointError | None = None
        try:
            pending.future.result()
        except DCP_ERRORS as e:  # DCP raises on every rank, so all ranks agree here
            error = CheckpointError(self.save_failed(pending.folder, e))
            error.__cause__ = e
        if self.ranks.is_rank0 and error is None:
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
        self._completed(pending)

    # ------------------------------------------------------------------ the two paths

    def _start_folder(
        self, folder: str, train_state: dict[str, Any], params: dict[str, Any] | None
    ) -> None:
        """An empty folder (a leftover of an interrupted save of this step is removed), small files."""
        if self.ranks.is_rank0 and cfs.exists(self.fs, folder):
            logger.warning("removing partial checkpoint %s before saving it again", folder)
            cfs.rm(self.fs, folder)
        self.ranks.barrier()
        try:
            self._write_small_files(folder, train_state, params)
        except OSError as e:
            raise CheckpointError(self.save_failed(folder, e)) from e

    def _write_small_files(
        self, folder: str, train_state: dict[str, Any], params: dict[str, Any] | None
    ) -> None:
        # Written first and synchronously (also for async saves): the marker never precedes them.
        cfs.makedirs(self.fs, folder)
        if self.ranks.is_tp_rank0:
            text = train_state_text(train_state)
            name = train_state_name(self.ranks.dp_rank)
            cfs.write_text_atomic(self.fs, cfs.join(folder, name), text)
        if self.ranks.is_rank0 and params is not None:
            text = json.dumps(params, indent=2, default=str)
            cfs.write_text_atomic(self.fs, cfs.join(folder, PARAMS_FILE), text)

    def _save_sync(
        self, step: int, folder: str, kinds: list[str], state: DcpState, writer: ManifestWriter
    ) -> SaveHandle:
        try:
            with quiet_single_process():
                dcp.save(
                    state,
                    storage_writer=writer,
                    process_group=self.ranks.process_group,
                    no_dist=not self.ranks.distributed,
                )
        except DCP_ERRORS as e:
            raise CheckpointError(self.save_failed(folder, e)) from e
        self.ranks.barrier()  # every rank has finished writing before the marker appears
        try:
            if self.ranks.is_rank0:
                self._finalize(step, folder, kinds)
        finally:
            self.ranks.barrier()  # on return the marker is visible to every rank (even if rank 0 failed)
        handle = SaveHandle(step, folder, kinds)
        self._completed(handle)
        return handle

    def _save_async(
        self, step: int, folder: str, kinds: list[str], state: DcpState, writer: ManifestWriter
    ) -> SaveHandle:
        group = self._async_group if self.ranks.distributed else None
        with quiet_single_process():
            future = dcp.async_save(
                state,
                storage_writer=writer,
                process_group=group,
                no_dist=not self.ranks.distributed,
            )
        pending = SaveHandle(
            step, folder, kinds, future, lambda: self._finalize(step, folder, kinds)
        )
        self.pending = pending
        if self.ranks.is_rank0:
            # Rank 0's DCP future resolves only after every rank reported its files written
            # (DCP gathers the write results to write .metadata), so no extra barrier is needed.
            future.add_done_callback(lambda _: pending.finalize())
        return pending

    # ------------------------------------------------------------------ completing

    def _finalize(self, step: int, folder: str, kinds: list[str]) -> None:
        """Rank 0, once every rank's data is written: folder manifest, marker, retention."""
        try:
            write_folder_manifest(self.fs, folder, self.ranks.group_size)
            self._write_marker(folder, step, kinds)
        except OSError as e:
            raise CheckpointError(self.save_failed(folder, e)) from e
        started = self._started.pop(step, None)
        took = "" if started is None else f" in {time.perf_counter() - started:.1f} s"
        logger.info("saved checkpoint %s (%s)%s", folder, ", ".join(kinds), took)
        if self._retain is not None:
            self._retain(step)

    def _write_marker(self, folder: str, step: int, kinds: list[str]) -> None:
        info = {
            "step": step,
            "kinds": kinds,
            "dp_size": self.ranks.dp_size,
            "world_size": self.ranks.world_size,
            "time": time.time(),
        }
        write_marker(self.fs, folder, info)

    def _completed(self, handle: SaveHandle) -> None:
        self.last_saved_step = handle.step
        if self._on_saved is not None:
            self._on_saved(handle)

    def save_failed(self, folder: str, error: BaseException) -> str:
        """The one line for a failed save (also logged: train.log keeps it); rank 0 removes the
        partial folder (frees the space)."""
        if self.ranks.is_rank0:
            try:
                cfs.rm(self.fs, folder)
            except OSError:
                pass  # the next successful save removes older partial folders anyway
        try:
            complete = self.folders.complete()
            previous = complete[-1].path if complete else None
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
