"""xformers masks take their document lengths from the batch's host arrays: the training forward
never copies device -> host for them, and the lengths equal the device path's."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from bytelatent.archs.blt import model as blt
from bytelatent.archs.blt.args import ByteLatentTransformerArgs
from bytelatent.archs.blt.model import ByteLatentTransformer
from bytelatent.archs.blt.patch_utils import (
    build_cross_mask,
    decoder_patch_ids_from_lengths,
    host_patch_has_eos,
    patch_ids_from_lengths,
)
from bytelatent.archs.lm import model as transformer
from bytelatent.archs.lm.model import LMTransformer
from bytelatent.data.batch import Batch
from bytelatent.model import global_transformer
from bytelatent.model.args import LMTransformerArgs
from bytelatent.model.attention import (
    HostDocuments,
    XformersBlockDiagonal,
    XformersCausal,
    document_lengths,
    self_attn_mask,
)
from bytelatent.model.attention import xformers as xformers_backend
from bytelatent.model.loss import forward_logits
from bytelatent.tokenizers.constants import BOE_ID
from tests.generation.conftest import BLT_BASE, BLT_VARIANTS, build
from tests.model.mask_helpers import FakeBias

EOS = 2
KINDS = [("block_causal", None), ("local_block_causal", 1), ("local_block_causal", 5)]


def random_tokens(rng: np.random.Generator, bsz: int, seqlen: int) -> np.ndarray:
    """Rows with random EOS layouts, plus the edge cases: no EOS, EOS first, EOS last, all EOS."""
    tokens = rng.integers(4, 260, size=(bsz, seqlen))
    tokens[rng.random((bsz, seqlen)) < rng.uniform(0.0, 0.3)] = EOS
    special = rng.choice(bsz, size=min(bsz, 4), replace=False)
    edits = [
        lambda row: row.__setitem__(slice(None), np.where(row == EOS, 9, row)),  # no EOS
        lambda row: row.__setitem__(0, EOS),
        lambda row: row.__setitem__(-1, EOS),
        lambda row: row.__setitem__(slice(None), EOS),
    ]
    for row, edit in zip(special, edits):
        edit(tokens[row])
    return tokens


def brute_lengths(tokens: np.ndarray) -> list[int]:
    lengths = []
    for row in tokens.tolist():
        current = 0
        for position, token in enumerate(row):
            current += 1
            if token == EOS or position == len(row) - 1:
                lengths.append(current)
                current = 0
    return lengths


@pytest.mark.parametrize("seed", range(40))
def test_host_lengths_equal_the_device_path(seed):
    rng = np.random.default_rng(seed)
    tokens = random_tokens(rng, int(rng.integers(1, 7)), int(rng.integers(1, 40)))
    host = HostDocuments.from_tokens(tokens, EOS).lengths()
    assert host == document_lengths(torch.from_numpy(tokens), EOS) == brute_lengths(tokens)
    assert all(isinstance(n, int) for n in host)


class _Fmha:
    class attn_bias:  # noqa: N801 - mirrors xformers.ops.fmha.attn_bias
        BlockDiagonalCausalMask = FakeBias


class HostSync(AssertionError):
    pass


class _NoNonzero(torch.utils._python_dispatch.TorchDispatchMode):
    """Ops that wait for the device when their input lives there."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.nonzero.default, torch.ops.aten._local_scalar_dense.default):
            raise HostSync(f"{func} reads device data on the host")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def no_host_sync(monkeypatch):
    """Every way a mask builder could copy a tensor to the host raises HostSync."""

    def refuse(name):
        def method(self, *args, **kwargs):
            raise HostSync(f"Tensor.{name} copies device data to the host")

        return method

    with monkeypatch.context() as patch:
        for name in ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__index__"):
            patch.setattr(torch.Tensor, name, refuse(name))
        with _NoNonzero():
            yield


@pytest.mark.parametrize(("kind", "window"), KINDS)
@pytest.mark.parametrize("seed", range(5))
def test_xformers_mask_from_host_documents_never_syncs(monkeypatch, kind, window, seed):
    monkeypatch.setattr(xformers_backend, "_import_fmha", lambda: _Fmha)
    tokens = random_tokens(np.random.default_rng(seed), 5, 33)
    device_tokens = torch.from_numpy(tokens)
    docs = HostDocuments.from_tokens(tokens, EOS)
    with no_host_sync(monkeypatch):
        mask = self_attn_mask(kind, device_tokens, EOS, window, backend="xformers", docs=docs)
    synced = self_attn_mask(kind, device_tokens, EOS, window, backend="xformers")
    assert isinstance(mask, XformersBlockDiagonal) and isinstance(synced, XformersBlockDiagonal)
    assert mask.bias.seqlens == synced.bias.seqlens == brute_lengths(tokens)
    assert mask.bias.window == synced.bias.window == window
    # the check can fail: without host documents the builder reads the device tokens
    with pytest.raises(HostSync), no_host_sync(monkeypatch):
        self_attn_mask(kind, device_tokens, EOS, window, backend="xformers")


def test_host_documents_of_other_rows_are_refused():
    docs = HostDocuments.from_tokens(np.zeros((2, 8), dtype=np.int64), EOS)
    with pytest.raises(ValueError, match="host documents are for rows of shape"):
        self_attn_mask("block_causal", torch.zeros(2, 9, dtype=torch.long), EOS, docs=docs)


def random_patch_lengths(rng: np.random.Generator, bsz: int, seqlen: int) -> np.ndarray:
    """Rows start with a patch of 1, sum to N or N+1, right-padded with zeros."""
    rows = []
    for row in range(bsz):
        total, lengths = seqlen + row % 2, [1]
        while sum(lengths) < total:
            lengths.append(min(int(rng.integers(1, 6)), total - sum(lengths)))
        rows.append(lengths)
    width = max(map(len, rows)) + int(rng.integers(0, 3))
    return np.array([r + [0] * (width - len(r)) for r in rows], dtype=np.int64)


@pytest.mark.parametrize("seed", range(30))
def test_host_patch_documents_equal_the_global_models_device_path(seed):
    rng = np.random.default_rng(seed)
    bsz, seqlen = int(rng.integers(1, 6)), int(rng.integers(1, 30))
    tokens, lengths = random_tokens(rng, bsz, seqlen), random_patch_lengths(rng, bsz, seqlen)
    device_tokens, device_lengths = torch.from_numpy(tokens), torch.from_numpy(lengths)
    patch_ids = patch_ids_from_lengths(device_lengths, seqlen)
    model = SimpleNamespace(args=SimpleNamespace(attn_bias_type="block_causal", eos_id=EOS))
    device = ByteLatentTransformer._patch_has_eos(model, device_tokens, patch_ids, lengths.shape[1])
    host = host_patch_has_eos(tokens, lengths, EOS)
    assert np.array_equal(host, device.numpy())
    # what the global model builds from them: the same documents
    global_tokens = torch.where(device, EOS, BOE_ID)
    assert HostDocuments(host).lengths() == document_lengths(global_tokens, EOS)


def _fake_xformers_attention(q, k, v, mask):
    """The function xformers would compute for ``mask`` (dense, on CPU)."""
    bsz, n_heads, seqlen, head_dim = q.shape
    k = k.repeat_interleave(n_heads // k.shape[1], dim=1)
    v = v.repeat_interleave(n_heads // v.shape[1], dim=1)
    if not isinstance(mask, XformersBlockDiagonal):
        assert isinstance(mask, XformersCausal)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    flat = [t.transpose(0, 1).reshape(1, n_heads, bsz * seqlen, head_dim) for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*flat, attn_mask=mask.bias.allowed())
    return out.reshape(n_heads, bsz, seqlen, head_dim).transpose(0, 1)


@pytest.fixture
def xformers_on_cpu(monkeypatch):
    """Models resolve attn_impl=xformers to xformers on CPU, run by a dense stand-in; the mask
    builder's only device -> host path (document_lengths) raises."""
    for module in (blt, global_transformer, transformer):
        monkeypatch.setattr(module, "resolve_backend", lambda impl, device: impl)
    monkeypatch.setattr(xformers_backend, "_import_fmha", lambda: _Fmha)
    monkeypatch.setattr(xformers_backend.BACKEND, "attend", _fake_xformers_attention)
    built = []
    monkeypatch.setattr(
        FakeBias, "from_seqlens", classmethod(lambda cls, s: built.append(s) or cls(s))
    )

    def synced(tokens, eos_id):
        raise HostSync("document lengths read from the device tokens")

    monkeypatch.setattr(xformers_backend, "document_lengths", synced)
    return built


def _batch(rng: np.random.Generator, bsz: int, seqlen: int, patches: bool) -> Batch:
    tokens = random_tokens(rng, bsz, seqlen)
    lengths = random_patch_lengths(rng, bsz, seqlen) if patches else None
    return Batch(tokens, tokens, np.ones_like(tokens, dtype=bool), lengths)


def test_trainer_forward_builds_blt_xformers_masks_from_host_data(xformers_on_cpu):
    def blt_model(attn_impl: str) -> ByteLatentTransformer:
        flags = {**BLT_BASE, **BLT_VARIANTS["released_flags"], "attn_impl": attn_impl}
        return build(ByteLatentTransformer, ByteLatentTransformerArgs(**flags), seed=3)

    model = blt_model("xformers")
    args = model.args
    assert args.local_attn_kind() == "local_block_causal" and args.attn_bias_type == "block_causal"
    batch = _batch(np.random.default_rng(0), 3, 40, patches=True)
    got = forward_logits(model, batch, torch.device("cpu"))
    seqlens = xformers_on_cpu
    assert len(seqlens) == 2  # the local mask (shared by encoder and decoder) and the global one
    assert seqlens[0] == brute_lengths(batch.x)
    assert sum(seqlens[1]) == batch.patch_lengths.size
    want = forward_logits(blt_model("sdpa"), batch, torch.device("cpu"))  # the same weights
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_trainer_forward_builds_lm_xformers_masks_from_host_data(xformers_on_cpu):
    def lm(attn_impl: str) -> LMTransformer:
        args = LMTransformerArgs(
            dim=32, n_layers=2, n_heads=2, max_seqlen=64, attn_bias_type="local_block_causal",
            sliding_window=6, attn_impl=attn_impl,
        )  # fmt: skip
        return build(LMTransformer, args, seed=2)

    model = lm("xformers")
    batch = _batch(np.random.default_rng(1), 3, 48, patches=False)
    got = forward_logits(model, batch, torch.device("cpu"))
    assert xformers_on_cpu == [brute_lengths(batch.x)]
    want = forward_logits(lm("sdpa"), batch, torch.device("cpu"))  # the same weights
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # a direct call without the host arrays takes the device path (here: refused)
    with pytest.raises(HostSync):
        model(torch.from_numpy(batch.x))


def test_flex_masks_build_without_host_sync(monkeypatch):
    """flex BlockMasks (self and windowed patch cross masks) come from device tensors alone."""
    rng = np.random.default_rng(0)
    tokens = torch.from_numpy(random_tokens(rng, 3, 300))
    lengths = torch.from_numpy(random_patch_lengths(rng, 3, 300))
    num_patches = lengths.shape[1]
    enc_ids = patch_ids_from_lengths(lengths, 300)
    dec_ids = decoder_patch_ids_from_lengths(lengths, 300)
    with no_host_sync(monkeypatch):
        for kind, window in KINDS:
            self_attn_mask(kind, tokens, EOS, window, backend="flex_attention")
        build_cross_mask("encoder", enc_ids, num_patches, 2, 3, "flex_attention")
        build_cross_mask("decoder", dec_ids, num_patches, 2, 3, "flex_attention")
