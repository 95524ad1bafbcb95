"""Patching: split each row of byte tokens into patches (reference BLT rules, §3.7).

``Patcher.patch(tokens [B,N], include_next_token)`` returns ``patch_lengths [B,P]`` (long,
right-padded with 0, trailing all-zero columns trimmed) whose rows sum to ``N`` (``N + 1`` with
``include_next_token``: the token after the row gets a place in the last patch or its own).

Every dynamic mode decides, for each position ``p``, whether a patch starts there. Positions 0
(the BOS) and 1 always start a patch; a start at ``p >= 2`` is decided by position ``p - 1``:

- ``entropy``: ``H[p-1]``, the entropy of predicting token ``p`` (global threshold; with
  ``monotonicity`` the rise ``H[p-1] - H[p-2]``; with ``threshold_add`` both; ``threshold=None``
  picks the ``N // patch_size - 2`` highest entropies);
- ``space``: token ``p-1`` is the first of a run of space-like bytes, or a special token;
- ``bpe``: token ``p-1`` is the BPE delimiter (id 3);
- ``bpe_patcher``: a model run on tokens ``1..`` predicts the delimiter after token ``p-1``.

``static`` cuts patches of ``patch_size``; ``byte`` makes every token a patch. ``max_patch_length``
then splits longer patches. Everything is vectorised over the batch, and entropies from an
attached model are computed row by row, so a row's patches never depend on the other rows.

At the edges (docs/differences.md, Patching edges): a delimiter at position 0 does not create an
empty patch; in ``bpe`` mode a delimiter as the last token starts the next-token patch when
``include_next_token`` (as in ``space`` mode, in every row); rows padded in a batch get the same
patches as alone; the top-k rule never picks a start outside the row.
"""

from __future__ import annotations

import time
from collections import defaultdict

import numpy as np
import torch
from torch import nn

from bytelatent.data.entropy import (
    calculate_entropies,
    entropy,
    per_document_outputs,
    resolve_device,
)
from bytelatent.data.patcher_args import PatcherArgs, PatchingMode
from bytelatent.errors import ConfigError, DataError
from bytelatent.tokenizers.constants import BPE_ID, OFFSET


def _load_realtime_model(args: PatcherArgs) -> nn.Module:
    """The entropy model for realtime patching, on this rank's device.

    Built inside the data worker process (which never ran `setup_distributed`), so the device is
    resolved from LOCAL_RANK and made current: every rank's worker uses its own GPU, not GPU 0.
    """
    device = resolve_device(args.model_device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # Here, not at the top: the data-loader worker preloads this module, and only realtime
    # patching needs the checkpoint and model stack (DCP, ~1 s of imports per process).
    from bytelatent.checkpoint.pretrained import load_entropy_model  # noqa: PLC0415

    return load_entropy_model(args.entropy_model_checkpoint_dir, device)


class Patcher:
    """Applies PatcherArgs; ``entropy_model`` overrides loading one from the checkpoint dir."""

    def __init__(
        self, args: PatcherArgs, entropy_model: nn.Module | None = None
    ) -> None:
        self.args = args
        self.patching_mode = args.patching_mode
        self.entropy_model = entropy_model
        if entropy_model is None and args.realtime_patching:
            self.entropy_model = _load_realtime_model(args)
        if (
            self.patching_mode == PatchingMode.bpe_patcher
            and self.entropy_model is None
        ):
            raise ConfigError(
                "patching_mode=bpe_patcher needs a model: set realtime_patching=true and "
                "entropy_model_checkpoint_dir, or pass entropy_model="
            )
        self.log: defaultdict[str, float] = defaultdict(float)

    def patch_document(self, tokens: np.ndarray, entropies: np.ndarray | None) -> np.ndarray:
        """One document's patch lengths (`include_next_token=False`), numpy in and out: what the
        data pipeline calls, so that it never handles torch tensors itself."""
        lengths, _ = self.patch(
            torch.from_numpy(tokens)[None],
            include_next_token=False,
            entropies=None if entropies is None else torch.from_numpy(entropies)[None],
        )
        return lengths[0].numpy()

    def patch(
        self,
        tokens: torch.Tensor,
        include_next_token: bool = False,
        entropies: torch.Tensor | None = None,
        threshold: float | None = None,
        *,
        logits: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """tokens [B,N] long -> (patch_lengths [B,P] long, scores [B,N] float32 or None).

        ``entropies`` (or ``logits`` of the entropy model) skip running the model; ``threshold``
        overrides ``args.threshold`` for this call. Scores are the entropies in entropy mode.
        """
        if tokens.dim() != 2:
            raise DataError(
                f"tokens must be [batch, seq_len], got shape {tuple(tokens.shape)}"
            )
        started = time.perf_counter()
        batch, seq_len = tokens.shape
        length = seq_len + int(include_next_token)
        scores = None
        mode = self.patching_mode
        if mode == PatchingMode.static:
            lengths = static_patch_lengths(batch, length, int(self.args.patch_size))
        elif mode == PatchingMode.byte:
            lengths = torch.ones((batch, length), dtype=torch.long)
        else:
            if mode == PatchingMode.entropy:
                scores = self._scores(tokens, entropies, logits)
                starts = self._entropy_starts(scores.cpu(), length, threshold)
            elif mode == PatchingMode.space:
                starts = space_patch_starts(tokens.cpu(), length)
            elif mode == PatchingMode.bpe:
                starts = bpe_delim_patch_starts(tokens.cpu(), length)
            else:
                starts = self._bpe_patcher_starts(tokens.cpu(), length)
            lengths = lengths_from_starts(starts)
        if self.args.max_patch_length is not None:
            lengths = split_long_patches(lengths, self.args.max_patch_length)
        lengths = trim_zero_columns(lengths)
        if lengths.shape[1] and not torch.all(lengths.sum(dim=1) == length):
            raise RuntimeError(
                f"patch lengths do not sum to {length}: {lengths.sum(dim=1)}"
            )
        if self.args.log_time:
            self.log["patch_seconds"] += time.perf_counter() - started
            self.log["tokens"] += batch * length
        return lengths.to(tokens.device), scores

    def _scores(
        self,
        tokens: torch.Tensor,
        entropies: torch.Tensor | None,
        logits: torch.Tensor | None,
    ) -> torch.Tensor:
        if entropies is not None:
            if tuple(entropies.shape) != tuple(tokens.shape):
                raise DataError(
                    f"entropies shape {tuple(entropies.shape)} does not match tokens shape "
                    f"{tuple(tokens.shape)}"
                )
            return entropies.to(dtype=torch.float32)
        if logits is not None:
            return entropy(logits).to(tokens.device)
        if self.entropy_model is None:
            raise ConfigError(
                "patching_mode=entropy without entropies: pass entropies (e.g. from "
                "apps.preprocess_entropies) or set realtime_patching=true with "
                "entropy_model_checkpoint_dir"
            )
        started = time.perf_counter()
        scores = calculate_entropies(
            tokens, self.entropy_model, self.args.patching_batch_size
        )
        if self.args.log_time:
            self.log["calculate_entropies_seconds"] += time.perf_counter() - started
        return scores

    def _entropy_starts(
        self, scores: torch.Tensor, length: int, threshold: float | None
    ) -> torch.Tensor:
        threshold = self.args.threshold if threshold is None else threshold
        if threshold is None:
            return topk_entropy_patch_starts(scores, length, self.args.patch_size)
        return entropy_patch_starts(
            scores,
            length,
            threshold,
            threshold_add=self.args.threshold_add,
            monotonicity=self.args.monotonicity,
        )

    def _bpe_patcher_starts(self, tokens: torch.Tensor, length: int) -> torch.Tensor:
        starts = _first_two_starts(tokens.shape[0], length)
        if length <= 2:
            return starts
        # the model reads the row without its BOS; its prediction after token p-1 decides p
        rows = list(tokens[:, 1 : length - 1].unbind(0))
        predicted = per_document_outputs(
            rows,
            self.entropy_model,
            lambda logits: logits.argmax(dim=-1) == BPE_ID,
            self.args.patching_batch_size,
        )
        starts[:, 2:] = torch.stack(predicted)
        return starts


def _first_two_starts(batch: int, length: int) -> torch.Tensor:
    starts = torch.zeros((batch, length), dtype=torch.bool)
    starts[:, : min(2, length)] = True
    return starts


def static_patch_lengths(batch: int, length: int, patch_size: int) -> torch.Tensor:
    """ceil(length / patch_size) patches of patch_size; the last holds the remainder."""
    n_patches = -(-length // patch_size)
    lengths = torch.full((batch, n_patches), patch_size, dtype=torch.long)
    if n_patches and length % patch_size:
        lengths[:, -1] = length % patch_size
    return lengths


def entropy_patch_starts(
    entropies: torch.Tensor,
    length: int,
    threshold: float,
    threshold_add: float | None = None,
    monotonicity: bool = False,
) -> torch.Tensor:
    """Start mask [B, length]; a start at p >= 2 is decided by H[p-1] (entropies [B, N])."""
    starts = _first_two_starts(entropies.shape[0], length)
    if length <= 2:
        return starts
    later = entropies[:, 1:].float()  # later[j] = H[j+1] decides position j+2
    rise = torch.zeros_like(later)
    rise[:, 1:] = later[:, 1:] - later[:, :-1]
    if monotonicity:
        decide = rise > threshold
        decide[:, 0] = True  # the reference always starts a patch at position 2 here
    elif threshold_add is not None:
        decide = (rise > threshold_add) & (later > threshold)
        decide[:, 0] = True
        decide[:, 1:2] = False  # ... and never at position 3
    else:
        decide = later > threshold
    starts[:, 2:] = decide[:, : length - 2]
    return starts


def topk_entropy_patch_starts(
    entropies: torch.Tensor, length: int, patch_size: float
) -> torch.Tensor:
    """Start at the N // patch_size - 2 positions after the highest entropies (threshold=None)."""
    starts = _first_two_starts(entropies.shape[0], length)
    candidates = entropies[:, 1 : length - 1].float()
    count = int(entropies.shape[1] // patch_size) - 2
    count = max(0, min(count, candidates.shape[1]))
    if count:
        picked = candidates.topk(count, dim=1).indices + 2
        starts.scatter_(1, picked, True)
    return starts


def space_like(tokens: torch.Tensor) -> torch.Tensor:
    """Bytes that end a patch in space mode: first of a run of non-alphanumeric ASCII or UTF-8
    lead bytes; special tokens (< OFFSET) always count."""
    byte = tokens - OFFSET
    like = (
        (byte < ord("0"))
        | ((byte > ord("9")) & (byte < ord("A")))
        | ((byte > ord("Z")) & (byte < ord("a")))
        | ((byte > ord("z")) & (byte < 0x80))
        | (byte >= 0xC0)
    )
    first = like.clone()
    first[:, 1:] &= ~like[:, :-1]
    return first | (tokens < OFFSET)


def space_patch_starts(tokens: torch.Tensor, length: int) -> torch.Tensor:
    """Start mask [B, length] for space mode: a patch starts after each space-like byte."""
    starts = _first_two_starts(tokens.shape[0], length)
    starts[:, 2:] = space_like(tokens)[:, 1 : length - 1]
    return starts


def bpe_delim_patch_starts(tokens: torch.Tensor, length: int) -> torch.Tensor:
    """Start mask [B, length] for bpe mode: a patch starts after each BPE delimiter."""
    starts = _first_two_starts(tokens.shape[0], length)
    starts[:, 2:] = tokens[:, 1 : length - 1] == BPE_ID
    return starts


def lengths_from_starts(starts: torch.Tensor) -> torch.Tensor:
    """Start mask [B, L] -> patch lengths [B, max starts] right-padded with 0."""
    batch, length = starts.shape
    n_patches = int(starts.sum(dim=1).max()) if batch and length else 0
    # Unused slots hold `length`, so the gaps after a row's last real start are 0. A scatter of the
    # start positions into their slot is ~1.5x faster than sorting (the data loader's hot spot).
    start_ids = torch.full((batch, n_patches), length, dtype=torch.long)
    rows, cols = starts.nonzero(as_tuple=True)
    slots = starts.long().cumsum(dim=1)[rows, cols] - 1
    start_ids[rows, slots] = cols
    end_ids = torch.cat(
        [start_ids[:, 1:], torch.full((batch, min(1, n_patches)), length)], dim=1
    )
    return end_ids - start_ids


def split_long_patches(lengths: torch.Tensor, max_length: int) -> torch.Tensor:
    """Split every patch longer than max_length into max_length pieces plus the remainder."""
    batch = lengths.shape[0]
    pieces = (lengths + max_length - 1) // max_length  # 0 for padding
    per_row = pieces.sum(dim=1)
    width = int(per_row.max()) if batch else 0
    flat_lengths, flat_pieces = lengths.flatten(), pieces.flatten()
    repeated = torch.repeat_interleave(flat_lengths, flat_pieces)
    total = repeated.numel()
    first_piece = torch.cumsum(flat_pieces, 0) - flat_pieces
    piece_index = torch.arange(total) - torch.repeat_interleave(
        first_piece, flat_pieces
    )
    values = torch.clamp(repeated - piece_index * max_length, max=max_length)
    rows = torch.repeat_interleave(torch.arange(batch), per_row)
    row_first = torch.cumsum(per_row, 0) - per_row
    cols = torch.arange(total) - torch.repeat_interleave(row_first, per_row)
    out = torch.zeros((batch, width), dtype=torch.long)
    out[rows, cols] = values
    return out


def trim_zero_columns(lengths: torch.Tensor) -> torch.Tensor:
    """Drop trailing columns that are 0 in every row."""
    if lengths.numel() == 0:
        return lengths
    keep = int((lengths != 0).sum(dim=1).max())
    return lengths[:, :keep]
