"""The byte-level LM transformer (the BLT entropy model); its args are in ``args.py``.

The document and sliding-window masks are honoured by every backend, flex/xformers configs fall
back to sdpa with the same masks off CUDA, and ``weight_tying`` shares the embedding weight with
the output (docs/differences.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from bytelatent.distributed.tp_plan import TPPlan
from bytelatent.errors import ConfigError
from bytelatent.model.args import LMTransformerArgs, block_head_counts
from bytelatent.model.attention import (
    HostBatch,
    HostDocuments,
    resolve_backend,
    self_attn_mask,
)
from bytelatent.model.cpu_bf16 import Linear
from bytelatent.model.layers import (
    KVCache,
    RMSNorm,
    RotaryEmbedding,
    TransformerBlock,
    init_std_factor,
)


class LMTransformer(nn.Module):
    """tokens [B,S] long -> logits [B,S,vocab] float32; the mask is built once per forward."""

    def __init__(self, args: LMTransformerArgs) -> None:
        super().__init__()
        self.args = args
        head_dim, _, _ = block_head_counts(args)
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.rope_embeddings = RotaryEmbedding(
            theta=args.rope_theta,
            head_dim=head_dim,
            max_seqlen=args.max_seqlen,
            use_fp32_outer=args.rope_use_fp32_in_outer_product,
            scaling=args.rope_scaling,
        )
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.output = Linear(args.dim, args.vocab_size, bias=False)
        self._tie_weights()

    def _tie_weights(self) -> None:
        if self.args.weight_tying:
            self.output.weight = self.tok_embeddings.weight

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        # to_empty()/to() give each module its own new Parameter; re-share the tied weight
        result = super()._apply(fn, recurse)
        self._tie_weights()
        return result

    def forward(
        self,
        tokens: torch.Tensor,
        host: HostBatch | None = None,
        cache: Sequence[KVCache] | None = None,
    ) -> torch.Tensor:
        """``host``: the batch's host arrays (``host.x`` = ``tokens`` before the copy to the
        device), from which xformers masks take their document lengths without a device sync.

        ``cache``: one KV cache per layer (generation, ``eval.generation.cache.CachedStack``):
        ``tokens`` are new positions after the cached ones; positions and masks come from the
        caches' current step."""
        h = self.tok_embeddings(tokens)
        if cache is not None:
            freq_cis = self.rope_embeddings.freqs_cis  # rows picked by the caches' positions
            for layer, layer_cache in zip(self.layers, cache, strict=True):
                h = layer(h, freq_cis, None, layer_cache)
            return self.output(self.norm(h)).float()
        seqlen = tokens.shape[1]
        backend = resolve_backend(self.args.attn_impl, tokens.device)
        mask = self_attn_mask(
            self.args.attn_bias_type,
            tokens,
            eos_id=self.args.eos_id,
            window=self.args.sliding_window,
            backend=backend,
            docs=None if host is None else HostDocuments.from_tokens(host.x, self.args.eos_id),
        )
        freq_cis = self.rope_embeddings(seqlen=seqlen)
        for layer in self.layers:
            h = layer(h, freq_cis, mask)
        return self.output(self.norm(h)).float()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialise every parameter in place and recompute the RoPE table.

        Blocks: trunc_normal ±3σ with σ from init_base_std / init_std_factor (reference §3.10);
        embeddings and output: σ = dim^-0.5; norms: 1.
        """
        args = self.args
        self.rope_embeddings.reset_parameters()
        for depth, layer in enumerate(self.layers):
            factor = init_std_factor(args.init_std_factor, depth, args.n_layers, args.dim)
            layer.init_weights(args.init_base_std, factor)
        self.norm.reset_parameters()
        std = args.dim**-0.5
        nn.init.trunc_normal_(self.tok_embeddings.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)
        if not args.weight_tying:
            nn.init.trunc_normal_(self.output.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)

    def fsdp_units(self) -> list[nn.Module]:
        """Modules to shard as separate FSDP units, in forward order.

        With weight tying the embedding and output share a parameter, so both stay with the root.
        """
        if self.args.weight_tying:
            return list(self.layers)
        return [self.tok_embeddings, *self.layers, self.output]

    def tp_plan(self, tp_size: int) -> TPPlan:
        """Tensor parallelism (`distributed.parallelize.apply_tp`): every block, sequence
        parallel, with a vocab-sharded embedding and output head."""
        if self.args.weight_tying:
            raise ConfigError(
                f"distributed.tp_size={tp_size} with model.weight_tying=true is not supported (the "
                "tied weight would need two layouts); set one of them off"
            )
        return TPPlan(
            blocks=[self.layers],
            sequence_parallel=True,
            embedding="tok_embeddings",
            norm="norm",
            output="output",
        )

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Number of distinct parameters; ``exclude_embeddings`` drops the input embedding table
        (a lookup, no FLOPs) unless it is tied to the output projection."""
        total = sum(p.numel() for p in self.parameters())  # parameters() yields shared ones once
        if exclude_embeddings and not self.args.weight_tying:
            total -= self.tok_embeddings.weight.numel()
        return total
