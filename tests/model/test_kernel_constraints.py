"""What the GPU kernels need of their inputs, checked on CPU (issue 39 item 4): xformers' dense
bias rows are 8-aligned in memory, and cached attention never hands sdpa a mask together with
``enable_gqa`` (only the math kernel takes both)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bytelatent.model import layers
from bytelatent.model.attention.xformers import BIAS_ALIGN, XformersDense, _additive_bias


@pytest.mark.parametrize("keys", [5, 8, 13, 97])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_xformers_dense_bias_rows_are_aligned(keys: int, dtype: torch.dtype) -> None:
    allowed = torch.rand(2, 1, 7, keys, generator=torch.Generator().manual_seed(keys)) > 0.3
    mask = XformersDense(allowed)
    bias = _additive_bias(mask, dtype)
    assert bias.shape == (2, 1, 7, keys) and bias.dtype == dtype
    assert bias.stride(-1) == 1
    assert bias.stride(-2) % BIAS_ALIGN == 0 and bias.stride(-2) >= keys
    assert bias.data_ptr() % 16 == 0
    assert torch.equal(bias == 0, allowed) and bool(torch.isinf(bias[~allowed]).all())
    assert _additive_bias(mask, dtype) is bias  # built once per dtype
    expanded = bias.expand(2, 4, 7, keys)  # what attend hands xformers
    assert expanded.stride(-2) % BIAS_ALIGN == 0


def _reference(q, k, v, mask):
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (6, 1), (3, 3)])
@pytest.mark.parametrize("with_mask", [True, False])
def test_cached_attention_never_combines_a_mask_with_gqa(
    heads: int, kv_heads: int, with_mask: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prefill of 5 positions through ``KVCache.attend`` (what generation runs)."""
    gen = torch.Generator().manual_seed(heads * 10 + kv_heads)
    bsz, seqlen, dim = 2, 5, 8
    xq = torch.randn(bsz, seqlen, heads, dim, generator=gen, dtype=torch.float64)
    xk, xv = (torch.randn(bsz, seqlen, kv_heads, dim, generator=gen, dtype=torch.float64)
              for _ in "kv")  # fmt: skip
    mask = torch.rand(bsz, 1, seqlen, seqlen, generator=gen) > 0.4 if with_mask else None
    if mask is not None:
        mask[..., 0] = True  # every query sees a key
    cache = layers.KVCache(
        keys=torch.zeros(bsz, kv_heads, 16, dim, dtype=torch.float64),
        values=torch.zeros(bsz, kv_heads, 16, dim, dtype=torch.float64),
        step=layers.CacheStep(torch.arange(seqlen).expand(bsz, -1), 0, 0, seqlen, mask),
    )
    calls = []
    sdpa = F.scaled_dot_product_attention

    def recording(*args, **kwargs):
        calls.append((kwargs.get("attn_mask") is not None, kwargs.get("enable_gqa", False)))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(layers.F, "scaled_dot_product_attention", recording)
    out = cache.attend(xq, xk, xv)
    monkeypatch.undo()
    assert calls and not any(masked and gqa for masked, gqa in calls), calls
    q, k, v = (t.transpose(1, 2) for t in (xq, xk, xv))
    torch.testing.assert_close(out, _reference(q, k, v, mask))
