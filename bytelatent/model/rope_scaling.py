"""Llama 3 RoPE frequency scaling (``rope_scaling: {rope_type: llama3, ...}`` in HF configs).

Llama 3.1+ models stretch the rotation frequencies so that a model trained on
``original_max_position_embeddings`` positions handles longer contexts: wavelengths longer than
``original_max_position_embeddings / low_freq_factor`` are divided by ``factor``, shorter than
``original_max_position_embeddings / high_freq_factor`` are kept, and the band between is
interpolated. A model initialised from such a checkpoint must rotate with the same frequencies.
"""

from __future__ import annotations

import math

import torch

from bytelatent.model.args import RopeScalingArgs


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
