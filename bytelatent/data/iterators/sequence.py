"""Cut one source's token stream into training sequences and shuffle them in a buffer.

A sequence is a window of n + 1 consecutive tokens of the stream (documents concatenated); the
packer turns it into x = window[:-1] and y = window[1:]. Consecutive windows overlap by exactly one
token (the last token of a window is the first of the next), so every token of the stream except
the very first is a target exactly once and no target is lost at a window boundary.

* bytes mode: windows of `seq_len + 1` tokens (`seq_len` targets).
* patches mode: a window's first patch is its first token alone (the model requires
  patch_lengths[:, 0] == 1), followed by the stream's patches (the first of them possibly the
  remainder of the patch that held the carried token) until there are `seq_len` patches or
  `max_length + 1` tokens; a patch that would overflow the token budget is cut there and the
  next window continues it. Patch lengths sum to the window length (n + 1): the BLT forward's
  "next token included" invariant.

Shuffling: `buffer_size` windows are cut, permuted with a seeded numpy Generator and yielded. The
state holds the Generator state from before the permutation, the stream position where the
buffer starts and how many of its windows were yielded: the buffer's content is part of the
state *by reference* (rebuilding cuts the same windows again from the same documents), which
keeps the state a few hundred bytes however large the buffer is, so it can travel with every
prefetched batch. Nothing in the buffer is lost on resume.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from bytelatent.data.iterators.base import (
    IteratorState,
    StatefulIterator,
    numpy_rng_from_state,
    numpy_rng_state,
)
from bytelatent.data.iterators.preprocess import (
    PreprocessIteratorState,
    TokenizedDocument,
)
from bytelatent.data.readers.base import changed_file_error


@dataclass
class Sequence:
    tokens: np.ndarray  # int64 [n + 1]
    patch_lengths: np.ndarray | None  # int64 [p], sums to n + 1, first entry 1; None in bytes mode
    loss_mask: np.ndarray | None = None  # bool [n + 1]: token i counts as a target; None: all do


def _window_loss_mask(parts: list[np.ndarray | None], sizes: list[int]) -> np.ndarray | None:
    """The loss mask of a window cut from documents: None when no document has one (text)."""
    if all(part is None for part in parts):
        return None
    return np.concatenate(
        [np.ones(n, dtype=bool) if part is None else part for part, n in zip(parts, sizes)]
    )


class SequenceArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    mode: Literal["bytes", "patches"] = "bytes"
    seq_len: int = Field(
        ...,
        ge=1,
        description="targets per window (bytes) or patches per window (patches)",
    )
    max_length: int | None = Field(
        None, ge=1, description="patches mode: at most this many input bytes"
    )
    buffer_size: int = Field(64, ge=1)

    @model_validator(mode="after")
    def _check(self) -> SequenceArgs:
        if self.mode == "patches":
            if self.max_length is None:
                raise ValueError("patches mode needs max_length (data.max_encoder_seq_length)")
            if self.seq_len < 2:
                raise ValueError(
                    "patches mode needs seq_len >= 2 (the first patch is a single carried token)"
                )
        return self


class SequenceIteratorState(IteratorState):
    type: Literal["sequence"] = "sequence"
    args: SequenceArgs
    source: PreprocessIteratorState  # positioned at the document holding the buffer's first token
    doc_offset: int = Field(0, ge=0)  # index of that token within the document
    rng_state: dict | None = None  # numpy bit-generator state before the buffer's permutation
    n_taken: int = 0  # windows of the current buffer already yielded

    def build(self) -> SequenceIterator:
        return SequenceIterator(self)


class _TokenStream:
    """The source's documents as one stream of tokens (and patches), read window by window."""

    def __init__(
        self, source_state: PreprocessIteratorState, doc_offset: int, args: SequenceArgs
    ) -> None:
        self.args = args
        self.source = source_state.build()
        # the source's state before `doc` was read: as built, so it names the fingerprints of the
        # files it opens (a buffer replays from this state)
        self.doc_state = self.source.get_state()
        self.doc: TokenizedDocument | None = None
        self.ends: np.ndarray | None = None  # cumulative patch ends of `doc`
        self.pos = doc_offset
        self.exhausted = False

    def position(self) -> tuple[PreprocessIteratorState, int]:
        return self.doc_state, self.pos

    def _load(self, first: bool) -> bool:
        """Read the next document (the current one when `first`); False at the end of the data."""
        if not first:
            self.doc_state = self.source.get_state()
        try:
            self.doc = next(self.source)
        except StopIteration:
            self.exhausted = True
            return False
        if not first:
            self.pos = 0
        elif self.pos >= len(self.doc.tokens):
            # a restored position past the document's end: the data changed under the state
            # (windows would otherwise never reach the document's end)
            raise changed_file_error(
                self.doc.path,
                f"row {self.doc.row} has {len(self.doc.tokens)} tokens, but the saved position "
                f"is token {self.pos} of it",
            )
        if self.doc.patch_lengths is not None:
            self.ends = np.cumsum(self.doc.patch_lengths)
        return True

    def _ready(self) -> bool:
        if self.doc is None and not self.exhausted:
            return self._load(first=True)
        return not self.exhausted

    def next_window(self) -> Sequence | None:
        if not self._ready():
            return None
        if self.args.mode == "bytes":
            return self._bytes_window()
        return self._patches_window()

    def _next_doc_tokens(self) -> bool:
        """Move to the next document; False (and nothing changes) at the end of the data."""
        doc_state, doc, ends, pos = self.doc_state, self.doc, self.ends, self.pos
        if self._load(first=False):
            return True
        self.doc_state, self.doc, self.ends, self.pos = doc_state, doc, ends, pos
        return False

    def _bytes_window(self) -> Sequence | None:
        need = self.args.seq_len + 1
        parts: list[np.ndarray] = []
        masks: list[np.ndarray | None] = []
        got = 0
        cursor = self.pos
        while True:
            take = max(0, min(len(self.doc.tokens) - cursor, need - got))
            parts.append(self.doc.tokens[cursor : cursor + take])
            masks.append(self._mask(cursor, take))
            got += take
            cursor += take
            if got == need or not self._next_doc_tokens():
                break
            cursor = 0
        self.pos = cursor - 1  # the window's last token starts the next window
        if got < 2:
            return None
        loss_mask = _window_loss_mask(masks, [len(p) for p in parts])
        return Sequence(tokens=np.concatenate(parts), patch_lengths=None, loss_mask=loss_mask)

    def _mask(self, cursor: int, take: int) -> np.ndarray | None:
        mask = self.doc.loss_mask
        return None if mask is None else mask[cursor : cursor + take]

    def _patches_window(self) -> Sequence | None:
        max_patches, budget = self.args.seq_len, self.args.max_length + 1
        parts = [self.doc.tokens[self.pos : self.pos + 1]]
        masks = [self._mask(self.pos, 1)]
        lengths: list[np.ndarray] = [np.ones(1, dtype=np.int64)]
        n_patches, n_tokens = 1, 1
        cursor = self.pos + 1
        while n_patches < max_patches and n_tokens < budget:
            if cursor >= len(self.doc.tokens):  # >=: bounded whatever the position
                if not self._next_doc_tokens():
                    break
                cursor = 0
            # patches of this document from `cursor` on: the first may be the tail of a patch
            first = int(np.searchsorted(self.ends, cursor, side="right"))
            cum = self.ends[first : first + max_patches - n_patches] - cursor
            room = budget - n_tokens
            fits = int(np.searchsorted(cum, room, side="right"))
            taken = int(cum[fits - 1]) if fits else 0
            sizes = self.doc.patch_lengths[first : first + fits].copy()
            if fits:
                sizes[0] = cum[0]  # the tail of the patch that holds `cursor`
            if fits < len(cum) and taken < room:
                # the next patch overflows the byte budget: cut it there
                sizes = np.append(sizes, room - taken)
                taken = room
            parts.append(self.doc.tokens[cursor : cursor + taken])
            masks.append(self._mask(cursor, taken))
            lengths.append(sizes)
            n_patches += len(sizes)
            n_tokens += taken
            cursor += taken
        self.pos = cursor - 1
        if n_tokens < 2:
            return None
        return Sequence(
            tokens=np.concatenate(parts),
            patch_lengths=np.concatenate(lengths),
            loss_mask=_window_loss_mask(masks, [len(p) for p in parts]),
        )


class SequenceIterator(StatefulIterator[Sequence]):
    def __init__(self, state: SequenceIteratorState) -> None:
        self.args = state.args
        self.stream = _TokenStream(state.source, state.doc_offset, state.args)
        self.rng = None if state.rng_state is None else numpy_rng_from_state(state.rng_state)
        self.buffer: list[Sequence] = []
        self.n_taken = 0
        self.buffer_start = self.stream.position()
        self.rng_before = state.rng_state
        if state.n_taken:
            self._fill()
            if state.n_taken > len(self.buffer):
                raise ValueError(
                    f"state says {state.n_taken} windows were taken from a buffer of {len(self.buffer)}"
                )
            self.n_taken = state.n_taken

    def _fill(self) -> None:
        self.buffer_start = self.stream.position()
        self.rng_before = None if self.rng is None else numpy_rng_state(self.rng)
        windows = []
        while len(windows) < self.args.buffer_size:
            window = self.stream.next_window()
            if window is None:
                break
            windows.append(window)
        if self.rng is not None and len(windows) > 1:
            windows = [windows[i] for i in self.rng.permutation(len(windows))]
        self.buffer = windows
        self.n_taken = 0

    def __next__(self) -> Sequence:
        if self.n_taken >= len(self.buffer):
            self._fill()
            if not self.buffer:
                raise StopIteration
        window = self.buffer[self.n_taken]
        self.n_taken += 1
        return window

    def get_state(self) -> SequenceIteratorState:
        if self.n_taken >= len(self.buffer):
            # buffer used up: the next buffer starts where the stream is now
            source, offset = self.stream.position()
            rng_state = None if self.rng is None else numpy_rng_state(self.rng)
            n_taken = 0
        else:
            (source, offset), rng_state, n_taken = (
                self.buffer_start,
                self.rng_before,
                self.n_taken,
            )
        return SequenceIteratorState(
            args=self.args,
            source=source,
            doc_offset=offset,
            rng_state=rng_state,
            n_taken=n_taken,
        )

    def close(self) -> None:
        self.stream.source.close()
