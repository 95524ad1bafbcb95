"""Patch-length statistics per log interval, from the host-side numpy batches (no device sync).

`metrics.jsonl` gets `patch_len_mean` (bytes per patch) and `patch_len_hist` (patch counts per
bin of PATCH_LEN_BINS) on every log step of a BLT run; `python -m apps.plot` draws them. The
numbers are this rank's batches (rank 0 writes the log), a sample of the global batch.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from bytelatent.data.batch import Batch

# Upper edges of the histogram bins (bytes): 1, 2, 3-4, 5-8, ..., 33-64, then 65 and longer.
PATCH_LEN_UPPER = (1, 2, 4, 8, 16, 32, 64)
PATCH_LEN_BINS = ("1", "2", "3-4", "5-8", "9-16", "17-32", "33-64", "65+")


def _real_patch_lengths(batch: Batch) -> np.ndarray:
    """Nonzero patch lengths without the row padding that the packer adds to each row's last
    patch (mask False after a row's bytes): otherwise rows that end at `seq_len` patches before
    `max_encoder_seq_length` bytes would inflate the mean."""
    lengths = batch.patch_lengths
    padding = (~batch.mask).sum(axis=1)
    if padding.any():
        lengths = lengths.copy()
        last = (lengths > 0).sum(axis=1) - 1  # nonzero patches come first
        rows = np.arange(len(lengths))
        lengths[rows, last] = np.maximum(lengths[rows, last] - padding, 0)
    return lengths[lengths > 0]  # 0: right padding of the patch dimension


class PatchLengthStats:
    """Accumulates patch lengths between log steps; `pop()` returns the metrics and resets."""

    def __init__(self) -> None:
        self._hist = np.zeros(len(PATCH_LEN_BINS), dtype=np.int64)
        self._bytes = 0

    def add(self, batches: Iterable[Batch]) -> None:
        for batch in batches:
            if batch.patch_lengths is None:
                continue
            lengths = _real_patch_lengths(batch)
            bins = np.searchsorted(PATCH_LEN_UPPER, lengths, side="left")
            self._hist += np.bincount(bins, minlength=len(PATCH_LEN_BINS))
            self._bytes += int(lengths.sum())

    def pop(self) -> dict:
        """{} when no batch had patches (entropy-model or byte-mode runs)."""
        n_patches = int(self._hist.sum())
        out = {}
        if n_patches:
            out = {
                "patch_len_mean": self._bytes / n_patches,
                "patch_len_hist": self._hist.tolist(),
            }
        self._hist[:] = 0
        self._bytes = 0
        return out
