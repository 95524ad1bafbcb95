"""The BLT's estimates: training FLOPs per byte (MFU) and a parameter lower bound (no build)."""

from __future__ import annotations

from typing import Any

from bytelatent.checkpoint.model_size import _block_params as _block_values
from bytelatent.checkpoint.model_size import _rope_values
from bytelatent.model.args import block_head_counts
from bytelatent.model.flops import _block_params, mean_attended_keys


def blt_flops_breakdown(args: object, mean_patch_size: float, seq_len: int) -> dict[str, float]:
    """Training FLOPs per byte of a ByteLatentTransformer, by component (see blt_flops_per_byte)."""
    if mean_patch_size <= 0 or seq_len < 1:
        raise ValueError(
            f"mean_patch_size={mean_patch_size} and seq_len={seq_len} must be positive"
        )
    per_patch = 1.0 / mean_patch_size
    k = args.cross_attn_k
    d_enc, d_dec, d_glob = args.dim_local_encoder, args.dim_local_decoder, args.dim
    enc, dec, glob = (
        args.encoder_block_args(),
        args.decoder_block_args(),
        args.global_block_args(),
    )
    local_keys = mean_attended_keys(seq_len, args.local_attention_window_len)
    global_keys = mean_attended_keys(max(1, round(seq_len / mean_patch_size)))
    terms: dict[str, float] = {}

    def attn_width(block_args: object) -> int:
        head_dim, n_heads, _ = block_head_counts(block_args)
        return n_heads * head_dim

    terms["encoder_layers"] = 6 * enc.n_layers * _block_params(enc)
    terms["encoder_attention"] = 12 * enc.n_layers * attn_width(enc) * local_keys
    if args.cross_attn_encoder:
        n_cross = args.n_cross_attn_layers("encoder")
        # wq/wo on k slots per patch, wk/wv on every byte; each slot attends the bytes of
        # `window` patches (mean_patch_size bytes each): per byte k * window keys on average
        terms["encoder_cross_projections"] = 6 * n_cross * (2 * k * per_patch + 2) * d_enc * d_enc
        terms["encoder_cross_attention"] = (
            12 * n_cross * d_enc * k * (args.cross_attn_window_encoder or 1)
        )
        if args.cross_attn_init_by_pooling:
            pooled = d_enc * len(args.pooling_modes())
            terms["encoder_patch_projection"] = 6 * per_patch * pooled * d_enc * k
    global_in = args.global_input_dim()
    if global_in != d_glob:
        terms["global_projection"] = 6 * per_patch * global_in * d_glob
    terms["global_layers"] = 6 * per_patch * glob.n_layers * _block_params(glob)
    terms["global_attention"] = 12 * per_patch * glob.n_layers * attn_width(glob) * global_keys
    slots = k if args.cross_attn_decoder else 1
    if d_glob != d_dec or slots > 1:
        terms["decoder_patch_projection"] = 6 * per_patch * d_glob * d_dec * slots
    if args.cross_attn_decoder:
        n_cross = args.n_cross_attn_layers("decoder")
        terms["decoder_cross_projections"] = 6 * n_cross * (2 + 2 * k * per_patch) * d_dec * d_dec
        terms["decoder_cross_attention"] = (
            12 * n_cross * d_dec * k * (args.cross_attn_window_decoder or 1)
        )
    terms["decoder_layers"] = 6 * dec.n_layers * _block_params(dec)
    terms["decoder_attention"] = 12 * dec.n_layers * attn_width(dec) * local_keys
    n_out = args.vocab_size + args.pm_size + (256 if args.boundary_head else 0)
    terms["output"] = 6 * d_dec * n_out
    return terms


def blt_flops_per_byte(args: object, mean_patch_size: float, seq_len: int) -> float:
    """Training (forward + backward) FLOPs per byte of a ByteLatentTransformer.

    ``args``: ByteLatentTransformerArgs; ``mean_patch_size``: bytes per patch (N / patches);
    ``seq_len``: bytes per row N (not patches: in patch-packed data that is
    ``max_encoder_seq_length``, while the data's ``seq_len`` counts patches). With p = 1 / mean_patch_size, d the local width, D the global
    width, L layers, k = cross_attn_k, w the cross-attention windows (1 without), per byte:

    - local encoder / decoder blocks: 6 * L * P_block + 12 * L * d * k_eff(N, local window);
    - global blocks (per patch, so times p): p * (6 * L * P_block + 12 * L * D * k_eff(N * p));
    - encoder cross-attention (per cross layer): 6 * (2 k p + 2) d² projections (wq/wo on k slots
      per patch, wk/wv on bytes) + 12 * d * k * w attention; init-by-pooling projection
      6 p (d * n_pool)(d k); global input projection 6 p * in * D when widths differ;
    - decoder: patch projection 6 p D (d k); cross layers 6 (2 + 2 k p) d² + 12 d k w;
    - output 6 * d * (vocab + pm_size).

    P_block = 2 d (H + Hkv) head_dim + 3 d ffn; k_eff = ``mean_attended_keys`` (causal average;
    document boundaries ignored, the usual MFU convention). Hash / n-gram / byte embedding
    lookups, pooling, norms and softmaxes are not counted (no matmuls). Attention counts only
    attended keys: kernels that compute masked blocks do more work than this.
    """
    return sum(blt_flops_breakdown(args, mean_patch_size, seq_len).values())


def blt_training_flops(model_args: object, data_args: object):
    """A BLT: `blt_flops_per_byte` at the batch's mean patch size (rows of
    `data.max_encoder_seq_length` bytes); without patch lengths in the batch, one byte per patch
    in byte mode, else the static patch size."""
    patcher = data_args.patcher_args
    nominal_patch = 1.0 if patcher.patching_mode == "byte" else float(patcher.patch_size)
    row_len = data_args.max_encoder_seq_length

    def count(tokens: int, patches: float) -> float:
        if tokens == 0:
            return 0.0
        mean_patch = tokens / patches if patches > 0 else nominal_patch
        return tokens * blt_flops_per_byte(model_args, mean_patch, row_len)

    return count


def blt_lower_bound(args: Any) -> tuple[int, int]:
    """`lower_bound` of a BLT (ByteLatentTransformerArgs)."""
    enc, dec, glob = args.encoder_block_args(), args.decoder_block_args(), args.global_block_args()
    vocab = args.vocab_size + args.pm_size
    values = sum(b.n_layers * _block_values(b) for b in (enc, dec, glob))
    values += vocab * args.dim_local_encoder + vocab * args.dim_local_decoder  # bytes in, out
    if args.encoder_hash_byte_group_size:
        n_tables = (
            len(args.encoder_hash_byte_group_size) * args.encoder_hash_byte_group_nb_functions
        )
        values += n_tables * args.encoder_hash_byte_group_vocab * args.dim_local_encoder
    values += sum(args.ngram_sizes().values()) * args.dim_local_encoder
    values += _rope_values(glob, args.max_seqlen)
    return values, enc.n_layers + dec.n_layers + glob.n_layers
