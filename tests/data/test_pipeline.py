"""The full chain built by DataArgs: exact resume, packing invariants, sharding, errors."""

import json
from pathlib import Path

import numpy as np
import pytest
from datagen import batches_equal, write_arrow, write_jsonl

from bytelatent.data.args import DataArgs
from bytelatent.data.iterators.file import FileIteratorState, FileShard
from bytelatent.data.iterators.packing import (
    PackingArgs,
    PackingIteratorState,
    check_patch_invariants,
)
from bytelatent.data.iterators.preprocess import PreprocessIteratorState
from bytelatent.data.iterators.sequence import SequenceArgs, SequenceIteratorState
from bytelatent.data.iterators.states import load_state
from bytelatent.data.patcher import Patcher, PatcherArgs
from bytelatent.errors import ConfigError, DataError
from bytelatent.tokenizers import BltTokenizer

SPACE = {"patching_mode": "space"}


def make_args(root, **overrides) -> DataArgs:
    base = {
        "root_dir": str(root),
        "sources": {"a": 1.0, "b": 2.0},
        "batch_size": 3,
        "seq_len": 48,
        "max_encoder_seq_length": 40,
        "buffer_size": 4,
        "load_async": False,
        "patcher_args": {"patching_mode": "byte"},
    }
    return DataArgs(**(base | overrides))


def take(it, n):
    return [next(it) for _ in range(n)]


def epochs_of(state) -> dict:
    return {name: s.source.source.epoch for name, s in state.source.sources.items()}


@pytest.mark.parametrize("mode", ["byte", "space", "static"])
def test_resume_anywhere_is_exact(corpus, mode):
    patcher_args = {"patching_mode": mode, "patch_size": 3}
    args = make_args(corpus, seq_len=48 if mode == "byte" else 16, patcher_args=patcher_args)
    n = 18
    straight = take(args.build_from_rank(0, 1), n)
    for k in (0, 1, 6, 11, 17):
        it = args.build_from_rank(0, 1)
        head = take(it, k)
        saved = it.get_state().model_dump_json()
        resumed = args.build_from_rank(0, 1, state=json.loads(saved))
        assert batches_equal(head + take(resumed, n - k), straight), k
    final = args.build_from_rank(0, 1)
    take(final, n)
    assert max(epochs_of(final.get_state()).values()) >= 1  # the run crossed an epoch boundary


def test_state_rebuild_via_state_build_and_dict(corpus):
    args = make_args(corpus, patcher_args=SPACE, seq_len=6)
    it = args.build_from_rank(0, 1)
    take(it, 3)
    state = it.get_state()
    a = take(state.build(), 4)
    b = take(load_state(state.model_dump()).build(), 4)
    c = take(load_state(state.model_dump_json()).build(), 4)
    assert batches_equal(a, b) and batches_equal(a, c) and batches_equal(a, take(it, 4))


def stream_of(paths, tokenizer, repeats=3):
    docs = []
    for path in paths:
        docs += [json.loads(line)["text"] for line in Path(path).read_text().splitlines()]
    return np.concatenate([tokenizer.encode_array(t) for t in docs * repeats])


def test_byte_windows_cover_every_target_once(tmp_path):
    paths = [write_jsonl(tmp_path / "s" / "s.chunk.00.jsonl", "s", range(9))]
    args = make_args(tmp_path, sources={"s": 1.0}, buffer_size=1, seq_len=37)
    stream = stream_of(paths, BltTokenizer(), repeats=6)
    targets, previous_last = [], None
    for batch in take(args.build_from_rank(0, 1), 10):
        assert batch.patch_lengths is None and batch.x.shape == (3, 37)
        for x, y, m in zip(batch.x, batch.y, batch.mask):
            assert m.all()  # looping data: every row full
            assert np.array_equal(x[1:], y[:-1])
            if previous_last is not None:
                assert x[0] == previous_last  # windows overlap by one token
            previous_last = y[-1]
            targets.append(y[m])
    targets = np.concatenate(targets)
    assert np.array_equal(targets, stream[1 : 1 + len(targets)])


@pytest.mark.parametrize("mode,pad", [("space", True), ("space", False), ("static", True)])
def test_patch_windows_follow_stream_patches(tmp_path, mode, pad):
    paths = [write_jsonl(tmp_path / "s" / "s.chunk.00.jsonl", "s", range(9))]
    patcher_args = {"patching_mode": mode, "patch_size": 3}
    args = make_args(
        tmp_path,
        sources={"s": 1.0},
        buffer_size=1,
        seq_len=7,
        max_encoder_seq_length=24,
        pad_to_max_length=pad,
        patcher_args=patcher_args,
    )
    tokenizer, patcher = BltTokenizer(), Patcher(PatcherArgs(**patcher_args))
    docs = [json.loads(line)["text"] for line in Path(paths[0]).read_text().splitlines()] * 3
    stream_starts, stream, offset = set(), [], 0
    import torch

    for text in docs:
        tokens = tokenizer.encode_array(text)
        lengths, _ = patcher.patch(torch.from_numpy(tokens)[None], include_next_token=False)
        stream_starts.update(
            (offset + np.concatenate([[0], np.cumsum(lengths[0].numpy())[:-1]])).tolist()
        )
        stream.append(tokens)
        offset += len(tokens)
    stream = np.concatenate(stream)
    position, targets = 0, []
    for batch in take(args.build_from_rank(0, 1), 8):
        width = batch.x.shape[1]
        assert width == 24 if pad else width <= 24
        assert batch.patch_lengths.shape == (3, 7)
        check_patch_invariants(batch.patch_lengths, width)
        for x, y, m, pl in zip(batch.x, batch.y, batch.mask, batch.patch_lengths):
            n = int(m.sum())
            assert m[:n].all() and not m[n:].any() and (x[n:] == 0).all() and (y[n:] == 0).all()
            assert np.array_equal(x[:n], stream[position : position + n])
            assert np.array_equal(y[:n], stream[position + 1 : position + n + 1])
            starts = np.concatenate([[0], np.cumsum(pl[pl > 0])[:-1]])
            inside = {int(s) for s in starts if 2 <= s <= n}
            expected = {s - position for s in stream_starts if 2 <= s - position <= n}
            assert inside == expected
            assert n == 24 or (pl > 0).sum() == 7  # a window ends on the byte or the patch budget
            targets.append(y[:n])
            position += n  # the last target starts the next window
    assert np.array_equal(np.concatenate(targets), stream[1 : 1 + position])


def finite_packing_state(paths, mode, batch_size, seq_len, max_length=None):
    file_state = FileIteratorState(shards=[FileShard(path=str(p), format="json") for p in paths])
    patcher = PatcherArgs(patching_mode="space") if mode == "patches" else None
    preprocess = PreprocessIteratorState(source=file_state, patcher_args=patcher)
    sequence = SequenceIteratorState(
        args=SequenceArgs(mode=mode, seq_len=seq_len, max_length=max_length, buffer_size=1),
        source=preprocess,
    )
    packing_args = PackingArgs(
        mode=mode, batch_size=batch_size, seq_len=seq_len, max_length=max_length
    )
    return PackingIteratorState(args=packing_args, source=sequence)


@pytest.mark.parametrize("mode", ["bytes", "patches"])
def test_partial_last_batch_and_end(tmp_path, mode):
    path = write_jsonl(tmp_path / "f.jsonl", "s", range(3))
    n_windows = len(list(finite_packing_state([path], mode, 1, seq_len=6, max_length=30).build()))
    assert n_windows >= 3
    state = finite_packing_state([path], mode, n_windows - 1, seq_len=6, max_length=30)
    batches = list(state.build())
    assert len(batches) == 2
    total_tokens = len(stream_of([path], BltTokenizer(), repeats=1))
    assert sum(int(b.mask.sum()) for b in batches) == total_tokens - 1  # every target once
    last = batches[-1]
    empty = ~last.mask.any(axis=1)
    assert empty.any()  # padded rows in the final batch
    if mode == "patches":
        check_patch_invariants(last.patch_lengths, last.x.shape[1])
        assert (last.patch_lengths[empty, 1] == last.x.shape[1]).all()
    resumed = load_state(state.model_dump_json()).build()
    assert batches_equal(list(resumed), batches)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_ranks_read_disjoint_documents_covering_the_data(corpus, world):
    args = make_args(corpus)
    seen = []
    for rank in range(world):
        state = args.initial_state(rank, world)
        for source in state.source.sources.values():
            file_state = source.source.source.file_state
            seen += [d.sample_id for d in file_state.build()]
    assert len(seen) == len(set(seen))  # no document on two ranks
    assert sorted(seen) == sorted([f"a-{i}" for i in range(21)] + [f"b-{i}" for i in range(18)])


def test_ranks_get_different_batches(corpus):
    args = make_args(corpus)
    a, b = take(args.build_from_rank(0, 2), 2), take(args.build_from_rank(1, 2), 2)
    assert not batches_equal(a, b)
    with pytest.raises(ConfigError, match="dp_rank 2"):
        args.build_from_rank(2, 2)


def test_source_weights_are_followed(corpus):
    args = make_args(corpus, sources={"a": 1.0, "b": 0.0}, batch_size=4, seq_len=16, buffer_size=1)
    for batch in take(args.build_from_rank(0, 1), 5):
        text = BltTokenizer().decode(batch.x.reshape(-1).tolist())
        assert "<b:" not in text


def test_entropy_mode_uses_stored_entropies(tmp_path):
    write_arrow(tmp_path / "e" / "e.shard_0.arrow", "e", range(12), batch_rows=5)
    args = make_args(
        tmp_path,
        sources={"e": 1.0},
        seq_len=10,
        patcher_args={"patching_mode": "entropy", "threshold": 1.5},
    )
    batches = take(args.build_from_rank(0, 1), 4)
    for batch in batches:
        check_patch_invariants(batch.patch_lengths, 40)
    it = args.build_from_rank(0, 1)
    take(it, 2)
    assert batches_equal(take(load_state(it.get_state().model_dump_json()).build(), 2), batches[2:])


def test_entropy_mode_without_entropies_is_a_clear_error(corpus):
    args = make_args(
        corpus, sources={"a": 1.0}, seq_len=8, patcher_args={"patching_mode": "entropy"}
    )
    with pytest.raises(
        DataError,
        match=r"a\.chunk\.0\d\.jsonl: row 0: no 'entropies'.*patching_mode=space",  # seeded order
    ):
        next(args.build_from_rank(0, 1))


def test_empty_document_error_and_skip(tmp_path):
    lines = ['{"text": "hello there"}', '{"text": ""}', '{"text": "more text here"}']
    path = tmp_path / "s" / "s.chunk.00.jsonl"
    path.parent.mkdir()
    path.write_text("\n".join(lines) + "\n")
    args = make_args(tmp_path, sources={"s": 1.0}, seq_len=16, buffer_size=1)
    with pytest.raises(DataError, match=r"s\.chunk\.00\.jsonl: row 1: empty text"):
        take(args.build_from_rank(0, 1), 3)
    skipping = args.model_copy(update={"skip_bad_records": True}).build_from_rank(0, 1)
    take(skipping, 3)
    assert skipping.get_state().source.sources["s"].source.n_skipped >= 1


def test_source_discovery(tmp_path, corpus):
    args = make_args(corpus)
    assert [p.rsplit("/", 1)[1] for p in args.files_of("a")] == [
        f"a.chunk.0{i}.jsonl" for i in range(3)
    ]
    assert [p.rsplit("/", 1)[1] for p in args.files_of("b")] == [
        "b.shard_0.arrow",
        "b.shard_1.arrow",
    ]
    glob_args = make_args(corpus, sources={"b/*.arrow": 1.0})
    assert len(glob_args.files_of("b/*.arrow")) == 2
    with pytest.raises(DataError, match=r"data source 'nope': .*nope does not exist"):
        make_args(corpus, sources={"nope": 1.0}).build_from_rank(0, 1)
    # preprocessed layout: only shards with a .complete marker
    pre = tmp_path / "pre" / "b" / "transformer_100m"
    for shard in range(12):
        write_arrow(pre / f"b.chunk.00.jsonl.shard_{shard}.arrow", "b", range(2))
        if shard != 5:
            (pre / f"b.chunk.00.jsonl.shard_{shard}.arrow.complete").touch()
    pre_args = make_args(corpus, preprocess_dir=str(tmp_path / "pre"), sources={"b": 1.0})
    names = [p.rsplit("/", 1)[1] for p in pre_args.files_of("b")]
    assert names == [
        f"b.chunk.00.jsonl.shard_{s}.arrow" for s in range(12) if s != 5
    ]  # natural order
    with pytest.raises(DataError, match="preprocessed directory .* does not exist"):
        make_args(corpus, preprocess_dir=str(tmp_path / "nowhere"), sources={"b": 1.0}).files_of(
            "b"
        )
    files_args = DataArgs(dataset_files=[str(corpus / "a" / "a.val.jsonl")], load_async=False)
    assert files_args.files_of("dataset_files") == [str(corpus / "a" / "a.val.jsonl")]


def test_data_args_validation():
    with pytest.raises(ValueError, match="weights must be >= 0"):
        DataArgs(sources={"a": -1.0})
    with pytest.raises(ValueError, match="at least one weight"):
        DataArgs(sources={"a": 0.0})
    with pytest.raises(ValueError, match="enable_byte_ngrams"):
        DataArgs(enable_byte_ngrams=True)
    with pytest.raises(ValueError, match="either sources"):
        DataArgs(sources={"a": 1.0}, dataset_files=["x.jsonl"])
    with pytest.raises(ValueError, match="extra"):
        DataArgs(root_dirr="x")
    with pytest.raises(ConfigError, match="no data configured"):
        DataArgs().build_from_rank(0, 1)
    assert DataArgs(patcher_args={"patching_mode": "byte"}).packing_mode == "bytes"
    assert DataArgs(add_patches=False, patcher_args=SPACE).packing_mode == "bytes"
    assert DataArgs(patcher_args=SPACE).packing_mode == "patches"
    assert DataArgs(s3_profile="p", storage_options={"anon": False}).fsspec_options() == {
        "anon": False,
        "profile": "p",
    }


@pytest.mark.parametrize("world", [1, 2])
def test_validation_pass_is_finite_and_counts_every_target(corpus, world):
    args = make_args(corpus, patcher_args=SPACE, seq_len=8)
    tokenizer = BltTokenizer()
    total = 0
    for rank in range(world):
        batches = list(args.build_validation("a/a.val.jsonl", rank, world, batch_size=2))
        for batch in batches:
            check_patch_invariants(batch.patch_lengths, batch.x.shape[1])
        total += sum(int(b.mask.sum()) for b in batches)
    texts = [
        json.loads(line)["text"] for line in (corpus / "a" / "a.val.jsonl").read_text().splitlines()
    ]
    n_tokens = sum(len(tokenizer.encode(t)) for t in texts)
    ranks_with_data = min(world, len(texts))
    assert total == n_tokens - ranks_with_data  # each rank's stream loses only its first token


def sub_states(state):
    """Every level of one source's chain, outermost first."""
    sampling = state.source
    sequence = sampling.sources["b"]
    preprocess = sequence.source
    looping = preprocess.source
    return {
        "packing": state,
        "sampling": sampling,
        "sequence": sequence,
        "preprocess": preprocess,
        "looping": looping,
        "file": looping.file_state,
    }


def comparable(item):
    if hasattr(item, "x"):
        return (
            "batch",
            item.x.tobytes(),
            item.y.tobytes(),
            item.mask.tobytes(),
            item.patch_lengths.tobytes(),
        )
    if hasattr(item, "sample_id"):
        return ("doc", item.sample_id, item.text)
    return (
        "tokens",
        item.tokens.tobytes(),
        None if item.patch_lengths is None else item.patch_lengths.tobytes(),
    )


@pytest.mark.parametrize(
    "level", ["packing", "sampling", "sequence", "preprocess", "looping", "file"]
)
def test_every_level_resumes_at_every_position(corpus, level):
    args = make_args(corpus, patcher_args=SPACE, seq_len=6, batch_size=2, buffer_size=3)
    state = sub_states(args.initial_state(0, 1))[level]
    n = 15
    straight = [comparable(x) for _, x in zip(range(n), state.build())]
    assert len(straight) == n or level == "file"
    for k in range(len(straight)):
        it = state.build()
        head = [comparable(next(it)) for _ in range(k)]
        rebuilt = load_state(it.get_state().model_dump_json()).build()
        tail = [comparable(x) for _, x in zip(range(len(straight) - k), rebuilt)]
        assert head + tail == straight, (level, k)
