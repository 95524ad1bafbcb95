"""Load consolidated weights (`params.json` + `consolidated.pth`) into our models.

Two layouts share the file names: the released facebook/blt weights (`blt_1b/`, `entropy_model/`,
whose params.json is the reference's TrainArgs) and our own consolidated checkpoints
(`python -m bytelatent.checkpoint consolidate`, whose params.json is our TrainArgs).

`load_entropy_model` is the loader realtime patching and entropy preprocessing use (the data
side receives the model; it does not read checkpoints itself). It never touches the global
default dtype (docs/differences.md, `load_entropy_model`).
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Literal

import fsspec
import torch
from pydantic import BaseModel, ValidationError
from torch import nn

from bytelatent.checkpoint import fs as cfs
from bytelatent.checkpoint.consolidate import METADATA_FILE, load_dcp_state_dict
from bytelatent.checkpoint.model_size import require_model_fits
from bytelatent.errors import CheckpointError
from bytelatent.model.registry import ArchSpec, arch_name_from_params, arch_section, get_arch

logger = logging.getLogger("bytelatent")

WEIGHT_FILES = ("consolidated.pth", "consolidated/consolidated.pth")
# `consolidate --format safetensors` output; tried after the .pth files
SAFETENSORS_FILES = ("consolidated.safetensors", "consolidated/consolidated.safetensors")
# The architecture of entropy models (the byte LM; realtime patching, generation and the
# harness load one for an entropy-patched BLT): named here once, the loaders below use it.
ENTROPY_ARCH = "entropy"
# "auto" (the arch params.json names), or a registered arch name ("blt", "entropy", ...)
Kind = Literal["auto", "blt", "entropy"] | str


def _join(base: str, name: str) -> str:
    return base.rstrip("/") + "/" + name


def read_params(path: str) -> dict[str, Any]:
    for name in ("params.json", "consolidated/params.json"):
        fs, local = fsspec.core.url_to_fs(_join(path, name))
        if fs.exists(local):
            with fs.open(local, "r") as handle:
                try:
                    return json.load(handle)
                except json.JSONDecodeError as exc:
                    raise CheckpointError(f"{_join(path, name)}: invalid JSON ({exc})") from None
    raise CheckpointError(f"{path}: no params.json; expected params.json + consolidated.pth")


def read_weights(path: str) -> dict[str, torch.Tensor]:
    for name in WEIGHT_FILES:
        fs, local = fsspec.core.url_to_fs(_join(path, name))
        if fs.exists(local):
            try:
                with fs.open(local, "rb") as handle:
                    state = torch.load(handle, map_location="cpu", weights_only=True)
            except Exception as exc:  # truncated / corrupted files surface as pickle or zip errors
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                raise CheckpointError(
                    f"{_join(path, name)}: cannot read ({type(exc).__name__}: {first})"
                ) from None
            return state.get("model", state) if isinstance(state, dict) else state
    for name in SAFETENSORS_FILES:
        fs, local = fsspec.core.url_to_fs(_join(path, name))
        if fs.exists(local):
            return _read_safetensors(fs, local, _join(path, name))
    looked = ", ".join(WEIGHT_FILES + SAFETENSORS_FILES)
    raise CheckpointError(
        f"{path}: no consolidated.pth (looked for {looked}) and no DCP .metadata; "
        "`python -m bytelatent.checkpoint consolidate STEP_DIR` writes one from a training step"
    )


def _read_safetensors(fs: Any, local: str, where: str) -> dict[str, torch.Tensor]:
    try:
        from safetensors.torch import load
    except ImportError:
        raise CheckpointError(
            f"{where}: reading safetensors needs the safetensors package: pip install 'bytelatent[hf]'"
        ) from None
    with fs.open(local, "rb") as handle:
        data = handle.read()
    try:
        return load(data)
    except Exception as exc:  # truncated / foreign files
        raise CheckpointError(
            f"{where}: cannot read safetensors ({type(exc).__name__}: {exc})"
        ) from None


def _resolve_kind(
    params: dict[str, Any], kind: Kind, where: str = "params.json", allow_import: bool = False
) -> ArchSpec:
    """The spec of `kind`, or with "auto" of the arch params.json names (checkpoints from before
    `arch`: `train_entropy_model: true` or no `model` section means entropy, else blt).

    A `"pkg.module:name"` the file names is imported only with `allow_import` (the caller's
    opt-in); a `kind` the caller names is its own choice."""
    name = arch_name_from_params(params) if kind == "auto" else kind
    try:
        return get_arch(name, allow_import=allow_import or kind != "auto")
    except ValueError as exc:
        raise CheckpointError(f"{where}: {exc}") from None


def model_args_from_params(
    params: dict[str, Any],
    kind: Kind = "auto",
    where: str = "params.json",
    allow_arch_import: bool = False,
):
    """(model args, arch name, reference fields without effect) for either params.json layout."""
    spec = _resolve_kind(params, kind, where, allow_arch_import)
    read = spec.adapters.read_params
    if read is not None:
        args, ignored = read(params, where)
        return args, spec.name, ignored
    section = arch_section(params, spec)
    if not isinstance(section, dict):
        raise CheckpointError(f"{where}: no 'model' section; is this a {spec.name} checkpoint?")
    try:
        return spec.args_class.model_validate(section), spec.name, []
    except ValidationError as exc:
        raise CheckpointError(f"{where}: model args invalid: {exc}") from None


def build_and_load(args: BaseModel, kind: str, state: dict, device: torch.device, reference: bool):
    """Meta build → to_empty → init (buffers) → strict load of `state` (`kind`: the arch name)."""
    spec = get_arch(kind)
    with torch.device("meta"):
        model = spec.build(args)
    model.to_empty(device=device)
    model.init_weights()  # recomputes non-persistent buffers (RoPE tables) too
    adapt = spec.adapters.reference_state_dict
    if adapt is not None and reference:
        state, notes = adapt(state, args)
        for note in notes:
            logger.info("reference weights: %s", note)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        detail = " ".join(line.strip() for line in str(exc).strip().splitlines()[:3])
        raise CheckpointError(f"weights do not match params.json: {detail}") from None
    return model


def load_pretrained(
    path: str,
    device: str | torch.device = "cpu",
    kind: Kind = "auto",
    allow_arch_import: bool = False,
):
    """Load a checkpoint directory; returns `(model, model_args)`, model in eval mode.

    A consolidated or released folder, or a DCP step folder as training writes it (read in this
    process, no process group; see `load_any_checkpoint`).

    `kind="auto"` picks the architecture params.json names (`arch`; from before `arch`: the
    entropy model when it says `train_entropy_model: true` or has no `model` section, else the
    BLT). Reference fields with no effect here are counted in one short warning line (listed
    with reasons at DEBUG level). An arch `"pkg.module:name"` is imported only with
    `allow_arch_import=True` (else it must already be imported). `model(tokens)` (entropy model)
    / `model(tokens, patch_lengths=...)` (BLT) give logits `[batch, length, vocab]`.
    """
    model, args, _ = load_any_checkpoint(path, device, kind, allow_arch_import)
    return model, args


def warn_ignored_fields(where: str, ignored: list[str], shown: int = 4) -> None:
    """One short warning line naming a few of the reference fields with no effect here; the full
    list with each reason at DEBUG. A released params.json has dozens (most did nothing in the
    reference either): listed whole, they made one 3.5 KB warning line on every load/export."""
    names = [note.split(" (", 1)[0].split("=", 1)[0] for note in ignored]
    more = f", ... ({len(names) - shown} more)" if len(names) > shown else ""
    logger.warning(
        "%s: %d reference field(s) have no effect here: %s%s (the list with reasons is logged "
        "at DEBUG level)",
        where,
        len(names),
        ", ".join(names[:shown]),
        more,
    )
    logger.debug("%s: reference fields without effect here: %s", where, ", ".join(ignored))


def load_any_checkpoint(
    path: str,
    device: str | torch.device = "cpu",
    kind: Kind = "auto",
    allow_arch_import: bool = False,
):
    """`(model, model_args, params)` from a DCP step folder, a consolidated or a released folder.

    The one loader behind evaluation, generation and export: a DCP step folder (`.metadata` +
    `params.json`, as the trainer writes it) is read in this process without a process group;
    anything else goes through `load_pretrained`'s readers. The model is in eval mode.
    `allow_arch_import`: the user trusts the module a `"pkg.module:name"` arch names.
    """
    path = str(path).rstrip("/")
    fs = cfs.get_fs(path)
    if not cfs.exists(fs, path):
        raise CheckpointError(f"{path}: does not exist")
    params = read_params(path)
    where = _join(path, "params.json")
    args, resolved, ignored = model_args_from_params(params, kind, where, allow_arch_import)
    if ignored:
        warn_ignored_fields(where, ignored)
    require_model_fits(args, device, where)  # before reading or allocating any weight
    if cfs.exists(fs, cfs.join(path, METADATA_FILE)):
        state = load_dcp_state_dict(path, keys={"model"}).get("model")
        if not state:
            raise CheckpointError(f"{path}: the DCP checkpoint has no 'model' entries")
        reference = False
    else:
        state = read_weights(path)
        reference = bool(ignored) or "eval_on_gpus" in params
    model = build_and_load(args, resolved, state, torch.device(device), reference)
    model.eval()
    return model, args, params


def load_entropy_checkpoint(path: str, device: str | torch.device = "cpu") -> nn.Module:
    """An entropy model from any checkpoint folder (DCP step, consolidated, released), eval mode."""
    return load_any_checkpoint(path, device, kind=ENTROPY_ARCH)[0]


def load_entropy_model(
    checkpoint_dir: str,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> nn.Module:
    """Build the LMTransformer in params.json and load consolidated.pth, in eval mode, no grads.

    Strict loading: a missing or unexpected weight is a CheckpointError. `device` is used as given
    (resolve "auto" with `bytelatent.data.entropy.resolve_device`).
    """
    where = os.path.join(checkpoint_dir, "params.json")
    # the byte LM's reader (its spec's read_params): our layout, the reference's, the released one
    args, _, _ = model_args_from_params(read_params(checkpoint_dir), ENTROPY_ARCH, where)
    require_model_fits(args, device, where)  # before reading or allocating any weight
    try:
        model = build_and_load(
            args, ENTROPY_ARCH, read_weights(checkpoint_dir), torch.device(device), False
        )
    except CheckpointError as exc:
        raise CheckpointError(f"{checkpoint_dir}: {exc}") from None
    model = model.to(dtype=dtype)
    model.eval()
    model.requires_grad_(False)
    return model
