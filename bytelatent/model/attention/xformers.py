"""The xformers backend (optional, CUDA only): ``memory_efficient_attention`` with its biases.

xformers is imported lazily, when a mask is built for it or run on it (never at module level).
Its masks, built once per forward:

- ``XformersBlockDiagonal``: document masks as a block-diagonal causal bias over the flattened
  batch (plus ``make_local_attention`` for a window), built from host document lengths
  (``masks.HostDocuments`` when the caller hands the batch's host arrays over, the training
  forward always does; else one device-to-host copy of the end flags);
- ``XformersCausal``: plain causal (``LowerTriangularMask``);
- ``XformersDense``: a dense bool mask run as an additive bias (cross-attention masks: slow but
  the same function), the bias built once per dtype and shared by the layers.

It also runs sdpa's causal and dense masks (``attend(..., backend="xformers")``), as those are
the same representations.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from bytelatent.model.attention.base import AttnMask, register_backend, wrong_backend
from bytelatent.model.attention.masks import (
    Causal,
    Dense,
    KeyIntervals,
    LocalBlockCausal,
    MaskCache,
    MaskSpec,
    document_lengths,
)
from bytelatent.model.attention.sdpa import SdpaCausal, SdpaDense


@dataclass(eq=False)
class XformersCausal(SdpaCausal):
    """Plain causal, run as xformers' ``LowerTriangularMask``."""

    backend: ClassVar[str] = "xformers"


@dataclass(eq=False)
class XformersDense(SdpaDense):
    """A dense bool mask, run as an additive bias (0 / -inf) built once per dtype."""

    backend: ClassVar[str] = "xformers"
    _additive: MaskCache = field(default_factory=MaskCache, repr=False)


@dataclass(eq=False)
class XformersBlockDiagonal(AttnMask):
    """An xformers attention bias over the flattened batch: q/k/v run as one row [1, B*S, H, D]."""

    backend: ClassVar[str] = "xformers"
    bias: Any


class XformersBackend:
    """``xformers.ops.fmha.memory_efficient_attention`` with the masks above."""

    name = "xformers"

    def unavailable_reason(self, device: torch.device) -> str | None:
        if device.type != "cuda":
            return f"it needs CUDA and the model is on {device.type}"
        if not xformers_available():
            return "xformers is not installed or cannot load its CUDA kernels"
        return None

    def build(self, spec: MaskSpec) -> AttnMask:
        if isinstance(spec, Causal):
            return XformersCausal()
        if isinstance(spec, Dense):
            return XformersDense(*spec.opened())
        if isinstance(spec, KeyIntervals):
            return XformersDense(*Dense(spec.allowed()).opened())
        fmha = _import_fmha()
        if spec.docs is None:
            seqlens = document_lengths(spec.tokens, spec.eos_id)
        else:
            seqlens = spec.docs.lengths()
        bias = fmha.attn_bias.BlockDiagonalCausalMask.from_seqlens(seqlens)
        if isinstance(spec, LocalBlockCausal):
            bias = bias.make_local_attention(spec.window)
        return XformersBlockDiagonal(bias)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttnMask
    ) -> torch.Tensor:
        if not q.is_cuda:
            raise RuntimeError(
                "attention backend xformers needs CUDA tensors (it has no CPU kernel); "
                "use backend='sdpa' (resolve_backend does this for model configs)"
            )
        if not isinstance(mask, (XformersBlockDiagonal, SdpaCausal, SdpaDense)):
            raise wrong_backend(mask, self.name)
        fmha = _import_fmha()
        bsz, n_heads, seqlen, head_dim = q.shape
        flatten = isinstance(mask, XformersBlockDiagonal)
        if flatten:
            bias = mask.bias
        elif isinstance(mask, SdpaCausal):
            bias = fmha.attn_bias.LowerTriangularMask()
        else:
            bias = _additive_bias(mask, q.dtype).expand(bsz, n_heads, seqlen, k.shape[2])
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # xformers wants [B,S,H,D]
        if flatten:
            q, k, v = (t.reshape(1, -1, n_heads, head_dim) for t in (q, k, v))
        out = fmha.memory_efficient_attention(q, k, v, attn_bias=bias)
        return out.reshape(bsz, seqlen, n_heads, head_dim).transpose(1, 2)


BIAS_ALIGN = 8  # xformers' kernels read a bf16/fp16 bias in 16-byte rows: K % 8 == 0


def _additive_bias(mask: SdpaDense, dtype: torch.dtype) -> torch.Tensor:
    """The dense mask as 0 / -inf of ``dtype`` (kept on an XformersDense: once per forward).

    Its rows are allocated at K rounded up to ``BIAS_ALIGN`` columns and sliced back to K (the
    form xformers documents for a K that is not a multiple of 8): the view's row stride is
    aligned, which the kernels need in bf16/fp16."""
    cache = mask._additive.masks if isinstance(mask, XformersDense) else {}
    if dtype not in cache:
        *lead, keys = mask.dense.shape
        padded = -(-keys // BIAS_ALIGN) * BIAS_ALIGN
        storage = torch.zeros((*lead, padded), dtype=dtype, device=mask.dense.device)
        cache[dtype] = storage[..., :keys].masked_fill_(~mask.dense, float("-inf"))
    return cache[dtype]


@functools.cache
def xformers_available() -> bool:
    """Whether xformers imports (cached: asked once per process)."""
    try:
        _import_fmha()
    except RuntimeError:
        return False
    return True


def _import_fmha() -> Any:
    try:
        from xformers.ops import fmha  # optional GPU dependency, imported lazily
    except ImportError as err:
        raise RuntimeError(
            f"attention backend xformers is not installed ({err}); pip install 'bytelatent[gpu]' "
            "or use attn_impl=sdpa"
        ) from err
    return fmha


BACKEND = register_backend(XformersBackend())
