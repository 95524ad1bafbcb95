"""Hugging Face transformers ``BltForCausalLM`` <-> our weights: export and import folders.

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

import json
import logging
import os
from pathlib import Path

import torch
from fsspec.implementations.local import LocalFileSystem

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
    HNET_MODEL_TYPE,
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
from bytelatent.checkpoint.pretrained import load_any_checkpoint
from bytelatent.checkpoint.safe_paths import read_shard_index, require_inside
from bytelatent.errors import CheckpointError
from bytelatent.model.args import LMTransformerArgs

logger = logging.getLogger("bytelatent")


def _require_hf_deps() -> None:
    try:
        import safetensors  # noqa: F401
    except ImportError:
        raise CheckpointError(
            "Hugging Face export/import needs safetensors: pip install 'bytelatent[hf]'"
        ) from None


def _state_for_export(model: torch.nn.Module) -> StateDict:
    return {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}


def _save_safetensors(tensors: StateDict, path: Path) -> None:
    from safetensors.torch import save_file

    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata={"format": "pt"})
    umask = os.umask(0)  # safetensors writes 0600; give it the mode any other file here gets
    os.umask(umask)
    tmp.chmod(0o666 & ~umask)
    tmp.replace(path)  # atomic: an interrupted export leaves no half-written weights


def _write_json(path: Path, data: JsonDict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    tmp.replace(path)


def export_hf(
    ckpt: str,
    out: str,
    entropy_model: str | None = None,
    allow_window_mismatch: bool = False,
    allow_arch_import: bool = False,
) -> list[str]:
    """Write `out/` for BltForCausalLM.from_pretrained (or BltPatcher for an entropy model).

    `ckpt` is a DCP step folder, a consolidated or a released folder. Returns notes on what HF
    computes differently for some inputs (to print); refuses what HF cannot represent, and an
    attention window shorter than the model's rows unless `allow_window_mismatch`. A
    `"pkg.module:name"` arch in its params.json is imported only with `allow_arch_import`.
    """

    _require_hf_deps()
    exporter = _other_arch_adapter(_arch_of_checkpoint(ckpt), "hf_export", allow_arch_import)
    if exporter is not None:  # e.g. H-Net (bytelatent/archs/hnet/hf.py)
        return exporter(ckpt, out, entropy_model, allow_window_mismatch)
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


def read_hf_folder(
    hf_dir: str,
    model_types: tuple[str, ...] = (HF_MODEL_TYPE, HF_PATCHER_TYPE),
    what: str = "a BLT model",
) -> tuple[JsonDict, StateDict]:
    """(config.json, all weights) of a Hugging Face model folder whose model_type is one of
    `model_types`; one-line errors otherwise."""
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
    if model_type not in model_types:
        expected = " or ".join(repr(t) for t in model_types)
        raise CheckpointError(
            f"{config_path}: model_type {model_type!r} is not {what} (expected {expected})"
        )
    index = folder / (WEIGHTS_FILE + ".index.json")
    if index.exists():  # shard names stay inside the folder
        files = read_shard_index(LocalFileSystem(), str(folder), index.name)
    elif (folder / WEIGHTS_FILE).exists():
        files = [WEIGHTS_FILE]
        require_inside(files, str(folder), str(folder / WEIGHTS_FILE), "weights file")
    else:
        raise CheckpointError(f"{hf_dir}: no {WEIGHTS_FILE} (nor a sharded index)")
    weights: StateDict = {}
    for name in files:
        try:
            weights.update(load_file(str(folder / name)))
        except Exception as exc:  # truncated / foreign files surface as safetensors errors
            raise CheckpointError(
                f"{folder / name}: cannot read ({type(exc).__name__}: {exc})"
            ) from None
    return config, weights


def _write_consolidated(out_dir: Path, params: JsonDict, state: StateDict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / "consolidated.pth.tmp"
    torch.save({"model": state}, tmp)
    tmp.replace(out_dir / "consolidated.pth")
    _write_json(out_dir / "params.json", params)


def import_hf(hf_dir: str, out: str) -> str:
    """HF BLT folder -> our consolidated layout (entropy model, if any, in out/entropy_model);
    an exported H-Net folder (model_type bytelatent_hnet) goes to its own adapter."""
    importer = _other_arch_adapter(_arch_of_hf_folder(hf_dir), "hf_import")
    if importer is not None:
        return importer(hf_dir, out)
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


def _arch_of_checkpoint(ckpt: str) -> str:
    """The arch its params.json names (blt when unreadable: the loader then says why)."""
    from bytelatent.checkpoint.pretrained import read_params
    from bytelatent.model.registry import arch_name_from_params

    try:
        return arch_name_from_params(read_params(ckpt))
    except CheckpointError:
        return "blt"


def _arch_of_hf_folder(hf_dir: str) -> str:
    """The arch an HF folder's config.json names through its model_type (blt when unknown: the
    BLT reader then names what is wrong with the folder)."""
    try:
        config = json.loads((Path(hf_dir) / CONFIG_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return "blt"
    return "hnet" if config.get("model_type") == HNET_MODEL_TYPE else "blt"


def _other_arch_adapter(arch: str, field: str, allow_import: bool = False):
    """The spec's `field` adapter when it is not this module's (the BLT/entropy one), else None."""
    from bytelatent.model.registry import get_arch

    try:
        adapter = get_arch(arch, allow_import=allow_import).resolve(field)
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None
    if adapter is None:
        raise CheckpointError(f"arch {arch!r} has no Hugging Face {field.removeprefix('hf_')}")
    return None if adapter in (export_hf, import_hf) else adapter
