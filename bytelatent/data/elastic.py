"""The trainer's data hooks: build this rank's training iterator, and re-derive it at a resume.

Training data is read through `n_streams` virtual streams (`iterators/streams.py`), fixed at the
first start (`data.virtual_streams`, default: one per row of the global batch) and stored in
every data state. A resume at another data-parallel size gathers every stream's exact state from
the checkpoint's `train_state_*.json` files and hands it to its new rank, so the run continues the
same global sequence of global batches. Rules checked at a resume (each a one-line config error):

* the global batch `dp * data.batch_size * grad_acc_steps` must equal the saved one;
* the new dp size must divide `n_streams`.

States written before virtual streams (one pipeline per rank) resume at their own dp size; at
another size each rank starts a fresh pipeline (data is repeated, as before, with a warning).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from bytelatent.data.args import DataArgs
from bytelatent.data.iterators.base import StatefulIterator
from bytelatent.data.iterators.multiprocess import MultiprocessIteratorState
from bytelatent.data.iterators.packing import PackingIteratorState
from bytelatent.data.iterators.states import load_state
from bytelatent.data.iterators.streams import StreamsIteratorState, streams_of_rank
from bytelatent.errors import ConfigError, DataError

logger = logging.getLogger(__name__)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def packing_base(state: dict | str | None) -> PackingIteratorState | None:
    """The packing state inside a saved data state (unwrapping the prefetcher's); None for None."""
    if state is None:
        return None
    loaded = load_state(state)
    base = loaded.base if isinstance(loaded, MultiprocessIteratorState) else loaded
    if not isinstance(base, PackingIteratorState):
        raise DataError(f"data state: expected a packing or multiprocess state, got '{base.type}'")
    return base


def check_layout(
    n_streams: int, global_rows: int, dp_size: int, batch_size: int, grad_acc_steps: int
) -> None:
    """One-line ConfigError unless this layout reads the stored global stream."""
    now = dp_size * batch_size * grad_acc_steps
    if now != global_rows:
        per_rank, rest = divmod(global_rows, dp_size)
        if rest:
            fix = f"dp sizes that can keep it: {_divisors(global_rows)}"
        else:
            pairs = [f"{per_rank // g}x{g}" for g in _divisors(per_rank)]
            fix = (
                f"at dp={dp_size} set data.batch_size x grad_acc_steps = {per_rank} "
                f"({' or '.join(pairs)})"
            )
        raise ConfigError(
            f"global batch: the checkpoint's data stream has {global_rows} rows per step, this "
            f"run would take {now} (dp {dp_size} x data.batch_size {batch_size} x grad_acc_steps "
            f"{grad_acc_steps}); {fix}"
        )
    if n_streams % dp_size:
        raise ConfigError(
            f"data-parallel size {dp_size} does not divide the run's {n_streams} virtual data "
            f"streams (data.virtual_streams); use dp in {_divisors(n_streams)}"
        )


def fresh_streams(data: DataArgs, dp_rank: int, dp_size: int, grad_acc_steps: int):
    """This rank's part of a new run's virtual streams, as a packing state."""
    global_rows = dp_size * data.batch_size * grad_acc_steps
    n_streams = data.virtual_streams or global_rows
    if global_rows % n_streams:
        raise ConfigError(
            f"data.virtual_streams={n_streams} must divide the global batch of {global_rows} rows "
            f"(dp {dp_size} x data.batch_size {data.batch_size} x grad_acc_steps {grad_acc_steps})"
        )
    check_layout(n_streams, global_rows, dp_size, data.batch_size, grad_acc_steps)
    ids = streams_of_rank(n_streams, dp_rank, dp_size)
    files: dict[str, list[str]] = {}
    states = [data.initial_state(v, n_streams, files_cache=files) for v in ids]
    streams = StreamsIteratorState(
        n_streams=n_streams,
        rows_per_stream=global_rows // n_streams,
        stream_ids=ids,
        streams=[s.source for s in states],
    )
    return PackingIteratorState(args=states[0].args, source=streams)


def build_train_data(
    data: DataArgs, dp_rank: int, dp_size: int, grad_acc_steps: int, state: dict | None
) -> StatefulIterator:
    """The training iterator of this rank: fresh, or from the state `resume_data_state` gave."""
    base = packing_base(state)
    if base is None:
        base = fresh_streams(data, dp_rank, dp_size, grad_acc_steps)
    elif isinstance(base.source, StreamsIteratorState):
        s = base.source
        check_layout(
            s.n_streams, s.n_streams * s.rows_per_stream, dp_size, data.batch_size, grad_acc_steps
        )
        if s.stream_ids != streams_of_rank(s.n_streams, dp_rank, dp_size):
            raise DataError(
                f"data state: streams {s.stream_ids} are not those of dp rank {dp_rank}"
            )
        if data.virtual_streams not in (None, s.n_streams):
            logger.warning(
                "data.virtual_streams=%d ignored: this run's data has %d streams since its start",
                data.virtual_streams, s.n_streams,
            )  # fmt: skip
        args = base.args.model_copy(update={"batch_size": data.batch_size})
        base = PackingIteratorState(args=args, source=s)
    return data.wrap_prefetch(base)


def resume_data_state(
    data: DataArgs,
    path: str,
    state: dict | None,
    saved_dp_size: int,
    read_saved_states: Callable[[], list[dict | None]],
    dp_rank: int,
    dp_size: int,
    grad_acc_steps: int,
) -> dict | None:
    """This rank's data state after loading the checkpoint at `path` (the module docstring's rules).

    `state` is the data state of the train_state file the manager returned; `saved_dp_size` the
    dp size that wrote the checkpoint; `read_saved_states()` returns the data state of every rank
    that wrote it (called only when the streams must be re-sharded; the trainer reads the files,
    so that data/ does not depend on the checkpoint layout)."""
    base = packing_base(state)
    if base is None:
        return None
    if not isinstance(base.source, StreamsIteratorState):
        if saved_dp_size == dp_size:
            return state  # a per-rank state of an older version, at its own size
        logger.warning(
            "%s holds per-rank data states (an older version) for dp_size=%s, now %d: "
            "data loaders start afresh (data may repeat)",
            path, saved_dp_size, dp_size,
        )  # fmt: skip
        return None
    s = base.source
    check_layout(
        s.n_streams, s.n_streams * s.rows_per_stream, dp_size, data.batch_size, grad_acc_steps
    )
    if saved_dp_size == dp_size and s.stream_ids == streams_of_rank(s.n_streams, dp_rank, dp_size):
        return state
    by_stream: dict[int, Any] = {}
    for saved in read_saved_states():
        source = packing_base(saved).source
        if source.position != 0:
            raise DataError(f"{path}: a data state is not at a step boundary; cannot re-shard it")
        by_stream.update(zip(source.stream_ids, source.streams))
    ids = streams_of_rank(s.n_streams, dp_rank, dp_size)
    missing = [v for v in ids if v not in by_stream]
    if missing:
        raise DataError(f"{path}: the data states lack virtual streams {missing}")
    streams = s.model_copy(update={"stream_ids": ids, "streams": [by_stream[v] for v in ids]})
    logger.info(
        "data: dp size %d -> %d, rank %d continues virtual streams %s",
        saved_dp_size, dp_size, dp_rank, ids,
    )  # fmt: skip
    return PackingIteratorState(args=base.args, source=streams).model_dump(mode="json")
