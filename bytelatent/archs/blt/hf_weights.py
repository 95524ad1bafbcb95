"""Hugging Face BLT tensors <-> ours: the weight map (names and layout), no config, no files.

Our ``TransformerBlock`` / ``CrossAttention`` names become HF's ``BltTransformerLayer`` /
``BltCrossAttention`` names one table lookup at a time; the layout differs in two places only:
HF fuses the hash n-gram tables into one (table i at rows ``[i*vocab, (i+1)*vocab)``) and always
has a decoder patch projection (ours skips it when it would be the identity).
"""

from __future__ import annotations

import torch

from bytelatent.archs.blt.args import ByteLatentTransformerArgs
from bytelatent.archs.blt.model import ByteLatentTransformer
from bytelatent.checkpoint.hf_folder import WEIGHTS_FILE, StateDict  # noqa: F401 (re-exported)
from bytelatent.errors import CheckpointError

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


def blt_state_dict_to_hf(state: StateDict, args: ByteLatentTransformerArgs) -> StateDict:
    """Our BLT state dict -> HF BltForCausalLM names (hash tables fused in HF's order)."""
    out: StateDict = {}
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
    hf: StateDict, args: ByteLatentTransformerArgs
) -> tuple[StateDict, StateDict]:
    """HF BltForCausalLM tensors -> (our BLT state dict, entropy model state dict or {})."""

    with torch.device("meta"):
        expected = ByteLatentTransformer(args).state_dict()
    names = _invert({n: _blt_name_to_hf(n) for n in expected if "encoder_hash" not in n})
    ours: StateDict = {}
    patcher: StateDict = {}
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


def _entropy_names(hf: StateDict, prefix: str) -> dict[str, str]:
    """ours -> HF for the entropy-model weights present in `hf` (by inverting the forward map)."""
    result = {}
    for hf_name in hf:
        ours = entropy_hf_name_to_ours(hf_name, prefix)
        result[ours] = hf_name
    return result


def entropy_hf_name_to_ours(hf_name: str, prefix: str) -> str:
    rest = hf_name.removeprefix(prefix)
    for ours, hf in _ENTROPY_TOP.items():
        if rest == hf:
            return ours
    inverse_block = _invert(_BLOCK)
    hit = _rename(rest, "layers", "layers", inverse_block)
    if hit is None:
        raise CheckpointError(f"{hf_name}: not a weight of BltPatcher")
    return hit


def entropy_state_dict_to_hf(state: StateDict, prefix: str) -> StateDict:
    return {_entropy_name_to_hf(name, prefix): tensor for name, tensor in state.items()}
