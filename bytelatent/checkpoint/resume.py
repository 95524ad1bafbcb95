"""Which step folder a (re)started run resumes from, verified on every rank, with a fallback.

Order: `checkpoint.load_path` (must verify, never moved), else the newest complete folder that
passes verification, else `init_ckpt_path` when `continue_training_from_init`, else a fresh start.
The newest complete folder is verified by sizes when it is chosen; with `verify=checksum` its
CRC32s are checked by `load` while the folder is read (a background thread; the ranks split the
files). A folder that fails is renamed `{step}.corrupt-{time}` by rank 0 (kept, never deleted,
ignored from then on) and the previous complete folder is tried. Every method here is collective.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from fsspec import AbstractFileSystem

from bytelatent.checkpoint import fs as cfs
from bytelatent.checkpoint.args import CheckpointArgs
from bytelatent.checkpoint.layout import MARKER_FILE, FolderStore
from bytelatent.checkpoint.ranks import Ranks
from bytelatent.checkpoint.verify import VerifyReport, verify_step_folder
from bytelatent.errors import CheckpointError

logger = logging.getLogger(__name__)

T = TypeVar("T")


class ResumePolicy:
    """Chooses, verifies (collectively), sets aside and falls back; knows no model."""

    def __init__(
        self, args: CheckpointArgs, fs: AbstractFileSystem, folders: FolderStore, ranks: Ranks
    ) -> None:
        self.args, self.fs, self.folders, self.ranks = args, fs, folders, ranks
        self._checksums_owed: str | None = None  # chosen by resume_path, CRC32s checked by load

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

    def load(self, path: str | None, load_folder: Callable[[str], T]) -> T:
        """`load_folder(path)` (default: `resume_path()`), checking the CRC32s `resume_path` left
        owed while it reads; on a failure the folder is set aside and the previous one loaded."""
        path = str(path or self.resume_path() or "").rstrip("/")
        if not path:
            raise CheckpointError(
                f"{self.folders.path}: no complete checkpoint to resume from (a step folder needs {MARKER_FILE}); "
                "set checkpoint.load_path to load a specific folder"
            )
        owed, self._checksums_owed = self._checksums_owed == path, None
        if not owed:
            return load_folder(path)
        with ThreadPoolExecutor(1, thread_name_prefix="ckpt-crc32") as pool:
            check = pool.submit(verify_step_folder, path, True, self.fs, self.ranks.shard)
            loaded = load_folder(path)
            report = self._gather(check.result())
        if report.ok:
            return loaded
        self._set_aside_failed(path, report)
        return self.load(None, load_folder)  # the previous checkpoint (sizes, then CRC32s again)

    # ------------------------------------------------------------------ verification

    def verify(self, folder: str, checksum: bool | None = None) -> VerifyReport:
        """Check `folder` against its manifests (CRC32s too unless `verify=size`, or as `checksum`
        says); collective (ranks split the rank manifests)."""
        checksum = self.args.verify == "checksum" if checksum is None else checksum
        return self._gather(
            verify_step_folder(folder, checksum, fs=self.fs, shard=self.ranks.shard)
        )

    def _gather(self, report: VerifyReport) -> VerifyReport:
        """Every rank's share of a verification, merged on every rank (collective)."""
        if self.ranks.distributed:
            gathered = self.ranks.all_gather((report.problems, report.verified, report.n_files))
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
        if self.ranks.is_rank0:
            aside = self.folders.set_aside(folder)
            more = f" (+{len(report.problems) - 3} more)" if len(report.problems) > 3 else ""
            logger.error(
                "checkpoint %s fails verification: %s%s; moved it to %s (kept, not deleted); "
                "resuming from the previous checkpoint instead",
                folder, "; ".join(report.problems[:3]), more, aside,
            )  # fmt: skip
        self.ranks.barrier()  # the rename is visible before any rank lists the folder again

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
