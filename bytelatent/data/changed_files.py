"""Which file a saved data state refers to changed since it was saved (the resume's preflight).

Apart from `data/fingerprint.py` because it reads the file iterator's state, which itself
takes fingerprints when it opens a file.
"""

from __future__ import annotations

from typing import Any

from bytelatent.data.fingerprint import changed_file_error, describe_change, file_fingerprint
from bytelatent.data.iterators.file import FileIteratorState, shard_order
from bytelatent.errors import DataError


def changed_files(
    data_state: Any, storage_options: dict[str, Any] | None = None
) -> DataError | None:
    """The error for the first file a saved data state (its JSON dict) refers to that changed
    since; None when all match: what a resume would find when it opens them."""
    for node in _file_states(data_state):
        try:
            state = FileIteratorState.model_validate(node)
        except ValueError:
            continue  # the resume reports a damaged state
        order = shard_order(state.shards, state.order_seed, state.epoch)
        for cursor in [state.cursor(), *state.others]:
            if cursor.fingerprint is None or cursor.shard_index >= len(order):
                continue
            path = state.shards[order[cursor.shard_index]].path
            try:
                now = file_fingerprint(path, storage_options or state.storage_options)
            except DataError:
                continue  # missing or unreadable: the resume says so where it reads it
            if now != cursor.fingerprint:
                return changed_file_error(path, describe_change(cursor.fingerprint, now))
    return None


def _file_states(node: Any):
    """Every `"type": "file"` dict nested in a state's JSON."""
    if isinstance(node, dict):
        if node.get("type") == "file":
            yield node
            return
        for value in node.values():
            yield from _file_states(value)
    elif isinstance(node, list):
        for value in node:
            yield from _file_states(value)
