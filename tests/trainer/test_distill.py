"""Byte-level distillation targets (bytelatent/trainer/distill.py): the product of a token's byte
probabilities (closed by the END class) is the teacher's token probability, on a hand-made
vocabulary with nested prefixes and on a BPE tokenizer + tiny random Llama teacher; the
boundary targets are the tokenizer's own offsets."""

from __future__ import annotations

import pytest
import torch

from bytelatent.tokenizers.hf_bpe import byte_level_vocab, token_boundaries
from bytelatent.trainer.distill import (
    END,
    N_CLASSES,
    TokenByteTrie,
    boundary_mask,
    token_end_probs,
)
from tests.extras import lazy_extra

TEXT = (
    "def main(argv):\n    return sorted(set(argv), key=len)\n\n"
    "The patch boundaries follow the teacher's tokens: ab abc abd b ba \u00e9t\u00e9 \u2603!\n"
)


def byte_product(rows: torch.Tensor, data: bytes) -> torch.Tensor:
    return torch.stack([rows[k, b] for k, b in enumerate(data)]).prod()


def test_product_of_byte_probabilities_is_the_token_probability():
    # nested prefixes (a < ab < abc), a special token (b""), a multi-byte UTF-8 token
    vocab = [b"", b"a", b"ab", b"abc", b"abd", b"b", b"ba", b"c", "\u00e9".encode(), b"\xff"]
    trie = TokenByteTrie(vocab)
    torch.manual_seed(0)
    probs = torch.softmax(torch.randn(len(vocab), len(vocab), dtype=torch.float64), -1)
    probs[:, 0] = 0.0  # the special token stands for no bytes: no probability here
    probs = probs / probs.sum(-1, keepdim=True)
    for token in range(1, len(vocab)):
        data = vocab[token]
        dist = probs[token]  # any distribution; one per token for variety
        rows = trie.token_targets(dist[None], [token])
        assert rows.shape == (len(data), N_CLASSES)
        torch.testing.assert_close(rows.sum(-1), torch.ones(len(data), dtype=torch.float64))
        assert rows[0, END] == 0  # a token has at least one byte
        end = token_end_probs(trie, dist[None], [token])[0]
        got = byte_product(rows, data) * end
        assert abs(got.item() - dist[token].item()) < 1e-12, (data, got, dist[token])
        # without END the product is the mass of every token starting with `data`
        mass = sum(dist[i] for i, t in enumerate(vocab) if t and t.startswith(data))
        assert abs(byte_product(rows, data).item() - mass.item()) < 1e-12
    # "a" is a prefix of "ab": its bytes alone over-count it, END fixes that
    rows = trie.token_targets(probs[1][None], [1])
    assert byte_product(rows, b"a") > probs[1, 1] + 1e-3


def test_unknown_prefix_is_refused():
    trie = TokenByteTrie([b"a", b"ab"])
    with pytest.raises(ValueError, match="starts with b'x'"):
        trie.next_byte_target(torch.tensor([0.5, 0.5]), b"x")


@pytest.fixture(scope="module")
def bpe():
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<s>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([TEXT] * 4, trainer=trainer)
    return tok


def test_boundaries_are_the_tokenizer_offsets(bpe):
    enc = bpe.encode(TEXT)
    vocab = byte_level_vocab(bpe)
    assert b"".join(vocab[i] for i in enc.ids) == TEXT.encode()
    # the tokenizer's offsets count characters of TEXT: each token starts in the character the
    # tokenizer names, at its first byte unless the token starts inside a UTF-8 sequence (☃)
    starts = token_boundaries(enc.ids, vocab)
    char_bytes = [len(TEXT[:c].encode()) for c in range(len(TEXT) + 1)]
    inside = 0
    for start, (char, _) in zip(starts, enc.offsets):
        if start in char_bytes:
            assert start == char_bytes[char]
        else:
            assert char_bytes[char] < start < char_bytes[char + 1]
            inside += 1
    assert inside == 1  # b"\x83!": the snowman's last byte, split from its first two
    assert len(set(starts)) < len(TEXT.encode()) / 1.5  # merges happened: not one per byte
    mask = boundary_mask(enc.ids, vocab)
    assert mask.nonzero().flatten().tolist() == starts


def test_tiny_teacher_token_probabilities_from_bytes(bpe):
    transformers = lazy_extra("transformers", reason="pip install 'bytelatent[hf]'")
    vocab = byte_level_vocab(bpe)
    config = transformers.LlamaConfig(
        vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
        initializer_range=0.5,
    )  # fmt: skip
    torch.manual_seed(0)
    teacher = transformers.LlamaForCausalLM(config).eval()
    ids = [bpe.token_to_id("<s>")] + bpe.encode(TEXT).ids
    with torch.no_grad():
        logits = teacher(torch.tensor([ids])).logits[0, :-1].double()
    probs = torch.softmax(logits, -1)  # probs[i]: the teacher's distribution for ids[i + 1]
    targets = ids[1:]
    trie = TokenByteTrie(vocab)
    rows = trie.token_targets(probs, targets)
    assert rows.shape == (len(TEXT.encode()), N_CLASSES)
    ends = token_end_probs(trie, probs, targets)
    special = probs[:, bpe.token_to_id("<s>")]  # no bytes: byte targets renormalise without it
    offset = 0
    for i, token in enumerate(targets):
        data = vocab[token]
        got = byte_product(rows[offset : offset + len(data)], data) * ends[i]
        want = probs[i, token] / (1 - special[i])
        assert abs(got.item() - want.item()) < 1e-5 * want.item(), (i, data)
        offset += len(data)
    assert (probs.max(-1).values < 0.99).all()  # a random teacher, not a degenerate one


def test_vectorised_rows_equal_the_per_row_reference(bpe):
    vocab = byte_level_vocab(bpe)
    trie = TokenByteTrie(vocab)
    ids = bpe.encode(TEXT).ids
    torch.manual_seed(1)
    probs = torch.softmax(torch.randn(len(ids), len(vocab), dtype=torch.float64) * 3, -1)
    rows = trie.token_rows(probs, ids, end_rows=True)
    expected = [
        trie.next_byte_target(dist, vocab[token][:k])
        for dist, token in zip(trie.sorted_probs(probs), ids)
        for k in range(len(vocab[token]) + 1)  # + the row after the token's last byte
    ]
    torch.testing.assert_close(rows, torch.stack(expected), rtol=0, atol=1e-15)
    assert trie.token_rows(probs[:0], []).shape == (0, N_CLASSES)
