"""Rebuild any iterator state from JSON (the `type` tag picks the class)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, TypeAdapter

from bytelatent.data.iterators.base import IteratorState
from bytelatent.data.iterators.file import FileIteratorState, LoopingIteratorState
from bytelatent.data.iterators.multiprocess import MultiprocessIteratorState
from bytelatent.data.iterators.packing import PackingIteratorState
from bytelatent.data.iterators.preprocess import PreprocessIteratorState
from bytelatent.data.iterators.sampling import SamplingIteratorState
from bytelatent.data.iterators.sequence import SequenceIteratorState
from bytelatent.data.iterators.streams import StreamsIteratorState
from bytelatent.errors import DataError

AnyState = Annotated[
    FileIteratorState
    | LoopingIteratorState
    | PreprocessIteratorState
    | SequenceIteratorState
    | SamplingIteratorState
    | StreamsIteratorState
    | PackingIteratorState
    | MultiprocessIteratorState,
    Field(discriminator="type"),
]
_ADAPTER: TypeAdapter = TypeAdapter(AnyState)


def load_state(data: str | bytes | dict[str, Any] | IteratorState) -> IteratorState:
    """A state from its JSON text, its `model_dump()` dict, or the state itself."""
    if isinstance(data, IteratorState):
        return data
    try:
        if isinstance(data, (str, bytes)):
            return _ADAPTER.validate_json(data)
        return _ADAPTER.validate_python(data)
    except ValueError as exc:
        raise DataError(f"data loader state is not valid: {exc}") from exc
