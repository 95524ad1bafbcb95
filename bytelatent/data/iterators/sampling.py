"""Mix several sources: each sequence comes from a source drawn with probability ∝ its weight."""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import Field, model_validator

from bytelatent.data.iterators.base import (
    IteratorState,
    StatefulIterator,
    numpy_rng_from_state,
    numpy_rng_state,
)
from bytelatent.data.iterators.sequence import Sequence, SequenceIteratorState


class SamplingIteratorState(IteratorState):
    type: Literal["sampling"] = "sampling"
    rng_state: dict
    weights: dict[str, float]
    sources: dict[str, SequenceIteratorState]
    exhausted: list[str] = Field(default_factory=list)  # finite sources that ran out

    @model_validator(mode="after")
    def _check(self) -> SamplingIteratorState:
        if set(self.weights) != set(self.sources):
            raise ValueError(
                f"weights {sorted(self.weights)} and sources {sorted(self.sources)} differ"
            )
        if any(w < 0 for w in self.weights.values()) or not any(
            w > 0 for w in self.weights.values()
        ):
            raise ValueError(
                f"source weights must be >= 0 with at least one > 0, got {self.weights}"
            )
        return self

    def build(self) -> SamplingIterator:
        return SamplingIterator(self)


class SamplingIterator(StatefulIterator[Sequence]):
    def __init__(self, state: SamplingIteratorState) -> None:
        self.names = sorted(state.sources)  # a fixed order makes the draws reproducible
        self.weights = dict(state.weights)
        self.iterators = {name: state.sources[name].build() for name in self.names}
        self.exhausted = list(state.exhausted)
        self.rng = numpy_rng_from_state(state.rng_state)
        self._probabilities()

    def _probabilities(self) -> None:
        live = np.array([0.0 if n in self.exhausted else self.weights[n] for n in self.names])
        self.p = live / live.sum() if live.sum() > 0 else None

    def __next__(self) -> Sequence:
        while self.p is not None:
            name = self.names[int(self.rng.choice(len(self.names), p=self.p))]
            try:
                return next(self.iterators[name])
            except StopIteration:
                self.exhausted.append(name)
                self._probabilities()
        raise StopIteration

    def get_state(self) -> SamplingIteratorState:
        return SamplingIteratorState(
            rng_state=numpy_rng_state(self.rng),
            weights=self.weights,
            sources={name: it.get_state() for name, it in self.iterators.items()},
            exhausted=list(self.exhausted),
        )

    def close(self) -> None:
        for it in self.iterators.values():
            it.close()
