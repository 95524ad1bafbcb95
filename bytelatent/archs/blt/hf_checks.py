"""What Hugging Face's BLT can represent, and whether imported weights fit: the checks.

``check_hf_representable`` / ``check_hf_entropy_representable`` refuse, in one line naming the
field, a config HF's port computes another function for; ``check_windows`` refuses an attention
window HF cannot reproduce unless allowed; ``patching_notes`` says what differs only on some
inputs. ``check_weights`` compares imported tensors with the model the config builds and names
every mismatch (missing, unexpected, shape, non-floating dtype, NaN/inf values) in one line.
"""

from __future__ import annotations

from typing import Any

import torch

from bytelatent.archs.blt.args import ByteLatentTransformerArgs
from bytelatent.archs.blt.hf_weights import StateDict
from bytelatent.errors import CheckpointError
from bytelatent.model.args import LMTransformerArgs, block_head_counts
from bytelatent.model.registry import arch_of_args


def check_hf_representable(args: ByteLatentTransformerArgs) -> list[str]:
    """Raise a one-line CheckpointError where HF's BltForCausalLM computes another function.

    Returns the notes for differences that only show on some inputs (masks), for logging.
    """

    def refuse(field: str, why: str) -> None:
        raise CheckpointError(
            f"cannot export to Hugging Face BltForCausalLM: model.{field}: {why} "
            "(see docs/differences.md)"
        )

    if not (args.cross_attn_encoder and args.cross_attn_decoder):
        refuse(
            "cross_attn_encoder/cross_attn_decoder",
            "HF always runs both cross-attentions; both must be true",
        )
    if not args.cross_attn_init_by_pooling or args.pooling_modes() != ("max",):
        refuse(
            "cross_attn_init_by_pooling/downsampling_by_pooling",
            "HF initialises the encoder's patch queries by max pooling only",
        )
    if args.cross_attn_all_layers_encoder and args.n_layers_local_encoder > 1:
        refuse(
            "cross_attn_all_layers_encoder",
            "HF re-pools the patch queries before every encoder cross-attention; the reference "
            "pools once and accumulates (same only with one encoder layer)",
        )
    if not args.encoder_hash_byte_group_size:
        refuse(
            "encoder_hash_byte_group_size",
            "HF always adds hash n-gram embeddings; set at least one size",
        )
    if args.ngram_sizes():
        refuse("encoder_ngram_to_size_str", "HF has no frequency n-gram tables")
    if args.pm_size:
        refuse("pm_size", "HF's output layer has exactly vocab_size rows")
    if getattr(args, "rope_scaling", None) is not None:
        refuse("rope_scaling", "HF's BLT global transformer has no llama3 RoPE scaling")
    if not args.use_rope:
        refuse("use_rope", "HF's local models always use RoPE")
    if args.cross_attn_window_encoder is not None or args.cross_attn_window_decoder is not None:
        refuse("cross_attn_window_encoder/decoder", "HF's patch cross-attention has no window")
    for side in ("encoder", "decoder"):
        block = getattr(args, f"{side}_block_args")()
        head_dim, n_heads, n_kv = block_head_counts(block)
        if head_dim * n_heads != block.dim:
            refuse("head_dim", f"HF's local {side} needs head_dim * n_heads == dim")
        if n_kv != n_heads:
            refuse("n_kv_heads", f"HF's local {side} cross-attention would share its GQA kv heads")
        if (args.cross_attn_nheads or n_heads) != n_heads:
            refuse(
                "cross_attn_nheads",
                f"HF's cross-attention uses the local {side}'s n_heads ({n_heads})",
            )
    head_dim, n_heads, _ = block_head_counts(args.global_block_args())
    if head_dim * n_heads != args.dim:
        refuse("head_dim", "HF's global transformer needs head_dim * n_heads == dim")
    if args.rope_use_fp32_in_outer_product:
        pass  # HF computes the angles in fp32 always: the same numbers
    notes = []
    notes.append(
        "HF attends across documents (EOS inside a row); ours stops at document ends "
        "(same logits for one document per row)"
    )
    return notes


def check_hf_entropy_representable(args: LMTransformerArgs) -> list[str]:
    head_dim, n_heads, _ = block_head_counts(args)
    if head_dim * n_heads != args.dim:
        raise CheckpointError(
            "cannot export the entropy model to Hugging Face BltPatcher: entropy_model.head_dim: "
            "HF needs head_dim * n_heads == dim (see docs/differences.md)"
        )
    if args.weight_tying:
        raise CheckpointError(
            "cannot export the entropy model to Hugging Face BltPatcher: entropy_model.weight_tying: "
            "HF's patcher has separate embedding and output weights"
        )
    return []


def window_mismatches(
    args: ByteLatentTransformerArgs | None, entropy_args: LMTransformerArgs | None
) -> dict[str, int]:
    """{what: window} for attention windows shorter than the model's rows (HF attends without one)."""
    found = {}
    if args is not None and args.local_attention_window_len is not None:
        window, rows = args.local_attention_window_len, args.max_encoder_seq_length
        if window < rows:
            found[f"model.local_attention_window_len={window} < max_encoder_seq_length={rows}"] = (
                window
            )
    if entropy_args is not None and entropy_args.sliding_window is not None:
        window, rows = entropy_args.sliding_window, entropy_args.max_seqlen
        if window < rows:
            found[f"entropy_model.sliding_window={window} < max_seqlen={rows}"] = window
    return found


def check_windows(
    args: ByteLatentTransformerArgs | None, entropy_args: LMTransformerArgs | None, allow: bool
) -> list[str]:
    """Refuse a window HF cannot reproduce unless `allow`; then return it as a note."""
    found = window_mismatches(args, entropy_args)
    if not found:
        return []
    what, shortest = "; ".join(found), min(found.values())
    if not allow:
        raise CheckpointError(
            f"cannot export to Hugging Face faithfully: {what}: HF attends without a window, so "
            f"rows longer than {shortest} bytes get other logits; pass --allow-window-mismatch "
            "(export_hf(..., allow_window_mismatch=True)) to export anyway"
        )
    return [f"window mismatch ({what}): HF equals ours only on rows of at most {shortest} bytes"]


def patching_notes(patching: dict[str, Any], has_patcher: bool) -> list[str]:
    mode = patching.get("patching_mode", "entropy")
    if not has_patcher or mode != "entropy":
        return [
            f"HF patches only by entropy with a patcher; this model's patches ({mode}) must be "
            "passed as patch_lengths to forward (without them HF uses one byte per patch)"
        ]
    notes = []
    if patching.get("monotonicity") or patching.get("threshold_add") is not None:
        notes.append("HF's patcher uses the global threshold only (no monotonicity/threshold_add)")
    return notes


def expected_shapes(
    args: ByteLatentTransformerArgs | LMTransformerArgs,
) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape of the model `args` builds (on the meta device: no memory)."""
    with torch.device("meta"):
        model = arch_of_args(args).build(args)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def weight_mismatches(expected: dict[str, tuple[int, ...]], state: StateDict) -> list[str]:
    """Every way `state` differs from `expected`: missing and unexpected names, shapes, tensors
    that are not floating point, and tensors holding NaN/inf (each named; empty when it fits)."""
    problems = [f"missing {name}" for name in sorted(set(expected) - set(state))]
    problems += [f"unexpected {name}" for name in sorted(set(state) - set(expected))]
    for name in sorted(set(expected) & set(state)):
        tensor = state[name]
        if tuple(tensor.shape) != expected[name]:
            problems.append(f"{name}: shape {tuple(tensor.shape)} != {expected[name]}")
        elif not tensor.is_floating_point():
            problems.append(
                f"{name}: dtype {str(tensor.dtype).removeprefix('torch.')}, not floating point"
            )
        elif tensor.numel() and not bool(torch.isfinite(tensor).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            problems.append(f"{name}: {bad} NaN/inf values")
    return problems


def check_weights(
    args: ByteLatentTransformerArgs | LMTransformerArgs, state: StateDict, where: str
) -> None:
    """Fail, before anything is written, naming every tensor that does not fit `args`'s model."""
    problems = weight_mismatches(expected_shapes(args), state)
    if problems:
        raise CheckpointError(
            f"{where}: weights do not match config.json ({len(problems)} problems: "
            + "; ".join(problems)
            + ")"
        )
