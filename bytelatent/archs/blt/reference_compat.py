"""Read model configs and weights in the reference (facebookresearch/blt) format.

``blt_args_from_reference(params["model"])`` and ``lm_args_from_reference(params["entropy_model"])``
turn the reference's ``params.json`` model sections into this package's args, and return the
list of reference fields that have no effect here, each with the reason, so callers can log
them. ``adapt_reference_blt_state_dict`` turns a reference ``consolidated.pth["model"]`` state
dict into one this package's ``ByteLatentTransformer`` loads with ``strict=True`` and that
computes the same function.

A field is "without effect" when the reference never reads it (verified no-ops), when it only
configures the patcher or data pipeline (patching_mode etc.: set those in data.patcher_args), or
when it is an alias (the reference ignores the top-level dim/n_layers/n_heads for BLT; the global
transformer's size is dim_global/n_layers_global/n_heads_global, which become dim/n_layers/n_heads).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from bytelatent.archs.blt.args import ByteLatentTransformerArgs
from bytelatent.errors import CheckpointError, ConfigError, UserError
from bytelatent.model.args import LMTransformerArgs
from bytelatent.tokenizers.constants import VOCAB_SIZE

if TYPE_CHECKING:
    import torch

# fields the reference declares but never reads (BLT_REFERENCE_FACTS.md §2, verified)
REFERENCE_NOOP_FIELDS = (
    "tie_local_encoder_decoder_logits",
    "encoder_lm_loss",
    "encoder_enable_byte_group_hash",
    "log_patch_lengths",
    "non_linearity",
    "recompute_fc1_out",
    "recompute_fc3_out",
    "recompute_attn",
    "custom_bwd",
    "layer_ckpt",
    "init_use_gaussian",
    "init_use_depth",
    "alpha_depth",
    "norm_affine",
    "pre_norm",
    "norm_type",
    "output_size",
    "architecture",
    "global_local_decoder_residual_layer",
    "tokenize_with_bpe_delimiter",
    "patching_thresholds_str",
    "tie_local_encoder_decoder",
    "encoder_preds_low_entropy_toks",
    "encoder_preds_random_toks",
    "encoder_ngram_table_dir",
    "entropy_model_is_ngram_model",
    "conv_kernel_size",
    "sequence_parallel",
    "loss_parallel",
    "fuse_sequence_parallel",
    "use_fsdp",
    "attn_to_keep",
    "full_logging_n_layers",
    "weight_tying",
    "dim_token_emb",
    "dim_patch_emb",
    "ngram_vocab_sizes",
)
# patcher / data settings carried in the reference model section
REFERENCE_PATCHER_FIELDS = (
    "patching_mode",
    "patching_threshold",
    "patching_threshold_add",
    "monotonicity",
    "max_patch_length",
    "patching_batch_size",
    "patching_device",
    "entropy_model_checkpoint_dir",
    "pad_to_max_length",
)
# reference field -> field here, copied unchanged when present
_BLT_SAME = (
    "seed",
    "pm_size",
    "n_kv_heads_global",
    "max_seqlen",
    "init_base_std",
    "dim_local_encoder",
    "dim_local_decoder",
    "n_layers_local_encoder",
    "n_layers_local_decoder",
    "n_heads_local_encoder",
    "n_heads_local_decoder",
    "n_kv_heads",
    "local_attention_window_len",
    "use_rope",
    "head_dim",
    "ffn_dim_multiplier",
    "multiple_of",
    "norm_eps",
    "rope_theta",
    "rope_use_fp32_in_outer_product",
    "init_std_factor",
    "attn_impl",
    "eos_id",
    "dropout",
    "patch_in_forward",
    "downsampling_by_pooling",
    "cross_attn_encoder",
    "cross_attn_decoder",
    "cross_attn_nheads",
    "cross_attn_window_encoder",
    "cross_attn_window_decoder",
    "cross_attn_all_layers_encoder",
    "cross_attn_all_layers_decoder",
    "cross_attn_init_by_pooling",
    "encoder_hash_byte_group_size",
    "encoder_hash_byte_group_vocab",
    "encoder_hash_byte_group_nb_functions",
)
# reference defaults of the fields whose absence means something different here
_BLT_REFERENCE_DEFAULTS = {
    "dim": 512,
    "n_layers": 8,
    "n_heads": 8,
    "dim_global": 512,
    "n_layers_global": 8,
    "n_heads_global": 8,
    "dim_local_encoder": 512,
    "dim_local_decoder": 512,
    "n_layers_local_encoder": 8,
    "n_layers_local_decoder": 8,
    "n_heads_local_encoder": 8,
    "n_heads_local_decoder": 8,
    "encoder_hash_byte_group_vocab": 30000,
    "encoder_hash_byte_group_nb_functions": 3,
    "attn_bias_type": "causal",
    "attn_impl": "sdpa",
    "multiple_of": 256,
    "ffn_dim_multiplier": 1.0,
    "rope_theta": 10000.0,
    "max_seqlen": 1024,
    "vocab_size": -1,
    "use_local_encoder_transformer": False,
    "share_encoder_decoder_emb": True,
    "max_length": 2048,
    "cross_attn_use_flex_attention": True,
    "encoder_enable_byte_ngrams": False,
}
_BLT_HANDLED = {
    "dim",
    "n_layers",
    "n_heads",
    "dim_global",
    "n_layers_global",
    "n_heads_global",
    "vocab_size",
    "attn_bias_type",
    "max_encoder_seq_length",
    "cross_attn_k",
    "patch_size",
    "dim_token",
    "use_local_encoder_transformer",
    "share_encoder_decoder_emb",
    "max_length",
    "cross_attn_use_flex_attention",
    "encoder_enable_byte_ngrams",
    "encoder_ngram_to_size_str",
}
_LM_FIELDS = set(LMTransformerArgs.model_fields)


def reference_blt_fields() -> frozenset[str]:
    """Every field name of the reference's ByteLatentTransformerArgs (model section)."""
    known = (
        set(_BLT_SAME) | _BLT_HANDLED | set(REFERENCE_NOOP_FIELDS) | set(REFERENCE_PATCHER_FIELDS)
    )
    return frozenset(known | {"sliding_window"})


def blt_args_from_reference(
    model_dict: dict[str, Any],
) -> tuple[ByteLatentTransformerArgs, list[str]]:
    """ByteLatentTransformerArgs for a reference ``params.json["model"]``, plus the ignored fields."""
    known = (
        set(_BLT_SAME) | _BLT_HANDLED | set(REFERENCE_NOOP_FIELDS) | set(REFERENCE_PATCHER_FIELDS)
    )
    known |= {"sliding_window"}  # BaseTransformerArgs field of the reference, unused by BLT
    unknown = sorted(set(model_dict) - known)
    if unknown:
        raise ConfigError(f"model.{unknown[0]}: not a reference ByteLatentTransformerArgs field")

    def ref(name: str) -> Any:
        return model_dict.get(name, _BLT_REFERENCE_DEFAULTS.get(name))

    fields = {name: model_dict[name] for name in _BLT_SAME if name in model_dict}
    ignored = [
        f"{name} (no effect in the reference)"
        for name in REFERENCE_NOOP_FIELDS
        if name in model_dict
    ]
    ignored += [
        f"{name} (patcher/data setting: configure data.patcher_args)"
        for name in REFERENCE_PATCHER_FIELDS
        if name in model_dict
    ]
    if "sliding_window" in model_dict:
        ignored.append(
            "sliding_window (not read by BLT; local models use local_attention_window_len)"
        )
    for canonical in ("dim", "n_layers", "n_heads"):
        fields[canonical] = ref(f"{canonical}_global")
        if canonical in model_dict:
            ignored.append(
                f"{canonical}={model_dict[canonical]} (the reference ignores it for BLT; the global "
                f"transformer uses {canonical}_global={fields[canonical]})"
            )
    _map_vocab(ref("vocab_size"), fields, ignored)
    _map_global_mask(ref("attn_bias_type"), fields, ignored)
    _map_attn_impl(fields, ignored)
    _map_patch_settings(model_dict, ref, fields, ignored)
    _check_token_dims(ref, fields)
    if model_dict.get("max_encoder_seq_length") is not None:
        fields["max_encoder_seq_length"] = model_dict["max_encoder_seq_length"]
    for name, reason in (
        (
            "cross_attn_use_flex_attention",
            "the attention backend is chosen from attn_impl and the device",
        ),
        (
            "share_encoder_decoder_emb",
            "only changes shapes the reference forward cannot run",
        ),
        (
            "use_local_encoder_transformer",
            "the local encoder always runs its layers; consistent dims checked",
        ),
        ("dim_token", "equals dim_local_encoder (checked)"),
        ("max_length", "learned positions use max_encoder_seq_length rows"),
    ):
        if name in model_dict:
            ignored.append(f"{name} ({reason})")
    if not ref("use_rope"):
        ignored.append(
            "use_rope=false: the reference never adds its learned positions; adapt_reference_blt_state_dict "
            "zeroes them so a loaded checkpoint computes the same function"
        )
    try:
        return ByteLatentTransformerArgs(**fields), ignored
    except ValueError as err:  # pydantic ValidationError is a ValueError
        raise ConfigError(f"reference BLT model config: {_first_error(err)}") from None


def _map_vocab(vocab: int | None, fields: dict[str, Any], ignored: list[str]) -> None:
    if vocab is None or vocab < 1:
        fields["vocab_size"] = VOCAB_SIZE
        ignored.append(
            f"vocab_size={vocab} (the reference fills it from the tokenizer: {VOCAB_SIZE})"
        )
    else:
        fields["vocab_size"] = vocab


def _map_global_mask(kind: str | None, fields: dict[str, Any], ignored: list[str]) -> None:
    if kind in (None, "causal"):
        fields["attn_bias_type"] = "causal"
    elif kind in ("block_causal", "local_block_causal"):
        fields["attn_bias_type"] = "block_causal"
        if kind == "local_block_causal":
            ignored.append(
                "attn_bias_type=local_block_causal for the global model: it has no window in the "
                "reference (xformers asserts); runs as block_causal over patches"
            )
    else:
        raise ConfigError(
            f"model.attn_bias_type={kind!r}: expected causal, block_causal or local_block_causal"
        )


def _has_cuda() -> bool:
    import torch  # here: reading a config (print_config, a config error) must not load torch

    return torch.cuda.is_available()


def _map_attn_impl(fields: dict[str, Any], ignored: list[str]) -> None:
    impl = fields.get("attn_impl", "sdpa")
    if impl == "fmha":
        raise ConfigError(
            "model.attn_impl=fmha attends without any mask in the reference (future bytes visible); "
            "this cannot reproduce a trained model's function: use sdpa"
        )
    if impl in ("xformers", "flex_attention") and not _has_cuda():
        ignored.append(f"attn_impl={impl} (needs CUDA; runs on sdpa with the same masks here)")


def _map_patch_settings(
    model_dict: dict[str, Any], ref: Any, fields: dict[str, Any], ignored: list[str]
) -> None:
    cross_on = ref("cross_attn_encoder") or ref("cross_attn_decoder")
    if model_dict.get("cross_attn_k") is not None:
        fields["cross_attn_k"] = model_dict["cross_attn_k"]
    elif cross_on:
        raise ConfigError(
            "model.cross_attn_k is null but cross-attention is enabled; set it (released models: 2)"
        )
    pooling = model_dict.get("downsampling_by_pooling")
    fields["downsampling_by_pooling"] = pooling  # reference default None (concatenation)
    needs_patch_size = not ref("cross_attn_encoder") and not pooling
    if "patch_size" in model_dict:
        if needs_patch_size:
            fields["patch_size"] = model_dict["patch_size"]
        else:
            ignored.append("patch_size (patcher setting: configure data.patcher_args)")
    if model_dict.get("encoder_ngram_to_size_str"):
        if ref("encoder_enable_byte_ngrams"):
            fields["encoder_ngram_to_size_str"] = model_dict["encoder_ngram_to_size_str"]
        else:
            ignored.append(
                "encoder_ngram_to_size_str (the reference builds no tables unless encoder_enable_byte_ngrams)"
            )
    if "encoder_enable_byte_ngrams" in model_dict:
        ignored.append(
            "encoder_enable_byte_ngrams (n-gram tables exist iff encoder_ngram_to_size_str is set)"
        )


def _check_token_dims(ref: Any, fields: dict[str, Any]) -> None:
    """The reference's dim_token_emb must equal the local widths for its forward to run."""
    dim_enc = fields.get("dim_local_encoder", 512)
    if ref("dim_token") is not None:
        token_dim = ref("dim_token")
    elif ref("use_local_encoder_transformer"):
        token_dim = dim_enc
    else:
        patch_size = ref("patch_size")
        token_dim = None if not patch_size else fields["dim"] // patch_size
    if token_dim != dim_enc:
        raise ConfigError(
            f"reference model with token embedding width {token_dim} != dim_local_encoder={dim_enc} "
            "(dim_token / use_local_encoder_transformer): the reference forward cannot run it; set "
            "use_local_encoder_transformer=true and dim_token=null"
        )


def _first_error(err: ValueError) -> str:
    errors = getattr(err, "errors", None)
    if callable(errors):
        first = errors()[0]
        loc = ".".join(str(part) for part in first.get("loc", ()))
        msg = first["msg"].removeprefix("Value error, ")
        return f"{loc}: {msg}" if loc else msg
    return str(err)


def lm_args_from_reference(
    model_dict: dict[str, Any],
) -> tuple[LMTransformerArgs, list[str]]:
    """LMTransformerArgs for a reference ``params.json["entropy_model"]``, plus ignored fields."""
    unknown = sorted(set(model_dict) - _LM_FIELDS)
    if unknown:
        raise ConfigError(f"entropy_model.{unknown[0]}: not a reference LMTransformerArgs field")
    fields = dict(model_dict)
    ignored: list[str] = []
    vocab = fields.get("vocab_size", -1)
    if vocab is None or vocab < 1:
        fields["vocab_size"] = VOCAB_SIZE
        ignored.append(
            f"vocab_size={vocab} (the reference fills it from the tokenizer: {VOCAB_SIZE})"
        )
    impl = fields.get("attn_impl", "sdpa")
    if impl == "fmha":
        raise ConfigError(
            "entropy_model.attn_impl=fmha attends without any mask in the reference; use sdpa"
        )
    if impl in ("xformers", "flex_attention") and not _has_cuda():
        ignored.append(f"attn_impl={impl} (needs CUDA; runs on sdpa with the same masks here)")
    try:
        return LMTransformerArgs(**fields), ignored
    except ValueError as err:
        raise ConfigError(f"reference entropy model config: {_first_error(err)}") from None


def patcher_settings_from_reference(model_dict: dict[str, Any]) -> dict[str, Any]:
    """The patcher settings a reference BLT model section carries (for building a patcher)."""
    names = (
        "patching_mode",
        "patching_threshold",
        "patching_threshold_add",
        "monotonicity",
        "max_patch_length",
        "patch_size",
    )
    return {name: model_dict[name] for name in names if name in model_dict}


def patcher_fields_from_params(params: dict[str, Any]) -> dict[str, Any]:
    """The BLT spec's `patcher_settings`: PatcherArgs fields that a reference-layout params.json
    keeps in its model section (its BLT forward read them there); {} for our layout."""
    model = params.get("model") or {}
    if "patching_mode" not in model:
        return {}
    renames = {"patching_threshold": "threshold", "patching_threshold_add": "threshold_add"}
    return {
        renames.get(name, name): value
        for name, value in patcher_settings_from_reference(model).items()
        if value is not None or name in renames
    }


def adapt_reference_blt_state_dict(
    state_dict: dict[str, torch.Tensor], args: ByteLatentTransformerArgs
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """A reference BLT state dict as this package's ByteLatentTransformer expects it.

    Drops parameters the reference creates but its forward never uses, and replaces unused
    learned positions (use_rope=false) by zeros of this model's shape, so ``load_state_dict(strict=True)``
    works and the function is unchanged. Returns the new dict and a note per change.
    """
    import torch

    adapted = dict(state_dict)
    notes: list[str] = []
    unused = [
        "local_encoder.token_embedding_projection.weight",
        "local_decoder.token_embedding_projection.weight",
    ]
    if args.cross_attn_encoder and not args.cross_attn_init_by_pooling:
        raise CheckpointError(
            "reference checkpoints with cross_attn_encoder and no cross_attn_init_by_pooling cannot "
            "have been trained (the reference forward fails on them)"
        )
    if not args.cross_attn_encoder:
        unused.append("local_encoder.patch_embedding_projection.weight")
    for key in unused:
        if key in adapted:
            del adapted[key]
            notes.append(f"dropped {key} (created but never used by the reference forward)")
    if not args.use_rope:
        for side in ("local_encoder", "local_decoder"):
            key = f"{side}.pos_embeddings.weight"
            width = args.dim_local_encoder if side == "local_encoder" else args.dim_local_decoder
            reference = adapted.get(key)
            dtype = reference.dtype if reference is not None else torch.float32
            adapted[key] = torch.zeros(args.max_encoder_seq_length, width, dtype=dtype)
            notes.append(f"{key}: zeros (the reference never adds its learned positions)")
    return adapted, notes


def blt_args_from_params(params: dict[str, Any], where: str = "params.json"):
    """The BLT spec's `adapters.read_params`: (args, ignored reference fields) from our `model` section
    or the reference's."""
    section = params.get("model")
    if not isinstance(section, dict):
        raise CheckpointError(f"{where}: no 'model' section; is this a BLT checkpoint?")
    try:
        return ByteLatentTransformerArgs.model_validate(section), []
    except ValidationError:
        pass  # not our layout: read it as the reference's
    try:
        return blt_args_from_reference(section)
    except (ValidationError, ValueError, UserError) as exc:
        raise CheckpointError(f"{where}: model args invalid: {exc}") from None
