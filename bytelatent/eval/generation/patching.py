"""Patch starts decided online, one position at a time, by the training patcher's own rules.

A start at position ``p >= 2`` depends only on positions ``p-1`` and ``p-2`` (tokens, or entropies
of the entropy model), and ``max_patch_length`` only on the previous start, so each new byte's
decision is made by calling ``bytelatent.data.patcher``'s functions on a short tail of the row
(long enough that the patcher's special cases at positions 2 and 3 do not apply) — never a
re-implementation. Top-k entropy patching (``threshold=None``) depends on the whole row and
``bpe_patcher`` on another model's predictions: neither can be decided online.

Static patching: the patcher cuts a document into ``patch_size`` patches from its first byte
(each split into ``max_patch_length`` pieces), and training's patches mode
(data/iterators/sequence.py) makes a window's first token a patch of its own, so a BLT trained
with static patching sees ``[1, ps - 1, ps, ps, ...]`` from a document's first token (BOS):
starts at 0, 1 and the static grid. ``blt_patch_lengths`` gives those lengths for a whole row
(the other modes already start patches at 0 and 1: unchanged) and generation uses them.
"""

from __future__ import annotations

import numpy as np
import torch

from bytelatent.data.chat import is_marker
from bytelatent.data.patch_rules import (
    bpe_delim_patch_starts,
    entropy_patch_starts,
    space_patch_starts,
)
from bytelatent.data.patcher import Patcher, PatcherArgs, PatchingMode
from bytelatent.data.patcher_args import OFFLINE_MODES
from bytelatent.errors import ConfigError
from bytelatent.model.patch_lengths import first_token_alone

TAIL = 4  # tail positions handed to the patcher functions; position TAIL is the one decided


def blt_patch_lengths(
    patcher: Patcher,
    tokens: torch.Tensor,
    entropies: torch.Tensor | None = None,
) -> torch.Tensor:
    """The patch lengths [B, P] that a BLT trained on ``patcher``'s documents sees for rows
    ``tokens`` [B, N] that start at a document's first token (``include_next_token=True``)."""
    lengths, _ = patcher.patch(tokens, include_next_token=True, entropies=entropies)
    return first_token_alone(lengths)


def refuse_offline_patching(args: PatcherArgs) -> None:
    """A mode whose starts depend on the bytes after them (`OFFLINE_MODES`: tokenizer) cannot
    patch what is generated, nor score a continuation without seeing it: one config line."""
    if args.patching_mode in OFFLINE_MODES:
        raise ConfigError(
            f"patching_mode={args.patching_mode.value} cannot generate or score: a patch start "
            "depends on the bytes after it (where the tokenizer cuts), which generation does not "
            "have; override the patcher with a causal rule, e.g. patcher.patching_mode=space"
        )


class OnlinePatcher:
    """Decides whether each new position starts a patch (``PatcherArgs`` semantics)."""

    def __init__(self, args: PatcherArgs) -> None:
        refuse_offline_patching(args)
        mode = args.patching_mode
        if mode == PatchingMode.bpe_patcher:
            raise ConfigError(
                "generation with patching_mode=bpe_patcher is not supported (its starts come from "
                "a second model); use use_cache=false"
            )
        if mode == PatchingMode.entropy and args.threshold is None:
            raise ConfigError(
                "patcher threshold=null (top-k entropy patching) depends on the whole sequence and "
                "cannot be decided while generating; set a threshold or use use_cache=false"
            )
        self.args = args
        self.mode = mode
        # the offline patcher (no model: entropies are passed in) for prompts and for checks
        self.offline = Patcher(args.model_copy(update={"realtime_patching": False}))

    @property
    def needs_entropies(self) -> bool:
        return self.mode == PatchingMode.entropy

    def prefix_starts(self, tokens: torch.Tensor, entropies: torch.Tensor | None) -> list[int]:
        """Start positions of a 1-D prompt of n tokens, positions 0..n (include_next_token)."""
        lengths = blt_patch_lengths(
            self.offline,
            tokens[None].cpu(),
            None if entropies is None else entropies[None].cpu(),
        )
        ends = torch.cumsum(lengths[0], 0)
        return [0] + [int(end) for end in ends[:-1] if end > 0]

    def starts_here(
        self,
        tokens: torch.Tensor | list[int],
        entropies: torch.Tensor | None,
        position: int,
        last_start: int,
    ) -> bool:
        """Does ``position`` start a patch, given 1-D ``tokens`` (a tensor or a host list) and
        ``entropies`` of positions < it."""
        mode = self.mode
        limit = self.args.max_patch_length
        after_marker = position >= 1 and bool(is_marker(np.asarray(int(tokens[position - 1]))))
        if mode == PatchingMode.byte or position < 2 or after_marker:
            start = True  # a chat-template marker ends a patch in every mode (data/chat.py)
        elif mode == PatchingMode.static:
            # the document's static grid, each patch cut into max_patch_length pieces from its
            # start (not from the split-off first token: training splits after the grid)
            offset = position % int(self.args.patch_size)
            return offset == 0 or (limit is not None and offset % limit == 0)
        else:
            first = max(0, position - TAIL)
            local = position - first  # index of `position` in the tail row
            if mode == PatchingMode.entropy:
                tail = entropies[first:position][None].detach().float().cpu().numpy()
                start = bool(
                    entropy_patch_starts(
                        tail,
                        local + 1,
                        self.args.threshold,
                        threshold_add=self.args.threshold_add,
                        monotonicity=self.args.monotonicity,
                    )[0, local]
                )
            else:
                rule = space_patch_starts if mode == PatchingMode.space else bpe_delim_patch_starts
                tail = torch.as_tensor(tokens[first:position])[None].cpu().numpy()
                start = bool(rule(tail, local + 1)[0, local])
        if limit is not None and not start and position - last_start >= limit:
            start = True
        return start
