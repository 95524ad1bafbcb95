"""Warm start: model weights only, from a DCP step folder or a consolidated folder/.pth file.

Checkpoint keys are mapped to model keys (optional prefix renames, longest prefix wins), shapes
are checked key by key, and with `strict` any missing or unexpected key is one CheckpointError.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

from bytelatent.checkpoint import fs as cfs
from bytelatent.checkpoint.consolidate import (
    METADATA_FILE,
    find_consolidated_file,
    load_consolidated_state_dict,
)
from bytelatent.checkpoint.dcp_io import dcp_load, read_metadata
from bytelatent.checkpoint.verify import require_loadable
from bytelatent.errors import CheckpointError

logger = logging.getLogger(__name__)


@dataclass
class InitLoadReport:
    """Result of `load_init`: which keys were loaded and which were skipped (non-strict mode)."""

    path: str
    format: str  # "dcp" or "consolidated"
    loaded: list[str] = field(default_factory=list)
    # Model keys the checkpoint did not provide, and checkpoint keys with no model key.
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)


def rename_key(key: str, rename: dict[str, str] | None) -> str:
    for old in sorted(rename or {}, key=len, reverse=True):
        if key.startswith(old):
            return rename[old] + key[len(old) :]
    return key


def short_list(keys: Sequence[str], limit: int = 5) -> str:
    keys = sorted(keys)
    more = f" (+{len(keys) - limit} more)" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


def load_init(
    model: nn.Module,
    path: str,
    strict: bool,
    rename: dict[str, str] | None,
    s3_profile: str | None = None,
    process_group: Any = None,
) -> InitLoadReport:
    """Load model weights from `path` (DCP folder or consolidated); call after `init_weights()`.

    Non-persistent buffers (RoPE tables) are not in checkpoints and keep their initialised values.
    """
    fs = cfs.get_fs(path, s3_profile)
    if cfs.exists(fs, cfs.join(path, METADATA_FILE)):
        require_loadable(path, s3_profile)
        report = _load_dcp(model, path, strict, rename, s3_profile, process_group)
    elif find_consolidated_file(path, s3_profile) is not None:
        report = _load_consolidated(model, path, strict, rename, s3_profile)
    else:
        raise CheckpointError(
            f"{path}: neither a DCP folder (.metadata) nor a consolidated checkpoint (consolidated.pth)"
        )
    if report.missing or report.unexpected:
        logger.warning(
            "warm start from %s: missing %s; unexpected %s",
            path,
            short_list(report.missing),
            short_list(report.unexpected),
        )
    return report


def match_keys(
    path: str,
    fmt: str,
    model_shapes: dict[str, torch.Size],
    ckpt_shapes: dict[str, torch.Size],
    strict: bool,
    rename: dict[str, str] | None,
) -> tuple[dict[str, str], InitLoadReport]:
    """Map checkpoint keys to model keys; raise on shape mismatches, and on missing/extra keys if strict."""
    mapping = {ckpt_key: rename_key(ckpt_key, rename) for ckpt_key in ckpt_shapes}
    matched = {c: m for c, m in mapping.items() if m in model_shapes}
    report = InitLoadReport(
        path=path,
        format=fmt,
        loaded=sorted(matched.values()),
        missing=sorted(set(model_shapes) - set(matched.values())),
        unexpected=sorted(c for c, m in mapping.items() if m not in model_shapes),
    )
    for ckpt_key, model_key in matched.items():
        if tuple(ckpt_shapes[ckpt_key]) != tuple(model_shapes[model_key]):
            raise CheckpointError(
                f"{path}: {ckpt_key} has shape {tuple(ckpt_shapes[ckpt_key])} but model key {model_key} "
                f"needs {tuple(model_shapes[model_key])}; check the model config matches the checkpoint"
            )
    if strict and (report.missing or report.unexpected):
        raise CheckpointError(
            f"{path}: keys do not match the model (missing: {short_list(report.missing) or '-'}; "
            f"unexpected: {short_list(report.unexpected) or '-'}); fix checkpoint.init_ckpt_rename or set "
            "checkpoint.init_ckpt_strict=false"
        )
    return matched, report


def _dcp_model_shapes(path: str, s3_profile: str | None) -> tuple[bool, dict[str, torch.Size]]:
    """(nested under "model"?, checkpoint key -> shape) of a DCP folder's model entries."""
    metadata = read_metadata(path, s3_profile)
    planner_paths = metadata.planner_data or {}
    nested = any(planner_paths.get(k, (None,))[0] == "model" for k in metadata.state_dict_metadata)
    shapes: dict[str, torch.Size] = {}
    for flat_key, md in metadata.state_dict_metadata.items():
        obj_path = planner_paths.get(flat_key, (flat_key,))
        if nested and (obj_path[0] != "model" or len(obj_path) != 2):
            continue  # optimizer state and anything else outside "model"
        if hasattr(md, "size"):
            shapes[obj_path[1] if nested else flat_key] = md.size
    return nested, shapes


def _load_dcp(
    model: nn.Module,
    path: str,
    strict: bool,
    rename: dict[str, str] | None,
    s3_profile: str | None,
    process_group: Any,
) -> InitLoadReport:
    nested, ckpt_shapes = _dcp_model_shapes(path, s3_profile)
    model_sd = get_model_state_dict(model)
    model_shapes = {k: v.shape for k, v in model_sd.items()}
    matched, report = match_keys(path, "dcp", model_shapes, ckpt_shapes, strict, rename)
    targets = {ckpt_key: model_sd[model_key] for ckpt_key, model_key in matched.items()}
    state = {"model": targets} if nested else targets
    options = cfs.storage_options(path, s3_profile)
    dcp_load(state, path, "warm start failed", options, process_group)
    loaded = state["model"] if nested else state
    set_model_state_dict(
        model,
        {matched[c]: t for c, t in loaded.items()},
        options=StateDictOptions(strict=False),
    )
    return report


def _load_consolidated(
    model: nn.Module, path: str, strict: bool, rename: dict[str, str] | None, s3_profile: str | None
) -> InitLoadReport:
    ckpt = load_consolidated_state_dict(path, s3_profile)
    model_sd = get_model_state_dict(model)
    matched, report = match_keys(
        path,
        "consolidated",
        {k: v.shape for k, v in model_sd.items()},
        {k: v.shape for k, v in ckpt.items()},
        strict,
        rename,
    )
    full = {model_key: ckpt[ckpt_key] for ckpt_key, model_key in matched.items()}
    # full_state_dict=True: every rank holds the whole tensors and FSDP/TP slice out their shard.
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, strict=False))
    return report
