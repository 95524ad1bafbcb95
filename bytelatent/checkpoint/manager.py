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

`CheckpointManager` is a facade over the roles, each in its own module:

    layout.FolderStore    folder names, markers, listing, deleting, setting aside (no model, no DCP)
    saver.Saver           writing a step folder, sync or async behind one `save` -> handle, `wait`
    resume.ResumePolicy   which folder to resume from, verified on every rank, set aside, fallback
    retention.Retention   which folders to delete after a save (keep counts, leases, holds)
    train_state           the per-DP-rank train state files
    verify, dcp_io, warm_start: manifests, safe DCP reading, warm starts

A folder holding a reader lease (`.lease.*`) is never deleted by retention, nor one that `hold`
(e.g. the async-eval launcher: an eval still owed) names a reason for.
A folder without `.complete` is a partial save (killed, crashed, or still being written): it is
never resumed from automatically and is deleted by rank 0 after a later successful save.
On resume the newest complete folder is verified against its manifests (sizes and CRC32s by
default; sizes only with `checkpoint.verify=size`); one that fails is renamed
`{step}.corrupt-{time}` (kept, never deleted, ignored from then on) and the next newest is tried.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

from bytelatent.checkpoint import fs as cfs
from bytelatent.checkpoint import warm_start
from bytelatent.checkpoint.args import CheckpointArgs, SaveEvery  # noqa: F401  (re-exported)
from bytelatent.checkpoint.consolidate import require_dcp_dir
from bytelatent.checkpoint.dcp_io import dcp_load
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
)
from bytelatent.checkpoint.ranks import Ranks
from bytelatent.checkpoint.resume import ResumePolicy
from bytelatent.checkpoint.retention import Retention
from bytelatent.checkpoint.saver import SaveHandle, Saver, dcp_state
from bytelatent.checkpoint.train_state import (  # noqa: F401  (re-exported)
    LoadInfo,
    read_train_state,
    train_state_text,
)
from bytelatent.checkpoint.verify import VerifyReport
from bytelatent.checkpoint.warm_start import InitLoadReport  # noqa: F401  (re-exported)
from bytelatent.errors import ConfigError

logger = logging.getLogger(__name__)

# on_complete(step, folder, kinds), on every rank once a save is complete (marker visible)
CompleteFn = Callable[[int, str, list[str]], object]


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
        self.fs = cfs.get_fs(self.path, args.s3_profile)
        self.folders = FolderStore(self.fs, self.path)
        self.ranks = Ranks.current(dp_rank, dp_size, is_tp_rank0, process_group)
        self.is_rank0 = self.ranks.is_rank0
        self._options = cfs.storage_options(self.path, args.s3_profile)
        self.last_load: LoadInfo | None = None
        # Called as on_complete(step, folder, kinds) on every rank once a save is complete
        # (marker visible), e.g. to launch an async eval of it.
        self.on_complete: CompleteFn | None = None
        self.retention = Retention(self.folders, args.dump.keep, args.eval.keep)
        self.resume = ResumePolicy(args, self.fs, self.folders, self.ranks)
        self.saver = Saver(
            self.fs,
            self.folders,
            self.ranks,
            self._options,
            async_save=args.async_save,
            retain=self.retention.apply,
            on_saved=self._completed,
        )

    @property
    def hold(self) -> HoldFn | None:
        """Called by retention (rank 0) as hold(step, folder, kinds) -> reason to keep, or None."""
        return self.retention.hold

    @hold.setter
    def hold(self, hold: HoldFn | None) -> None:
        self.retention.hold = hold

    # ------------------------------------------------------------------ listing

    def step_folder(self, step: int) -> str:
        return self.folders.step_folder(step)

    def complete_checkpoints(self) -> list[tuple[int, str, list[str]]]:
        """(step, folder, kinds) of every complete step folder, oldest first."""
        return [(e.step, e.path, e.kinds) for e in self.folders.complete()]

    def latest_complete(self) -> str | None:
        """Newest step folder whose save completed (has the marker); partial folders are ignored."""
        complete = self.folders.complete()
        return complete[-1].path if complete else None

    # ------------------------------------------------------------------ resuming (ResumePolicy)

    def resume_path(self) -> str | None:
        """Where a (re)started run resumes from; see `ResumePolicy.resume_path`."""
        return self.resume.resume_path()

    def verify(self, folder: str, checksum: bool | None = None) -> VerifyReport:
        """Check `folder` against its manifests; collective (see `ResumePolicy.verify`)."""
        return self.resume.verify(folder, checksum)

    def latest_verified(self, checksum: bool | None = None) -> str | None:
        """Newest complete folder that passes verification; failing ones are set aside (renamed)."""
        return self.resume.latest_verified(checksum)

    # ------------------------------------------------------------------ saving (Saver)

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
        return self.saver.save(step, model, optimizer, train_state, params, kinds).folder

    def wait(self) -> None:
        """Block until the in-flight async save (if any) is written, marked complete and retained.

        Collective like `save`: on return the marker is visible to every rank.
        """
        self.saver.wait()

    def close(self) -> None:
        self.wait()

    def _completed(self, handle: SaveHandle) -> None:
        if self.on_complete is not None:
            self.on_complete(handle.step, handle.folder, handle.kinds)

    # ------------------------------------------------------------------ retention (Retention)

    def retain(self) -> None:
        """Apply retention now (rank 0), e.g. once a reader released its lease; not while an
        async save is in flight (its own finalize applies retention then)."""
        if self.is_rank0 and self.saver.pending is None:
            self.retention.apply_latest()

    # ------------------------------------------------------------------ loading

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
        return self.resume.load(path, lambda folder: self._load_folder(model, optimizer, folder))

    def _read_train_state(self, path: str) -> tuple[dict[str, Any], LoadInfo]:
        return read_train_state(self.fs, path, self.ranks.dp_rank, self.ranks.dp_size)

    def _load_folder(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None, path: str
    ) -> dict[str, Any]:
        require_dcp_dir(path, self.args.s3_profile)
        if read_marker(self.fs, path) is None:
            logger.warning(
                "%s has no %s marker (older format or partial save); loading it as asked",
                path,
                MARKER_FILE,
            )
        train_state, info = self._read_train_state(path)
        state = dcp_state(model, optimizer)
        dcp_load(
            state,
            path,
            "cannot load into this model/optimizer",
            self._options,
            self.ranks.process_group,
        )
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
            self.ranks.process_group,
        )
