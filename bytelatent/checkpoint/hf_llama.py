"""Hugging Face ``LlamaForCausalLM`` decoder layers -> the global transformer ("byteify") of a BLT
(``model.global_init``) or an H-Net (the same key: the same class and names).

An adapter at the edge, like ``archs/blt/hf.py``: a name/layout map plus a shape check that names
every mismatch; the model code does not know where its weights came from.

* ``check_hf_llama(model_args)`` reads ``config.json`` (and the shard index) and raises one
  ``CheckpointError`` line listing every architecture mismatch (``model.dim`` vs ``hidden_size``,
  layers, heads, ``n_kv_heads_global``, head_dim, FFN width, ``norm_eps``, ``rope_theta``,
  ``rope_scaling``) or the first missing file. Runs before anything is built or trained.
* ``load_hf_llama(model, model_args)`` copies the decoder layers into ``global_transformer`` one
  shard file at a time (local files are read one tensor at a time), on every layout: each rank
  cuts its own FSDP/TP shard from the full tensor, no communication. A malformed safetensors
  file, a tensor with NaN/inf values, or a shard index naming a file outside the folder is one
  ``CheckpointError`` line.

Layout: HF rotates q/k with "rotate half" (feature j pairs with j + head_dim/2), ours rotates
interleaved pairs (2i, 2i+1), so q_proj/k_proj rows are permuted per head; everything else is a
rename. HF's ``embed_tokens``, final ``norm`` and ``lm_head`` are not used (the global transformer
reads patch representations and ends without a norm).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator
from typing import Any

import torch
from fsspec.implementations.local import LocalFileSystem
from torch import nn

from bytelatent.checkpoint.fs import get_fs
from bytelatent.checkpoint.hf_llama_files import (  # noqa: F401 (re-exported)
    CONFIG_FILE,
    INDEX_FILE,
    SINGLE_FILE,
    read_hf_config,
    weight_files,
)
from bytelatent.errors import CheckpointError, ConfigError
from bytelatent.model.args import block_head_counts
from bytelatent.model.layers import ffn_hidden_dim

logger = logging.getLogger("bytelatent")

PREFIX = "global_transformer.layers"
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)\.weight$")
_NAMES = {  # HF LlamaDecoderLayer names -> our TransformerBlock names
    "self_attn.q_proj": "attention.wq",
    "self_attn.k_proj": "attention.wk",
    "self_attn.v_proj": "attention.wv",
    "self_attn.o_proj": "attention.wo",
    "mlp.gate_proj": "feed_forward.w1",
    "mlp.up_proj": "feed_forward.w3",
    "mlp.down_proj": "feed_forward.w2",
    "input_layernorm": "attention_norm",
    "post_attention_layernorm": "ffn_norm",
}
_UNUSED = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")


# ---------------------------------------------------------------------------------- config
def _rope(cfg: dict[str, Any]) -> tuple[float | None, dict[str, Any] | None]:
    """(rope_theta, llama3-style rope_scaling or None) from transformers 4.x or 5.x configs."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict):  # transformers >= 5
        kind = params.get("rope_type", "default")
        return params.get("rope_theta"), None if kind == "default" else params
    scaling = cfg.get("rope_scaling")
    return cfg.get("rope_theta", 10000.0), scaling or None


def architecture_mismatches(cfg: dict[str, Any], model_args: Any) -> list[str]:
    """One entry per field where the HF config and the global transformer's args disagree (named
    in their config section, ``model.``)."""
    kind, arch = cfg.get("model_type"), cfg.get("architectures") or []
    if kind != "llama" or (arch and "LlamaForCausalLM" not in arch):
        return [
            f"model_type={kind!r} architectures={arch}: format hf_llama reads LlamaForCausalLM folders"
        ]
    block = model_args.global_block_args()
    head_dim, n_heads, n_kv_heads = block_head_counts(block)
    hf_heads = cfg.get("num_attention_heads")
    hf_hidden = cfg.get("hidden_size")
    section = "model."
    kv_key = "n_kv_heads_global" if hasattr(model_args, "n_kv_heads_global") else "n_kv_heads"
    pairs = [
        ("dim", block.dim, "hidden_size", hf_hidden),
        ("n_layers", block.n_layers, "num_hidden_layers", cfg.get("num_hidden_layers")),
        ("n_heads", n_heads, "num_attention_heads", hf_heads),
        (
            kv_key,
            n_kv_heads,
            "num_key_value_heads",
            cfg.get("num_key_value_heads", hf_heads),
        ),
        (
            "head_dim",
            head_dim,
            "head_dim",
            cfg.get("head_dim") or (hf_hidden // hf_heads if hf_hidden and hf_heads else None),
        ),
        (
            "ffn_dim_multiplier/multiple_of (FFN width)",
            ffn_hidden_dim(block.dim, block.multiple_of, block.ffn_dim_multiplier),
            "intermediate_size",
            cfg.get("intermediate_size"),
        ),
        ("norm_eps", block.norm_eps, "rms_norm_eps", cfg.get("rms_norm_eps")),
        ("rope_theta", block.rope_theta, "rope_theta", _rope(cfg)[0]),
    ]
    out = [
        f"{section}{ours}={mine} but {theirs}={hf}"
        for ours, mine, theirs, hf in pairs
        if mine != hf
    ]
    scaling = _rope(cfg)[1]
    if scaling is not None and "rope_scaling" not in type(model_args).model_fields:
        out.append(f"rope_scaling={scaling}: {section}* has no rope_scaling (use a Llama without)")
    else:
        out += _rope_scaling_mismatches(scaling, block.rope_scaling, section)
    for key, expected in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if cfg.get(key, expected) != expected:
            out.append(f"{key}={cfg[key]!r} is not supported (our blocks need {expected!r})")
    return out


def _rope_scaling_mismatches(hf: dict[str, Any] | None, ours: Any, section: str) -> list[str]:
    if hf is None:
        return (
            []
            if ours is None
            else [f"{section}rope_scaling={ours.model_dump()} but rope_scaling=null"]
        )
    kind = hf.get("rope_type", hf.get("type"))
    if kind != "llama3":
        return [f"rope_scaling.rope_type={kind!r} is not supported (only llama3)"]
    if ours is None:
        return [
            f"{section}rope_scaling=null but rope_scaling={hf}; copy it into {section}rope_scaling"
        ]
    fields = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    return [
        f"{section}rope_scaling.{name}={getattr(ours, name)} but rope_scaling.{name}={hf.get(name)}"
        for name in fields
        if getattr(ours, name) != hf.get(name)
    ]


def check_hf_llama(model_args: Any) -> list[str]:
    """Raise CheckpointError on any mismatch or missing file; returns the weight files."""
    path = model_args.global_init.path
    mismatches = architecture_mismatches(read_hf_config(path), model_args)
    if mismatches:
        raise CheckpointError(
            f"model.global_init {path}/{CONFIG_FILE} does not match the global "
            "transformer: " + "; ".join(mismatches)
        )
    return weight_files(path)


# ---------------------------------------------------------------------------------- weights
def hf_to_ours(hf_name: str) -> str | None:
    """Our parameter name for a HF decoder-layer weight; None for the unused top-level ones."""
    match = _LAYER.match(hf_name)
    if match is None or match.group(2) not in _NAMES:
        if hf_name in _UNUSED or hf_name.endswith("rotary_emb.inv_freq"):
            return None
        raise CheckpointError(f"{hf_name}: unexpected tensor in a LlamaForCausalLM checkpoint")
    return f"{PREFIX}.{match.group(1)}.{_NAMES[match.group(2)]}.weight"


def rotate_half_to_interleaved(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """q/k projection rows: per head, HF feature j (j < d/2) -> 2j, j + d/2 -> 2j + 1."""
    rows, cols = weight.shape
    head_dim = rows // n_heads
    return weight.view(n_heads, 2, head_dim // 2, cols).transpose(1, 2).reshape(rows, cols)


def _read_tensors(file: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of one safetensors file; a malformed file (header length or data offsets
    past its end, truncated) is one CheckpointError line."""
    try:
        yield from _read_safetensors(file)
    except CheckpointError:
        raise
    except Exception as err:  # safetensors' SafetensorError, OSError from the filesystem
        text = str(err).strip().splitlines()
        raise CheckpointError(
            f"{file}: not a readable safetensors file ({type(err).__name__}: "
            f"{text[0] if text else ''})"
        ) from None


def _nonfinite(tensor: torch.Tensor) -> str | None:
    """'N NaN and M inf values' when a floating tensor has any, else None."""
    if not tensor.is_floating_point() or bool(torch.isfinite(tensor).all()):
        return None
    nan = int(torch.isnan(tensor).sum())
    return f"{nan:,} NaN and {int((~torch.isfinite(tensor)).sum()) - nan:,} inf values"


def _read_safetensors(file: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of one safetensors file; local files tensor by tensor, remote whole."""
    from safetensors import safe_open
    from safetensors.torch import load as load_bytes

    fs = get_fs(file)
    if isinstance(fs, LocalFileSystem):
        with safe_open(fs._strip_protocol(file), framework="pt") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)
        return
    with fs.open(file, "rb") as f:
        tensors = load_bytes(f.read())  # one shard in memory at a time
    yield from tensors.items()


def _copy_into(param: torch.Tensor, full: torch.Tensor) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor

    full = full.to(device=param.device, dtype=param.dtype)
    if isinstance(param, DTensor):  # every rank holds the full tensor: cut the local shard
        shard = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(shard.to_local())
    else:
        param.copy_(full)


@torch.no_grad()
def load_hf_llama(model: nn.Module, model_args: Any) -> int:
    """Copy the HF decoder layers into ``model.global_transformer``; returns tensors copied."""
    files = check_hf_llama(model_args)
    _, n_heads, n_kv_heads = block_head_counts(model_args.global_block_args())
    params = {n: p for n, p in model.named_parameters() if n.startswith(PREFIX + ".")}
    done: set[str] = set()
    for file in files:
        for hf_name, tensor in _read_tensors(file):
            name = hf_to_ours(hf_name)
            if name is None:
                continue
            if name not in params:
                raise CheckpointError(f"{file}: {hf_name} has no place in the global transformer")
            if (bad := _nonfinite(tensor)) is not None:  # would poison every step after
                raise CheckpointError(f"{file}: {hf_name} has {bad}; refusing to load it")
            if name.endswith("attention.wq.weight"):
                tensor = rotate_half_to_interleaved(tensor, n_heads)
            elif name.endswith("attention.wk.weight"):
                tensor = rotate_half_to_interleaved(tensor, n_kv_heads)
            if tuple(tensor.shape) != tuple(params[name].shape):
                raise CheckpointError(
                    f"{file}: {hf_name} has shape {tuple(tensor.shape)}, "
                    f"{name} needs {tuple(params[name].shape)}"
                )
            _copy_into(params[name], tensor)
            done.add(name)
    missing = sorted(set(params) - done)
    if missing:
        raise CheckpointError(
            f"{model_args.global_init.path}: no weights for {len(missing)} global transformer "
            f"parameters, e.g. {missing[0]}"
        )
    logger.info("global transformer: %d tensors from %s", len(done), model_args.global_init.path)
    return len(done)


@torch.no_grad()
def load_subword_embeddings(model: nn.Module, model_args: Any) -> int:
    """The Llama's input embedding table and its tokenizer's vocabulary into `model.subword`
    (`model.subword_vocab_size`, docs/byteify.md); returns the tokens keyed."""
    path = model_args.global_init.path
    tokenizer_file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tokenizer_file):
        raise ConfigError(
            f"model.subword_vocab_size needs the token model's tokenizer.json in "
            f"model.global_init.path={path} (a local folder)"
        )
    try:
        from tokenizers import Tokenizer

        from bytelatent.tokenizers.hf_bpe import byte_level_vocab
    except ImportError as exc:
        raise ConfigError(
            f"subword embeddings need tokenizers ({exc}); pip install -e '.[hf]'"
        ) from None
    try:
        vocab = byte_level_vocab(Tokenizer.from_file(tokenizer_file))
        too_long = model.subword.set_vocabulary(vocab)
    except ValueError as exc:
        raise ConfigError(f"{tokenizer_file}: {exc}") from None
    head = getattr(model, "teacher_head", None)
    if head is not None:
        head.set_vocabulary(vocab)
    table = model.subword.table.weight
    found = {}
    for file in check_hf_llama(model_args):
        for hf_name, tensor in _read_tensors(file):
            if hf_name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
                found[hf_name] = tensor
    if "model.embed_tokens.weight" not in found:
        raise CheckpointError(f"{path}: no model.embed_tokens.weight for the subword embeddings")
    _copy_rows(table, found["model.embed_tokens.weight"], path)
    if head is not None:
        # a Llama with tied embeddings has no lm_head.weight: its head is the input table
        weight = found.get("lm_head.weight", found["model.embed_tokens.weight"])
        _copy_rows(head.head.weight, weight, path)
        if "model.norm.weight" not in found:
            raise CheckpointError(f"{path}: no model.norm.weight for model.teacher_head")
        _copy_into(head.norm.weight, found["model.norm.weight"])
    if too_long:
        logger.warning(
            "subword embeddings: %d tokens are longer than model.subword_max_bytes=%d and are "
            "never looked up",
            too_long,
            model_args.subword_max_bytes,
        )
    return len(vocab)


def _copy_rows(param: torch.Tensor, tensor: torch.Tensor, path: str) -> None:
    """A [V, dim] token table into a [subword_vocab_size, dim] parameter (rows past V zero)."""
    if tensor.shape[1] != param.shape[1] or tensor.shape[0] > param.shape[0]:
        raise CheckpointError(
            f"{path}: a token table of shape {tuple(tensor.shape)}; model.subword_vocab_size "
            f"must be >= {tensor.shape[0]} and model.dim = {tensor.shape[1]}"
        )
    full = torch.zeros(tuple(param.shape), dtype=tensor.dtype)
    full[: tensor.shape[0]] = tensor
    _copy_into(param, full)


def warm_start_global(model: nn.Module, model_args: Any) -> bool:
    """The BLT spec's warm start (`ArchSpec.warm_start`): `model.global_init`'s Llama layers into
    the global transformer (and its embeddings into `model.subword` when the model has them);
    False when the config sets none."""
    if model_args is None or getattr(model_args, "global_init", None) is None:
        return False
    load_hf_llama(model, model_args)
    if getattr(model, "subword", None) is not None:
        n = load_subword_embeddings(model, model_args)
        logger.info("subword embeddings: %d tokens from %s", n, model_args.global_init.path)
    logging.getLogger("bytelatent").info(
        "global transformer initialised from %s", model_args.global_init.path
    )
    return True
