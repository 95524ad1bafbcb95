"""Patch-length statistics: host-side histogram and mean per log interval."""

import numpy as np

from bytelatent.data.batch import Batch
from bytelatent.trainer.patch_stats import PATCH_LEN_BINS, PatchLengthStats


def batch(patch_lengths) -> Batch:
    x = np.zeros((len(patch_lengths), 4), dtype=np.int64)
    pl = None if patch_lengths is None else np.array(patch_lengths, dtype=np.int64)
    return Batch(x=x, y=x, mask=x == 0, patch_lengths=pl)


def test_histogram_mean_and_reset():
    stats = PatchLengthStats()
    stats.add([batch([[1, 3, 4, 0], [1, 9, 70, 0]]), batch([[1, 2, 64, 65]])])
    m = stats.pop()
    assert len(m["patch_len_hist"]) == len(PATCH_LEN_BINS)
    #                          1  2  3-4 5-8 9-16 17-32 33-64 65+
    assert m["patch_len_hist"] == [3, 1, 2, 0, 1, 0, 1, 2]
    assert m["patch_len_mean"] == (1 + 3 + 4 + 1 + 9 + 70 + 1 + 2 + 64 + 65) / 10
    assert stats.pop() == {}  # reset after each log step


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
