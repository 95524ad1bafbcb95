"""BLT's byte-level local encoder/decoder and the patch-level global transformer.

Parameter names and shapes follow the reference checkpoints (``BLT_REFERENCE_FACTS.md`` §3.11).
Where the reference crashes or does nothing (docs/differences.md):

- cross-attention encoder without ``cross_attn_init_by_pooling``: the queries start from a
  learned ``patch_queries`` [k, dim] (one vector per slot, shared by all patches), so the k slots
  can differ;
- ``use_rope=False``: ``pos_embeddings`` are added to the local models' inputs (learned absolute
  byte positions, like RoPE not reset at document boundaries);
- pooling with several ops ("avg,max") before the encoder cross-attention: the projection takes
  the concatenated width;
- the decoder's patch projection exists whenever its output is needed (``dim_global != dim`` or
  k > 1 slots for cross-attention), and without decoder cross-attention it is applied per patch
  before gathering per byte (same result as gathering first, which costs k*N/P times the FLOPs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from bytelatent.archs.blt.args import ByteLatentTransformerArgs
from bytelatent.archs.blt.cross_attention import CrossAttention, PatchStep, SlotCache
from bytelatent.archs.blt.patch_utils import PatchCrossMask, pool_patches
from bytelatent.model.args import BaseTransformerArgs, block_head_counts
from bytelatent.model.attention import (
    AttnMask,
)
from bytelatent.model.cpu_bf16 import Linear
from bytelatent.model.layers import (
    KVCache,
    RMSNorm,
    RotaryEmbedding,
    TransformerBlock,
    init_std_factor,
)


def _trunc_normal_(weight: torch.Tensor, std: float) -> None:
    nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-3 * std, b=3 * std)


def _dropout(h: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    return F.dropout(h, p=p, training=training) if p > 0 and training else h


def _identity_rotation(seqlen: int, head_dim: int, like: torch.Tensor) -> torch.Tensor:
    """RoPE table of angle 0 (no rotation): what blocks get when use_rope=False."""
    eye = torch.eye(2, dtype=torch.float32, device=like.device)
    return eye.expand(seqlen, head_dim // 2, 2, 2)


@dataclass
class DecoderCache:
    """What ``LocalDecoder.forward`` reads and extends when run a few bytes at a time.

    ``layers``: one KV cache per block; ``patches``: where new patch states go and which patch
    each new byte reads; ``patch_states`` [B, patches, dim]: the projected patch states (without
    cross-attention); ``cross``: one slot cache per cross-attention layer (with it).
    """

    layers: Sequence[KVCache]
    patches: PatchStep
    patch_states: torch.Tensor | None = None
    cross: Sequence[SlotCache] | None = None


class PatchQueries:
    """The patch states the encoder forms while it runs (``LocalEncoder.forward(patches=...)``):
    ``ids`` [B,N] the patch of each byte, ``count`` patches per row, ``mask`` the encoder
    cross-attention mask; ``embeds`` [B,P*k,d] is set by the forward. A plain object, not a
    dataclass, so that module hooks pass it through untouched."""

    __slots__ = ("ids", "count", "mask", "embeds")

    def __init__(self, ids: torch.Tensor, count: int, mask: PatchCrossMask) -> None:
        self.ids, self.count, self.mask = ids, count, mask
        self.embeds: torch.Tensor | None = None


class LocalModelBase(nn.Module):
    """Layers, positions and cross-attention layers shared by the local encoder and decoder."""

    def __init__(
        self,
        block_args: BaseTransformerArgs,
        args: ByteLatentTransformerArgs,
        side: str,
    ) -> None:
        super().__init__()
        # cross_for_layer[i]: index of the cross-attention paired with layer i, or None
        self.cross_for_layer = args.cross_attn_pairing(side)
        n_cross = args.n_cross_attn_layers(side)
        self.dim = block_args.dim
        self.dropout = args.dropout
        self.use_rope = args.use_rope
        self.init_std_factor = args.init_std_factor
        self.head_dim, n_heads, _ = block_head_counts(block_args)
        self.layers = nn.ModuleList(
            TransformerBlock(block_args) for _ in range(block_args.n_layers)
        )
        if args.use_rope:
            self.rope = RotaryEmbedding(
                theta=block_args.rope_theta,
                head_dim=self.head_dim,
                max_seqlen=block_args.max_seqlen,
                use_fp32_outer=block_args.rope_use_fp32_in_outer_product,
            )
            self.pos_embeddings = None
        else:
            self.rope = None
            self.pos_embeddings = nn.Embedding(block_args.max_seqlen, self.dim)
        cross_heads = args.cross_attn_nheads or n_heads
        self.cross_attn_layers = (
            nn.ModuleList(
                CrossAttention(
                    self.dim,
                    self.dim // cross_heads,
                    cross_heads,
                    cross_heads,
                    args.norm_eps,
                )
                for _ in range(n_cross)
            )
            if n_cross
            else None
        )

    def freqs(self, seqlen: int, like: torch.Tensor) -> torch.Tensor:
        if self.rope is not None:
            return self.rope(seqlen=seqlen)
        return _identity_rotation(seqlen, self.head_dim, like)

    @property
    def max_positions(self) -> int:
        """Length of the position table (RoPE or learned positions): the most bytes a row holds."""
        if self.rope is not None:
            return self.rope.max_seqlen
        return self.pos_embeddings.num_embeddings

    def cached_freqs(self, cache: Sequence[KVCache], like: torch.Tensor) -> torch.Tensor:
        """The RoPE table whose rows the caches' positions pick (identity without RoPE)."""
        if self.rope is not None:
            return self.rope.freqs_cis
        return _identity_rotation(cache[0].keys.shape[2], self.head_dim, like)

    def add_positions(self, h: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Learned absolute positions (use_rope=False) of bytes 0..S-1, or of ``positions`` [B,S]."""
        if self.pos_embeddings is None:
            return h
        if positions is not None:
            return h + self.pos_embeddings(positions)
        if h.shape[1] > self.pos_embeddings.num_embeddings:
            raise ValueError(
                f"{h.shape[1]} bytes exceed the learned position table "
                f"(max_encoder_seq_length={self.pos_embeddings.num_embeddings})"
            )
        return h + self.pos_embeddings.weight[: h.shape[1]]

    @torch.no_grad()
    def init_weights(self) -> None:
        std = self.dim**-0.5
        if self.rope is not None:
            self.rope.reset_parameters()
        if self.pos_embeddings is not None:
            _trunc_normal_(self.pos_embeddings.weight, std)
        n_layers = len(self.layers)
        for depth, layer in enumerate(self.layers):
            layer.init_weights(
                None, init_std_factor(self.init_std_factor, depth, n_layers, self.dim)
            )
        for depth, layer in enumerate(self.cross_attn_layers or ()):
            layer.init_weights(
                None, init_std_factor(self.init_std_factor, depth, n_layers, self.dim)
            )


class LocalEncoder(LocalModelBase):
    """Bytes -> byte states h [B,N,d] and, with cross-attention, patch states [B,P*k,d]."""

    def __init__(self, args: ByteLatentTransformerArgs) -> None:
        super().__init__(args.encoder_block_args(), args, "encoder")
        self.cross_attn_encoder = args.cross_attn_encoder
        self.cross_attn_k = args.cross_attn_k
        self.pooling = args.pooling_modes()
        self.init_by_pooling = args.cross_attn_init_by_pooling
        self.patch_embedding_projection = None
        self.patch_queries = None
        if args.cross_attn_encoder and args.cross_attn_init_by_pooling:
            self.patch_embedding_projection = Linear(
                self.dim * len(self.pooling), self.dim * args.cross_attn_k, bias=False
            )
        elif args.cross_attn_encoder:
            self.patch_queries = nn.Parameter(torch.empty(args.cross_attn_k, self.dim))
        self.tok_embeddings = nn.Embedding(args.vocab_size + args.pm_size, self.dim)

    def forward(
        self,
        embeds: torch.Tensor,
        mask: AttnMask | None,
        cache: Sequence[KVCache] | None = None,
        patches: PatchQueries | None = None,
    ) -> list[torch.Tensor]:
        """embeds [B,N,d] (byte + hash embeddings) -> every layer's byte states [B,N,d].

        ``cache``: one KV cache per layer (generation): ``embeds`` are new bytes after the cached
        ones (positions and masks from the caches' step); a cache with ``outputs`` also keeps its
        layer's byte states, from which ``encode_patches`` later forms patches.

        ``patches`` (training, whole rows): each cross-attention runs right after the layer it is
        paired with, as the reference's encoder does, and leaves the patch states in
        ``patches.embeds``. The values are those of ``encode_patches`` after the layers, but
        autograd sums a tensor's gradient contributions in the order their ops ran: this order
        keeps the gradients bitwise the reference's when a layer's states feed both the next
        layer and a cross-attention (cross-attention after several encoder layers)."""
        h, freqs, caches = self._layer_inputs(embeds, cache)
        states = []
        for layer, layer_cache, cross_index in zip(
            self.layers, caches, self.cross_for_layer, strict=True
        ):
            h = layer(h, freqs, mask, cache=layer_cache)
            if layer_cache is not None:
                layer_cache.keep_outputs(h)
            states.append(h)
            if patches is not None and cross_index is not None:
                patches.embeds = self._cross_step(
                    patches.embeds, h, cross_index, patches.ids, patches.count, patches.mask
                )
        return states

    def _layer_inputs(
        self, embeds: torch.Tensor, cache: Sequence[KVCache] | None
    ) -> tuple[torch.Tensor, torch.Tensor, Sequence[KVCache | None]]:
        """The first layer's input (positions, dropout), the rotation table, a cache per layer."""
        positions = None if cache is None else cache[0].step.positions
        h = _dropout(self.add_positions(embeds, positions), self.dropout, self.training)
        if cache is None:
            return h, self.freqs(h.shape[1], h), [None] * len(self.layers)
        return h, self.cached_freqs(cache, h), cache

    def encode_patches(
        self,
        states: Sequence[torch.Tensor | None],
        patch_ids: torch.Tensor,
        num_patches: int,
        cross_mask: PatchCrossMask,
    ) -> torch.Tensor:
        """Patch states [B,P*k,d] from the byte states of the layers paired with a
        cross-attention (``states[i]`` [B,N,d], None for unpaired layers): queries from
        ``patch_queries`` or pooling, then each cross-attention in layer order (generation;
        training forms them during ``forward``)."""
        patch_embeds = None
        for layer_states, cross_index in zip(states, self.cross_for_layer):
            if cross_index is not None:
                patch_embeds = self._cross_step(
                    patch_embeds, layer_states, cross_index, patch_ids, num_patches, cross_mask
                )
        return patch_embeds

    def _cross_step(
        self,
        patch_embeds: torch.Tensor | None,
        layer_states: torch.Tensor,
        cross_index: int,
        patch_ids: torch.Tensor,
        num_patches: int,
        cross_mask: PatchCrossMask,
    ) -> torch.Tensor:
        """One cross-attention of the patch queries over a layer's byte states (the queries from
        ``patch_queries`` or pooling of these states when ``patch_embeds`` is None)."""
        if patch_embeds is None:
            patch_embeds = self._initial_patch_queries(layer_states, patch_ids, num_patches)
        cross = self.cross_attn_layers[cross_index]
        # double residual, as the reference: CrossAttention already returns x + out
        return patch_embeds + cross(patch_embeds, layer_states, cross_mask)

    def _initial_patch_queries(
        self, h: torch.Tensor, patch_ids: torch.Tensor, num_patches: int
    ) -> torch.Tensor:
        bsz = h.shape[0]
        if self.patch_queries is not None:
            queries = self.patch_queries.to(h.dtype)
            return queries.repeat(num_patches, 1).unsqueeze(0).expand(bsz, -1, -1)
        pooled = self.patch_embedding_projection(
            pool_patches(h, patch_ids, num_patches, self.pooling)
        )
        return pooled.reshape(bsz, num_patches * self.cross_attn_k, self.dim)

    @torch.no_grad()
    def init_weights(self) -> None:
        super().init_weights()
        std = self.dim**-0.5
        _trunc_normal_(self.tok_embeddings.weight, std)
        if self.patch_queries is not None:
            _trunc_normal_(self.patch_queries, std)
        if self.patch_embedding_projection is not None:
            _trunc_normal_(
                self.patch_embedding_projection.weight,
                self.patch_embedding_projection.in_features**-0.5,
            )


class LocalDecoder(LocalModelBase):
    """Byte states + global patch states -> logits [B,N,vocab+pm_size] float32."""

    def __init__(self, args: ByteLatentTransformerArgs) -> None:
        super().__init__(args.decoder_block_args(), args, "decoder")
        self.cross_attn_decoder = args.cross_attn_decoder
        self.slots = args.cross_attn_k if args.cross_attn_decoder else 1
        self.patch_embedding_projection = None
        if args.dim != self.dim or self.slots > 1:
            self.patch_embedding_projection = Linear(args.dim, self.dim * self.slots, bias=False)
        self.norm = RMSNorm(self.dim, eps=args.norm_eps)
        # boundary_head: 256 more classes, "byte b, and its patch ends after it" (docs/byteify.md)
        n_out = args.vocab_size + args.pm_size + (256 if args.boundary_head else 0)
        self.output = Linear(self.dim, n_out, bias=False)

    def forward(
        self,
        embeds: torch.Tensor,
        patch_embeds: torch.Tensor,
        decoder_patch_ids: torch.Tensor | None,
        mask: AttnMask | None,
        cross_mask: PatchCrossMask | None,
        cache: DecoderCache | None = None,
    ) -> torch.Tensor:
        """embeds [B,N,d], patch_embeds [B,P,dim_global] -> logits [B,N,V] float32.

        ``cache`` (generation): ``embeds`` are new bytes after the cached ones and
        ``patch_embeds`` only the new patches' global states [B,P_new,dim_global] (stored at
        ``cache.patches.write_at``, possibly P_new=0); each byte reads its patch
        (``cache.patches.patch_ids``) from the cache; ``decoder_patch_ids``, ``mask`` and
        ``cross_mask`` are unused."""
        bsz, num_patches = patch_embeds.shape[:2]
        if self.patch_embedding_projection is not None:
            patch_embeds = self.patch_embedding_projection(patch_embeds)
        h = embeds
        if self.cross_attn_decoder:
            patch_embeds = patch_embeds.reshape(bsz, num_patches * self.slots, self.dim)
        elif cache is not None:
            cache.patches.store(cache.patch_states, patch_embeds)
            h = h + cache.patches.read(cache.patch_states)[0][:, :, -1]
        else:
            index = decoder_patch_ids.unsqueeze(-1).expand(-1, -1, self.dim)
            h = h + torch.gather(patch_embeds, 1, index)
        if cache is None:
            h = _dropout(self.add_positions(h), self.dropout, self.training)
            freqs, caches, crosses = self.freqs(h.shape[1], h), [None] * len(self.layers), None
        else:
            h = _dropout(
                self.add_positions(h, cache.layers[0].step.positions), self.dropout, self.training
            )
            freqs, caches, crosses = self.cached_freqs(cache.layers, h), cache.layers, cache.cross
        for layer, cross_index, layer_cache in zip(
            self.layers, self.cross_for_layer, caches, strict=True
        ):
            if cross_index is not None:
                cross = self.cross_attn_layers[cross_index]
                slot_cache = None if crosses is None else crosses[cross_index]
                # double residual, as the reference: CrossAttention already returns x + out
                h = h + cross(h, patch_embeds, cross_mask, cache=slot_cache)
            h = layer(h, freqs, mask, cache=layer_cache)
        h = _dropout(self.norm(h), self.dropout, self.training)
        return self.output(h).float()

    @torch.no_grad()
    def init_weights(self) -> None:
        super().init_weights()
        self.norm.reset_parameters()
        _trunc_normal_(self.output.weight, self.dim**-0.5)
        if self.patch_embedding_projection is not None:
            _trunc_normal_(
                self.patch_embedding_projection.weight,
                self.patch_embedding_projection.in_features**-0.5,
            )
