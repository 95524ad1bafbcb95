"""Activations autograd keeps for one micro-batch: the estimate of `model-info.txt`
(`bytelatent/trainer/model_info.py` explains what is counted), for the built-in architectures
(a spec's `Sizes.activation_bytes`: the blocks each architecture checkpoints). `args` is a TrainArgs."""

from __future__ import annotations

from typing import Any

from torch import nn

from bytelatent.distributed.parallelize import checkpoint_blocks
from bytelatent.model.registry import get_arch


def _patched(args: Any) -> bool:
    return get_arch(args.arch).patched


def _block_dims(block: nn.Module) -> tuple[int, int, int] | None:
    """(dim, kv_dim, ffn_hidden) of a self-attention + SwiGLU block, None for anything else."""
    attention, ffn = getattr(block, "attention", None), getattr(block, "feed_forward", None)
    if attention is None or ffn is None:
        return None
    return attention.wq.weight.shape[1], attention.wk.weight.shape[0], ffn.w1.weight.shape[0]


def _block_values_per_token(dims: tuple[int, int, int], mode: str, tp: int) -> tuple[int, int]:
    """(values kept for backward per token, values of one block recomputed in backward)."""
    dim, kv, hidden = dims
    # norms' inputs/outputs stay whole under BLT's TP; q/k/v, attention and FFN are split
    full = 4 * dim + (2 * dim + 2 * kv + 4 * hidden) // tp
    if mode == "full":
        return dim, full
    if mode == "selective":
        return dim + (3 * dim + 2 * kv + 2 * hidden) // tp, 0
    return full, 0


def _tokens_of(path: str, args: Any, micro_batch: int) -> int:
    """Tokens a block at `path` sees in one micro-batch."""
    if not _patched(args):
        return micro_batch * args.data.seq_len
    if path.startswith("global_transformer"):
        return micro_batch * args.data.seq_len  # patches per row
    return micro_batch * args.data.max_encoder_seq_length  # bytes per row


def _cross_attention_values(model: nn.Module, args: Any, micro_batch: int) -> int:
    """Cross-attention layers of the BLT local models: norms, q, k, v and output per token side."""
    total = 0
    n_bytes = micro_batch * args.data.max_encoder_seq_length
    n_queries = micro_batch * args.data.seq_len * (getattr(args.model, "cross_attn_k", None) or 1)
    for name, module in model.named_modules():
        if not name.endswith("cross_attn_layers") or not isinstance(module, nn.ModuleList):
            continue
        for layer in module:
            dim = layer.wq.weight.shape[0]
            q_side, kv_side = (
                (n_queries, n_bytes) if name.startswith("local_encoder") else (n_bytes, n_queries)
            )
            total += q_side * 4 * dim + kv_side * 4 * dim
    return total


def _dense_mask_values(args: Any, micro_batch: int) -> int:
    """sdpa runs block-causal, windowed and cross-attention masks as dense [B, 1, Q, K] tensors
    that autograd keeps (flex_attention and xformers build none)."""
    model_args = args.active_model_args()
    if getattr(model_args, "attn_impl", "sdpa") != "sdpa":
        return 0
    if not _patched(args):
        return micro_batch * args.data.seq_len**2
    n_bytes, n_patches = args.data.max_encoder_seq_length, args.data.seq_len
    queries = n_patches * (getattr(model_args, "cross_attn_k", None) or 1)
    # encoder and decoder self-attention, the global transformer, both cross-attentions
    return micro_batch * (2 * n_bytes**2 + n_patches**2 + 2 * n_bytes * queries)


def activation_bytes(model: nn.Module, args: Any, tp: int = 1) -> int:
    """Estimated bytes autograd keeps for one micro-batch of `data.batch_size` rows."""
    micro_batch = args.data.batch_size
    mode = args.distributed.activation_checkpointing
    act_bytes = args.distributed.param_dtype.itemsize
    kept, peak_recompute = 0, 0
    block_ids = {id(b) for b in checkpoint_blocks(model)}
    for path, module in model.named_modules():
        dims = _block_dims(module) if id(module) in block_ids else None
        if dims is None:
            continue
        block_tp = tp if path.startswith(("global_transformer", "layers")) else 1
        per_token, recompute = _block_values_per_token(dims, mode, block_tp)
        tokens = _tokens_of(path, args, micro_batch)
        kept += per_token * tokens
        peak_recompute = max(peak_recompute, recompute * tokens)
    if _patched(args):
        kept += _cross_attention_values(model, args, micro_batch)
    values = kept + peak_recompute + _dense_mask_values(args, micro_batch)
    output = getattr(model, "output", None) or getattr(
        getattr(model, "local_decoder", None), "output", None
    )
    vocab = output.weight.shape[0] if output is not None else 0
    out_tokens = micro_batch * (get_arch(args.arch).row_length(args.data))
    logits = out_tokens * vocab * (act_bytes + 4)  # logits, then the loss's fp32 log-softmax
    return values * act_bytes + logits
