"""Virtual streams: a global sample stream that does not depend on the number of ranks.

A training run has `n_streams` virtual streams, fixed at its first start. Stream v is the
pipeline a rank v of a world of n_streams would read (its files, its shuffle and sampling RNGs),
so it is a pure function of (config, v, n_streams). Every global step takes exactly
`rows_per_stream` sequences from every stream, so

    global batch size (rows) = n_streams * rows_per_stream = dp * data.batch_size * grad_acc_steps

and the multiset of rows of global step t is the same for every dp size. Data-parallel rank r of
a world of D reads the streams v with v % D == r (D must divide n_streams), taking per step
`rows_per_stream` rounds of one sequence from each of its streams, in stream order; these fill
its `grad_acc_steps` micro-batches of `data.batch_size` rows. At a step boundary every stream's
state is exact and independent of the others, so a resume at another dp size hands each stream's
state to its new rank (`bytelatent.data.elastic`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from bytelatent.data.iterators.base import IteratorState, StatefulIterator
from bytelatent.data.iterators.sampling import SamplingIteratorState
from bytelatent.data.iterators.sequence import Sequence


class StreamsIteratorState(IteratorState):
    type: Literal["streams"] = "streams"
    n_streams: int = Field(..., ge=1)
    rows_per_stream: int = Field(..., ge=1, description="sequences per stream per global step")
    stream_ids: list[int]  # the streams this rank reads, ascending
    streams: list[SamplingIteratorState]  # their states, in stream_ids order
    position: int = Field(0, ge=0, description="sequences taken in the current global step")

    @model_validator(mode="after")
    def _check(self) -> StreamsIteratorState:
        if len(self.stream_ids) != len(self.streams) or not self.stream_ids:
            raise ValueError("stream_ids and streams must be non-empty and of equal length")
        if any(not 0 <= v < self.n_streams for v in self.stream_ids):
            raise ValueError(f"stream ids {self.stream_ids} outside [0, {self.n_streams})")
        return self

    @property
    def rows_per_step(self) -> int:
        """Sequences this rank takes per global step."""
        return self.rows_per_stream * len(self.stream_ids)

    def build(self) -> StreamsIterator:
        return StreamsIterator(self)


def streams_of_rank(n_streams: int, dp_rank: int, dp_size: int) -> list[int]:
    """The virtual streams data-parallel rank `dp_rank` of `dp_size` reads."""
    return list(range(dp_rank, n_streams, dp_size))


class StreamsIterator(StatefulIterator[Sequence]):
    def __init__(self, state: StreamsIteratorState) -> None:
        self.state = state
        self.iterators = [s.build() for s in state.streams]
        self.position = state.position

    def __next__(self) -> Sequence:
        sequence = next(self.iterators[self.position % len(self.iterators)])
        self.position = (self.position + 1) % self.state.rows_per_step
        return sequence

    def get_state(self) -> StreamsIteratorState:
        return self.state.model_copy(
            update={
                "streams": [it.get_state() for it in self.iterators],
                "position": self.position,
            }
        )

    def close(self) -> None:
        for it in self.iterators:
            it.close()
