"""Patch-length statistics per log interval, from the host-side numpy batches (no device sync).

`metrics.jsonl` gets `patch_len_mean` (real bytes per patch, padding excluded) and `patch_len_hist`
(patch counts per bin of PATCH_LEN_BINS) on every log step of a BLT run (`padding_frac`, the
padded share of all ranks' rows, comes from `trainer/interval.py`); `python -m apps.plot` draws them. The
numbers are this rank's batches (rank 0 writes the log), a sample of the global batch.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from bytelatent.data.batch import Batch

# Upper edges of the histogram bins (bytes): 1, 2, 3-4, 5-8, ..., 33-64, then 65 and longer.
PATCH_LEN_UPPER = (1, 2, 4, 8, 16, 32, 64)
PATCH_LEN_BINS = ("1", "2", "3-4", "5-8", "9-16", "17-32", "33-64", "65+")


class PatchLengthStats:
    """Accumulates patch lengths between log steps; `pop()` returns the metrics and resets.

    Only real bytes count: a row's right padding (where `mask` is False) is cut off its last
    patches and patches of padding alone are dropped.
    """

    def __init__(self) -> None:
        self._hist = np.zeros(len(PATCH_LEN_BINS), dtype=np.int64)
        self._bytes = 0

    def add(self, batches: Iterable[Batch]) -> None:
        for batch in batches:
            if batch.patch_lengths is None:
                continue
            lengths = real_patch_lengths(batch)
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


def real_patch_lengths(batch: Batch) -> np.ndarray:
    """1-D lengths of the patches' real bytes (patches over right padding cut or dropped).

    Row r's patches cover its L + 1 tokens; the real ones are x[r, 0] and every y whose mask is
    True (padding only ever sits on the right).
    """
    lengths = batch.patch_lengths
    ends = np.cumsum(lengths, axis=1)
    n_real = 1 + batch.mask.sum(axis=1, keepdims=True)
    real = np.clip(np.minimum(ends, n_real) - (ends - lengths), 0, None)
    return real[real > 0]
