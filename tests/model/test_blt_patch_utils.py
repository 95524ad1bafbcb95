"""Patch ids, pooling and cross-attention masks against brute-force definitions."""

import pytest
import torch

from bytelatent.archs.blt.cross_attention import CrossAttention
from bytelatent.archs.blt.patch_utils import (
    build_cross_mask,
    check_patch_lengths,
    concat_patches,
    cross_attn_key_bounds,
    decoder_cross_attn_allowed,
    decoder_patch_ids_from_lengths,
    encoder_cross_attn_allowed,
    patch_ids_from_lengths,
    pool_patches,
)
from bytelatent.errors import DataError
from bytelatent.model.args import parse_pooling
from bytelatent.model.attention import FlexMask, KeyIntervals, SdpaDense, attend, build_mask
from tests.model.mask_helpers import LargestTensor, flex_elementwise


def random_lengths(gen: torch.Generator, bsz: int, seq_len: int, max_len: int = 5) -> torch.Tensor:
    """Rows: first patch 1, random lengths, summing to N or N+1, right-padded with zeros."""
    rows = []
    for b in range(bsz):
        total = seq_len + (b % 2)
        row = [1]
        while sum(row) < total:
            row.append(
                min(
                    int(torch.randint(1, max_len + 1, (1,), generator=gen)),
                    total - sum(row),
                )
            )
        rows.append(row)
    width = max(len(r) for r in rows) + 1  # at least one padded column
    return torch.tensor([r + [0] * (width - len(r)) for r in rows])


def brute_patch_ids(lengths: list[int], seq_len: int) -> tuple[list[int], list[int]]:
    starts, ends, pos = [], [], 0
    for length in lengths:
        if length == 0:
            break
        starts.append(pos)
        pos += length
        ends.append(pos - 1)  # inclusive
    enc = [max(p for p, s in enumerate(starts) if s <= i) for i in range(seq_len)]
    dec = [max(p for p, e in enumerate(ends) if e <= i) for i in range(seq_len)]
    return enc, dec


@pytest.mark.parametrize("seed", range(4))
def test_patch_ids_brute_force(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    seq_len = 23
    lengths = random_lengths(gen, 4, seq_len)
    check_patch_lengths(lengths, seq_len)
    enc = patch_ids_from_lengths(lengths, seq_len)
    dec = decoder_patch_ids_from_lengths(lengths, seq_len)
    for b in range(4):
        want_enc, want_dec = brute_patch_ids(lengths[b].tolist(), seq_len)
        assert enc[b].tolist() == want_enc
        assert dec[b].tolist() == want_dec


def test_decoder_ids_never_point_at_padding_when_rows_sum_to_n() -> None:
    lengths = torch.tensor([[1, 3, 2, 0, 0], [1, 1, 1, 1, 2]])
    assert decoder_patch_ids_from_lengths(lengths, 6).tolist() == [
        [0, 0, 0, 1, 1, 2],
        [0, 1, 2, 3, 3, 4],
    ]


@pytest.mark.parametrize("window", [None, 1, 2, 3])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_cross_masks_brute_force(window: int | None, k: int) -> None:
    gen = torch.Generator().manual_seed(k * 10 + (window or 0))
    seq_len = 15
    lengths = random_lengths(gen, 2, seq_len, max_len=4)
    num_patches = lengths.shape[1]
    enc_ids = patch_ids_from_lengths(lengths, seq_len)
    dec_ids = decoder_patch_ids_from_lengths(lengths, seq_len)
    enc = encoder_cross_attn_allowed(enc_ids, num_patches, k, window)
    dec = decoder_cross_attn_allowed(dec_ids, num_patches, k, window)
    assert enc.shape == (2, 1, num_patches * k, seq_len)
    assert dec.shape == (2, 1, seq_len, num_patches * k)
    span = 1 if window is None else window
    for b in range(2):
        for slot in range(num_patches * k):
            patch = slot // k
            for i in range(seq_len):
                want_enc = patch - span < int(enc_ids[b, i]) <= patch
                want_dec = int(dec_ids[b, i]) - span < patch <= int(dec_ids[b, i])
                assert bool(enc[b, 0, slot, i]) == want_enc
                assert bool(dec[b, 0, i, slot]) == want_dec


@pytest.mark.parametrize("n_kv_heads", [4, 2])
@pytest.mark.parametrize("side", ["encoder", "decoder"])
def test_structured_cross_attention_equals_dense(side: str, n_kv_heads: int) -> None:
    torch.manual_seed(0)
    seq_len, dim, k = 19, 32, 2
    lengths = random_lengths(torch.Generator().manual_seed(3), 3, seq_len)
    num_patches = lengths.shape[1]
    layer = CrossAttention(dim, 8, 4, n_kv_heads, 1e-5)
    layer.init_weights()
    if side == "encoder":
        ids = patch_ids_from_lengths(lengths, seq_len)
        x, kv = torch.randn(3, num_patches * k, dim), torch.randn(3, seq_len, dim)
    else:
        ids = decoder_patch_ids_from_lengths(lengths, seq_len)
        x, kv = torch.randn(3, seq_len, dim), torch.randn(3, num_patches * k, dim)
    outputs, grads = [], []
    for structured in (True, False):
        xs, kvs = x.clone().requires_grad_(), kv.clone().requires_grad_()
        mask = build_cross_mask(side, ids, num_patches, k, None, structured=structured)
        assert mask.structured == structured
        out = layer(xs, kvs, mask)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        outputs.append(out.detach())
        grads.append((xs.grad, kvs.grad, layer.wq.weight.grad.clone()))
        layer.zero_grad()
    torch.testing.assert_close(outputs[0], outputs[1], atol=1e-5, rtol=1e-5)
    for got, want in zip(grads[0], grads[1]):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    if side == "encoder":  # padded patch slots: no byte to attend, so only the residual remains
        padded = (lengths == 0).repeat_interleave(k, dim=1)
        torch.testing.assert_close(outputs[0][padded], x[padded])


def test_cross_attention_double_residual() -> None:
    """forward returns x + out: with zero output weights it is exactly x."""
    layer = CrossAttention(16, 4, 4, 4, 1e-5)
    layer.init_weights()
    torch.nn.init.zeros_(layer.wo.weight)
    x, kv = torch.randn(1, 9, 16), torch.randn(1, 4, 16)
    mask = build_cross_mask("decoder", torch.zeros(1, 9, dtype=torch.long), 2, 2, None)
    torch.testing.assert_close(layer(x, kv, mask), x)


@pytest.mark.parametrize(
    "modes", [("avg",), ("min",), ("max",), ("avg", "max"), ("avg", "min", "max")]
)
def test_pool_patches_brute_force(modes: tuple[str, ...]) -> None:
    lengths = torch.tensor([[1, 3, 2, 0], [1, 1, 2, 2]])
    ids = patch_ids_from_lengths(lengths, 6)
    h = torch.randn(2, 6, 5)
    pooled = pool_patches(h, ids, 4, modes)
    assert pooled.shape == (2, 4, 5 * len(modes))
    ops = {
        "avg": lambda t: t.mean(0),
        "min": lambda t: t.min(0).values,
        "max": lambda t: t.max(0).values,
    }
    for b in range(2):
        for p in range(4):
            members = h[b][ids[b] == p]
            want = (
                torch.cat([ops[m](members) for m in modes])
                if len(members)
                else torch.zeros(5 * len(modes))
            )
            torch.testing.assert_close(pooled[b, p], want)


def test_concat_patches_takes_last_bytes_of_each_patch() -> None:
    h = torch.arange(8, dtype=torch.float32).view(1, 8, 1)
    lengths = torch.tensor([[1, 4, 3]])  # sums to N: patches end at bytes 0, 4, 7
    out = concat_patches(h, lengths, 2)
    assert out.tolist() == [[[0.0, 0.0], [3.0, 4.0], [6.0, 7.0]]]
    # N+1: the last patch ends past the row; clamped to the last byte
    out = concat_patches(h[:, :7], lengths, 2)
    assert out[0, -1].tolist() == [6.0, 6.0]


def test_parse_pooling() -> None:
    assert parse_pooling("max") == ("max",)
    assert parse_pooling("max,mean") == ("avg", "max")
    assert parse_pooling(None) == () == parse_pooling("")
    with pytest.raises(ValueError, match="unknown pooling 'sum'"):
        parse_pooling("avg,sum")


@pytest.mark.parametrize(
    ("lengths", "message"),
    [
        ([[2, 3, 4]], "first patch"),
        ([[1, 3, 3]], "sums to 7"),
        ([[1, 0, 8]], "right"),
        ([[1, -1, 9]], "negative"),
    ],
)
def test_check_patch_lengths_errors(lengths: list[list[int]], message: str) -> None:
    with pytest.raises(DataError, match=message):
        check_patch_lengths(torch.tensor(lengths), 9)


def _cross_layout(seed: int, seq_len: int, k: int, extra_padding: int):
    """Random patch lengths (one row ends early: many padded patches, i.e. empty encoder rows)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.nn.functional.pad(
        random_lengths(gen, 3, seq_len, max_len=7), (0, extra_padding)
    )
    return lengths, lengths.shape[1]


def _cross_ids(side: str, lengths: torch.Tensor, seq_len: int) -> torch.Tensor:
    build = patch_ids_from_lengths if side == "encoder" else decoder_patch_ids_from_lengths
    return build(lengths, seq_len)


def _dense_cross(side, ids, num_patches, k, window) -> torch.Tensor:
    build = encoder_cross_attn_allowed if side == "encoder" else decoder_cross_attn_allowed
    return build(ids, num_patches, k, window)[:, 0]


@pytest.mark.parametrize("side", ["encoder", "decoder"])
@pytest.mark.parametrize(("window", "k"), [(None, 2), (1, 1), (2, 2), (3, 3), (40, 2)])
@pytest.mark.parametrize("seed", [0, 1])
def test_flex_cross_block_mask_equals_brute_force(side, window, k, seed) -> None:
    from torch.nn.attention.flex_attention import create_block_mask

    seq_len = 300
    lengths, num_patches = _cross_layout(seed, seq_len, k, extra_padding=70)
    ids = _cross_ids(side, lengths, seq_len)
    mask = build_cross_mask(side, ids, num_patches, k, window, "flex_attention", structured=False)
    attn = mask.attn
    assert isinstance(attn, FlexMask) and attn.backend == "flex_attention" and not mask.structured
    expected = _dense_cross(side, ids, num_patches, k, window)
    q_len, kv_len = expected.shape[1:]
    assert torch.equal(flex_elementwise(attn.block_mask, 3, q_len, kv_len), expected)
    assert torch.equal(attn.query_has_key[:, 0, :, 0], expected.any(-1))
    if side == "encoder" and window is None:
        assert not attn.query_has_key.all()  # the padded patches: empty query rows
    # block classification is exact: the blocks torch's own builder finds in the dense mask
    reference = create_block_mask(
        lambda b, h, q, kv: expected[b, q, kv], 3, None, q_len, kv_len, device="cpu"
    )
    assert torch.equal(attn.block_mask.to_dense(), reference.to_dense())
    assert torch.equal(attn.block_mask.full_kv_num_blocks, reference.full_kv_num_blocks)


@pytest.mark.parametrize("side", ["encoder", "decoder"])
@pytest.mark.parametrize(("window", "k"), [(None, 2), (1, 1), (3, 3)])
def test_key_interval_spec_builds_the_cross_masks_of_every_backend(side, window, k) -> None:
    """masks.KeyIntervals from cross_attn_key_bounds: sdpa's dense mask is the patch_utils one
    (empty rows opened and flagged), flex's BlockMask the one build_cross_mask makes."""
    seq_len = 300
    lengths, num_patches = _cross_layout(2, seq_len, k, extra_padding=70)
    ids = _cross_ids(side, lengths, seq_len)
    lo, hi = cross_attn_key_bounds(side, ids, num_patches, k, window)
    kv_len = seq_len if side == "encoder" else num_patches * k
    spec = KeyIntervals(lo, hi, kv_len)
    want = build_cross_mask(side, ids, num_patches, k, window, structured=False).attn
    got = build_mask(spec)
    assert isinstance(got, SdpaDense) and torch.equal(got.dense, want.dense)
    assert torch.equal(got.query_has_key, want.query_has_key)
    flex = build_mask(spec, "flex_attention")
    flex_want = build_cross_mask(
        side, ids, num_patches, k, window, "flex_attention", structured=False
    ).attn
    assert torch.equal(flex.block_mask.to_dense(), flex_want.block_mask.to_dense())
    assert torch.equal(flex.query_has_key, flex_want.query_has_key)


@pytest.mark.parametrize("side", ["encoder", "decoder"])
def test_flex_cross_mask_never_allocates_the_dense_mask(side) -> None:
    seq_len, k, window = 2048, 2, 3
    lengths, num_patches = _cross_layout(4, seq_len, k, extra_padding=8)
    ids = _cross_ids(side, lengths, seq_len)
    dense_size = 3 * num_patches * k * seq_len
    with LargestTensor() as sizes:
        build_cross_mask(side, ids, num_patches, k, window, "flex_attention", structured=False)
    assert sizes.largest < dense_size // 64
    with LargestTensor() as sizes:  # the sdpa path builds it (the check can fail)
        build_cross_mask(side, ids, num_patches, k, window)
    assert sizes.largest >= dense_size


@pytest.mark.parametrize(("side", "window"), [("encoder", None), ("encoder", 2), ("decoder", 3)])
def test_flex_cross_forward_on_cpu_matches_dense(side, window) -> None:
    from torch.nn.attention.flex_attention import flex_attention

    seq_len, k = 260, 2
    lengths, num_patches = _cross_layout(7, seq_len, k, extra_padding=30)
    ids = _cross_ids(side, lengths, seq_len)
    dense = build_cross_mask(side, ids, num_patches, k, window, structured=False).attn
    flex = build_cross_mask(
        side, ids, num_patches, k, window, "flex_attention", structured=False
    ).attn
    q_len, kv_len = dense.dense.shape[2:]
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, q_len, 16, generator=gen, dtype=torch.float64)
    kv = torch.randn(2, 3, 4, kv_len, 16, generator=gen, dtype=torch.float64)
    want = attend(q, kv[0], kv[1], dense)
    got = flex_attention(q, kv[0], kv[1], block_mask=flex.block_mask)  # eager CPU forward
    torch.testing.assert_close(got * flex.query_has_key, want)
