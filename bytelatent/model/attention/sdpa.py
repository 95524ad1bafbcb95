"""The sdpa backend (``F.scaled_dot_product_attention``): CPU and CUDA, and the fallback of the others.

Its masks, built once per forward and shared by every layer:

- ``SdpaCausal``: plain causal runs the ``is_causal`` kernel (no tensor);
- ``SdpaDense``: a dense bool [B|1,1,Q,K] (document masks, cross-attention masks);
- ``SdpaBanded``: a local mask over a row much longer than its window (``chunked.BandedMask``);
- on CPU, a dense document mask with an execution plan (``chunked``): ``SdpaSingleDocument``
  (every row is one document and any window covers the row, so the mask *is* plain causal and
  sdpa runs ``is_causal``) or ``SdpaChunked`` (a ``ChunkPlan``). Both are ``SdpaDense`` (the
  dense tensor stays the definition), so anything that runs a dense mask runs them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F

from bytelatent.model.attention import chunked
from bytelatent.model.attention.base import AttnMask, register_backend, wrong_backend
from bytelatent.model.attention.masks import (
    BlockCausal,
    Causal,
    Dense,
    KeyIntervals,
    LocalBlockCausal,
    MaskSpec,
    dense_self_attn_mask,
)
from bytelatent.model.cpu_bf16 import autocast_off, fp32_attention


@dataclass(eq=False)
class SdpaCausal(AttnMask):
    """Plain causal: the ``is_causal`` kernel (needs as many queries as keys)."""

    backend: ClassVar[str] = "sdpa"


@dataclass(eq=False)
class SdpaDense(AttnMask):
    """A dense bool mask ``dense`` (broadcastable to [B,1,Q,K], True = attend)."""

    backend: ClassVar[str] = "sdpa"
    dense: torch.Tensor
    query_has_key: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.dense.dtype != torch.bool:
            raise ValueError(
                f"{type(self).__name__}.dense must be a bool tensor, got {self.dense.dtype}"
            )


@dataclass(eq=False)
class SdpaSingleDocument(SdpaDense):
    """CPU: a document mask whose rows are single documents: runs as ``is_causal``."""


@dataclass(eq=False)
class SdpaChunked(SdpaDense):
    """CPU: a document mask run piece by piece over ``chunks`` (see ``chunked.ChunkPlan``)."""

    chunks: chunked.ChunkPlan = field(kw_only=True)


@dataclass(eq=False)
class SdpaBanded(AttnMask):
    """A local self-attention mask stored per query block (see ``chunked.BandedMask``)."""

    backend: ClassVar[str] = "sdpa"
    band: chunked.BandedMask


class SdpaBackend:
    """``F.scaled_dot_product_attention`` with the masks above; runs everywhere."""

    name = "sdpa"

    def unavailable_reason(self, device: torch.device) -> str | None:
        return None

    def build(self, spec: MaskSpec) -> AttnMask:
        if isinstance(spec, Causal):
            return SdpaCausal()
        if isinstance(spec, Dense):
            return SdpaDense(*spec.opened())
        if isinstance(spec, KeyIntervals):
            return SdpaDense(*Dense(spec.allowed()).opened())
        return _document_mask(spec)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttnMask
    ) -> torch.Tensor:
        if fp32_attention(q):  # bf16 on a CPU without bf16 GEMMs: the kernels in fp32
            with autocast_off(q.device.type):
                return self._attend(q.float(), k.float(), v.float(), mask).to(q.dtype)
        return self._attend(q, k, v, mask)

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttnMask
    ) -> torch.Tensor:
        if isinstance(mask, SdpaCausal):
            if q.shape[2] != k.shape[2]:
                raise ValueError("is_causal masks need as many queries as keys; pass a dense mask")
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if isinstance(mask, SdpaBanded):
            return chunked.attend_banded(q, k, v, mask.band)
        if isinstance(mask, SdpaSingleDocument) and q.shape[2] == k.shape[2]:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if (
            isinstance(mask, SdpaChunked)
            and q.device.type == "cpu"
            and q.shape[2] == mask.chunks.seqlen
        ):
            return chunked.attend_chunked(q, k, v, mask.chunks)
        if isinstance(mask, SdpaDense):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.dense)
        raise wrong_backend(mask, self.name)


def _document_mask(spec: BlockCausal | LocalBlockCausal) -> AttnMask:
    """A (local) block-causal mask: banded when the row is much longer than the window, else
    dense, with the cheapest exact CPU plan attached on CPU."""
    tokens, eos_id = spec.tokens, spec.eos_id
    seqlen = tokens.shape[1]
    window = spec.window if isinstance(spec, LocalBlockCausal) else None
    kind = "block_causal" if window is None else "local_block_causal"
    if window is not None:
        chunk = chunked.band_chunk(seqlen, window)
        if chunk is not None:
            return SdpaBanded(chunked.banded_self_attn_mask(tokens, eos_id, window, chunk))
    dense = dense_self_attn_mask(kind, tokens, eos_id, window)
    if tokens.device.type == "cpu":
        single = (
            spec.docs.single_document
            if spec.docs is not None  # from the host: no device sync, no graph break
            else chunked.is_single_document(tokens, eos_id)
        )
        if (window is None or window >= seqlen) and single:
            return SdpaSingleDocument(dense)
        if seqlen > chunked.SDPA_CHUNK and not torch.compiler.is_compiling():
            plan = chunked.chunk_plan(dense, tokens, eos_id, window, chunked.SDPA_CHUNK)
            return SdpaChunked(dense, chunks=plan)
    return SdpaDense(dense)


BACKEND = register_backend(SdpaBackend())
