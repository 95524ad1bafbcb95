"""Hugging Face transformers ``BltForCausalLM`` <-> our weights: names, shapes and config.

An adapter at the edge (a sibling of ``bytelatent/model/reference_compat.py``): the model code
knows nothing about HF. ``export_hf`` writes a folder ``BltForCausalLM.from_pretrained`` loads
(``config.json``, ``model.safetensors``, tokenizer files); ``import_hf`` turns such a folder back
into our consolidated layout (``params.json`` + ``consolidated.pth``, the entropy model under
``entropy_model/``). Neither needs transformers installed: config.json is written and read as
JSON, the weights with safetensors.

HF's port computes the same function as ours only for a subset of configurations; everything
outside it is refused with one line naming the field (``check_hf_representable``). What differs
even inside the subset (masks: no sliding window, no document boundaries) is in
docs/differences.md, with a minimal repro.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
from fsspec.implementations.local import LocalFileSystem

from bytelatent.checkpoint.pretrained import load_any_checkpoint
from bytelatent.checkpoint.safe_paths import read_shard_index, require_inside
from bytelatent.errors import CheckpointError
from bytelatent.model.args import LMTransformerArgs, block_head_counts
from bytelatent.model.blt import ByteLatentTransformer
from bytelatent.model.blt_args import ByteLatentTransformerArgs
from bytelatent.model.layers import ffn_hidden_dim
from bytelatent.model.registry import get_arch

logger = logging.getLogger("bytelatent")

HF_MODEL_TYPE = "blt"
HF_PATCHER_TYPE = "blt_patcher"
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
# our params.json extras stored in config.json so that import restores what HF has no field for
OURS_KEY = "bytelatent"

_BLOCK = {  # our TransformerBlock names -> HF BltTransformerLayer names
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj",
    "attention_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_CROSS = {  # our CrossAttention names -> HF BltCrossAttention names
    "wq": "q_proj",
    "wk": "k_proj",
    "wv": "v_proj",
    "wo": "o_proj",
    "cross_attn_norm_q": "q_norm",
    "cross_attn_norm_kv": "k_norm",
}
_TOP = {  # whole-name renames outside the layer stacks
    "local_encoder.tok_embeddings.weight": "model.local_encoder.embed_tokens.weight",
    "local_encoder.patch_embedding_projection.weight": (
        "model.local_encoder.patch_embedding_projection.weight"
    ),
    "local_decoder.patch_embedding_projection.weight": (
        "model.local_decoder.patch_embedding_projection.weight"
    ),
    "local_decoder.norm.weight": "model.local_decoder.norm.weight",
    "local_decoder.output.weight": "lm_head.weight",
    "global_transformer.token_embedding_projection.weight": (
        "model.global_transformer.token_embedding_projection.weight"
    ),
}
_ENTROPY_TOP = {
    "tok_embeddings.weight": "embed_tokens.weight",
    "norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
}
HASH_KEY = "model.encoder_hash_tok_embedding.weight"


# ---------------------------------------------------------------------------------------------
# names


def _rename(name: str, prefix_ours: str, prefix_hf: str, table: dict[str, str]) -> str | None:
    """`prefix_ours.{i}.<ours>.weight` -> `prefix_hf.{i}.<hf>.weight`, or None if no match."""
    if not name.startswith(prefix_ours + "."):
        return None
    index, _, rest = name[len(prefix_ours) + 1 :].partition(".")
    stem = rest.removesuffix(".weight")
    if not index.isdigit() or stem not in table:
        return None
    return f"{prefix_hf}.{index}.{table[stem]}.weight"


def _blt_name_to_hf(name: str) -> str:
    if name in _TOP:
        return _TOP[name]
    for side in ("local_encoder", "global_transformer", "local_decoder"):
        for ours, table in (("layers", _BLOCK), ("cross_attn_layers", _CROSS)):
            hf = _rename(name, f"{side}.{ours}", f"model.{side}.{ours}", table)
            if hf is not None:
                return hf
    raise CheckpointError(f"weight {name}: no Hugging Face BltForCausalLM counterpart")


def _entropy_name_to_hf(name: str, prefix: str) -> str:
    if name in _ENTROPY_TOP:
        return prefix + _ENTROPY_TOP[name]
    hf = _rename(name, "layers", prefix + "layers", _BLOCK)
    if hf is None:
        raise CheckpointError(
            f"entropy model weight {name}: no Hugging Face BltPatcher counterpart"
        )
    return hf


def _invert(names: dict[str, str]) -> dict[str, str]:
    inverse = {hf: ours for ours, hf in names.items()}
    if len(inverse) != len(names):
        raise AssertionError("name mapping is not one-to-one")  # a bug here, not user input
    return inverse


# ---------------------------------------------------------------------------------------------
# what HF can represent


def check_hf_representable(args: Any) -> list[str]:
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


def check_hf_entropy_representable(args: Any) -> list[str]:
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


def window_mismatches(args: Any | None, entropy_args: Any | None) -> dict[str, int]:
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


def check_windows(args: Any | None, entropy_args: Any | None, allow: bool) -> list[str]:
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


# ---------------------------------------------------------------------------------------------
# state dicts


def blt_state_dict_to_hf(state: dict[str, torch.Tensor], args: Any) -> dict[str, torch.Tensor]:
    """Our BLT state dict -> HF BltForCausalLM names (hash tables fused in HF's order)."""
    out: dict[str, torch.Tensor] = {}
    hash_tables: dict[int, torch.Tensor] = {}
    for name, tensor in state.items():
        if name.startswith("encoder_hash_tok_embedding."):
            hash_tables[int(name.split(".")[1])] = tensor
            continue
        out[_blt_name_to_hf(name)] = tensor
    # HF fuses the tables into one, table i at rows [i*vocab, (i+1)*vocab): the same (function,
    # size) order as ours (function outer, size inner), so a concatenation is exact
    out[HASH_KEY] = torch.cat([hash_tables[i] for i in range(len(hash_tables))], dim=0)
    dec_proj = _TOP["local_decoder.patch_embedding_projection.weight"]
    if dec_proj not in out:
        # we skip the projection when dim == dim_local_decoder and k == 1; HF always has one
        out[dec_proj] = torch.eye(
            args.dim_local_decoder, args.dim, dtype=out["lm_head.weight"].dtype
        )
    return out


def hf_state_dict_to_blt(
    hf: dict[str, torch.Tensor], args: Any
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """HF BltForCausalLM tensors -> (our BLT state dict, entropy model state dict or {})."""

    with torch.device("meta"):
        expected = ByteLatentTransformer(args).state_dict()
    names = _invert({n: _blt_name_to_hf(n) for n in expected if "encoder_hash" not in n})
    ours: dict[str, torch.Tensor] = {}
    patcher: dict[str, torch.Tensor] = {}
    entropy_names = {}
    for name, tensor in hf.items():
        if name.startswith("model.patcher."):
            patcher[name] = tensor
        elif name == HASH_KEY:
            continue
        elif name in names:
            ours[names[name]] = tensor
        elif name == _TOP["local_decoder.patch_embedding_projection.weight"]:
            eye = torch.eye(args.dim_local_decoder, args.dim, dtype=tensor.dtype)
            if not torch.equal(tensor, eye):
                raise CheckpointError(
                    f"{name}: not the identity, but the config needs no decoder patch projection"
                )
        else:
            raise CheckpointError(f"{name}: not a weight of BltForCausalLM with this config.json")
    fused = hf.get(HASH_KEY)
    if fused is None:
        raise CheckpointError(f"{WEIGHTS_FILE}: no {HASH_KEY}")
    vocab = args.encoder_hash_byte_group_vocab
    n_tables = sum(1 for n in expected if n.startswith("encoder_hash_tok_embedding."))
    if fused.shape[0] != vocab * n_tables:
        raise CheckpointError(
            f"{HASH_KEY}: {fused.shape[0]} rows, config.json implies {n_tables} tables x {vocab}"
        )
    for i, table in enumerate(fused.split(vocab, dim=0)):
        ours[f"encoder_hash_tok_embedding.{i}.weight"] = table.clone()
    if patcher:
        entropy_names = {
            hf_name: ours_name
            for ours_name, hf_name in _entropy_names(patcher, "model.patcher.").items()
        }
        patcher = {entropy_names[n]: t for n, t in patcher.items()}
    return ours, patcher


def _entropy_names(hf: dict[str, torch.Tensor], prefix: str) -> dict[str, str]:
    """ours -> HF for the entropy-model weights present in `hf` (by inverting the forward map)."""
    result = {}
    for hf_name in hf:
        ours = _entropy_hf_name_to_ours(hf_name, prefix)
        result[ours] = hf_name
    return result


def _entropy_hf_name_to_ours(hf_name: str, prefix: str) -> str:
    rest = hf_name.removeprefix(prefix)
    for ours, hf in _ENTROPY_TOP.items():
        if rest == hf:
            return ours
    inverse_block = _invert(_BLOCK)
    hit = _rename(rest, "layers", "layers", inverse_block)
    if hit is None:
        raise CheckpointError(f"{hf_name}: not a weight of BltPatcher")
    return hit


def entropy_state_dict_to_hf(
    state: dict[str, torch.Tensor], prefix: str
) -> dict[str, torch.Tensor]:
    return {_entropy_name_to_hf(name, prefix): tensor for name, tensor in state.items()}


# ---------------------------------------------------------------------------------------------
# config.json


def _ffn_width(hf: dict[str, torch.Tensor], prefix: str) -> int:
    return int(hf[f"{prefix}layers.0.mlp.gate_proj.weight"].shape[0])


def _local_config(args: Any, side: str, hf: dict[str, torch.Tensor]) -> dict[str, Any]:
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


def _global_config(args: Any, hf: dict[str, torch.Tensor]) -> dict[str, Any]:
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


def patcher_config(args: Any, hf: dict[str, torch.Tensor], prefix: str) -> dict[str, Any]:
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
    args: Any,
    hf: dict[str, torch.Tensor],
    patching: dict[str, Any],
    entropy_args: Any | None = None,
) -> dict[str, Any]:
    """config.json for BltForCausalLM; `patching` holds patching_mode/threshold/patch_size/max_patch_length."""
    dtype = str(hf["lm_head.weight"].dtype).removeprefix("torch.")
    config: dict[str, Any] = {
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


# ---------------------------------------------------------------------------------------------
# export / import


def _require_hf_deps() -> None:
    try:
        import safetensors  # noqa: F401
    except ImportError:
        raise CheckpointError(
            "Hugging Face export/import needs safetensors: pip install 'bytelatent[hf]'"
        ) from None


def _patching_settings(params: dict[str, Any]) -> dict[str, Any]:
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


def _state_for_export(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}


def _save_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata={"format": "pt"})
    umask = os.umask(0)  # safetensors writes 0600; give it the mode any other file here gets
    os.umask(umask)
    tmp.chmod(0o666 & ~umask)
    tmp.replace(path)  # atomic: an interrupted export leaves no half-written weights


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    tmp.replace(path)


def export_hf(
    ckpt: str, out: str, entropy_model: str | None = None, allow_window_mismatch: bool = False
) -> list[str]:
    """Write `out/` for BltForCausalLM.from_pretrained (or BltPatcher for an entropy model).

    `ckpt` is a DCP step folder, a consolidated or a released folder. Returns notes on what HF
    computes differently for some inputs (to print); refuses what HF cannot represent, and an
    attention window shorter than the model's rows unless `allow_window_mismatch`.
    """

    _require_hf_deps()
    model, args, params = load_any_checkpoint(ckpt)
    out_dir = Path(out)
    if isinstance(args, LMTransformerArgs):
        if entropy_model is not None:
            raise CheckpointError(
                f"{ckpt}: is an entropy model; --entropy-model is for BLT exports"
            )
        return _export_entropy_only(model, args, out_dir, allow_window_mismatch)
    notes = check_hf_representable(args)
    hf = blt_state_dict_to_hf(_state_for_export(model), args)
    entropy_args = None
    if entropy_model is not None:
        emodel, entropy_args, _ = load_any_checkpoint(entropy_model, kind="entropy")
        notes += check_hf_entropy_representable(entropy_args)
        hf.update(entropy_state_dict_to_hf(_state_for_export(emodel), "model.patcher."))
    notes += check_windows(args, entropy_args, allow_window_mismatch)
    patching = _patching_settings(params)
    notes += _patching_notes(patching, entropy_args is not None)
    out_dir.mkdir(parents=True, exist_ok=True)
    _save_safetensors(hf, out_dir / WEIGHTS_FILE)
    _write_json(out_dir / CONFIG_FILE, blt_hf_config(args, hf, patching, entropy_args))
    write_tokenizer(out_dir, args.max_encoder_seq_length)
    return notes


def _patching_notes(patching: dict[str, Any], has_patcher: bool) -> list[str]:
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


def _export_entropy_only(
    model: torch.nn.Module, args: Any, out_dir: Path, allow_window_mismatch: bool
) -> list[str]:
    notes = check_hf_entropy_representable(args)
    notes += check_windows(None, args, allow_window_mismatch)
    hf = entropy_state_dict_to_hf(_state_for_export(model), "")
    config = patcher_config(args, hf, "")
    config.update(
        {
            "architectures": ["BltPatcher"],
            "model_type": HF_PATCHER_TYPE,
            "torch_dtype": str(hf["lm_head.weight"].dtype).removeprefix("torch."),
            OURS_KEY: {"entropy_model": args.model_dump(mode="json")},
        }
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    _save_safetensors(hf, out_dir / WEIGHTS_FILE)
    _write_json(out_dir / CONFIG_FILE, config)
    write_tokenizer(out_dir, args.max_seqlen)
    notes.append(
        "transformers has no Auto class for the entropy model alone: load it with "
        "transformers.models.blt.modeling_blt.BltPatcher.from_pretrained(OUT)"
    )
    return notes


# ---------------------------------------------------------------------------------------------
# tokenizer: BOE/pad=0, BOS=1, EOS=2, BPE delimiter=3, byte b -> b + 4 (ours and the reference's)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character per byte, which the ByteLevel pre-tokenizer emits."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<bpe>")  # ids 0..3


def write_tokenizer(out_dir: Path, max_length: int) -> None:
    """tokenizer.json + tokenizer_config.json: text -> [BOS] + [b + 4 for b in text.encode()]."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    except ImportError:
        raise CheckpointError(
            "writing the Hugging Face tokenizer needs `tokenizers`: pip install 'bytelatent[hf]'"
        ) from None
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({char: byte + len(SPECIAL_TOKENS) for byte, char in _bytes_to_unicode().items()})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", 1)]
    )
    tokenizer.save(str(out_dir / "tokenizer.json"))
    _write_json(
        out_dir / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "pad_token": "<pad>",
            "bos_token": "<s>",
            "eos_token": "</s>",
            "add_bos_token": True,
            "add_eos_token": False,
            "model_max_length": max_length,
            "clean_up_tokenization_spaces": False,
        },
    )
    _write_json(
        out_dir / "special_tokens_map.json",
        {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>"},
    )


def to_hf_patch_lengths(patch_lengths: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Patch lengths that make HF's BltForCausalLM assign every byte the patch ours does.

    HF's decoder gives byte i the patch holding byte i+1, minus one; ours (and the reference's)
    gives it the last patch that ends at or before byte i. They agree whenever a row covers
    N+1 positions (the forward-time convention, include_next_token=True). A row summing to
    exactly N (the data pipeline's convention) gets one more patch of length 1 (in its first
    zero-padding slot, or a new column), which changes nothing else: no byte belongs to it and
    the global model is causal.
    """
    lengths = patch_lengths.to(torch.long).clone()
    short = lengths.sum(dim=1) == seq_len
    if not bool(short.any()):
        return lengths
    lengths = torch.cat([lengths, torch.zeros_like(lengths[:, :1])], dim=1)
    for row in torch.nonzero(short).flatten().tolist():
        first_zero = int((lengths[row] != 0).sum())
        lengths[row, first_zero] = 1
    if not bool((lengths[:, -1] != 0).any()):
        lengths = lengths[:, :-1]
    return lengths


def read_hf_folder(hf_dir: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config.json, all weights) of a Hugging Face model folder; one-line errors otherwise."""
    _require_hf_deps()
    from safetensors.torch import load_file

    folder = Path(hf_dir)
    if not folder.is_dir():
        raise CheckpointError(f"{hf_dir}: not a folder")
    config_path = folder / CONFIG_FILE
    if not config_path.exists():
        raise CheckpointError(f"{hf_dir}: no {CONFIG_FILE}; not a Hugging Face model folder")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{config_path}: invalid JSON ({exc})") from None
    model_type = config.get("model_type")
    if model_type not in (HF_MODEL_TYPE, HF_PATCHER_TYPE):
        raise CheckpointError(
            f"{config_path}: model_type {model_type!r} is not a BLT model "
            f"(expected {HF_MODEL_TYPE!r} or {HF_PATCHER_TYPE!r})"
        )
    index = folder / (WEIGHTS_FILE + ".index.json")
    if index.exists():  # shard names stay inside the folder
        files = read_shard_index(LocalFileSystem(), str(folder), index.name)
    elif (folder / WEIGHTS_FILE).exists():
        files = [WEIGHTS_FILE]
        require_inside(files, str(folder), str(folder / WEIGHTS_FILE), "weights file")
    else:
        raise CheckpointError(f"{hf_dir}: no {WEIGHTS_FILE} (nor a sharded index)")
    weights: dict[str, torch.Tensor] = {}
    for name in files:
        try:
            weights.update(load_file(str(folder / name)))
        except Exception as exc:  # truncated / foreign files surface as safetensors errors
            raise CheckpointError(
                f"{folder / name}: cannot read ({type(exc).__name__}: {exc})"
            ) from None
    return config, weights


def _one(values: dict[str, Any], what: str) -> Any:
    distinct = set(values.values())
    if len(distinct) != 1:
        raise CheckpointError(
            f"config.json: {what} differs between components ({values}); ours uses one value"
        )
    return distinct.pop()


def _ffn_settings(dims: dict[str, tuple[int, int]]) -> dict[str, Any]:
    """multiple_of / ffn_dim_multiplier that give every component its intermediate_size."""

    for multiple_of, mult in ((256, 1.0), (1, 1.0), (128, 1.0), (64, 1.0), (32, 1.0)):
        if all(ffn_hidden_dim(d, multiple_of, mult) == w for d, w in dims.values()):
            return {"multiple_of": multiple_of, "ffn_dim_multiplier": mult}
    raise CheckpointError(
        f"config.json: intermediate sizes { ({k: w for k, (_, w) in dims.items()}) } cannot be "
        "expressed with one multiple_of/ffn_dim_multiplier as our models compute them"
    )


def blt_args_from_hf_config(config: dict[str, Any]) -> Any:
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


def entropy_args_from_hf_config(patcher: dict[str, Any], ours: dict[str, Any] | None) -> Any:
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


def _write_consolidated(
    out_dir: Path, params: dict[str, Any], state: dict[str, torch.Tensor]
) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / "consolidated.pth.tmp"
    torch.save({"model": state}, tmp)
    tmp.replace(out_dir / "consolidated.pth")
    _write_json(out_dir / "params.json", params)


def _load_strict(args: Any, kind: str, state: dict[str, torch.Tensor], where: str) -> None:
    """Fail on a missing / unexpected / misshaped tensor before anything is written."""

    with torch.device("meta"):
        model = get_arch(kind).build(args)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in state.items()}
    if expected != got:
        missing = sorted(set(expected) - set(got))
        extra = sorted(set(got) - set(expected))
        shape = sorted(k for k in set(expected) & set(got) if expected[k] != got[k])
        detail = (missing and f"missing {missing[0]}") or (extra and f"unexpected {extra[0]}")
        detail = detail or f"{shape[0]}: shape {got[shape[0]]} != {expected[shape[0]]}"
        raise CheckpointError(f"{where}: weights do not match config.json ({detail})")


def import_hf(hf_dir: str, out: str) -> str:
    """HF BLT folder -> our consolidated layout (entropy model, if any, in out/entropy_model)."""
    config, weights = read_hf_folder(hf_dir)
    ours = config.get(OURS_KEY) or {}
    out_dir = Path(out)
    if config["model_type"] == HF_PATCHER_TYPE:
        eargs = entropy_args_from_hf_config(config, ours.get("entropy_model"))
        state = {_entropy_hf_name_to_ours(k, ""): v for k, v in weights.items()}
        _load_strict(eargs, "entropy", state, hf_dir)
        _write_consolidated(out_dir, _entropy_params(eargs, hf_dir), state)
        return str(out_dir)
    args = blt_args_from_hf_config(config)
    state, patcher_state = hf_state_dict_to_blt(weights, args)
    _load_strict(args, "blt", state, hf_dir)
    patching = ours.get("patching") or {
        "patching_mode": config.get("patching_mode", "entropy"),
        "threshold": config.get("patching_threshold", 1.335442066192627),
        "patch_size": config.get("patch_size", 4.5),
        "max_patch_length": config.get("max_patch_length"),
    }
    eargs = None
    if patcher_state:
        eargs = entropy_args_from_hf_config(
            config.get("patcher_config") or {}, ours.get("entropy_model")
        )
        _load_strict(eargs, "entropy", patcher_state, hf_dir)
    params = {
        "name": "hf_import",
        "source": str(hf_dir),
        "train_entropy_model": False,
        "model": args.model_dump(mode="json"),
        "data": {"patcher_args": patching},
    }
    _write_consolidated(out_dir, params, state)
    if eargs is not None:
        _write_consolidated(
            out_dir / "entropy_model", _entropy_params(eargs, hf_dir), patcher_state
        )
    return str(out_dir)


def _entropy_params(eargs: Any, source: str) -> dict[str, Any]:
    return {
        "name": "hf_import",
        "source": str(source),
        "train_entropy_model": True,
        "model": None,
        "entropy_model": eargs.model_dump(mode="json"),
    }
