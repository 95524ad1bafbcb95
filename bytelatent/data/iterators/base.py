"""Stateful iterators: every iterator can report its position as a JSON-able pydantic state.

Contract: `it.get_state()` returns a state `s` such that `s.build()` is an iterator yielding
exactly what `it` would have yielded next. States nest (each one holds its upstream's state) and
every state class carries a `type` tag, so a whole tree rebuilds from JSON (`load_state`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Generic, TypeVar

from pydantic import BaseModel, ConfigDict

T = TypeVar("T")


class IteratorState(BaseModel):
    """Base of every iterator state: strict (unknown keys are errors) and JSON round-trippable."""

    model_config = ConfigDict(extra="forbid")

    def build(self) -> StatefulIterator:
        raise NotImplementedError


class StatefulIterator(ABC, Iterator[T], Generic[T]):
    """An iterator whose position is a state (see module docstring)."""

    def __iter__(self) -> StatefulIterator[T]:
        return self

    @abstractmethod
    def __next__(self) -> T: ...

    @abstractmethod
    def get_state(self) -> IteratorState: ...

    def close(self) -> None:
        """Release files, processes, ... (idempotent)."""

    def __enter__(self) -> StatefulIterator[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def numpy_rng_state(rng) -> dict:
    """A JSON-able copy of a numpy Generator's bit-generator state."""
    state = rng.bit_generator.state
    return {k: (dict(v) if isinstance(v, dict) else v) for k, v in state.items()}


def numpy_rng_from_state(state: dict):
    """A numpy Generator positioned at `state` (as produced by `numpy_rng_state`)."""
    import numpy as np

    bit_generator = getattr(np.random, state["bit_generator"])()
    bit_generator.state = state
    return np.random.Generator(bit_generator)
