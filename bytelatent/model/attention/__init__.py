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
different mask. How to add a backend: docs/attention.md.
"""

from __future__ import annotations

from bytelatent.model.attention import chunked, flex, sdpa, xformers
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
