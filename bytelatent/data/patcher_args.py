"""How to patch (`PatcherArgs`, `PatchingMode`): configuration only, no torch.

The data config (`DataArgs`) and the data-loader worker import this module. The rules run on numpy
(`patch_rules.py`); `Patcher(args)` (`bytelatent/data/patcher.py`, torch) is imported only where
patching needs torch (`needs_torch`: a model, or top-k), so most workers start without torch.
"""

from __future__ import annotations

import re
from enum import Enum

from pydantic import BaseModel, ConfigDict, field_validator, model_validator

_DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


class PatchingMode(str, Enum):
    entropy = "entropy"
    bpe = "bpe"
    bpe_patcher = "bpe_patcher"
    space = "space"
    static = "static"
    byte = "byte"


MODEL_MODES = (PatchingMode.entropy, PatchingMode.bpe_patcher)


class PatcherArgs(BaseModel):
    """How to patch byte sequences (reference field names; devices default to 'auto')."""

    model_config = ConfigDict(extra="forbid")

    patching_mode: PatchingMode = PatchingMode.entropy
    # where a loaded entropy model runs: auto (cuda if available), cpu, cuda, cuda:N
    patching_device: str = "auto"
    entropy_model_checkpoint_dir: str | None = None
    # compute entropies on the fly with the model in entropy_model_checkpoint_dir
    realtime_patching: bool = False
    threshold: float | None = 1.335442066192627
    threshold_add: float | None = None
    max_patch_length: int | None = None
    patch_size: float = 4.5
    patching_batch_size: int = 1
    # the reference's second device setting (where model inputs go); must agree with
    # patching_device when both are set
    device: str = "auto"
    monotonicity: bool = False
    log_time: bool = False

    @field_validator("patching_device", "device")
    @classmethod
    def _check_device(cls, value: str) -> str:
        if not _DEVICE_RE.match(value):
            raise ValueError(
                f"{value!r} is not a device; use auto, cpu, cuda or cuda:N"
            )
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
        if (
            mode == PatchingMode.entropy
            and self.threshold is None
            and self.patch_size <= 0
        ):
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
        if self.monotonicity and self.threshold_add is not None:
            raise ValueError(
                "monotonicity=true and threshold_add are two different rules; set only one"
            )
        if self.max_patch_length is not None and self.max_patch_length < 1:
            raise ValueError(f"max_patch_length={self.max_patch_length} must be >= 1")
        if self.patching_batch_size < 1:
            raise ValueError(
                f"patching_batch_size={self.patching_batch_size} must be >= 1"
            )
        if "auto" not in (self.device, self.patching_device) and self.device != self.patching_device:
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
