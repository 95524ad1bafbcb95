"""A Hugging Face-style model folder (config.json, model.safetensors, tokenizer files): the files
every architecture's HF adapter reads and writes, and `export_hf` / `import_hf`, which pick the
adapter by the architecture's spec (`Adapters.hf_export`, `Adapters.hf_import` and
`Adapters.hf_model_types`; `python -m bytelatent.checkpoint export-hf|import-hf`)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from fsspec.implementations.local import LocalFileSystem

from bytelatent.checkpoint.safe_paths import read_shard_index, require_inside
from bytelatent.errors import CheckpointError
from bytelatent.model.registry import ArchSpec, arch_name_from_params, get_arch, registered_archs
from bytelatent.tokenizers.byte_level import byte_to_unicode

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
# config.json key holding our own args (what an import reads back exactly)
OURS_KEY = "bytelatent"
JsonDict = dict[str, Any]
StateDict = dict[str, torch.Tensor]


def require_hf_deps() -> None:
    try:
        import safetensors  # noqa: F401
    except ImportError:
        raise CheckpointError(
            "Hugging Face export/import needs safetensors: pip install 'bytelatent[hf]'"
        ) from None


def state_for_export(model: torch.nn.Module) -> StateDict:
    return {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}


def save_safetensors(tensors: StateDict, path: Path) -> None:
    from safetensors.torch import save_file

    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata={"format": "pt"})
    umask = os.umask(0)  # safetensors writes 0600; give it the mode any other file here gets
    os.umask(umask)
    tmp.chmod(0o666 & ~umask)
    tmp.replace(path)  # atomic: an interrupted export leaves no half-written weights


def write_json(path: Path, data: JsonDict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    tmp.replace(path)


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
    vocab.update({char: byte + len(SPECIAL_TOKENS) for byte, char in byte_to_unicode().items()})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", 1)]
    )
    tokenizer.save(str(out_dir / "tokenizer.json"))
    write_json(
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
    write_json(
        out_dir / "special_tokens_map.json",
        {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>"},
    )


def read_hf_folder(
    hf_dir: str,
    model_types: tuple[str, ...],
    what: str,
) -> tuple[JsonDict, StateDict]:
    """(config.json, all weights) of a Hugging Face model folder whose model_type is one of
    `model_types`; one-line errors otherwise."""
    require_hf_deps()
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


def write_consolidated(out_dir: Path, params: JsonDict, state: StateDict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / "consolidated.pth.tmp"
    torch.save({"model": state}, tmp)
    tmp.replace(out_dir / "consolidated.pth")
    write_json(out_dir / "params.json", params)


def export_hf(
    ckpt: str,
    out: str,
    entropy_model: str | None = None,
    allow_window_mismatch: bool = False,
    allow_arch_import: bool = False,
) -> list[str]:
    """Write `out/` from checkpoint `ckpt` with the HF export of the architecture its params.json
    names; returns notes on what the HF side computes differently (to print). A
    `"pkg.module:name"` arch in its params.json is imported only with `allow_arch_import`."""
    require_hf_deps()
    spec = _spec_of_checkpoint(ckpt, allow_arch_import)
    exporter = spec.adapters.hf_export
    if exporter is None:
        raise CheckpointError(
            f"{ckpt}: arch {_spec_of_checkpoint(ckpt).name!r} has no Hugging Face export"
        )
    return exporter(ckpt, out, entropy_model, allow_window_mismatch)


def import_hf(hf_dir: str, out: str) -> str:
    """HF folder -> our consolidated layout, by the spec whose `hf_model_types` holds the folder's
    config.json `model_type` (else the first with an HF import, whose reader names what is wrong)."""
    try:
        model_type = json.loads((Path(hf_dir) / CONFIG_FILE).read_text()).get("model_type")
    except (OSError, json.JSONDecodeError, AttributeError):
        model_type = None
    importers = [s for s in registered_archs().values() if s.adapters.hf_import is not None]
    chosen = next((s for s in importers if model_type in s.adapters.hf_model_types), None)
    if chosen is None and not importers:
        raise CheckpointError("no registered architecture imports Hugging Face folders")
    return (chosen or importers[0]).adapters.hf_import(hf_dir, out)


def _spec_of_checkpoint(ckpt: str, allow_import: bool = False) -> ArchSpec:
    """The spec its params.json names (the first with an HF export when unreadable: its loader
    then says why)."""
    from bytelatent.checkpoint.pretrained import read_params

    try:
        name = arch_name_from_params(read_params(ckpt))
    except CheckpointError:
        return next(s for s in registered_archs().values() if s.adapters.hf_export is not None)
    try:
        return get_arch(name, allow_import=allow_import)
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None
