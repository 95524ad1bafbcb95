"""Virtual streams: the global sequence of global batches does not depend on the dp size, and a
checkpoint's data states re-shard exactly onto another dp size (bytelatent/data/elastic.py)."""

import json
from collections import Counter

import pytest
from fsspec.implementations.local import LocalFileSystem

from bytelatent.data.args import DataArgs
from bytelatent.data.elastic import build_train_data, resume_data_state
from bytelatent.errors import ConfigError
from bytelatent.trainer.state import read_data_states

STEPS, SAVE_AT = 5, 2


def data_args(root, batch_size: int, load_async: bool = False) -> DataArgs:
    return DataArgs(
        root_dir=str(root),
        sources={"a": 1.0, "b": 1.0},
        batch_size=batch_size,
        seq_len=10,
        max_encoder_seq_length=32,
        buffer_size=3,
        load_async=load_async,
        prefetch_size=2,
        patcher_args={"patching_mode": "space"},
    )


def rows(batch) -> list[tuple]:
    """Each row as (targets, patch lengths): what one sample contributes to a step."""
    out = []
    for i in range(len(batch.x)):
        patches = () if batch.patch_lengths is None else tuple(batch.patch_lengths[i].tolist())
        out.append((tuple(batch.y[i][batch.mask[i]].tolist()), patches))
    return out


def global_step(iterators, grad_acc_steps: int) -> Counter:
    """The multiset of rows all ranks consume in one optimizer step."""
    return Counter(r for it in iterators for _ in range(grad_acc_steps) for r in rows(next(it)))


def save(folder, iterators) -> None:
    folder.mkdir(parents=True)
    for rank, it in enumerate(iterators):
        state = {"step": SAVE_AT, "data_state": it.get_state().model_dump(mode="json")}
        (folder / f"train_state_{rank:05d}.json").write_text(json.dumps(state))


def resume(folder, data, dp_size: int, grad_acc_steps: int, saved_dp_size: int):
    iterators = []
    for rank in range(dp_size):
        own = folder / f"train_state_{rank if rank < saved_dp_size else 0:05d}.json"
        saved = json.loads(own.read_text())["data_state"]
        state = resume_data_state(
            data, str(folder), saved, saved_dp_size,
            lambda: read_data_states(LocalFileSystem(), str(folder), saved_dp_size),
            rank, dp_size, grad_acc_steps,
        )  # fmt: skip
        iterators.append(build_train_data(data, rank, dp_size, grad_acc_steps, state))
    return iterators


@pytest.fixture(scope="module")
def uninterrupted(module_corpus, tmp_path_factory):
    """2 ranks x batch 2: the global rows of every step, and the data states saved at SAVE_AT."""
    tmp_path = tmp_path_factory.mktemp("uninterrupted")
    data = data_args(module_corpus, 2)
    its = [build_train_data(data, r, 2, 1, None) for r in range(2)]
    steps = []
    for step in range(1, STEPS + 1):
        steps.append(global_step(its, 1))
        if step == SAVE_AT:
            save(tmp_path / "ckpt", its)
    for it in its:
        it.close()
    return steps, tmp_path / "ckpt"


@pytest.mark.parametrize(
    ("dp_size", "batch_size", "grad_acc_steps", "load_async"),
    [(1, 2, 2, False), (1, 2, 2, True), (4, 1, 1, False), (4, 1, 1, True), (2, 1, 2, False)],
)
def test_resume_on_another_dp_size_continues_the_global_batches(
    module_corpus, uninterrupted, dp_size, batch_size, grad_acc_steps, load_async
):
    steps, folder = uninterrupted
    data = data_args(module_corpus, batch_size, load_async)
    its = resume(folder, data, dp_size, grad_acc_steps, saved_dp_size=2)
    try:
        resumed = [global_step(its, grad_acc_steps) for _ in range(SAVE_AT, STEPS)]
    finally:
        for it in its:
            it.close()
    assert resumed == steps[SAVE_AT:]
    # the split differs (a rank reads other streams) but nothing repeats or is skipped
    assert all(sum(c.values()) == 4 for c in resumed)


def test_same_size_resume_is_bitwise(corpus, tmp_path):
    data = data_args(corpus, 2)  # the prefetcher's exact state: the load_async cases above
    its = [build_train_data(data, r, 2, 1, None) for r in range(2)]
    for _ in range(3):
        [next(it) for it in its]
    states = [it.get_state().model_dump(mode="json") for it in its]
    expected = [[next(it) for _ in range(3)] for it in its]
    for it in its:
        it.close()
    for rank, state in enumerate(states):
        it = build_train_data(data, rank, 2, 1, json.loads(json.dumps(state)))
        got = [next(it) for _ in range(3)]
        it.close()
        assert all(a.equals(b) for a, b in zip(got, expected[rank]))


def test_changed_global_batch_is_refused_with_what_would_work(module_corpus, uninterrupted):
    corpus = module_corpus
    _, folder = uninterrupted
    with pytest.raises(ConfigError) as info:
        resume(folder, data_args(corpus, 2), 4, 1, saved_dp_size=2)
    message = info.value.one_line()
    assert "\n" not in message and "4 rows per step" in message and "would take 8" in message
    assert "at dp=4 set data.batch_size x grad_acc_steps = 1" in message
    with pytest.raises(ConfigError, match=r"dp sizes that can keep it: \[1, 2, 4\]"):
        resume(folder, data_args(corpus, 1), 3, 1, saved_dp_size=2)


def test_dp_size_must_divide_the_streams(corpus, tmp_path):
    data = data_args(corpus, 2).model_copy(update={"virtual_streams": 2})
    its = [build_train_data(data, r, 2, 2, None) for r in range(2)]  # global batch 8, 2 streams
    save(tmp_path / "c", its)
    with pytest.raises(ConfigError, match=r"does not divide the run's 2 virtual data streams"):
        resume(tmp_path / "c", data_args(corpus, 1), 4, 2, saved_dp_size=2)
    with pytest.raises(ConfigError, match="must divide the global batch"):
        build_train_data(data.model_copy(update={"virtual_streams": 3}), 0, 1, 1, None)


def test_old_per_rank_states_resume_at_their_own_size(corpus, tmp_path):
    data = data_args(corpus, 2)
    old = data.build_from_rank(1, 2)  # the layout of checkpoints written before virtual streams
    next(old)
    state = old.get_state().model_dump(mode="json")
    expected = next(old)

    def unused():
        raise AssertionError("an old per-rank state is never re-sharded")

    kept = resume_data_state(data, str(tmp_path), state, 2, unused, 1, 2, 1)
    assert kept == state and next(build_train_data(data, 1, 2, 1, kept)).equals(expected)
    assert resume_data_state(data, str(tmp_path), state, 2, unused, 0, 1, 2) is None
