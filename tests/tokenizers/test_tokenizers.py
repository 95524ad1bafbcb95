import base64
import json
import sys

import numpy as np
import pytest

from bytelatent.errors import ConfigError
from bytelatent.tokenizers import BltTokenizer, TokenizerArgs
from bytelatent.tokenizers.constants import BOS_ID, BPE_ID, EOS_ID, OFFSET
from tests.paths import CONFORMANCE

TEXTS = [
    "",
    "a",
    "hello world",
    "Ünïcödé — ☃ 日本語 🙂",
    "tabs\tand\nnewlines\r\n",
    "\x00\x7f",
]


@pytest.mark.conformance("cases.json")
def test_blt_tokenizer_matches_reference_cases():
    tokenizer = TokenizerArgs(name="blt").build()
    cases = json.loads((CONFORMANCE / "cases.json").read_text())
    assert cases
    for case in cases:
        assert tokenizer.encode(case["text"]) == case["token_ids"]
        assert tokenizer.encode_array(case["text"]).tolist() == case["token_ids"]
        assert tokenizer.decode(case["token_ids"]) == case["text"]


def test_reference_fixture_prefix():
    ids = BltTokenizer().encode("Let's check if these tokenizers match!")
    assert ids[:7] == [1, 80, 105, 120, 43, 119, 36]
    assert ids[-2:] == [37, 2]


@pytest.mark.parametrize("text", TEXTS)
def test_blt_round_trip_and_layout(text):
    tok = BltTokenizer()
    ids = tok.encode(text)
    assert ids[0] == BOS_ID and ids[-1] == EOS_ID
    assert ids[1:-1] == [b + OFFSET for b in text.encode("utf-8")]
    assert tok.decode(ids) == text
    assert tok.encode_array(text).dtype == np.int64
    assert tok.encode_array(text).tolist() == ids


def test_blt_bos_eos_switches_and_cut_at_eos():
    assert BltTokenizer(add_bos=False, add_eos=False).encode("ab") == [101, 102]
    assert BltTokenizer(add_bos=False).encode_array("ab").tolist() == [101, 102, EOS_ID]
    assert BltTokenizer().encode("ab", add_bos=False) == [101, 102, EOS_ID]
    tok = BltTokenizer()
    assert tok.decode(tok.encode("ab") + tok.encode("cd"), cut_at_eos=True) == "ab"
    assert tok.get_vocab_size() == 260


def test_blt_invalid_unicode_ignored_or_strict():
    tok = BltTokenizer()
    assert tok.encode("a\ud800b") == tok.encode("ab")  # reference behaviour: dropped
    with pytest.raises(UnicodeEncodeError):
        tok.encode_array("a\ud800b", strict=True)


def test_blt_n_bytes_counts_unmasked_targets():
    tok = BltTokenizer()
    y = np.array([[1, 104, 105, 2, 0], [4, 5, 0, 0, 0]])
    mask = y != 0
    assert tok.n_bytes(y, mask) == 6
    assert tok.n_bytes(y) == 6


def test_tokenizer_args_names_and_errors():
    assert isinstance(TokenizerArgs(name="bytes").build(), BltTokenizer)
    with pytest.raises(ValueError):
        TokenizerArgs(name="mystery")
    with pytest.raises(ValueError):
        TokenizerArgs(name="blt", unknown=1)
    with pytest.raises(ConfigError, match="init_kwargs"):
        TokenizerArgs(name="blt", init_kwargs={"nope": 1}).build()
    with pytest.raises(ConfigError, match="bpe_tokenizer_path"):
        TokenizerArgs(name="blt", init_kwargs={"bpe_delim": True}).build()
    args = TokenizerArgs(name="blt", init_kwargs={"add_eos": False})
    assert TokenizerArgs.model_validate_json(args.model_dump_json()) == args


def test_missing_sentencepiece_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "sentencepiece", None)
    with pytest.raises(ConfigError, match="pip install sentencepiece"):
        TokenizerArgs(name="sp", init_kwargs={"model_path": str(tmp_path / "x.model")}).build()


def test_missing_tiktoken_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "tiktoken", None)
    with pytest.raises(ConfigError, match="pip install tiktoken"):
        TokenizerArgs(name="tiktoken", init_kwargs={"model_path": str(tmp_path / "x")}).build()


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    spm = pytest.importorskip("sentencepiece")
    directory = tmp_path_factory.mktemp("sp")
    corpus = directory / "corpus.txt"
    words = [
        "hello world",
        "the quick brown fox",
        "jumps over the lazy dog",
        "byte latent transformer",
    ]
    corpus.write_text("\n".join(words * 50) + "\n")
    spm.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(directory / "m"),
        vocab_size=320,
        model_type="bpe",
        byte_fallback=True,
        minloglevel=2,
    )
    return str(directory / "m.model")


def test_sentencepiece_round_trip_and_n_bytes(sp_model):
    tok = TokenizerArgs(name="sp", init_kwargs={"model_path": sp_model}).build()
    text = "hello lazy fox ☃"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert tok.decode(ids) == text
    assert tok.n_bytes(np.array(ids)) == len(text.encode()) + 2
    mask = np.ones(len(ids), dtype=bool)
    mask[-1] = False  # EOS not a target
    assert tok.n_bytes(np.array(ids), mask) == len(text.encode()) + 1


def test_blt_bpe_delimiters(sp_model):
    tok = BltTokenizer(bpe_delim=True, bpe_tokenizer_path=sp_model)
    text = "hello world fox"
    ids = tok.encode(text)
    assert ids[0] == BOS_ID and ids[1] == BPE_ID and ids[-1] == EOS_ID
    assert ids.count(BPE_ID) >= 3  # at least one piece per word
    without = [i for i in ids if i != BPE_ID]
    assert without == BltTokenizer().encode(text)
    assert tok.encode_array(text).tolist() == ids
    assert tok.decode(ids) == text


@pytest.fixture(scope="module")
def tiktoken_file(tmp_path_factory):
    pytest.importorskip("tiktoken")
    ranks = [bytes([b]) for b in range(256)] + [
        b"he",
        b"ll",
        b"hell",
        b"hello",
        b" w",
        b" wo",
    ]
    path = tmp_path_factory.mktemp("tt") / "tiny.tiktoken"
    path.write_text("".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(ranks)))
    return str(path), len(ranks)


def test_tiktoken_round_trip_and_specials(tiktoken_file):
    path, n = tiktoken_file
    tok = TokenizerArgs(name="tiktoken", init_kwargs={"model_path": path}).build()
    assert tok.get_vocab_size() == n + 256
    text = "hello world ☃"
    ids = tok.encode(text)
    assert ids[0] == n and ids[-1] == n + 1
    assert tok.decode(ids) == text
    assert len(ids) < len(text.encode()) + 2  # merges applied
    assert tok.n_bytes(np.array(ids)) == len(text.encode()) + 2
