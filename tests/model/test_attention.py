"""Masks and backends of bytelatent.model.attention against a brute-force masked softmax."""

import logging
import math

import pytest
import torch

from bytelatent.model import attention
from bytelatent.model.args import BACKENDS
from bytelatent.model.attention import (
    AttnMask,
    FlexMask,
    KeyIntervals,
    SdpaBanded,
    SdpaChunked,
    SdpaDense,
    SdpaSingleDocument,
    XformersBlockDiagonal,
    attend,
    band_chunk,
    banded_self_attn_mask,
    build_mask,
    document_lengths,
    resolve_backend,
    select_backend,
    self_attn_mask,
)
from bytelatent.model.attention import xformers as xformers_backend
from tests.model.mask_helpers import FakeBias, LargestTensor, flex_elementwise

EOS = 2
HAS_CUDA = torch.cuda.is_available()


def packed_rows(bsz: int, seqlen: int, seed: int) -> torch.Tensor:
    """Rows of bytes with several EOS each, at different places per row."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(4, 260, (bsz, seqlen), generator=gen)
    for row in range(bsz):
        n_eos = 2 + row
        cuts = torch.randperm(seqlen, generator=gen)[:n_eos]
        tokens[row, cuts] = EOS
    tokens[0, 0] = EOS  # a one-token document at the start of a row
    return tokens


def brute_force_allowed(kind: str | None, tokens: torch.Tensor, window: int | None) -> torch.Tensor:
    """allowed[b, i, j] written out with loops from the mask definitions."""
    bsz, seqlen = tokens.shape
    allowed = torch.zeros(bsz, seqlen, seqlen, dtype=torch.bool)
    for b in range(bsz):
        doc_start = 0
        for i in range(seqlen):
            for j in range(i + 1):
                ok = True
                if kind in ("block_causal", "local_block_causal"):
                    ok = j >= doc_start
                if kind == "local_block_causal":
                    ok = ok and i - j < window
                allowed[b, i, j] = ok
            if tokens[b, i] == EOS:
                doc_start = i + 1  # the EOS closes its document
    return allowed


def brute_force_attention(q, k, v, allowed):
    n_rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(n_rep, dim=1)
    v = v.repeat_interleave(n_rep, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    return scores.softmax(-1) @ v


def qkv(bsz, seqlen, n_heads=4, n_kv_heads=4, head_dim=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(bsz, n_heads, seqlen, head_dim, generator=gen, dtype=torch.float64)
    k = torch.randn(bsz, n_kv_heads, seqlen, head_dim, generator=gen, dtype=torch.float64)
    v = torch.randn(bsz, n_kv_heads, seqlen, head_dim, generator=gen, dtype=torch.float64)
    return [t.requires_grad_() for t in (q, k, v)]


def forward_backward(fn, q, k, v):
    out = fn(q, k, v)
    gen = torch.Generator(device=out.device).manual_seed(1)
    grad_out = torch.randn(out.shape, generator=gen, dtype=out.dtype, device=out.device)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    return out, grads


CASES = [
    (None, None),
    ("causal", None),
    ("block_causal", None),
    ("local_block_causal", 1),
    ("local_block_causal", 4),
    ("local_block_causal", 9),
]


@pytest.mark.parametrize(("kind", "window"), CASES)
@pytest.mark.parametrize("n_kv_heads", [4, 2])
def test_sdpa_masks_match_brute_force(kind, window, n_kv_heads):
    tokens = packed_rows(3, 40, seed=CASES.index((kind, window)))
    mask = self_attn_mask(kind, tokens, eos_id=EOS, window=window)
    allowed = brute_force_allowed(kind, tokens, window)
    if isinstance(mask, SdpaDense):
        dense = mask.dense.expand(3, 1, 40, 40)[:, 0]
        assert torch.equal(dense, allowed)
    q, k, v = qkv(3, 40, n_kv_heads=n_kv_heads)
    out, grads = forward_backward(lambda a, b, c: attend(a, b, c, mask), q, k, v)
    ref_out, ref_grads = forward_backward(
        lambda a, b, c: brute_force_attention(a, b, c, allowed), q, k, v
    )
    torch.testing.assert_close(out, ref_out, rtol=1e-9, atol=1e-9)
    for grad, ref_grad in zip(grads, ref_grads):
        torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize(
    ("seqlen", "window", "chunk"), [(40, 4, 8), (45, 9, 8), (64, 16, 16), (37, 1, 4), (50, 7, 64)]
)
def test_banded_local_mask_matches_brute_force(seqlen, window, chunk):
    tokens = packed_rows(3, seqlen, seed=seqlen + window)
    mask = SdpaBanded(banded_self_attn_mask(tokens, EOS, window, chunk))
    allowed = brute_force_allowed("local_block_causal", tokens, window)
    q, k, v = qkv(3, seqlen, n_kv_heads=2)
    out, grads = forward_backward(lambda a, b, c: attend(a, b, c, mask), q, k, v)
    ref_out, ref_grads = forward_backward(
        lambda a, b, c: brute_force_attention(a, b, c, allowed), q, k, v
    )
    torch.testing.assert_close(out, ref_out, rtol=1e-9, atol=1e-9)
    for grad, ref_grad in zip(grads, ref_grads):
        torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-9)


def test_long_rows_use_the_band_and_short_rows_the_dense_mask():
    assert band_chunk(1024, 512) is None  # band would cover most of the row
    assert band_chunk(8192, 512) == 256
    long_row = packed_rows(1, 2048, seed=0)
    assert isinstance(self_attn_mask("local_block_causal", long_row, window=64), SdpaBanded)
    short = self_attn_mask("local_block_causal", long_row[:, :100], window=64)
    assert isinstance(short, SdpaDense)
    assert isinstance(self_attn_mask("block_causal", long_row), SdpaDense)


def test_documents_are_separated():
    """Changing document 1 must not change the attention output of document 2."""
    tokens = torch.tensor([[7, 8, 9, EOS, 10, 11, 12, 13]])
    mask = self_attn_mask("block_causal", tokens, eos_id=EOS)
    q, k, v = (t.detach() for t in qkv(1, 8))
    out = attend(q, k, v, mask)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, :4] += 5.0
    v2[:, :, :4] -= 3.0
    out2 = attend(q, k2, v2, mask)
    torch.testing.assert_close(out[:, :, 4:], out2[:, :, 4:])
    assert not torch.allclose(out[:, :, :4], out2[:, :, :4])


def test_window_semantics_match_xformers_local_attention():
    """window w: a query sees itself and the w - 1 previous positions (xformers triu(1 - w))."""
    tokens = torch.full((1, 6), 9)
    dense = self_attn_mask("local_block_causal", tokens, eos_id=EOS, window=3).dense[0, 0]
    expected = torch.ones(6, 6).tril().triu(diagonal=1 - 3).bool()
    assert torch.equal(dense, expected)


def test_document_lengths_flatten_rows_like_xformers_seqlens():
    tokens = torch.tensor([[5, 6, EOS, 7, 8, 9, EOS, 5], [EOS, 5, 5, 5, 5, EOS, 6, 6]])
    assert document_lengths(tokens, EOS) == [3, 4, 1, 1, 5, 2]


def test_fully_masked_query_row_gives_zeros_and_finite_grads():
    allowed = torch.ones(2, 1, 5, 7, dtype=torch.bool).tril()
    allowed[0, 0, 3] = False  # query 3 of row 0 may attend nothing (e.g. padding)
    allowed[1, 0, :, :] = False
    mask = AttnMask.from_dense(allowed)
    q = torch.randn(2, 2, 5, 8, requires_grad=True)
    k = torch.randn(2, 2, 7, 8, requires_grad=True)
    v = torch.randn(2, 2, 7, 8, requires_grad=True)
    out = attend(q, k, v, mask)
    assert torch.isfinite(out).all()
    assert out[0, :, 3].abs().max() == 0 and out[1].abs().max() == 0
    out.square().sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    assert q.grad[1].abs().max() == 0
    ref = brute_force_attention(
        q[:1, :, :3].detach(), k[:1].detach(), v[:1].detach(), allowed[:1, 0, :3]
    )
    torch.testing.assert_close(out[:1, :, :3], ref)


def test_bad_arguments_raise():
    tokens = packed_rows(1, 8, seed=0)
    with pytest.raises(ValueError, match="sliding window"):
        self_attn_mask("local_block_causal", tokens)
    with pytest.raises(ValueError, match="unknown attention mask kind"):
        self_attn_mask("sliding", tokens)
    with pytest.raises(ValueError, match="fmha"):
        self_attn_mask("causal", tokens, backend="fmha")
    with pytest.raises(ValueError, match="must be bool"):
        AttnMask.from_dense(torch.ones(1, 1, 2, 2))
    with pytest.raises(ValueError, match="flex_attention builds its masks from key intervals"):
        AttnMask.from_dense(torch.ones(1, 1, 2, 2, dtype=torch.bool), backend="flex_attention")


@pytest.mark.skipif(HAS_CUDA, reason="checks the CPU error path")
@pytest.mark.parametrize("backend", ["flex_attention", "xformers"])
def test_cuda_only_backends_fail_clearly_on_cpu(backend):
    q, k, v = (t.detach().float() for t in qkv(1, 8))
    with pytest.raises(RuntimeError, match="CUDA|not installed"):
        attend(q, k, v, AttnMask.causal(), backend=backend)
    tokens = packed_rows(1, 8, seed=0)
    mask = self_attn_mask("block_causal", tokens, backend="flex_attention")  # builds on CPU
    with pytest.raises(RuntimeError, match="CUDA|not installed"):
        attend(q, k, v, mask)  # the mask carries its backend
    if backend == "xformers" and not attention.xformers_available():
        with pytest.raises(RuntimeError, match="not installed"):
            self_attn_mask("block_causal", tokens, backend=backend)


@pytest.mark.parametrize(("kind", "window"), CASES)
@pytest.mark.parametrize("seqlen", [300, 384])
def test_flex_block_mask_equals_brute_force_and_create_block_mask(kind, window, seqlen):
    from torch.nn.attention.flex_attention import create_block_mask

    tokens = packed_rows(2, seqlen, seed=5)
    tokens[1, 100:230] = 7  # a document spanning whole blocks: full blocks off the diagonal
    window = None if window is None else window * 17
    mask = self_attn_mask(kind, tokens, eos_id=EOS, window=window, backend="flex_attention")
    assert isinstance(mask, FlexMask) and mask.backend == "flex_attention"
    block_mask = mask.block_mask
    expected = brute_force_allowed(kind, tokens, window)
    assert torch.equal(flex_elementwise(block_mask, 2, seqlen), expected)
    # block classification is exact: the same blocks as torch's own builder from the dense mask
    reference = create_block_mask(
        lambda b, h, q, kv: expected[b, q, kv], 2, None, seqlen, seqlen, device="cpu"
    )
    assert torch.equal(block_mask.to_dense().expand(2, -1, -1, -1), reference.to_dense())


@pytest.mark.parametrize(("kind", "window"), [("block_causal", None), ("local_block_causal", 64)])
def test_flex_forward_on_cpu_matches_brute_force(kind, window):
    from torch.nn.attention.flex_attention import flex_attention

    tokens = packed_rows(2, 200, seed=2)
    q, k, v = (t.detach() for t in qkv(2, 200))
    mask = self_attn_mask(kind, tokens, eos_id=EOS, window=window, backend="flex_attention")
    out = flex_attention(q, k, v, block_mask=mask.block_mask)  # eager CPU forward
    ref = brute_force_attention(q, k, v, brute_force_allowed(kind, tokens, window))
    torch.testing.assert_close(out, ref)


class _FakeFmha:
    class attn_bias:  # noqa: N801 - mirrors xformers.ops.fmha.attn_bias
        BlockDiagonalCausalMask = FakeBias


@pytest.mark.parametrize(("kind", "window"), CASES[2:])
@pytest.mark.parametrize("backend", ["flex_attention", "xformers"])
def test_flex_and_xformers_masks_never_allocate_s_by_s(monkeypatch, kind, window, backend):
    monkeypatch.setattr(xformers_backend, "_import_fmha", lambda: _FakeFmha)
    seqlen = 1024
    tokens = packed_rows(2, seqlen, seed=1)
    with LargestTensor() as sizes:
        mask = self_attn_mask(kind, tokens, eos_id=EOS, window=window, backend=backend)
    assert sizes.largest < seqlen * seqlen // 8
    assert not isinstance(mask, SdpaDense) and mask.backend == backend
    if backend == "xformers":
        assert isinstance(mask, XformersBlockDiagonal)
        assert mask.bias.seqlens == document_lengths(tokens, EOS)
        assert mask.bias.window == window
        assert sum(mask.bias.seqlens) == tokens.numel()
    with LargestTensor() as sizes:  # the sdpa path does build it (the check can fail)
        self_attn_mask(kind, tokens, eos_id=EOS, window=window)
    if kind == "block_causal":
        assert sizes.largest >= seqlen * seqlen


def test_resolve_backend_falls_back_to_sdpa_off_cuda(caplog, monkeypatch):
    monkeypatch.setattr(attention.base, "_warned_fallbacks", set())
    with caplog.at_level(logging.WARNING, logger="bytelatent.model.attention"):
        assert resolve_backend("xformers", "cpu") == "sdpa"
        assert resolve_backend("xformers", "cpu") == "sdpa"
        assert resolve_backend("flex_attention", "cpu") == "sdpa"
    assert resolve_backend("sdpa", "cpu") == "sdpa"
    fallback_logs = [r for r in caplog.records if "using sdpa with the same masks" in r.message]
    assert len(fallback_logs) == 2  # once per (impl, device type)
    with pytest.raises(ValueError, match="unknown attention backend"):
        resolve_backend("triton", "cpu")


def test_every_config_backend_is_registered_and_selected_once(caplog, monkeypatch):
    monkeypatch.setattr(attention.base, "_warned_fallbacks", set())
    assert sorted(attention.base._BACKENDS) == sorted(BACKENDS)
    for name in BACKENDS:
        assert attention.get_backend(name).name == name
    assert select_backend("sdpa", "cpu") is attention.get_backend("sdpa")
    with caplog.at_level(logging.WARNING, logger="bytelatent.model.attention"):
        assert select_backend("flex_attention", "cpu") is attention.get_backend("sdpa")
    assert select_backend("flex_attention", "cuda").name == "flex_attention"  # no CUDA needed


def test_a_mask_runs_only_on_a_backend_that_has_its_representation():
    """A flex or xformers mask handed to sdpa raises instead of running unmasked."""
    tokens = packed_rows(1, 8, seed=0)
    q, k, v = (t.detach() for t in qkv(1, 8))
    flex_mask = self_attn_mask("block_causal", tokens, eos_id=EOS, backend="flex_attention")
    with pytest.raises(ValueError, match="built for flex_attention .* cannot run on sdpa"):
        attend(q, k, v, flex_mask, backend="sdpa")
    with pytest.raises(ValueError, match="cannot run on sdpa"):
        attend(q, k, v, XformersBlockDiagonal(bias=None), backend="sdpa")


def test_key_intervals_dense_matches_the_bounds():
    lo = torch.tensor([[0, 0, 1, 3, 3]])
    hi = torch.tensor([[1, 2, 3, 3, 5]])
    mask = build_mask(KeyIntervals(lo, hi, 5))
    expected = torch.tensor([[j >= lo[0, q] and j < hi[0, q] for j in range(5)] for q in range(5)])
    assert torch.equal(mask.query_has_key[0, 0, :, 0], torch.tensor([1, 1, 1, 0, 1]).bool())
    assert torch.equal(mask.dense[0, 0][[0, 1, 2, 4]], expected[[0, 1, 2, 4]])
    assert mask.dense[0, 0, 3].all()  # the empty row is opened up (attend zeroes it)


def _cuda_backend_available(backend: str) -> bool:
    if not HAS_CUDA:
        return False
    return backend != "xformers" or attention.xformers_available()


@pytest.mark.parametrize("backend", ["flex_attention", "xformers"])
@pytest.mark.parametrize(("kind", "window"), CASES[1:])
def test_cuda_backends_match_sdpa(backend, kind, window):
    if not _cuda_backend_available(backend):
        pytest.skip(f"{backend} needs CUDA (and xformers installed)")
    tokens = packed_rows(2, 256, seed=3).cuda()
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (
        torch.randn(2, 4, 256, 64, device="cuda", generator=gen, requires_grad=True)
        for _ in range(3)
    )
    ref_mask = self_attn_mask(kind, tokens, eos_id=EOS, window=window)
    mask = self_attn_mask(kind, tokens, eos_id=EOS, window=window, backend=backend)
    ref_out, ref_grads = forward_backward(lambda a, b, c: attend(a, b, c, ref_mask), q, k, v)
    out, grads = forward_backward(lambda a, b, c: attend(a, b, c, mask, backend=backend), q, k, v)
    torch.testing.assert_close(out, ref_out, rtol=2e-3, atol=2e-3)
    for grad, ref_grad in zip(grads, ref_grads):
        torch.testing.assert_close(grad, ref_grad, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize(("kind", "window"), [("block_causal", None), ("local_block_causal", 9)])
@pytest.mark.parametrize("n_kv_heads", [4, 2])
def test_cpu_chunk_plan_matches_brute_force(kind, window, n_kv_heads, monkeypatch):
    """The block-sparse CPU plan (chunks of 8 over 40 positions) computes the dense mask's
    attention, forward and backward, with rows that share chunks and rows that do not."""
    monkeypatch.setattr(attention.chunked, "SDPA_CHUNK", 8)
    tokens = packed_rows(3, 40, seed=11)
    tokens[2] = 7  # one row without documents: its chunks see from key 0 (or the window)
    mask = self_attn_mask(kind, tokens, eos_id=EOS, window=window)
    assert isinstance(mask, SdpaChunked)
    assert any(k0 > 0 for *_, k0 in mask.chunks.pieces)  # some work is skipped
    allowed = brute_force_allowed(kind, tokens, window)
    for (r0, r1, q0, q1, k0), block in zip(mask.chunks.pieces, mask.chunks.allowed):
        assert not allowed[r0:r1, q0:q1, :k0].any()  # nothing visible is left out
        assert torch.equal(block[:, 0], allowed[r0:r1, q0:q1, k0:q1])
    q, k, v = qkv(3, 40, n_kv_heads=n_kv_heads)
    out, grads = forward_backward(lambda a, b, c: attend(a, b, c, mask), q, k, v)
    ref_out, ref_grads = forward_backward(
        lambda a, b, c: brute_force_attention(a, b, c, allowed), q, k, v
    )
    torch.testing.assert_close(out, ref_out, rtol=1e-9, atol=1e-9)
    for grad, ref_grad in zip(grads, ref_grads):
        torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-9)


def test_chunk_plan_survives_fsdp_casting_its_forward_inputs(monkeypatch):
    """FSDP2 casts a module's floating forward inputs to the compute dtype through dicts and
    dataclass fields (`_apply_to_tensors`, as `MixedPrecisionPolicy(cast_forward_inputs=True)`
    does); the plan's fp32 additive mask must stay fp32 for fp32 attention (bf16 on a CPU without
    bf16 GEMMs runs its attention in fp32), not come back as the bf16 copy."""
    from torch.distributed.utils import _apply_to_tensors

    monkeypatch.setattr(attention.chunked, "SDPA_CHUNK", 8)
    tokens = packed_rows(3, 40, seed=11)
    mask = self_attn_mask("block_causal", tokens, eos_id=EOS, window=None)
    assert isinstance(mask, SdpaChunked)
    mask.chunks.additive_mask(torch.float32)

    def to_bf16(t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.bfloat16) if t.is_floating_point() else t

    cast = _apply_to_tensors(to_bf16, mask)
    assert cast.chunks.additive_mask(torch.float32).dtype == torch.float32
    q, k, v = qkv(3, 40)
    out = attend(q.float(), k.float(), v.float(), cast)  # raised on a bf16 mask before
    ref = attend(q.float(), k.float(), v.float(), mask)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


@pytest.mark.parametrize(("kind", "window"), [("block_causal", None), ("local_block_causal", 64)])
def test_single_document_rows_run_as_plain_causal(kind, window):
    """Rows without an EOS before their end: the document mask is plain causal (is_causal)."""
    tokens = packed_rows(3, 40, seed=5)
    tokens[tokens == EOS] = 9
    tokens[1, -1] = EOS  # an EOS at the very end closes the only document
    mask = self_attn_mask(kind, tokens, eos_id=EOS, window=window)
    assert isinstance(mask, SdpaSingleDocument)
    allowed = brute_force_allowed(kind, tokens, window)
    assert torch.equal(mask.dense.expand(3, 1, 40, 40)[:, 0], allowed)
    q, k, v = qkv(3, 40)
    out, grads = forward_backward(lambda a, b, c: attend(a, b, c, mask), q, k, v)
    ref_out, ref_grads = forward_backward(
        lambda a, b, c: brute_force_attention(a, b, c, allowed), q, k, v
    )
    torch.testing.assert_close(out, ref_out, rtol=1e-9, atol=1e-9)
    for grad, ref_grad in zip(grads, ref_grads):
        torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-9)
    tokens[0, 5] = EOS  # one more document: no longer plain causal
    assert not isinstance(
        self_attn_mask(kind, tokens, eos_id=EOS, window=window), SdpaSingleDocument
    )
