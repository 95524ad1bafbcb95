"""Patch-length statistics: host-side histogram, mean and padding share per log interval."""

import numpy as np

from bytelatent.data.batch import Batch
from bytelatent.trainer.patch_stats import PATCH_LEN_BINS, PatchLengthStats


def batch(patch_lengths, n_real=None) -> Batch:
    """Rows of L + 1 = sum(patch lengths) tokens; `n_real[r]` of them real (the rest padding)."""
    pl = np.array(patch_lengths, dtype=np.int64)
    length = int(pl.sum(axis=1).max()) - 1
    n_real = n_real or [int(row.sum()) for row in pl]
    mask = np.array([[i + 1 < n for i in range(length)] for n in n_real])
    x = np.zeros(mask.shape, dtype=np.int64)
    return Batch(x=x, y=x, mask=mask, patch_lengths=pl)


def test_histogram_mean_and_reset():
    stats = PatchLengthStats()
    stats.add([batch([[1, 3, 4, 75, 0], [1, 9, 70, 3, 0]]), batch([[1, 2, 64, 16]])])
    m = stats.pop()
    assert len(m["patch_len_hist"]) == len(PATCH_LEN_BINS)
    #                          1  2  3-4 5-8 9-16 17-32 33-64 65+
    assert m["patch_len_hist"] == [3, 1, 3, 0, 2, 0, 1, 2]
    assert m["patch_len_mean"] == (1 + 3 + 4 + 75 + 1 + 9 + 70 + 3 + 1 + 2 + 64 + 16) / 12
    assert "padding_frac" not in m  # all ranks' padding_frac comes from trainer/interval.py
    assert stats.pop() == {}  # reset after each log step


def test_padding_is_cut_off_the_last_patch():
    """Row of 16 positions, 6 real: patches [1, 2, 3, 10] count as [1, 2, 3]; [1, 5, 10] as [1, 5]."""
    stats = PatchLengthStats()
    stats.add([batch([[1, 2, 3, 10], [1, 5, 10, 0]], n_real=[6, 6])])
    m = stats.pop()
    assert m["patch_len_mean"] == (1 + 2 + 3 + 1 + 5) / 5
    assert m["patch_len_hist"] == [2, 1, 1, 1, 0, 0, 0, 0]


def test_byte_mode_batches_log_nothing():
    stats = PatchLengthStats()
    stats.add(
        [
            Batch(
                x=np.zeros((2, 3), dtype=np.int64),
                y=np.zeros((2, 3), dtype=np.int64),
                mask=np.ones((2, 3), dtype=bool),
            )
        ]
    )
    assert stats.pop() == {}


def test_row_padding_in_the_last_patch_is_not_counted():
    # rows of L=8 bytes + next token: row 0 has 6 real tokens + 2 padding in its last patch
    x = np.zeros((2, 8), dtype=np.int64)
    mask = np.ones((2, 8), dtype=bool)
    mask[0, 6:] = False
    pl = np.array([[1, 3, 5, 0], [1, 4, 4, 0]], dtype=np.int64)
    stats = PatchLengthStats()
    stats.add([Batch(x=x, y=x, mask=mask, patch_lengths=pl)])
    assert stats.pop()["patch_len_mean"] == (1 + 3 + 3 + 1 + 4 + 4) / 6
