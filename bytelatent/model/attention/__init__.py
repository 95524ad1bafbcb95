"""Attention masks and the backends that run them (the only place masks are built).

- ``masks``: what a mask means, for every backend: the specs ``Causal``, ``BlockCausal``,
  ``LocalBlockCausal``, ``KeyIntervals`` (cross-attention patch masks), ``Dense`` (their union is
  ``MaskSpec``), the host document ends (``HostDocuments``) and the mask math they share;
- ``base``: the ``AttentionBackend`` protocol, ``AttnMask`` (the base of every backend's mask
  types), the registry (``select_backend``) and ``attend``;
- one module per backend, each with its own mask types: ``sdpa`` (CPU and CUDA, the fallback),
  ``chunked`` (the block-structured plans sdpa runs: banded local masks, CPU chunk plans),
  ``flex`` (CUDA: BlockMasks from key intervals), ``xformers`` (optional, CUDA, imported lazily).

A model picks its backend once (``resolve_backend``/``select_backend``: flex or xformers where
they can run, else sdpa with the same masks, logged once), builds each mask once per forward in
that backend's representation (``self_attn_mask``, ``build_mask``) and shares it across the
layers; ``attend(q, k, v, mask)`` runs it on the backend it was built for, never on a silently
different mask. How to add a backend: docs/extending.md, "How to add an attention backend".
"""

from __future__ import annotations

from typing import Any

import torch

from bytelatent.model.attention import base, chunked, flex, sdpa, xformers
from bytelatent.model.attention.base import (
    AttentionBackend,
    AttnMask,
    attend,
    build_mask,
    get_backend,
    register_backend,
    resolve_backend,
    select_backend,
    self_attn_mask,
)
from bytelatent.model.attention.chunked import (
    SDPA_CHUNK,
    BandedMask,
    ChunkPlan,
    band_chunk,
    banded_self_attn_mask,
    chunk_plan,
)
from bytelatent.model.attention.flex import (
    FLEX_BLOCK,
    FlexMask,
    flex_interval_block_mask,
    flex_self_block_mask,
)
from bytelatent.model.attention.masks import (
    SELF_ATTN_KINDS,
    BlockCausal,
    Causal,
    Dense,
    HostBatch,
    HostDocuments,
    KeyIntervals,
    LocalBlockCausal,
    MaskSpec,
    dense_self_attn_mask,
    document_ids,
    document_lengths,
    first_visible_key,
    self_attn_spec,
)
from bytelatent.model.attention.sdpa import (
    SdpaBanded,
    SdpaCausal,
    SdpaChunked,
    SdpaDense,
    SdpaSingleDocument,
)
from bytelatent.model.attention.xformers import (
    XformersBlockDiagonal,
    XformersCausal,
    XformersDense,
    xformers_available,
)


def _from_fields(
    *,
    is_causal: bool = False,
    dense: torch.Tensor | None = None,
    band: BandedMask | None = None,
    block_mask: Any = None,
    xformers_bias: Any = None,
    query_has_key: torch.Tensor | None = None,
    backend: str = "sdpa",
) -> AttnMask:
    """``AttnMask(field=...)``: the old keyword form, mapped onto the variant it describes.

    Kept for ``patch_utils``' flex cross mask (``AttnMask(block_mask=..., query_has_key=...)``);
    new code names the variant (``FlexMask(...)``) or builds from a spec (``build_mask``)."""
    given = {
        "is_causal": is_causal,
        "dense": dense is not None,
        "band": band is not None,
        "block_mask": block_mask is not None,
        "xformers_bias": xformers_bias is not None,
    }
    if sum(given.values()) != 1:
        raise ValueError(
            "AttnMask needs exactly one of is_causal=True, a dense bool tensor, a band, a flex "
            "block_mask or an xformers bias (or name the variant: SdpaDense, FlexMask, ...)"
        )
    get_backend(backend)
    variant = {
        ("is_causal", "sdpa"): lambda: SdpaCausal(),
        ("is_causal", "xformers"): lambda: XformersCausal(),
        ("dense", "sdpa"): lambda: SdpaDense(dense, query_has_key),
        ("dense", "xformers"): lambda: XformersDense(dense, query_has_key),
        ("band", "sdpa"): lambda: SdpaBanded(band),
        ("block_mask", "flex_attention"): lambda: FlexMask(block_mask, query_has_key),
        ("xformers_bias", "xformers"): lambda: XformersBlockDiagonal(xformers_bias),
    }.get((next(name for name, on in given.items() if on), backend))
    if variant is None:
        raise ValueError(f"no {backend} mask holds the fields given; name the variant instead")
    return variant()


base._LegacyConstructor.from_fields = staticmethod(_from_fields)

__all__ = [
    "FLEX_BLOCK",
    "SDPA_CHUNK",
    "SELF_ATTN_KINDS",
    "AttentionBackend",
    "AttnMask",
    "BandedMask",
    "BlockCausal",
    "Causal",
    "ChunkPlan",
    "Dense",
    "FlexMask",
    "HostBatch",
    "HostDocuments",
    "KeyIntervals",
    "LocalBlockCausal",
    "MaskSpec",
    "SdpaBanded",
    "SdpaCausal",
    "SdpaChunked",
    "SdpaDense",
    "SdpaSingleDocument",
    "XformersBlockDiagonal",
    "XformersCausal",
    "XformersDense",
    "attend",
    "band_chunk",
    "banded_self_attn_mask",
    "build_mask",
    "chunk_plan",
    "chunked",
    "dense_self_attn_mask",
    "document_ids",
    "document_lengths",
    "first_visible_key",
    "flex",
    "flex_interval_block_mask",
    "flex_self_block_mask",
    "get_backend",
    "register_backend",
    "resolve_backend",
    "sdpa",
    "select_backend",
    "self_attn_mask",
    "self_attn_spec",
    "xformers",
    "xformers_available",
]
