"""Model FLOPs per token/byte, for MFU (training = forward + backward)."""

from __future__ import annotations

from bytelatent.model.args import block_head_counts
from bytelatent.model.layers import ffn_hidden_dim


def mean_attended_keys(seq_len: int, window: int | None = None) -> float:
    """Average number of keys a query attends under causal (optionally sliding-window) attention.

    Query i (0-based) sees min(i + 1, window) keys; document boundaries are ignored (model FLOPs
    count a packed row as one sequence, the usual MFU convention).
    """
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len} must be >= 1")
    if window is None or window >= seq_len:
        return (seq_len + 1) / 2
    if window < 1:
        raise ValueError(f"window={window} must be >= 1")
    ramp = window * (window + 1) / 2  # queries 0..window-1 see 1..window keys
    return (ramp + (seq_len - window) * window) / seq_len


def lm_flops_per_token(
    n_non_embedding_params: int,
    n_layers: int,
    dim: int,
    seq_len: int,
    window: int | None = None,
) -> float:
    """Training FLOPs per token of a decoder-only transformer.

    ``6 * N + 12 * n_layers * dim * k_eff`` where

    - N = parameters that take part in matmuls (everything but the input embedding lookup; the
      output projection counts): forward 2N, backward 4N;
    - the attention term counts q·kᵀ and p·v (2 * dim * k_eff FLOPs each per layer forward,
      times 3 for forward + backward), with ``dim`` = n_heads * head_dim;
    - k_eff = ``mean_attended_keys(seq_len, window)``: (S + 1) / 2 for causal attention, the
      windowed average for local attention. Skipped masked blocks are not counted, so a kernel
      that computes the full S×S matrix does more work than this.
    """
    attention = 12 * n_layers * dim * mean_attended_keys(seq_len, window)
    return 6 * n_non_embedding_params + attention


def _block_params(block_args: object) -> int:
    """Matmul parameters of one TransformerBlock (attention q/k/v/o + SwiGLU w1/w3/w2)."""
    head_dim, n_heads, n_kv_heads = block_head_counts(block_args)
    dim = block_args.dim
    attention = 2 * dim * n_heads * head_dim + 2 * dim * n_kv_heads * head_dim
    hidden = ffn_hidden_dim(dim, block_args.multiple_of, block_args.ffn_dim_multiplier)
    return attention + 3 * dim * hidden
