"""Chat data (data/chat.py, issue 41): the template and its loss mask, the three record shapes
through the JSONL and Parquet readers, malformed conversations (one line, or counted skips),
patches that never straddle a turn (every patching mode, offline and online), and an exact
mid-epoch resume of a chat stream."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bytelatent.data.args import DataArgs
from bytelatent.data.chat import (
    END_ID,
    ROLE_IDS,
    BadConversation,
    conversation_of,
    encode_chat_prompt,
    encode_conversation,
    is_marker,
    render_chat,
    text_tokens,
)
from bytelatent.data.iterators.multiprocess import _decode, _encode
from bytelatent.data.patch_rules import patch_lengths
from bytelatent.data.patcher_args import PatcherArgs
from bytelatent.errors import DataError
from bytelatent.tokenizers.constants import BOS_ID, EOS_ID, OFFSET

TEMPLATE = "bytelatent-chat-v1"
RECORDS = [
    {"messages": [{"role": "system", "content": "be brief"},
                  {"role": "user", "content": "reverse abc"},
                  {"role": "assistant", "content": "cba"},
                  {"role": "user", "content": "upper it"},
                  {"role": "assistant", "content": "CBA"}]},
    {"prompt": "count hello", "response": "5"},
    {"instruction": "upper", "input": "word", "output": "WORD"},
]  # fmt: skip


def write_jsonl(path: Path, rows: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def chat_args(files: list[str], **overrides) -> DataArgs:
    base = dict(dataset_files=files, chat_template=TEMPLATE, load_async=False, batch_size=2,
                seq_len=24, max_encoder_seq_length=64, buffer_size=1,
                patcher_args={"patching_mode": "space"})  # fmt: skip
    return DataArgs(**(base | overrides))


def test_template_row_and_loss_mask() -> None:
    tokens, mask = encode_conversation([("user", "ab"), ("assistant", "xy")])
    u, a = ROLE_IDS["user"], ROLE_IDS["assistant"]
    b = [c + OFFSET for c in b"abxy"]
    assert tokens.tolist() == [BOS_ID, u, b[0], b[1], END_ID, a, b[2], b[3], END_ID, EOS_ID]
    # only the answer's bytes and its end marker are targets that count
    assert mask.tolist() == [0, 0, 0, 0, 0, 0, 1, 1, 1, 0]
    # generation's prompt is the training row up to the answer; the harness's text form too
    prompt = encode_chat_prompt([("user", "ab")])
    assert prompt == tokens[:6].tolist()
    assert [BOS_ID, *text_tokens(render_chat([("user", "ab")]))] == prompt
    # markers are bytes no UTF-8 text has: text never produces them
    assert not is_marker(np.array(text_tokens("\U000f00fa is not a marker char?"[1:]))).any()


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"messages": [{"role": "bot", "content": "x"}]}, "unknown role 'bot'"),
        ({"messages": []}, "non-empty list"),
        ({"messages": [{"role": "user", "content": "x"}]}, "no answer"),
        ({"prompt": "x", "response": ""}, "no answer"),
        ({"text": "plain"}, "not a chat record"),
        ({"messages": [{"role": "user", "content": 3}]}, "must be a string"),
    ],
)
def test_malformed_conversations_name_the_problem(record, message) -> None:
    with pytest.raises(BadConversation, match=message):
        conversation_of(record)


def test_malformed_record_is_one_line_or_a_counted_skip(tmp_path) -> None:
    rows = [RECORDS[1], {"messages": [{"role": "bot", "content": "x"}]}, RECORDS[2]] * 3
    path = str(write_jsonl(tmp_path / "bad.jsonl", rows))
    with pytest.raises(DataError, match=r"bad\.jsonl.*row 1.*unknown role 'bot'.*skip_bad_records"):
        next(chat_args([path]).build_from_rank(0, 1))
    it = chat_args([path], skip_bad_records=True, seq_len=200).build_from_rank(0, 1)
    batch = next(it)
    assert batch.loss_mask is not None and batch.target_mask.sum() > 0
    assert "bot" not in bytes(int(t) - OFFSET for t in batch.x.ravel() if t >= OFFSET).decode(errors="ignore")  # fmt: skip
    assert _skipped(it.get_state().model_dump()) >= 1


def _skipped(state) -> int:
    """Σ n_skipped anywhere in a state dump."""
    if isinstance(state, dict):
        return state.get("n_skipped", 0) + sum(_skipped(v) for v in state.values())
    if isinstance(state, list):
        return sum(_skipped(v) for v in state)
    return 0


def _conversations_of(batch) -> list[bytes]:
    """The answer bytes the loss sees, row by row."""
    return [bytes(int(t) - OFFSET for t in row[m] if t >= OFFSET) for row, m in zip(batch.y, batch.target_mask)]  # fmt: skip


def test_jsonl_and_parquet_give_the_same_batches(tmp_path) -> None:
    jsonl = write_jsonl(tmp_path / "j" / "c.jsonl", RECORDS * 4)
    table = pa.Table.from_pylist([{"messages": RECORDS[0]["messages"]}] * 2 + [
        {"messages": [{"role": "user", "content": "count hello"}, {"role": "assistant", "content": "5"}]},
    ])  # fmt: skip
    pq.write_table(table, tmp_path / "c.parquet")
    got = next(chat_args([str(tmp_path / "c.parquet")]).build_from_rank(0, 1))
    assert b"cba" in b"".join(_conversations_of(got))
    batch = next(chat_args([str(jsonl)]).build_from_rank(0, 1))
    answers = b"".join(_conversations_of(batch))
    assert b"cba" in answers and b"CBA" in answers
    assert b"reverse" not in answers and b"be brief" not in answers
    assert batch.target_mask.sum() < batch.mask.sum()
    # the prefetcher's wire format keeps the loss mask
    assert _decode(_encode(batch)).equals(batch)


@pytest.mark.parametrize("mode", ["space", "static", "byte", "entropy", "bpe"])
def test_no_patch_straddles_a_turn(mode) -> None:
    tokens, _ = encode_conversation(
        [(r["role"], r["content"]) for r in RECORDS[0]["messages"]]
    )  # fmt: skip
    args = PatcherArgs(patching_mode=mode, patch_size=6, threshold=10.0)
    entropies = np.zeros((1, len(tokens)), dtype=np.float32)  # no entropy start by itself
    for include_next in (False, True):
        lengths = patch_lengths(args, tokens[None], include_next, scores=entropies)[0]
        starts = set((np.cumsum(lengths) - lengths)[lengths > 0].tolist())
        after_markers = {i + 1 for i in np.flatnonzero(is_marker(tokens)) if i + 1 < len(tokens) + include_next}  # fmt: skip
        assert after_markers <= starts, (mode, sorted(after_markers - starts))


@pytest.mark.parametrize("mode", ["space", "static", "entropy"])
def test_online_patching_agrees_with_training(mode) -> None:
    """Generation decides each position's start online; it matches the data pipeline's."""
    import torch

    from bytelatent.eval.generation.patching import OnlinePatcher

    tokens = np.array(encode_chat_prompt([("system", "hi"), ("user", "count hello")]))
    args = PatcherArgs(patching_mode=mode, patch_size=4, threshold=1.0)
    rng = np.random.default_rng(0)
    entropies = rng.uniform(0, 2, size=len(tokens)).astype(np.float32)
    online = OnlinePatcher(args)
    expected = online.prefix_starts(torch.from_numpy(tokens), torch.from_numpy(entropies))
    got, last = [0, 1], 1
    for position in range(2, len(tokens) + 1):
        if online.starts_here(torch.from_numpy(tokens), torch.from_numpy(entropies), position, last):  # fmt: skip
            got.append(position)
            last = position
    assert got == expected
    assert len(tokens) in got  # the answer starts a patch after the assistant marker...
    assert len(tokens) - 1 in got  # ...which starts its own, after the user turn's end


def test_chat_stream_resumes_mid_epoch_bitwise(tmp_path) -> None:
    path = str(write_jsonl(tmp_path / "c.jsonl", RECORDS * 20))
    args = chat_args([path], buffer_size=4, seq_len=12)
    it = args.build_from_rank(0, 1)
    for _ in range(3):
        next(it)
    state = it.get_state()
    expected = [next(it) for _ in range(4)]
    resumed = args.build_from_rank(0, 1, json.loads(json.dumps(state.model_dump())))
    for want in expected:
        got = next(resumed)
        assert got.equals(want) and np.array_equal(got.loss_mask, want.loss_mask)
