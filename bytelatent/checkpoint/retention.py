"""Which step folders a run keeps: per-kind `keep` counts, leases and holds (no model, no DCP).

Retention runs on rank 0 only, right after a save is marked complete (the saver calls it, also
from an async save's completion thread) and again when asked (`retain`, e.g. a reader released
its lease). A folder holding a reader lease (`.lease.*`) is never deleted, nor one that `hold`
names a reason for (e.g. the async-eval launcher: an eval still owed).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from bytelatent.checkpoint.layout import DUMP_KINDS, KEPT_KINDS, FolderStore, HoldFn, StepFolder

logger = logging.getLogger(__name__)


def retention_plan(
    folders: Sequence[StepFolder], just_saved: int, dump_keep: int, eval_keep: int
) -> list[StepFolder]:
    """Folders retention retires once `just_saved` is complete (before leases and holds).

    Partial folders older than `just_saved` (a newer one may be the next save starting on another
    rank). Complete folders: each kind group (dumps: dump/final/preempt; evals) keeps its newest
    `keep` (<= 0 keeps all); a folder goes only when every group it belongs to retires it; the
    newest complete folder and `step` saves always stay. Kinds come from the markers, not from
    `step % every`, so this stays right when `every` changes between runs.
    """
    complete = [entry for entry in folders if entry.complete]
    newest = complete[-1].step if complete else None
    votes: dict[int, list[bool]] = {entry.step: [] for entry in complete}
    for group, keep in ((DUMP_KINDS, dump_keep), (frozenset({"eval"}), eval_keep)):
        members = [entry.step for entry in complete if group & set(entry.kinds)]
        kept = set(members[-keep:]) if keep > 0 else set(members)
        for step in members:
            votes[step].append(step not in kept)
    retired = []
    for entry in folders:
        if not entry.complete:
            if entry.step < just_saved:
                retired.append(entry)
        elif (
            entry.step != newest
            and not KEPT_KINDS & set(entry.kinds)
            and votes[entry.step]
            and all(votes[entry.step])
        ):
            retired.append(entry)
    return retired


class Retention:
    """Deletes what `retention_plan` retires under one `FolderStore`, except held folders."""

    def __init__(
        self, folders: FolderStore, dump_keep: int, eval_keep: int, hold: HoldFn | None = None
    ) -> None:
        self.folders = folders
        self.dump_keep, self.eval_keep = dump_keep, eval_keep
        # Called as hold(step, folder, kinds) -> reason to keep, or None.
        self.hold = hold

    def apply(self, just_saved: int) -> list[str]:
        """After `just_saved` is complete: drop old periodic/eval saves and stale partial ones;
        returns the deleted folders."""
        deleted = []
        plan = retention_plan(self.folders.scan(), just_saved, self.dump_keep, self.eval_keep)
        for entry in plan:
            if entry.complete:
                reason = self._hold_reason(entry)
                if reason is not None:
                    logger.info("retention: keeping %s: %s", entry.path, reason)
                    continue
                logger.info("retention: removing checkpoint %s", entry.path)
            else:
                logger.info("removing partial checkpoint %s", entry.path)
            self.folders.delete(entry.path)
            deleted.append(entry.path)
        return deleted

    def apply_latest(self) -> list[str]:
        """Apply it as after the newest complete save (nothing when there is none)."""
        complete = self.folders.complete()
        return self.apply(complete[-1].step) if complete else []

    def _hold_reason(self, entry: StepFolder) -> str | None:
        if self.folders.leased(entry.path):
            return "a reader holds a lease"
        return self.hold(entry.step, entry.path, entry.kinds) if self.hold is not None else None
