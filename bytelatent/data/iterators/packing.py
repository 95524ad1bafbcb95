"""Pack windows (see sequence.py) into `Batch`es.

For a window w of n + 1 tokens: x[:n] = w[:-1], y[:n] = w[1:], mask[:n] = True; everything after
n is padding (pad_id in x and y, mask False), so no target is padding and every unmasked target
is a real next token.

bytes mode: x, y, mask are [B, seq_len]; patch_lengths is None.

patches mode: x, y, mask are [B, L] with L = max_length when pad_to_max_length, else the longest
window's n in this batch; patch_lengths is [B, seq_len], right-padded with 0. Invariants, asserted
for every batch:
    patch_lengths[:, 0] == 1
    patch_lengths.sum(1) == L + 1      (the next token is included, as the BLT forward expects;
                                        the padding after a row's bytes joins its last patch,
                                        whose global output the decoder never reads)
    nonzero patches come first, then zeros.
A final partial batch (finite sources) is filled with empty rows: all padding, mask False,
patch_lengths [1, L, 0, ...].
"""

from __future__ import annotations

from typing import Annotated, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from bytelatent.data.batch import Batch
from bytelatent.data.iterators.base import IteratorState, StatefulIterator
from bytelatent.data.iterators.sampling import SamplingIteratorState
from bytelatent.data.iterators.sequence import Sequence, SequenceIteratorState
from bytelatent.data.iterators.streams import StreamsIteratorState
from bytelatent.tokenizers.constants import BOE_ID, OFFSET, VOCAB_SIZE

# a boundary-head model's class for "byte b, and its patch ends": VOCAB_SIZE + b
BOUNDARY_SHIFT = VOCAB_SIZE - OFFSET

SequenceSourceState = Annotated[
    SamplingIteratorState | SequenceIteratorState | StreamsIteratorState,
    Field(discriminator="type"),
]


class PackingArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    mode: Literal["bytes", "patches"] = "bytes"
    batch_size: int = Field(..., ge=1)
    seq_len: int = Field(..., ge=1, description="bytes: row width; patches: patch_lengths columns")
    max_length: int | None = Field(
        None, ge=1, description="patches: bytes per row (max_encoder_seq_length)"
    )
    pad_to_max_length: bool = True
    pad_id: int = BOE_ID
    boundary_targets: bool = Field(
        False, description="patches: byte targets ending a patch move to class 256 + id"
    )

    @model_validator(mode="after")
    def _check(self) -> PackingArgs:
        if self.mode == "patches" and (self.max_length is None or self.seq_len < 2):
            raise ValueError("patches mode needs max_length and seq_len >= 2")
        return self


class PackingIteratorState(IteratorState):
    type: Literal["packing"] = "packing"
    args: PackingArgs
    source: SequenceSourceState

    def build(self) -> PackingIterator:
        return PackingIterator(self)


def pack_bytes(windows: list[Sequence], args: PackingArgs) -> Batch:
    width = args.seq_len
    x = np.full((args.batch_size, width), args.pad_id, dtype=np.int64)
    y = np.full((args.batch_size, width), args.pad_id, dtype=np.int64)
    mask = np.zeros((args.batch_size, width), dtype=bool)
    for row, window in enumerate(windows):
        n = len(window.tokens) - 1
        if n > width:
            raise ValueError(f"window of {n} targets does not fit seq_len={width}")
        x[row, :n] = window.tokens[:-1]
        y[row, :n] = window.tokens[1:]
        mask[row, :n] = True
    return Batch(x=x, y=y, mask=mask, loss_mask=_loss_mask(windows, mask.shape))


def _loss_mask(windows: list[Sequence], shape: tuple[int, int]) -> np.ndarray | None:
    """[B, L] bool: the targets that count (chat data: the answers); None when all real do."""
    if all(w.loss_mask is None for w in windows):
        return None
    loss_mask = np.zeros(shape, dtype=bool)
    for row, window in enumerate(windows):
        n = len(window.tokens) - 1
        loss_mask[row, :n] = True if window.loss_mask is None else window.loss_mask[1:]
    return loss_mask


def pack_patches(windows: list[Sequence], args: PackingArgs) -> Batch:
    lengths = [len(w.tokens) - 1 for w in windows]
    width = args.max_length if args.pad_to_max_length else max(lengths)
    x = np.full((args.batch_size, width), args.pad_id, dtype=np.int64)
    y = np.full((args.batch_size, width), args.pad_id, dtype=np.int64)
    mask = np.zeros((args.batch_size, width), dtype=bool)
    patch_lengths = np.zeros((args.batch_size, args.seq_len), dtype=np.int64)
    patch_lengths[:, 0] = 1
    patch_lengths[:, 1] = width  # empty rows of a partial batch
    for row, (window, n) in enumerate(zip(windows, lengths)):
        pl = window.patch_lengths
        if n > width or len(pl) > args.seq_len:
            raise ValueError(
                f"window of {n} bytes / {len(pl)} patches exceeds {width} bytes / {args.seq_len} patches"
            )
        x[row, :n] = window.tokens[:-1]
        y[row, :n] = window.tokens[1:]
        mask[row, :n] = True
        patch_lengths[row] = 0
        patch_lengths[row, : len(pl)] = pl
        patch_lengths[row, len(pl) - 1] += width - n  # padding joins the last patch
    check_patch_invariants(patch_lengths, width)
    loss_mask = _loss_mask(windows, mask.shape)
    if args.boundary_targets:
        loss_mask = mark_boundary_targets(y, mask, patch_lengths, lengths, loss_mask)
    return Batch(x=x, y=y, mask=mask, patch_lengths=patch_lengths, loss_mask=loss_mask)


def mark_boundary_targets(
    y: np.ndarray,
    mask: np.ndarray,
    patch_lengths: np.ndarray,
    lengths: list[int],
    loss_mask: np.ndarray | None,
) -> np.ndarray:
    """In place: y[r, q] += BOUNDARY_SHIFT where y[r, q] is a byte that ends its patch (window
    token q + 1 is a patch's last), the joint classes of a boundary-head model
    (`model.boundary_head`). Returns the loss mask without each row's last target: the window
    cut decides whether that byte ends a patch, not the patching rule, so it is not scored."""
    out = mask.copy() if loss_mask is None else loss_mask.copy()
    for row, n in enumerate(lengths):
        if n < 1:
            continue
        ends = np.cumsum(patch_lengths[row][patch_lengths[row] > 0]) - 1  # window indices
        q = ends[(ends >= 1) & (ends <= n)] - 1  # target positions whose byte ends a patch
        byte = (y[row, q] >= OFFSET) & (y[row, q] < OFFSET + 256)
        y[row, q[byte]] += BOUNDARY_SHIFT
        out[row, n - 1] = False
    return out


def check_patch_invariants(patch_lengths: np.ndarray, width: int) -> None:
    """Raise AssertionError unless every row starts with 1, sums to width + 1 and is zero-padded."""
    assert np.all(patch_lengths[:, 0] == 1), "patch_lengths[:, 0] must be 1"
    assert np.all(patch_lengths.sum(axis=1) == width + 1), "patch_lengths rows must sum to L + 1"
    nonzero = patch_lengths > 0
    assert np.all(nonzero[:, :-1] | ~nonzero[:, 1:]), "zeros in patch_lengths must come last"


class PackingIterator(StatefulIterator[Batch]):
    def __init__(self, state: PackingIteratorState) -> None:
        self.args = state.args
        self.source = state.source.build()
        self._pack = pack_patches if self.args.mode == "patches" else pack_bytes

    def __next__(self) -> Batch:
        windows: list[Sequence] = []
        for window in self.source:
            windows.append(window)
            if len(windows) == self.args.batch_size:
                break
        if not windows:
            raise StopIteration
        return self._pack(windows, self.args)

    def get_state(self) -> PackingIteratorState:
        return PackingIteratorState(args=self.args, source=self.source.get_state())

    def close(self) -> None:
        self.source.close()
