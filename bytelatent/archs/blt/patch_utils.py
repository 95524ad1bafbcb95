"""Patch bookkeeping for BLT: patch ids, pooling, and the patch cross-attention masks.

Conventions (reference BLT, ``BLT_REFERENCE_FACTS.md`` §3.1/§3.5):

- ``patch_lengths`` [B,P] long: each row lists the lengths of consecutive patches of the row's
  bytes, first patch of length 1, right-padded with zeros. A row sums to N (exactly the bytes) or
  N+1 (the patcher's ``include_next_token=True``: the last patch also covers the byte to predict).
- ``patch_ids`` [B,N]: index of the patch holding each byte.
- ``decoder_patch_ids`` [B,N]: the patch whose global output byte i may read: the last patch that
  lies entirely at or before i (the one-patch lag that keeps BLT causal). With
  ``patch_lengths=[1,4,3,2]``: ``patch_ids=[0,1,1,1,1,2,2,2,3]``,
  ``decoder_patch_ids=[0,0,0,0,1,1,1,2,2]``.

Cross-attention (``k`` query/key slots per patch):

- encoder (patches as queries, [B, P*k, N]): slot q of patch p = q // k attends byte j iff
  ``patch_ids[j] == p`` or, with a window of w patches, ``p - w < patch_ids[j] <= p``;
- decoder (bytes as queries, [B, N, P*k]): byte i attends slot s of patch p = s // k iff
  ``p == decoder_patch_ids[i]`` or, with a window, ``decoder_patch_ids[i] - w < p <= decoder_patch_ids[i]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from bytelatent.errors import DataError
from bytelatent.model.attention import AttnMask, FlexMask, flex_interval_block_mask

_POOL_REDUCE = {"avg": "mean", "min": "amin", "max": "amax"}


def patch_ids_from_lengths(patch_lengths: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Patch index of each of the first ``seq_len`` bytes: [B, seq_len] long."""
    ends = torch.cumsum(patch_lengths, dim=1).contiguous()
    positions = torch.arange(seq_len, device=patch_lengths.device, dtype=ends.dtype)
    positions = positions.unsqueeze(0).expand(ends.shape[0], seq_len).contiguous()
    # number of patches that end at or before byte i (patch p covers [end_{p-1}, end_p))
    return torch.searchsorted(ends, positions, right=True)


def decoder_patch_ids_from_lengths(patch_lengths: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Index of the last patch lying entirely at or before each byte: [B, seq_len] long."""
    ends = torch.cumsum(patch_lengths, dim=1).contiguous()
    positions = torch.arange(1, seq_len + 1, device=patch_lengths.device, dtype=ends.dtype)
    positions = positions.unsqueeze(0).expand(ends.shape[0], seq_len).contiguous()
    complete = torch.searchsorted(ends, positions, right=True) - 1
    # zero-length right padding "ends" at the row total; never point at a padded patch
    n_real = (patch_lengths > 0).sum(dim=1, keepdim=True)
    return torch.minimum(complete, n_real - 1)


def host_patch_has_eos(tokens: np.ndarray, patch_lengths: np.ndarray, eos_id: int) -> np.ndarray:
    """[B, P] bool: the patches that hold an EOS, from the batch's host arrays (no device copy).

    tokens [B, N], patch_lengths [B, P] as for ``patch_ids_from_lengths`` (byte i belongs to the
    number of patches that end at or before it)."""
    ends = np.cumsum(patch_lengths, axis=1)
    has_eos = np.zeros(patch_lengths.shape, dtype=bool)
    for row, (row_tokens, row_ends) in enumerate(zip(tokens, ends)):
        eos_positions = np.flatnonzero(np.asarray(row_tokens) == eos_id)
        has_eos[row, np.searchsorted(row_ends, eos_positions, side="right")] = True
    return has_eos


def check_patch_lengths(patch_lengths: torch.Tensor, seq_len: int) -> None:
    """Raise DataError unless patch_lengths [B,P] fits the contract for seq_len bytes."""
    if patch_lengths.dim() != 2:
        raise DataError(
            f"patch_lengths must be [batch, patches], got shape {tuple(patch_lengths.shape)}"
        )
    if patch_lengths.dtype in (
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.bool,
    ):
        raise DataError(f"patch_lengths must be an integer tensor, got {patch_lengths.dtype}")
    if patch_lengths.is_cuda:
        # no host sync on the accelerator: checked asynchronously, fails at the next sync point
        torch._assert_async((patch_lengths[:, 0] == 1).all(), "patch_lengths[:, 0] must be 1")
        return
    if (patch_lengths < 0).any():
        raise DataError("patch_lengths has negative entries")
    if not (patch_lengths[:, 0] == 1).all():
        raise DataError(
            f"the first patch of every row must have length 1, got {patch_lengths[:, 0].tolist()}"
        )
    totals = patch_lengths.sum(dim=1)
    bad = ((totals != seq_len) & (totals != seq_len + 1)).nonzero().flatten()
    if len(bad) > 0:
        row = int(bad[0])
        raise DataError(
            f"patch_lengths row {row} sums to {int(totals[row])}; rows must sum to the number of "
            f"bytes ({seq_len}) or one more (include_next_token)"
        )
    nonzero = patch_lengths > 0
    # zeros only as right padding: once a row has a zero, everything after it is zero
    if (nonzero[:, 1:] & ~nonzero[:, :-1]).any():
        raise DataError(
            "patch_lengths has a zero-length patch before a non-empty one; pad only on the right"
        )


def pool_patches(
    h: torch.Tensor, patch_ids: torch.Tensor, num_patches: int, modes: tuple[str, ...]
) -> torch.Tensor:
    """Pool byte states h [B,N,D] into patches: [B, num_patches, D * len(modes)]; empty patches are 0."""
    if not modes:
        raise ValueError("pool_patches needs at least one pooling mode")
    index = patch_ids.unsqueeze(-1).expand(-1, -1, h.shape[-1])
    pooled = []
    for mode in modes:
        base = h.new_zeros(h.shape[0], num_patches, h.shape[-1])
        pooled.append(
            base.scatter_reduce(1, index, h, reduce=_POOL_REDUCE[mode], include_self=False)
        )
    return torch.cat(pooled, dim=-1) if len(pooled) > 1 else pooled[0]


def concat_patches(h: torch.Tensor, patch_lengths: torch.Tensor, patch_size: int) -> torch.Tensor:
    """Concatenate the last ``patch_size`` byte states of each patch: [B, P, patch_size * D].

    The reference's downsampling without pooling (static patches). Positions before the first
    byte are clamped to byte 0, as in the reference.
    """
    bsz, _, dim = h.shape
    ends = torch.cumsum(patch_lengths, dim=1)
    offsets = torch.arange(patch_size, 0, -1, device=h.device)
    gather_ids = (ends.unsqueeze(-1) - offsets).clamp(min=0, max=h.shape[1] - 1)
    gathered = torch.gather(h, 1, gather_ids.reshape(bsz, -1, 1).expand(-1, -1, dim))
    return gathered.reshape(bsz, patch_lengths.shape[1], patch_size * dim)


def encoder_cross_attn_allowed(
    patch_ids: torch.Tensor, num_patches: int, k: int, window: int | None = None
) -> torch.Tensor:
    """Bool mask [B,1,P*k,N] (True = attend) for patch slots attending bytes."""
    patch_of_query = torch.arange(num_patches * k, device=patch_ids.device) // k
    query = patch_of_query.view(1, 1, -1, 1)
    key = patch_ids.unsqueeze(1).unsqueeze(2)
    if window is None:
        return query == key
    return (key <= query) & (query < key + window)


def decoder_cross_attn_allowed(
    decoder_patch_ids: torch.Tensor, num_patches: int, k: int, window: int | None = None
) -> torch.Tensor:
    """Bool mask [B,1,N,P*k] (True = attend) for bytes attending patch slots."""
    patch_of_key = torch.arange(num_patches * k, device=decoder_patch_ids.device) // k
    key = patch_of_key.view(1, 1, 1, -1)
    query = decoder_patch_ids.unsqueeze(1).unsqueeze(-1)
    if window is None:
        return query == key
    return (key <= query) & (query < key + window)


@dataclass
class PatchCrossMask:
    """How one side's cross-attention is masked, built once per forward.

    ``structured`` (window None): each byte belongs to exactly one patch, so attention is computed
    from ``patch_ids`` with gathers/segment sums in O(N*k*D) (see ``CrossAttention``), instead of
    a dense [P*k, N] score matrix. Otherwise ``attn`` holds the mask for ``attend`` (flex: a
    BlockMask from per-query key bounds; sdpa and xformers: a dense bool mask).
    """

    side: str  # "encoder" (patch slots attend bytes) or "decoder" (bytes attend patch slots)
    patch_ids: torch.Tensor  # [B,N]: patch_ids (encoder) or decoder_patch_ids (decoder)
    num_patches: int
    k: int
    attn: AttnMask | None = None

    @property
    def structured(self) -> bool:
        return self.attn is None


def build_cross_mask(
    side: str,
    patch_ids: torch.Tensor,
    num_patches: int,
    k: int,
    window: int | None,
    backend: str = "sdpa",
    structured: bool = True,
) -> PatchCrossMask:
    """The cross-attention mask of one side: structured without a window (unless ``structured``
    is off), else a mask for ``attend`` in ``backend``'s representation (flex: a BlockMask from
    per-query key bounds, never a [P*k, N] tensor; sdpa and xformers: a dense bool mask)."""
    if side not in ("encoder", "decoder"):
        raise ValueError(f"side must be 'encoder' or 'decoder', got {side!r}")
    if structured and window is None:
        return PatchCrossMask(side, patch_ids, num_patches, k)
    if backend == "flex_attention":
        attn = _flex_cross_mask(side, patch_ids, num_patches, k, window)
    else:
        build = encoder_cross_attn_allowed if side == "encoder" else decoder_cross_attn_allowed
        attn = AttnMask.from_dense(build(patch_ids, num_patches, k, window), backend=backend)
    return PatchCrossMask(side, patch_ids, num_patches, k, attn)


def cross_attn_key_bounds(
    side: str, patch_ids: torch.Tensor, num_patches: int, k: int, window: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(lo, hi) [B, queries]: query q attends exactly the keys ``lo[b,q] <= j < hi[b,q]``.

    The same function as ``encoder_/decoder_cross_attn_allowed`` (w = window or 1): patch ids never
    decrease along the bytes, so the bytes of patches ``p-w+1 .. p`` (encoder) and the slots of
    patches ``d-w+1 .. d`` (decoder) are contiguous. Both bounds never decrease with q and chain
    (lo[q+1] <= hi[q]), as ``flex_interval_block_mask`` wants.
    """
    span = 1 if window is None else window
    if side == "encoder":  # slot q of patch p = q // k sees bytes with p - w < patch_ids <= p
        patch = torch.arange(num_patches * k, device=patch_ids.device) // k
        patch = patch.expand(patch_ids.shape[0], -1).contiguous()
        ids = patch_ids.contiguous()
        lo = torch.searchsorted(ids, patch - span, right=True)
        return lo, torch.searchsorted(ids, patch, right=True)
    # byte i sees the slots of patches d_i - w < p <= d_i
    return ((patch_ids - span + 1) * k).clamp(min=0), (patch_ids + 1) * k


def _flex_cross_mask(
    side: str, patch_ids: torch.Tensor, num_patches: int, k: int, window: int | None
) -> AttnMask:
    lo, hi = cross_attn_key_bounds(side, patch_ids, num_patches, k, window)
    kv_len = patch_ids.shape[1] if side == "encoder" else num_patches * k
    return FlexMask(flex_interval_block_mask(lo, hi, kv_len), (hi > lo)[:, None, :, None])
