"""Our args <-> Hugging Face ``config.json``: the config map (no weights are read or written here).

Export writes every field HF's ``BltConfig`` / ``BltPatcherConfig`` has and stores our own args
under ``OURS_KEY``; import restores those exactly when present, else derives our args from HF's
fields (one ``CheckpointError`` line naming the field that ours cannot express). The FFN widths
are read off the weights (``intermediate_size``): the only config fact that lives in a tensor.
"""

from __future__ import annotations

from typing import Any

from bytelatent.archs.blt.args import ByteLatentTransformerArgs
from bytelatent.archs.blt.hf_weights import StateDict
from bytelatent.checkpoint.hf_folder import (  # noqa: F401 (re-exported)
    CONFIG_FILE,
    OURS_KEY,
    JsonDict,
)
from bytelatent.errors import CheckpointError
from bytelatent.model.args import LMTransformerArgs, block_head_counts
from bytelatent.model.layers import ffn_hidden_dim

HF_MODEL_TYPE = "blt"

HF_PATCHER_TYPE = "blt_patcher"


def _ffn_width(hf: StateDict, prefix: str) -> int:
    return int(hf[f"{prefix}layers.0.mlp.gate_proj.weight"].shape[0])


def _local_config(args: ByteLatentTransformerArgs, side: str, hf: StateDict) -> JsonDict:
    block = getattr(args, f"{side}_block_args")()
    return {
        "vocab_size": args.vocab_size,
        "cross_attn_all_layers": getattr(args, f"cross_attn_all_layers_{side}"),
        "cross_attn_k": args.cross_attn_k,
        "hidden_size_global": args.dim,
        "hidden_size": block.dim,
        "num_attention_heads": block.n_heads,
        "num_key_value_heads": block.n_heads,
        "num_hidden_layers": block.n_layers,
        "rms_norm_eps": args.norm_eps,
        "dropout": args.dropout,
        "max_position_embeddings": args.max_encoder_seq_length,
        "rope_theta": args.rope_theta,
        "hidden_act": "silu",
        "intermediate_size": _ffn_width(hf, f"model.local_{side}."),
    }


def _global_config(args: ByteLatentTransformerArgs, hf: StateDict) -> JsonDict:
    _, n_heads, n_kv = block_head_counts(args.global_block_args())
    return {
        "hidden_size": args.dim,
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "num_hidden_layers": args.n_layers,
        "rms_norm_eps": args.norm_eps,
        "dropout": args.dropout,
        "max_position_embeddings": args.max_seqlen,
        "rope_theta": args.rope_theta,
        "hidden_act": "silu",
        "intermediate_size": _ffn_width(hf, "model.global_transformer."),
    }


def patcher_config(args: LMTransformerArgs, hf: StateDict, prefix: str) -> JsonDict:
    _, n_heads, n_kv = block_head_counts(args)
    return {
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "max_position_embeddings": args.max_seqlen,
        "rms_norm_eps": args.norm_eps,
        "dropout": 0.0,
        "rope_theta": args.rope_theta,
        "intermediate_size": _ffn_width(hf, prefix),
    }


def blt_hf_config(
    args: ByteLatentTransformerArgs,
    hf: StateDict,
    patching: JsonDict,
    entropy_args: LMTransformerArgs | None = None,
) -> JsonDict:
    """config.json for BltForCausalLM; `patching` holds patching_mode/threshold/patch_size/max_patch_length."""
    dtype = str(hf["lm_head.weight"].dtype).removeprefix("torch.")
    config: JsonDict = {
        "architectures": ["BltForCausalLM"],
        "model_type": HF_MODEL_TYPE,
        "vocab_size": args.vocab_size,
        "max_position_embeddings": args.max_seqlen,
        "patch_in_forward": entropy_args is not None,
        "patch_size": patching.get("patch_size", 4.5),
        "patching_mode": patching.get("patching_mode", "entropy"),
        "patching_threshold": patching.get("threshold", 1.335442066192627),
        "patching_batch_size": 1,
        "max_patch_length": patching.get("max_patch_length"),
        "cross_attn_k": args.cross_attn_k,
        "encoder_hash_byte_group_size": list(args.encoder_hash_byte_group_size),
        "encoder_hash_byte_group_vocab": args.encoder_hash_byte_group_vocab,
        "encoder_hash_byte_group_nb_functions": args.encoder_hash_byte_group_nb_functions,
        "rope_theta": args.rope_theta,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        # transformers 4.57's BLT cache is broken: generate() raises (no num_hidden_layers), and
        # with that added its encoder, global and decoder layers share cache slots (wrong bytes).
        # Off, generate() recomputes each step and equals our use_cache=false output.
        "use_cache": False,
        "encoder_config": _local_config(args, "encoder", hf),
        "decoder_config": _local_config(args, "decoder", hf),
        "global_config": _global_config(args, hf),
        OURS_KEY: {"model": args.model_dump(mode="json"), "patching": patching},
    }
    if entropy_args is not None:
        config["patcher_config"] = patcher_config(entropy_args, hf, "model.patcher.")
        config[OURS_KEY]["entropy_model"] = entropy_args.model_dump(mode="json")
    return config


def patching_settings(params: JsonDict) -> JsonDict:
    """Patcher settings of a run: ours under data.patcher_args, the reference's in its model section."""
    patcher = (params.get("data") or {}).get("patcher_args") or {}
    if (
        "eval_on_gpus" in params or not patcher
    ):  # the reference keeps the model's patcher in `model`
        model = params.get("model") or {}
        patcher = {
            "patching_mode": model.get("patching_mode", "entropy"),
            "threshold": model.get("patching_threshold", 1.335442066192627),
            "patch_size": model.get("patch_size", 4.5),
            "max_patch_length": model.get("max_patch_length"),
            "monotonicity": model.get("monotonicity", False),
            "threshold_add": model.get("patching_threshold_add"),
        }
    keys = (
        "patching_mode",
        "threshold",
        "patch_size",
        "max_patch_length",
        "monotonicity",
        "threshold_add",
    )
    return {k: patcher.get(k) for k in keys if k in patcher}


def _one(values: dict[str, Any], what: str) -> Any:
    distinct = set(values.values())
    if len(distinct) != 1:
        raise CheckpointError(
            f"config.json: {what} differs between components ({values}); ours uses one value"
        )
    return distinct.pop()


def _ffn_settings(dims: dict[str, tuple[int, int]]) -> dict[str, int | float]:
    """multiple_of / ffn_dim_multiplier that give every component its intermediate_size."""

    for multiple_of, mult in ((256, 1.0), (1, 1.0), (128, 1.0), (64, 1.0), (32, 1.0)):
        if all(ffn_hidden_dim(d, multiple_of, mult) == w for d, w in dims.values()):
            return {"multiple_of": multiple_of, "ffn_dim_multiplier": mult}
    raise CheckpointError(
        f"config.json: intermediate sizes { ({k: w for k, (_, w) in dims.items()}) } cannot be "
        "expressed with one multiple_of/ffn_dim_multiplier as our models compute them"
    )


def blt_args_from_hf_config(config: JsonDict) -> ByteLatentTransformerArgs:
    """ByteLatentTransformerArgs for an HF BltConfig dict (ours stored in it win, exactly)."""

    ours = (config.get(OURS_KEY) or {}).get("model")
    if ours is not None:
        return ByteLatentTransformerArgs.model_validate(ours)
    enc, dec, glob = (
        config.get(k) or {} for k in ("encoder_config", "decoder_config", "global_config")
    )
    parts = {"encoder": enc, "decoder": dec, "global": glob}
    for side in ("encoder", "decoder"):
        kv = parts[side].get("num_key_value_heads")
        if kv not in (None, parts[side].get("num_attention_heads")):
            raise CheckpointError(
                f"config.json: {side}_config.num_key_value_heads={kv}: ours has no local GQA"
            )
    fields = dict(
        vocab_size=config.get("vocab_size", 260),
        dim=glob["hidden_size"],
        n_layers=glob["num_hidden_layers"],
        n_heads=glob["num_attention_heads"],
        n_kv_heads_global=glob.get("num_key_value_heads") or None,
        max_seqlen=glob.get("max_position_embeddings", 4096),
        attn_bias_type="causal",  # HF's global attention is plain causal
        dim_local_encoder=enc["hidden_size"],
        dim_local_decoder=dec["hidden_size"],
        n_layers_local_encoder=enc["num_hidden_layers"],
        n_layers_local_decoder=dec["num_hidden_layers"],
        n_heads_local_encoder=enc["num_attention_heads"],
        n_heads_local_decoder=dec["num_attention_heads"],
        local_attention_window_len=None,  # HF's local attention has no window
        max_encoder_seq_length=_one(
            {s: parts[s].get("max_position_embeddings", 24576) for s in ("encoder", "decoder")},
            "max_position_embeddings",
        ),
        norm_eps=_one({s: p.get("rms_norm_eps", 1e-5) for s, p in parts.items()}, "rms_norm_eps"),
        rope_theta=_one({s: p.get("rope_theta", 500000.0) for s, p in parts.items()}, "rope_theta"),
        cross_attn_encoder=True,
        cross_attn_decoder=True,
        cross_attn_k=config.get("cross_attn_k", 2),
        cross_attn_nheads=enc["num_attention_heads"],
        cross_attn_all_layers_encoder=bool(enc.get("cross_attn_all_layers", False)),
        cross_attn_all_layers_decoder=bool(dec.get("cross_attn_all_layers", True)),
        cross_attn_init_by_pooling=True,
        downsampling_by_pooling="max",
        encoder_hash_byte_group_size=config.get("encoder_hash_byte_group_size"),
        encoder_hash_byte_group_vocab=config.get("encoder_hash_byte_group_vocab", 500002),
        encoder_hash_byte_group_nb_functions=config.get("encoder_hash_byte_group_nb_functions", 1),
    )
    if enc["num_attention_heads"] != dec["num_attention_heads"]:
        raise CheckpointError(
            "config.json: encoder and decoder head counts differ; ours shares cross_attn_nheads"
        )
    fields.update(
        _ffn_settings({s: (p["hidden_size"], p["intermediate_size"]) for s, p in parts.items()})
    )
    try:
        return ByteLatentTransformerArgs(**fields)
    except ValueError as exc:
        raise CheckpointError(f"config.json: cannot be expressed as our BLT args: {exc}") from None


def entropy_args_from_hf_config(patcher: JsonDict, ours: JsonDict | None) -> LMTransformerArgs:
    if ours is not None:
        return LMTransformerArgs.model_validate(ours)
    ffn = _ffn_settings({"patcher": (patcher["hidden_size"], patcher["intermediate_size"])})
    kv = patcher.get("num_key_value_heads")
    return LMTransformerArgs(
        dim=patcher["hidden_size"],
        n_layers=patcher["num_hidden_layers"],
        n_heads=patcher["num_attention_heads"],
        n_kv_heads=None if kv in (None, patcher["num_attention_heads"]) else kv,
        vocab_size=patcher.get("vocab_size", 260),
        max_seqlen=patcher.get("max_position_embeddings", 8192),
        norm_eps=patcher.get("rms_norm_eps", 1e-5),
        rope_theta=patcher.get("rope_theta", 10000.0),
        attn_bias_type="causal",  # HF's patcher is plain causal (no window)
        **ffn,
    )


def entropy_params(eargs: LMTransformerArgs, source: str) -> JsonDict:
    return {
        "name": "hf_import",
        "source": str(source),
        "arch": "entropy",
        "train_entropy_model": True,  # readers from before `arch`
        "model": eargs.model_dump(mode="json"),
    }


def patching_from_hf_config(config: JsonDict) -> JsonDict:
    """Our data.patcher_args for an HF BltConfig dict (ours stored in it win)."""
    return ((config.get(OURS_KEY) or {}).get("patching")) or {
        "patching_mode": config.get("patching_mode", "entropy"),
        "threshold": config.get("patching_threshold", 1.335442066192627),
        "patch_size": config.get("patch_size", 4.5),
        "max_patch_length": config.get("max_patch_length"),
    }


def blt_params(args: ByteLatentTransformerArgs, patching: JsonDict, source: str) -> JsonDict:
    """params.json of an imported BLT (what `load_any_checkpoint` reads back)."""
    return {
        "name": "hf_import",
        "source": str(source),
        "train_entropy_model": False,
        "model": args.model_dump(mode="json"),
        "data": {"patcher_args": patching},
    }
