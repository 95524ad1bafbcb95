"""Patch-length helpers the data, eval and generation code share with patched architectures.

``patch_lengths`` [B, P] long: each row lists the lengths of consecutive patches of the row's
bytes, right-padded with zeros (the full contract: ``bytelatent/archs/blt/patch_utils.py``).
"""

from __future__ import annotations

import torch


def first_token_alone(lengths: torch.Tensor) -> torch.Tensor:
    """Patch lengths [B, P] with each row's first patch split into its first token and the rest,
    as training's patches mode splits a window's first patch (a no-op where it is 1 already)."""
    if lengths.shape[1] == 0 or bool((lengths[:, 0] <= 1).all()):
        return lengths
    first = lengths[:, :1]
    head = torch.minimum(first, torch.ones_like(first))
    rest = first - head
    out = torch.cat([head, rest, lengths[:, 1:]], dim=1)
    # rows whose first patch was 1 now hold a 0: move it to the end (right padding)
    order = torch.argsort((out == 0).to(torch.int8), dim=1, stable=True)
    out = torch.gather(out, 1, order)
    return out[:, : int((out != 0).sum(dim=1).max())]
