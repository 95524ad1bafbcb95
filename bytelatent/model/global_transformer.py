"""The global transformer: the latent model two architectures share (BLT, H-Net)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from bytelatent.model.args import BaseTransformerArgs, block_head_counts
from bytelatent.model.attention import HostDocuments, resolve_backend, self_attn_mask
from bytelatent.model.cpu_bf16 import Linear
from bytelatent.model.layers import (
    KVCache,
    RotaryEmbedding,
    TransformerBlock,
    _trunc_normal_,
    init_std_factor,
)
from bytelatent.tokenizers.constants import BOE_ID


def _dropout(h: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    return F.dropout(h, p=p, training=training) if p > 0 and training else h


class GlobalTransformer(nn.Module):
    """Patch/chunk embeddings [B,P,in] -> states [B,P,dim] (no final norm, as the BLT reference).

    The BLT's global transformer over patches and the H-Net's main network over chunks (same
    parameter names, `global_transformer.layers.*`): `block_args` its blocks, `in_dim` the width
    of what it is fed (projected to `block_args.dim` when they differ)."""

    def __init__(
        self, block_args: BaseTransformerArgs, in_dim: int, eos_id: int, dropout: float = 0.0
    ) -> None:
        super().__init__()
        self.args = block_args
        self.dim = block_args.dim
        self.dropout = dropout
        self.eos_id = eos_id
        head_dim, _, _ = block_head_counts(block_args)
        self.layers = nn.ModuleList(
            TransformerBlock(block_args) for _ in range(block_args.n_layers)
        )
        self.rope_embeddings = RotaryEmbedding(
            theta=block_args.rope_theta,
            head_dim=head_dim,
            max_seqlen=block_args.max_seqlen,
            use_fp32_outer=block_args.rope_use_fp32_in_outer_product,
            scaling=block_args.rope_scaling,
        )
        self.token_embedding_projection = (
            Linear(in_dim, self.dim, bias=False) if in_dim != self.dim else None
        )

    def forward(
        self,
        h: torch.Tensor,
        patch_has_eos: torch.Tensor | None,
        docs: HostDocuments | None = None,
        cache: Sequence[KVCache] | None = None,
    ) -> torch.Tensor:
        """h [B,P,in]; patch_has_eos [B,P] bool (documents end at patches holding an EOS);
        ``docs``: the same documents known on the host (xformers then needs no device sync).

        ``cache``: one KV cache per layer (generation, ``eval.generation.cache.CachedStack``):
        ``h`` holds new patches after the cached ones, whose positions and masks come from the
        caches' current step (``patch_has_eos`` and ``docs`` are unused)."""
        mask = None
        if cache is None:
            kind = self.args.attn_bias_type
            if kind == "block_causal":
                tokens = torch.where(patch_has_eos, self.eos_id, BOE_ID)
            else:
                tokens = torch.zeros(h.shape[:2], dtype=torch.long, device=h.device)
            backend = resolve_backend(self.args.attn_impl, h.device)
            mask = self_attn_mask(kind, tokens, eos_id=self.eos_id, backend=backend, docs=docs)
        if self.token_embedding_projection is not None:
            h = self.token_embedding_projection(h)
        h = _dropout(h, self.dropout, self.training)
        if cache is None:
            freqs = self.rope_embeddings(seqlen=h.shape[1])
            caches = [None] * len(self.layers)
        else:
            freqs = self.rope_embeddings.freqs_cis  # rows picked by the caches' positions
            caches = cache
        for layer, layer_cache in zip(self.layers, caches, strict=True):
            h = layer(h, freqs, mask, layer_cache)
        return h

    @torch.no_grad()
    def init_weights(self) -> None:
        args = self.args
        self.rope_embeddings.reset_parameters()
        for depth, layer in enumerate(self.layers):
            layer.init_weights(
                args.init_base_std,
                init_std_factor(args.init_std_factor, depth, args.n_layers, args.dim),
            )
        if self.token_embedding_projection is not None:
            proj = self.token_embedding_projection
            _trunc_normal_(proj.weight, proj.in_features**-0.5)
