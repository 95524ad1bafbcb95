"""Llama 3 RoPE frequency scaling (``rope_scaling: {rope_type: llama3, ...}`` in HF configs).

Llama 3.1+ models stretch the rotation frequencies so that a model trained on
``original_max_position_embeddings`` positions handles longer contexts: wavelengths longer than
``original_max_position_embeddings / low_freq_factor`` are divided by ``factor``, shorter than
``original_max_position_embeddings / high_freq_factor`` are kept, and the band between is
interpolated. A model initialised from such a checkpoint must rotate with the same frequencies.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, model_validator


class RopeScalingArgs(BaseModel):
    """HF ``rope_scaling`` of ``rope_type: llama3`` (field names as in HF's config.json)."""

    model_config = ConfigDict(extra="forbid")

    rope_type: Literal["llama3"] = "llama3"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    @model_validator(mode="after")
    def _check(self) -> RopeScalingArgs:
        if self.factor <= 0 or self.original_max_position_embeddings < 1:
            raise ValueError(
                "rope_scaling: factor and original_max_position_embeddings must be > 0"
            )
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(
                f"rope_scaling: need 0 < low_freq_factor ({self.low_freq_factor}) < "
                f"high_freq_factor ({self.high_freq_factor})"
            )
        return self


def scale_frequencies(freqs: torch.Tensor, scaling: RopeScalingArgs | None) -> torch.Tensor:
    """Rotation frequencies [head_dim/2] after Llama 3 scaling (unchanged for ``None``)."""
    if scaling is None:
        return freqs
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / freqs
    scaled = torch.where(wavelen > low_freq_wavelen, freqs / scaling.factor, freqs)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)
