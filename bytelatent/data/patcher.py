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
- ``bpe_patcher``: a model run on tokens ``1..`` predicts the delimiter after token ``p-1``;
- ``tokenizer``: a token of ``tokenizer_path``'s byte-level BPE starts at ``p`` (decided from the
  whole document, bytes after ``p`` included: training and scoring only, never online).

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
from bytelatent.data.patch_rules import check_entropies, first_two_starts, patch_lengths
from bytelatent.data.patcher_args import PatcherArgs, PatchingMode
from bytelatent.errors import ConfigError, DataError
from bytelatent.tokenizers.constants import BPE_ID


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

    def __init__(self, args: PatcherArgs, entropy_model: nn.Module | None = None) -> None:
        self.args = args
        self.patching_mode = args.patching_mode
        self.entropy_model = entropy_model
        if entropy_model is None and args.realtime_patching:
            self.entropy_model = _load_realtime_model(args)
        if self.patching_mode == PatchingMode.bpe_patcher and self.entropy_model is None:
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
        The rules run on the host (patch_rules.py); the models and top-k run here.
        """
        if tokens.dim() != 2:
            raise DataError(f"tokens must be [batch, seq_len], got shape {tuple(tokens.shape)}")
        started = time.perf_counter()
        batch, seq_len = tokens.shape
        length = seq_len + int(include_next_token)
        scores = starts = None
        if self.patching_mode == PatchingMode.entropy:
            scores = self._scores(tokens, entropies, logits)
            if (self.args.threshold if threshold is None else threshold) is None:
                starts = topk_entropy_patch_starts(scores.cpu(), length, self.args.patch_size)
        elif self.patching_mode == PatchingMode.bpe_patcher:
            starts = self._bpe_patcher_starts(tokens.cpu(), length)
        lengths = patch_lengths(
            self.args,
            tokens.cpu().numpy(),
            include_next_token,
            scores=None if scores is None else scores.detach().float().cpu().numpy(),
            threshold=threshold,
            starts=None if starts is None else starts.numpy(),
        )
        if self.args.log_time:
            self.log["patch_seconds"] += time.perf_counter() - started
            self.log["tokens"] += batch * length
        return torch.from_numpy(lengths).to(tokens.device), scores

    def _scores(
        self,
        tokens: torch.Tensor,
        entropies: torch.Tensor | None,
        logits: torch.Tensor | None,
    ) -> torch.Tensor:
        if entropies is not None:
            check_entropies(tokens.shape, entropies.shape)
            return entropies.to(dtype=torch.float32)
        if logits is not None:
            return entropy(logits).to(tokens.device)
        if self.entropy_model is None:
            check_entropies(tokens.shape, None)  # raises: no entropies, no model
        started = time.perf_counter()
        scores = calculate_entropies(tokens, self.entropy_model, self.args.patching_batch_size)
        if self.args.log_time:
            self.log["calculate_entropies_seconds"] += time.perf_counter() - started
        return scores

    def _bpe_patcher_starts(self, tokens: torch.Tensor, length: int) -> torch.Tensor:
        starts = torch.from_numpy(first_two_starts(tokens.shape[0], length))
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


def topk_entropy_patch_starts(
    entropies: torch.Tensor, length: int, patch_size: float
) -> torch.Tensor:
    """Start at the N // patch_size - 2 positions after the highest entropies (threshold=None)."""
    starts = torch.from_numpy(first_two_starts(entropies.shape[0], length))
    candidates = entropies[:, 1 : length - 1].float()
    count = int(entropies.shape[1] // patch_size) - 2
    count = max(0, min(count, candidates.shape[1]))
    if count:
        picked = candidates.topk(count, dim=1).indices + 2
        starts.scatter_(1, picked, True)
    return starts
