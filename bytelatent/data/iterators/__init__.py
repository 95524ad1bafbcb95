"""Stateful data iterators (file -> looping -> preprocess -> sequence -> sampling -> packing -> prefetch)."""

from bytelatent.data.iterators.base import IteratorState, StatefulIterator
from bytelatent.data.iterators.states import AnyState, load_state

__all__ = ["AnyState", "IteratorState", "StatefulIterator", "load_state"]
