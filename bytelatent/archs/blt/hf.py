"""Hugging Face transformers ``BltForCausalLM`` <-> our weights: the BLT's (and its entropy
model's, as ``BltPatcher``) export and import adapters.

An adapter at the edge (a sibling of ``bytelatent/archs/blt/reference_compat.py``): the model code
knows nothing about HF. ``export_hf`` writes a folder ``BltForCausalLM.from_pretrained`` loads
(``config.json``, ``model.safetensors``, tokenizer files); ``import_hf`` turns such a folder back
into our consolidated layout (``params.json`` + ``consolidated.pth``, the entropy model under
``entropy_model/``). Neither needs transformers installed: config.json is written and read as
JSON, the weights with safetensors.

This module reads and writes the files; the three maps it composes live apart:

    hf_config    our args <-> config.json (``blt_hf_config``, ``blt_args_from_hf_config``, ...)
    hf_weights   our names/layout <-> HF tensors (``blt_state_dict_to_hf``, ``hf_state_dict_to_blt``)
    hf_checks    what HF can represent (``check_hf_representable``, windows) and whether imported
                 tensors fit the config (``check_weights``: every missing/unexpected/misshaped,
                 non-float or non-finite tensor, in one line)

and are re-exported here (``from bytelatent.archs.blt.hf import ...`` keeps working).

HF's port computes the same function as ours only for a subset of configurations; everything
outside it is refused with one line naming the field (``check_hf_representable``). What differs
even inside the subset (masks: no sliding window, no document boundaries) is in
docs/differences.md, with a minimal repro.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from bytelatent.archs.blt.hf_checks import (  # noqa: F401  (re-exported)
    check_hf_entropy_representable,
    check_hf_representable,
    check_weights,
    check_windows,
    patching_notes,
    weight_mismatches,
    window_mismatches,
)
from bytelatent.archs.blt.hf_config import (  # noqa: F401  (re-exported)
    CONFIG_FILE,
    HF_MODEL_TYPE,
    HF_PATCHER_TYPE,
    OURS_KEY,
    JsonDict,
    blt_args_from_hf_config,
    blt_hf_config,
    blt_params,
    entropy_args_from_hf_config,
    entropy_params,
    patcher_config,
    patching_from_hf_config,
    patching_settings,
)
from bytelatent.archs.blt.hf_weights import (  # noqa: F401  (re-exported)
    HASH_KEY,
    WEIGHTS_FILE,
    StateDict,
    blt_state_dict_to_hf,
    entropy_hf_name_to_ours,
    entropy_state_dict_to_hf,
    hf_state_dict_to_blt,
)
from bytelatent.checkpoint import hf_folder
from bytelatent.checkpoint.hf_folder import require_hf_deps as _require_hf_deps
from bytelatent.checkpoint.hf_folder import save_safetensors as _save_safetensors
from bytelatent.checkpoint.hf_folder import state_for_export as _state_for_export
from bytelatent.checkpoint.hf_folder import write_consolidated as _write_consolidated
from bytelatent.checkpoint.hf_folder import write_json as _write_json
from bytelatent.checkpoint.hf_folder import write_tokenizer
from bytelatent.checkpoint.pretrained import load_any_checkpoint
from bytelatent.errors import CheckpointError
from bytelatent.model.args import LMTransformerArgs

logger = logging.getLogger("bytelatent")


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
    patching = patching_settings(params)
    notes += patching_notes(patching, entropy_args is not None)
    out_dir.mkdir(parents=True, exist_ok=True)
    _save_safetensors(hf, out_dir / WEIGHTS_FILE)
    _write_json(out_dir / CONFIG_FILE, blt_hf_config(args, hf, patching, entropy_args))
    write_tokenizer(out_dir, args.max_encoder_seq_length)
    return notes


def _export_entropy_only(
    model: torch.nn.Module, args: LMTransformerArgs, out_dir: Path, allow_window_mismatch: bool
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


def read_hf_folder(
    hf_dir: str,
    model_types: tuple[str, ...] = (HF_MODEL_TYPE, HF_PATCHER_TYPE),
    what: str = "a BLT model",
) -> tuple[JsonDict, StateDict]:
    """(config.json, all weights) of a Hugging Face BLT folder (`hf_folder.read_hf_folder`)."""
    return hf_folder.read_hf_folder(hf_dir, model_types, what)


def import_hf(hf_dir: str, out: str) -> str:
    """HF BLT folder -> our consolidated layout (entropy model, if any, in out/entropy_model)."""
    config, weights = read_hf_folder(hf_dir)
    ours = config.get(OURS_KEY) or {}
    out_dir = Path(out)
    if config["model_type"] == HF_PATCHER_TYPE:
        eargs = entropy_args_from_hf_config(config, ours.get("entropy_model"))
        state = {entropy_hf_name_to_ours(k, ""): v for k, v in weights.items()}
        check_weights(eargs, state, hf_dir)
        _write_consolidated(out_dir, entropy_params(eargs, hf_dir), state)
        return str(out_dir)
    args = blt_args_from_hf_config(config)
    state, patcher_state = hf_state_dict_to_blt(weights, args)
    check_weights(args, state, hf_dir)
    eargs = None
    if patcher_state:
        eargs = entropy_args_from_hf_config(
            config.get("patcher_config") or {}, ours.get("entropy_model")
        )
        check_weights(eargs, patcher_state, hf_dir)
    _write_consolidated(out_dir, blt_params(args, patching_from_hf_config(config), hf_dir), state)
    if eargs is not None:
        _write_consolidated(out_dir / "entropy_model", entropy_params(eargs, hf_dir), patcher_state)
    return str(out_dir)
