"""How to patch (`PatcherArgs`, `PatchingMode`): configuration only, no torch.

The data config (`DataArgs`) and the data-loader worker import this module. The rules run on numpy
(`patch_rules.py`); `Patcher(args)` (`bytelatent/data/patcher.py`, torch) is imported only where
patching needs torch (`needs_torch`: a model, or top-k), so most workers start without torch.
"""

from __future__ import annotations

import re
from enum import Enum

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

_DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


class PatchingMode(str, Enum):
    entropy = "entropy"
    bpe = "bpe"
    bpe_patcher = "bpe_patcher"
    space = "space"
    static = "static"
    byte = "byte"
    tokenizer = "tokenizer"  # a patch per token of a Hugging Face byte-level BPE (byteify)


# Patch starts decided from the whole document (a token's start depends on the bytes after it):
# training and scoring only, never generation or online patching (docs/byteify.md).
OFFLINE_MODES = (PatchingMode.tokenizer,)


MODEL_MODES = (PatchingMode.entropy, PatchingMode.bpe_patcher)


class PatcherArgs(BaseModel):
    """How to patch byte sequences (reference field names; devices default to 'auto')."""

    model_config = ConfigDict(extra="forbid")

    patching_mode: PatchingMode = Field(
        PatchingMode.entropy,
        description="entropy (next-byte entropy vs threshold), space, bpe (BPE delimiters in the "
        "tokens), bpe_patcher (a model predicts them), static (patch_size bytes), byte (1 byte), "
        "tokenizer (a patch per token of tokenizer_path's byte-level BPE; training only)",
    )
    tokenizer_path: str | None = Field(
        None,
        description="tokenizer mode: a Hugging Face byte-level BPE, the folder holding "
        "tokenizer.json or the file (byteify: the teacher's, e.g. hf/stdlib-teacher); other "
        "modes ignore it",
    )
    patching_device: str = Field(
        "auto",
        description="where a loaded entropy model runs: auto (cuda if available), cpu, cuda, cuda:N",
    )
    entropy_model_checkpoint_dir: str | None = Field(
        None,
        description="entropy model folder (params.json, consolidated.pth) for realtime_patching",
    )
    realtime_patching: bool = Field(
        False,
        description="compute entropies on the fly with the model in entropy_model_checkpoint_dir "
        "instead of reading them from the data",
    )
    threshold: float | None = Field(
        1.335442066192627,
        description="entropy mode: a patch starts after a byte whose next-byte entropy (nats) "
        "exceeds it; null: the N // patch_size - 2 highest entropies of a row start patches",
    )
    threshold_add: float | None = Field(
        None,
        description="entropy mode: also require the entropy's rise over the previous byte to "
        "exceed this (both rules must hold); null: off",
    )
    max_patch_length: int | None = Field(
        None, description="split patches longer than this many bytes (any mode); null: no limit"
    )
    patch_size: float = Field(
        4.5,
        description="bytes per patch: the length in static mode (integer), the target mean of "
        "top-k entropy patching (threshold=null), the nominal size for FLOP counts",
    )
    patching_batch_size: int = Field(
        1, description="rows per forward of the entropy / bpe_patcher model (>= 1)"
    )
    device: str = Field(
        "auto",
        description="the reference's second device key; must agree with patching_device when "
        "both are set",
    )
    monotonicity: bool = Field(
        False,
        description="entropy mode: compare the entropy's rise over the previous byte with "
        "threshold instead of the entropy itself",
    )
    log_time: bool = Field(
        False, description="accumulate patching and entropy seconds in the Patcher's `log` dict"
    )

    @field_validator("patching_device", "device")
    @classmethod
    def _check_device(cls, value: str) -> str:
        if not _DEVICE_RE.match(value):
            raise ValueError(f"{value!r} is not a device; use auto, cpu, cuda or cuda:N")
        return value

    @model_validator(mode="after")
    def _check_combination(self) -> PatcherArgs:
        mode = self.patching_mode
        if mode == PatchingMode.static and (
            self.patch_size < 1 or self.patch_size != int(self.patch_size)
        ):
            raise ValueError(
                f"patching_mode=static needs an integer patch_size >= 1, got {self.patch_size}"
            )
        if mode == PatchingMode.entropy and self.threshold is None and self.patch_size <= 0:
            raise ValueError(
                "threshold=None (top-k entropy patching) needs patch_size > 0, "
                f"got {self.patch_size}"
            )
        if self.realtime_patching and mode not in MODEL_MODES:
            raise ValueError(
                f"realtime_patching=true only applies to patching_mode entropy or bpe_patcher, "
                f"not {mode.value}"
            )
        if self.realtime_patching and not self.entropy_model_checkpoint_dir:
            raise ValueError(
                "realtime_patching=true needs entropy_model_checkpoint_dir (a directory with "
                "params.json and consolidated.pth)"
            )
        if mode == PatchingMode.tokenizer and not self.tokenizer_path:
            raise ValueError(
                "patching_mode=tokenizer needs tokenizer_path (a Hugging Face tokenizer folder "
                "or its tokenizer.json)"
            )
        if self.monotonicity and self.threshold_add is not None:
            raise ValueError(
                "monotonicity=true and threshold_add are two different rules; set only one"
            )
        if self.max_patch_length is not None and self.max_patch_length < 1:
            raise ValueError(f"max_patch_length={self.max_patch_length} must be >= 1")
        if self.patching_batch_size < 1:
            raise ValueError(f"patching_batch_size={self.patching_batch_size} must be >= 1")
        if (
            "auto" not in (self.device, self.patching_device)
            and self.device != self.patching_device
        ):
            raise ValueError(
                f"patching_device={self.patching_device!r} and device={self.device!r} disagree; "
                "set patching_device only"
            )
        return self

    @property
    def needs_torch(self) -> bool:
        """Whether patching runs torch: a model (realtime entropies, bpe_patcher) or the top-k
        entropy rule (threshold=None: torch.topk, as the reference). Otherwise the rules run on
        numpy alone (patch_rules.py), in a data-loader worker that never imports torch."""
        mode = self.patching_mode
        return (
            self.realtime_patching
            or mode == PatchingMode.bpe_patcher
            or (mode == PatchingMode.entropy and self.threshold is None)
        )

    @property
    def model_device(self) -> str:
        """The device an entropy model runs on (patching_device, else device, else auto)."""
        return self.patching_device if self.patching_device != "auto" else self.device
