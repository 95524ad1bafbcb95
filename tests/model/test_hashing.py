"""Hash n-gram ids: the reference's verified vectors and a big-integer re-derivation."""

import pytest
import torch
from torch import nn

from bytelatent.archs.blt import hashing
from bytelatent.archs.blt.hashing import byte_group_hash, compute_hash_embeddings, hash_table_specs
from bytelatent.model.args import HASH_PRIMES

TOKENS = torch.tensor([[1, 76, 105, 120]])
VOCAB = 500002


@pytest.mark.parametrize(
    ("size", "func_nb", "expected"),
    [
        (3, 0, [443987, 124875, 393970, 34523]),
        (3, 1, [45033, 214129, 1694, 425593]),
        (4, 0, [437197, 433869, 117936, 58968]),
        (8, 0, [172383, 205585, 456240, 394396]),
    ],
)
def test_reference_vectors(size: int, func_nb: int, expected: list[int]) -> None:
    assert byte_group_hash(TOKENS, size, func_nb, VOCAB).tolist() == [expected]


def _slow_hash(row: list[int], size: int, prime: int, vocab: int) -> list[int]:
    """Exact integers, then the int64 wrap-around and Python's floor-mod, one position at a time."""
    padded = [0] * (size - 1) + row
    out = []
    for t in range(len(row)):
        window = padded[t : t + size]  # window[0] is the oldest token
        exact = sum(w * prime**j for j, w in enumerate(window))
        wrapped = exact % (1 << 64)
        signed = wrapped - (1 << 64) if wrapped >= 1 << 63 else wrapped
        out.append(signed % vocab)
    return out


@pytest.mark.parametrize("func_nb", [0, 2, 6, 10])
@pytest.mark.parametrize("size", [1, 2, 5, 8])
def test_matches_big_integer_definition(size: int, func_nb: int) -> None:
    gen = torch.Generator().manual_seed(size * 100 + func_nb)
    tokens = torch.randint(0, 260, (3, 17), generator=gen)
    got = byte_group_hash(tokens, size, func_nb, 30011)
    for row in range(3):
        expected = _slow_hash(tokens[row].tolist(), size, HASH_PRIMES[func_nb], 30011)
        assert got[row].tolist() == expected


def test_hash_ids_in_range_and_batch_rows_independent() -> None:
    tokens = torch.randint(0, 260, (4, 64))
    ids = byte_group_hash(tokens, 6, 0, 1009)
    assert ids.min() >= 0 and ids.max() < 1009
    assert torch.equal(byte_group_hash(tokens[2:3], 6, 0, 1009), ids[2:3])


def test_bad_arguments_raise() -> None:
    with pytest.raises(ValueError, match="n-gram size"):
        byte_group_hash(TOKENS, 0)
    with pytest.raises(ValueError, match="function number"):
        byte_group_hash(TOKENS, 3, len(HASH_PRIMES))


def test_compute_hash_embeddings_sums_tables_in_reference_order() -> None:
    sizes, nb_functions, vocab, dim = [3, 5], 2, 101, 8
    tok = nn.Embedding(260, dim)
    tables = nn.ModuleList(nn.Embedding(vocab, dim) for _ in range(4))
    tokens = torch.randint(0, 260, (2, 9))
    got = compute_hash_embeddings(tokens, tok, tables, sizes, nb_functions, vocab)
    assert hash_table_specs(sizes, nb_functions) == [(0, 3), (0, 5), (1, 3), (1, 5)]
    expected = tok(tokens)
    for index, (func_nb, size) in enumerate(hash_table_specs(sizes, nb_functions)):
        expected = expected + tables[index](byte_group_hash(tokens, size, func_nb, vocab))
    torch.testing.assert_close(got, expected)
    assert torch.equal(compute_hash_embeddings(tokens, tok, None, None, 1, vocab), tok(tokens))


def _hash_setup(seed: int = 0):
    torch.manual_seed(seed)
    sizes, vocab, dim = [3, 4], 37, 8
    tok = nn.Embedding(260, dim)
    tables = nn.ModuleList(nn.Embedding(vocab, dim) for _ in sizes)
    return tok, tables, sizes, vocab


def _grads(tok, tables, sizes, vocab, batches, fast, monkeypatch, zero="none"):
    """Gradients after backward over ``batches`` (one optimizer-free accumulation window each),
    clearing grads between windows the way ``zero`` says ("none": set_to_none, "zero": zero_)."""
    monkeypatch.setattr(hashing, "HASH_GRAD_BUFFER", fast)
    params = [tok.weight, *(t.weight for t in tables)]
    for p in params:
        p.grad = None
    history = []
    for window in batches:
        for p in params:
            if zero == "none":
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
        for tokens, weight in window:
            out = compute_hash_embeddings(tokens, tok, tables, sizes, 1, vocab)
            (out * weight).sum().backward()
        history.append([p.grad.clone() for p in params])
    return history


@pytest.mark.parametrize("zero", ["none", "zero"])
def test_grad_buffer_path_gives_the_dense_embedding_gradients(zero, monkeypatch) -> None:
    """Persistent-buffer gradients equal nn.Embedding's dense ones: across steps (stale rows of
    the previous step are cleared), with accumulation over micro-batches, and after zero_()."""
    tok, tables, sizes, vocab = _hash_setup()
    gen = torch.Generator().manual_seed(3)

    def micro():
        tokens = torch.randint(0, 260, (2, 11), generator=gen)
        return tokens, torch.randn(2, 11, 8, generator=gen)

    batches = [[micro()], [micro(), micro()], [micro()]]
    fast = _grads(tok, tables, sizes, vocab, batches, True, monkeypatch, zero)
    assert hashing._grad_buffers.get(tables[0].weight) is not None  # the fast path ran
    slow = _grads(tok, tables, sizes, vocab, batches, False, monkeypatch, zero)
    for fast_step, slow_step in zip(fast, slow):
        for got, expected in zip(fast_step, slow_step):
            torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def test_grad_buffer_path_is_skipped_for_hooked_or_frozen_tables(monkeypatch) -> None:
    monkeypatch.setattr(hashing, "HASH_GRAD_BUFFER", True)
    tok, tables, sizes, vocab = _hash_setup(1)
    assert hashing._use_grad_buffer([t.weight for t in tables])
    tables[0].weight.register_hook(lambda g: g)
    assert not hashing._use_grad_buffer([t.weight for t in tables])
    with torch.no_grad():
        assert not hashing._use_grad_buffer([tables[1].weight])


@pytest.mark.parametrize("nb_functions", [1, 2])
def test_last_position_embeddings_equal_the_whole_rows_last_position(nb_functions: int) -> None:
    """Generation's one-byte path (one int64 product for every table) gives exactly the
    embedding of the last position of ``compute_hash_embeddings``, windows with leading padding
    (a row's first bytes) and ids up to the full vocabulary included."""
    sizes, vocab, dim = [3, 4, 5, 6, 7, 8], 4099, 16
    torch.manual_seed(0)
    tok = nn.Embedding(260, dim)
    tables = nn.ModuleList(nn.Embedding(vocab, dim) for _ in hash_table_specs(sizes, nb_functions))
    rows = torch.randint(0, 260, (5, 30))
    rows[:, -1] = 259
    with torch.no_grad():
        whole = compute_hash_embeddings(rows, tok, tables, sizes, nb_functions, vocab)
        for end in (1, 4, 8, 9, 30):  # windows of the last 8 bytes, zero-padded at the start
            window = nn.functional.pad(rows[:, max(0, end - 8) : end], (max(0, 8 - end), 0))
            got = hashing.last_position_hash_embeddings(
                window, tok, tables, sizes, nb_functions, vocab
            )
            assert torch.equal(got, whole[:, end - 1 : end])
    with pytest.raises(ValueError, match="shorter than the longest n-gram"):
        hashing.last_position_hash_embeddings(rows[:, -7:], tok, tables, sizes, nb_functions, vocab)
