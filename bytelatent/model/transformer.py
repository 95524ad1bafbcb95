"""The byte-level LM transformer (the BLT entropy model) and the args shared by transformers.

The document and sliding-window masks are honoured by every backend, flex/xformers configs fall
back to sdpa with the same masks off CUDA, and ``weight_tying`` shares the embedding weight with
the output (docs/differences.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, model_validator
from torch import nn

from bytelatent.model.attention import (
    BACKENDS,
    HostBatch,
    HostDocuments,
    resolve_backend,
    self_attn_mask,
)
from bytelatent.model.layers import (
    INIT_STD_FACTORS,
    RMSNorm,
    RotaryEmbedding,
    TransformerBlock,
    block_head_counts,
    init_std_factor,
)
from bytelatent.model.rope_scaling import RopeScalingArgs
from bytelatent.tokenizers.constants import EOS_ID, VOCAB_SIZE

ATTN_BIAS_TYPES = (None, "causal", "block_causal", "local_block_causal")


class BaseTransformerArgs(BaseModel):
    """Shape and attention settings of a stack of TransformerBlocks (reference field names)."""

    model_config = ConfigDict(extra="forbid")

    dim: int = 512
    n_layers: int = 8
    head_dim: int | None = None
    n_heads: int | None = None
    n_kv_heads: int | None = None
    ffn_dim_multiplier: float | None = None
    multiple_of: int = 256
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_use_fp32_in_outer_product: bool = False
    rope_scaling: RopeScalingArgs | None = None  # Llama 3 frequency scaling (rope_scaling.py)
    init_base_std: float | None = None
    init_std_factor: str = "disabled"
    max_seqlen: int = 1024
    attn_impl: str = "sdpa"
    attn_bias_type: str | None = None
    eos_id: int = EOS_ID

    @model_validator(mode="after")
    def _check_base(self) -> BaseTransformerArgs:
        _check_positive(self, ("dim", "n_layers", "multiple_of", "max_seqlen"))
        _check_positive(self, ("head_dim", "n_heads", "n_kv_heads"), optional=True)
        if self.attn_impl == "fmha":
            raise ValueError(
                "attn_impl='fmha' attends without any mask in the reference (every token sees the "
                "whole row, future included); use sdpa, flex_attention or xformers"
            )
        if self.attn_impl not in BACKENDS:
            raise ValueError(f"attn_impl={self.attn_impl!r} is unknown; expected one of {BACKENDS}")
        if self.attn_bias_type not in ATTN_BIAS_TYPES:
            raise ValueError(
                f"attn_bias_type={self.attn_bias_type!r} is unknown; expected one of {ATTN_BIAS_TYPES}"
            )
        if self.init_std_factor not in INIT_STD_FACTORS:
            raise ValueError(
                f"init_std_factor={self.init_std_factor!r} is unknown; "
                f"expected one of {INIT_STD_FACTORS}"
            )
        self._check_heads()
        return self

    def _check_heads(self) -> None:
        if self.n_heads is not None and self.head_dim is None and self.dim % self.n_heads:
            raise ValueError(
                f"dim={self.dim} is not divisible by n_heads={self.n_heads}; "
                "change one of them or set head_dim"
            )
        if self.head_dim is not None and self.n_heads is None and self.dim % self.head_dim:
            raise ValueError(f"dim={self.dim} is not divisible by head_dim={self.head_dim}")
        if self.n_heads is None and self.head_dim is None:
            return
        head_dim, n_heads, n_kv_heads = block_head_counts(self)
        if head_dim % 2:
            raise ValueError(f"head_dim={head_dim} must be even for rotary embeddings")
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads={n_heads} must be a multiple of n_kv_heads={n_kv_heads}")


class LMTransformerArgs(BaseTransformerArgs):
    """A byte LM: embedding, TransformerBlocks, norm, output (the BLT entropy model)."""

    seed: int = 42
    vocab_size: int = VOCAB_SIZE
    weight_tying: bool = False
    sliding_window: int | None = None

    @model_validator(mode="after")
    def _check_lm(self) -> LMTransformerArgs:
        if self.n_heads is None and self.head_dim is None:
            raise ValueError("set n_heads (or head_dim) for the transformer")
        _check_positive(self, ("vocab_size",))
        _check_positive(self, ("sliding_window",), optional=True)
        if self.attn_bias_type == "local_block_causal" and self.sliding_window is None:
            raise ValueError("attn_bias_type='local_block_causal' needs sliding_window (e.g. 512)")
        return self


def _check_positive(args: BaseModel, names: tuple[str, ...], optional: bool = False) -> None:
    for name in names:
        value = getattr(args, name)
        if value is None and optional:
            continue
        if value is None or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")


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
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self._tie_weights()

    def _tie_weights(self) -> None:
        if self.args.weight_tying:
            self.output.weight = self.tok_embeddings.weight

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        # to_empty()/to() give each module its own new Parameter; re-share the tied weight
        result = super()._apply(fn, recurse)
        self._tie_weights()
        return result

    def forward(self, tokens: torch.Tensor, host: HostBatch | None = None) -> torch.Tensor:
        """``host``: the batch's host arrays (``host.x`` = ``tokens`` before the copy to the
        device), from which xformers masks take their document lengths without a device sync."""
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
        h = self.tok_embeddings(tokens)
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

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Number of distinct parameters; ``exclude_embeddings`` drops the input embedding table
        (a lookup, no FLOPs) unless it is tied to the output projection."""
        total = sum(p.numel() for p in self.parameters())  # parameters() yields shared ones once
        if exclude_embeddings and not self.args.weight_tying:
            total -= self.tok_embeddings.weight.numel()
        return total
