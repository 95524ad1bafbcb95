"""Rebuild any iterator state from JSON (the `type` tag picks the class)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, TypeAdapter, ValidationError

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
    except ValidationError as exc:  # one line: where in the state, and what is wrong
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "(top level)"
        more = f" (+{exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        raise DataError(
            f"data loader state is not valid: {where}: {err['msg'].removeprefix('Value error, ')}"
            f"{more}; the checkpoint's data state is damaged or from another version"
        ) from None
    except ValueError as exc:
        raise DataError(f"data loader state is not valid: {exc}") from exc
