"""`Batch`: what the data pipeline hands the trainer (numpy arrays; the trainer moves them to device)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class Batch:
    """x, y: int64 [B, L] inputs and next-token targets; mask: bool [B, L], False where y is padding.

    patch_lengths: int64 [B, P] (patch mode) whose rows sum to L + 1 (the next token is included,
    as the BLT forward expects), first column 1, right-padded with 0; None in byte mode.

    loss_mask: bool [B, L], the targets that count in the loss and in bpb (chat data: the answers'
    bytes, docs/sft.md), always within `mask`; None: every real target counts. `mask` keeps
    saying which positions are real (throughput, patch statistics), `target_mask` what is scored.
    """

    x: np.ndarray
    y: np.ndarray
    mask: np.ndarray
    patch_lengths: np.ndarray | None = None
    loss_mask: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.x.shape != self.y.shape or self.x.shape != self.mask.shape or self.x.ndim != 2:
            raise ValueError(
                f"x, y, mask must share one [B, L] shape; got {self.x.shape}, {self.y.shape}, {self.mask.shape}"
            )
        if self.patch_lengths is not None and (
            self.patch_lengths.ndim != 2 or self.patch_lengths.shape[0] != self.x.shape[0]
        ):
            raise ValueError(
                f"patch_lengths must be [B, P] with B={self.x.shape[0]}; got {self.patch_lengths.shape}"
            )

    @property
    def target_mask(self) -> np.ndarray:
        """bool [B, L]: the targets the loss sums over (mask, and loss_mask when set)."""
        return self.mask if self.loss_mask is None else self.mask & self.loss_mask

    @property
    def batch_size(self) -> int:
        return int(self.x.shape[0])

    def n_target_bytes(self) -> int:
        """Scored targets (the bpb denominator for byte tokenizers)."""
        return int(self.target_mask.sum())

    def to_python_dict(self) -> dict[str, Any]:
        """JSON-able form (lists of ints/bools)."""
        return {
            "x": self.x.tolist(),
            "y": self.y.tolist(),
            "mask": self.mask.tolist(),
            "patch_lengths": None if self.patch_lengths is None else self.patch_lengths.tolist(),
            "loss_mask": None if self.loss_mask is None else self.loss_mask.tolist(),
        }

    @classmethod
    def from_python_dict(cls, data: dict[str, Any]) -> Batch:
        patch_lengths, loss_mask = data.get("patch_lengths"), data.get("loss_mask")
        return cls(
            x=np.asarray(data["x"], dtype=np.int64),
            y=np.asarray(data["y"], dtype=np.int64),
            mask=np.asarray(data["mask"], dtype=bool),
            patch_lengths=None
            if patch_lengths is None
            else np.asarray(patch_lengths, dtype=np.int64),
            loss_mask=None if loss_mask is None else np.asarray(loss_mask, dtype=bool),
        )

    def equals(self, other: Batch) -> bool:
        """Exact equality of every array (for tests and resume checks)."""
        if (self.patch_lengths is None) != (other.patch_lengths is None):
            return False
        if not np.array_equal(self.target_mask, other.target_mask):
            return False
        same = all(
            np.array_equal(a, b)
            for a, b in ((self.x, other.x), (self.y, other.y), (self.mask, other.mask))
        )
        return same and (
            self.patch_lengths is None or np.array_equal(self.patch_lengths, other.patch_lengths)
        )
