"""One H-Net stage: encoder -> route -> chunk -> main network -> dechunk -> + residual -> decoder.

The encoder, main network and decoder are any modules called as
``module(hidden_states, mask=..., cu_seqlens=..., max_seqlen=...)`` that return the hidden states
(the main network may also be a ``DCStage``, whose routing outputs are collected: outermost first).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from bytelatent.archs.hnet.dc.chunking import ChunkLayer, DeChunkLayer
from bytelatent.archs.hnet.dc.residual import ResidualProjection, merge_residual
from bytelatent.archs.hnet.dc.routing import RoutingModule, RoutingOutput


class IdentityMixer(nn.Module):
    """A stand-in encoder/main/decoder that returns its input (accepts the layout keywords)."""

    def forward(self, hidden_states: torch.Tensor, **layout: object) -> torch.Tensor:
        return hidden_states


@dataclass
class StageOutput:
    hidden_states: torch.Tensor  # the input's shape and dtype
    routing: list[RoutingOutput]  # this stage's router, then those of nested stages


class DCStage(nn.Module):
    """A dynamic-chunking stage over ``[B, L, D]`` + ``mask`` or ``[T, D]`` + ``cu_seqlens``.

    kernel_dtype / block_size go to ``DeChunkLayer`` (None: the EMA in the model dtype, fp32
    at least; torch.bfloat16 reproduces the official model's default EMA rounding). Under
    autocast the residual projection, the EMA and the merge still run in those dtypes
    (autocast off around them, as in ``HNet``); the encoder, router, main network and decoder
    run under the caller's autocast.
    """

    def __init__(
        self,
        d_model: int,
        encoder: nn.Module | None = None,
        main_network: nn.Module | None = None,
        decoder: nn.Module | None = None,
        kernel_dtype: torch.dtype | None = None,
        block_size: int = 64,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.encoder = encoder if encoder is not None else IdentityMixer()
        self.main_network = main_network if main_network is not None else IdentityMixer()
        self.decoder = decoder if decoder is not None else IdentityMixer()
        self.routing_module = RoutingModule(d_model, device=device, dtype=dtype)
        self.chunk_layer = ChunkLayer()
        self.dechunk_layer = DeChunkLayer(kernel_dtype=kernel_dtype, block_size=block_size)
        self.residual_proj = ResidualProjection(d_model, device=device)

    def forward(
        self,
        hidden_states: torch.Tensor,
        mask: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
    ) -> StageOutput:
        if (mask is None) == (cu_seqlens is None):
            raise ValueError("DCStage: pass exactly one of mask (padded) or cu_seqlens (packed)")
        layout = {"mask": mask, "cu_seqlens": cu_seqlens, "max_seqlen": max_seqlen}
        hidden_states = self.encoder(hidden_states, **layout)
        residual = self.residual_proj(hidden_states)  # fp32 (autocast off inside)
        routing = self.routing_module(hidden_states, mask=mask, cu_seqlens=cu_seqlens)
        chunks = self.chunk_layer(
            hidden_states, routing.boundary_mask, mask=mask, cu_seqlens=cu_seqlens
        )
        inner = self.main_network(
            chunks.hidden_states,
            mask=chunks.mask,
            cu_seqlens=chunks.cu_seqlens,
            max_seqlen=chunks.max_seqlen,
        )
        nested: list[RoutingOutput] = []
        if isinstance(inner, StageOutput):
            inner, nested = inner.hidden_states, inner.routing
        # the fp32 island, as HNet._stage: the EMA (autocast off in dechunk) and the merge
        with torch.autocast(hidden_states.device.type, enabled=False):
            spread = self.dechunk_layer(
                inner, routing.boundary_mask, routing.boundary_prob, cu_seqlens=chunks.cu_seqlens
            )
            merged = merge_residual(spread.to(residual.dtype), residual, routing.selected_probs)
        hidden_states = self.decoder(merged.to(spread.dtype), **layout)
        return StageOutput(hidden_states, [routing, *nested])
