"""`patching_mode=tokenizer` (bytelatent/data/patch_rules.py): patch starts are the token starts
of a Hugging Face byte-level BPE, on a tiny BPE trained here; invalid UTF-8, chat markers and a
normalizer that changes the text take the documented fallbacks; the data loader's rows carry
those patches; config mistakes are one line; generation refuses the mode."""

from __future__ import annotations

import json

import numpy as np
import pytest
from datagen import write_jsonl

from bytelatent.data.args import DataArgs
from bytelatent.data.chat import END_ID, ROLE_IDS
from bytelatent.data.iterators.packing import check_patch_invariants
from bytelatent.data.patch_rules import patch_document, space_patch_starts, starts_from_lengths
from bytelatent.data.patcher_args import PatcherArgs
from bytelatent.errors import ConfigError
from bytelatent.tokenizers import BltTokenizer
from bytelatent.tokenizers.constants import BOS_ID, EOS_ID, OFFSET
from bytelatent.tokenizers.hf_bpe import byte_level_vocab, load_byte_level_bpe, token_boundaries

tokenizers = pytest.importorskip("tokenizers")

TEXT = (
    "def main(argv):\n    return sorted(set(argv), key=len)\n\n"
    "The patch boundaries follow the teacher's tokens: ab abc abd b ba \u00e9t\u00e9 \u2603!\n"
)


def train_bpe(normalizer=None, add_prefix_space=False, corpus=TEXT):
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<s>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([corpus] * 4, trainer=trainer)
    return tok


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bpe")
    train_bpe().save(str(folder / "tokenizer.json"))
    return folder


def row(data: bytes) -> np.ndarray:
    return np.array([BOS_ID, *(b + OFFSET for b in data), EOS_ID], dtype=np.int64)


def starts_of(lengths: np.ndarray) -> list[int]:
    return np.flatnonzero(starts_from_lengths(lengths[None], int(lengths.sum()))[0]).tolist()


def patch(path, tokens: np.ndarray) -> np.ndarray:
    lengths = patch_document(
        PatcherArgs(patching_mode="tokenizer", tokenizer_path=str(path)), tokens, None
    )
    assert lengths.sum() == len(tokens) and (lengths > 0).all()
    return lengths


def test_patch_starts_are_the_token_starts(bpe_dir):
    tok = tokenizers.Tokenizer.from_file(str(bpe_dir / "tokenizer.json"))
    enc = tok.encode(TEXT, add_special_tokens=False)
    vocab = byte_level_vocab(tok)
    data = TEXT.encode()
    assert b"".join(vocab[i] for i in enc.ids) == data
    token_starts = token_boundaries(enc.ids, vocab)
    # the tokenizer's own offsets (characters) name the character each start is in; a start may
    # fall inside a character (a byte-level BPE can split a UTF-8 sequence: the snowman)
    char_bytes = [len(TEXT[:c].encode()) for c in range(len(TEXT) + 1)]
    for start, (char, _) in zip(token_starts, enc.offsets):
        assert char_bytes[char] <= start < char_bytes[char + 1]
    lengths = patch(bpe_dir, row(data))  # the folder
    assert starts_of(lengths) == [0] + [1 + s for s in token_starts]  # BOS alone, then tokens
    assert len(lengths) < len(data) / 1.5  # merges happened: not a patch per byte
    assert lengths[-1] == len(vocab[enc.ids[-1]]) + 1  # EOS joins the last token's patch
    # the file itself works too, and a multi-byte character split by the BPE splits the patch
    same = patch(bpe_dir / "tokenizer.json", row(data))
    assert np.array_equal(same, lengths)
    assert any(start not in char_bytes for start in token_starts)


def test_invalid_bytes_markers_and_specials(bpe_dir):
    bpe = load_byte_level_bpe(str(bpe_dir))
    head, tail = b"return sorted(x) ", b" abc \xc3\xa9t\xc3\xa9"
    bad = b"\xff\xe2\x98"  # an invalid byte, then a snowman cut after 2 of its 3 bytes
    lengths = patch(bpe_dir, row(head + bad + tail))
    expected = [0, *(1 + bpe.token_starts(head))]
    at = 1 + len(head)
    expected += [at, at + 1, at + 2]  # each invalid byte a patch of its own
    expected += (at + 3 + bpe.token_starts(tail)).tolist()
    assert starts_of(lengths) == expected
    # chat markers cut the text (each side tokenized alone) and a patch starts after each one
    user, end = ROLE_IDS["user"], END_ID
    tokens = np.array([BOS_ID, user, *(b + OFFSET for b in head), end, EOS_ID], dtype=np.int64)
    starts = starts_of(patch(bpe_dir, tokens))
    assert starts == [0, 1, *(2 + bpe.token_starts(head)), 2 + len(head) + 1]
    # "<s>" written in a text is the special token's match: its own bytes, one patch
    assert bpe.token_starts(b"a <s>b").tolist() == [0, 1, 2, 5]


def test_a_normalizer_that_changes_the_text_falls_back_to_space_patching(tmp_path):
    folder = tmp_path / "lower"
    train_bpe(normalizer=tokenizers.normalizers.Lowercase()).save(str(folder.with_suffix(".json")))
    path = folder.with_suffix(".json")
    text = (
        b"Return Sorted(Set(argv))"  # lowercased by the normalizer: its tokens are not these bytes
    )
    assert load_byte_level_bpe(str(path)).token_starts(text) is None
    tokens = row(text)
    expected = space_patch_starts(tokens[None], len(tokens))[0]
    assert starts_of(patch(path, tokens)) == np.flatnonzero(expected).tolist()
    assert load_byte_level_bpe(str(path)).token_starts(b"return x") is not None  # unchanged text


def test_config_mistakes_are_one_line(tmp_path, bpe_dir):
    with pytest.raises(ValueError, match="patching_mode=tokenizer needs tokenizer_path"):
        PatcherArgs(patching_mode="tokenizer")
    with pytest.raises(ConfigError, match="no tokenizer.json there"):
        load_byte_level_bpe(str(tmp_path / "nowhere"))
    whitespace = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0}, unk_token="a"))
    whitespace.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    whitespace.save(str(tmp_path / "word.json"))
    with pytest.raises(ConfigError, match="not byte-level BPE"):
        load_byte_level_bpe(str(tmp_path / "word.json"))
    (tmp_path / "junk.json").write_text("{}")
    with pytest.raises(ConfigError, match="junk.json is not a tokenizer"):
        load_byte_level_bpe(str(tmp_path / "junk.json"))
    train_bpe(add_prefix_space=True).save(str(tmp_path / "prefix.json"))
    with pytest.raises(ConfigError, match="do not spell the text they encode"):
        load_byte_level_bpe(str(tmp_path / "prefix.json"))
    args = PatcherArgs(patching_mode="tokenizer", tokenizer_path=str(bpe_dir))
    assert not args.needs_torch  # the data-loader worker patches without torch
    with pytest.raises(ConfigError, match="cannot patch online"):
        from bytelatent.data.patch_rules import patch_lengths

        patch_lengths(args, row(b"abc")[None], include_next_token=True)


def test_data_loader_rows_carry_the_token_patches(tmp_path, bpe_dir):
    paths = [write_jsonl(tmp_path / "s" / "s.chunk.00.jsonl", "s", range(6))]
    patcher_args = {"patching_mode": "tokenizer", "tokenizer_path": str(bpe_dir)}
    args = DataArgs(
        root_dir=str(tmp_path),
        sources={"s": 1.0},
        batch_size=2,
        seq_len=40,
        max_encoder_seq_length=48,
        buffer_size=1,
        load_async=False,
        patcher_args=patcher_args,
    )
    docs = [json.loads(line)["text"] for line in paths[0].read_text().splitlines()] * 3
    tokenizer, stream_starts, stream = BltTokenizer(), set(), []
    offset = 0
    for text in docs:
        tokens = tokenizer.encode_array(text).astype(np.int64)
        stream_starts.update(offset + i for i in starts_of(patch(bpe_dir, tokens)))
        stream.append(tokens)
        offset += len(tokens)
    stream = np.concatenate(stream)
    position, iterator = 0, args.build_from_rank(0, 1)
    for _ in range(4):
        batch = next(iterator)
        check_patch_invariants(batch.patch_lengths, batch.x.shape[1])
        for x, m, pl in zip(batch.x, batch.mask, batch.patch_lengths):
            n = int(m.sum())
            assert np.array_equal(x[:n], stream[position : position + n])
            starts = np.concatenate([[0], np.cumsum(pl[pl > 0])[:-1]])
            # a window's first patch is its carried token alone: starts from 2 on are the stream's
            inside = {int(s) for s in starts if 2 <= s <= n}
            assert inside == {s - position for s in stream_starts if 2 <= s - position <= n}
            position += n


def test_a_token_patched_run_is_told_its_bpb_is_not_causal(bpe_dir):
    """train.log gets one warning line for tokenizer patching (its bpb sees the boundaries), none
    for a causal mode."""
    from bytelatent.args import TrainArgs
    from bytelatent.config import parse_args
    from bytelatent.preflight import offline_patching_warning

    base = ["config=configs/debug.yaml"]
    token = [
        *base,
        "data.patcher_args.patching_mode=tokenizer",
        f"data.patcher_args.tokenizer_path={bpe_dir}",
    ]
    line = offline_patching_warning(parse_args(TrainArgs, token))
    assert line is not None and "not a causal score" in line and "\n" not in line
    assert offline_patching_warning(parse_args(TrainArgs, base)) is None
