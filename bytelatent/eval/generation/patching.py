"""Patch starts decided online, one position at a time, by the training patcher's own rules.

A start at position ``p >= 2`` depends only on positions ``p-1`` and ``p-2`` (tokens, or entropies
of the entropy model), and ``max_patch_length`` only on the previous start, so each new byte's
decision is made by calling ``bytelatent.data.patcher``'s functions on a short tail of the row
(long enough that the patcher's special cases at positions 2 and 3 do not apply) — never a
re-implementation. Top-k entropy patching (``threshold=None``) depends on the whole row and
``bpe_patcher`` on another model's predictions: neither can be decided online.
"""

from __future__ import annotations

import torch

from bytelatent.data.patch_rules import (
    bpe_delim_patch_starts,
    entropy_patch_starts,
    space_patch_starts,
)
from bytelatent.data.patcher import Patcher, PatcherArgs, PatchingMode
from bytelatent.errors import ConfigError

TAIL = 4  # tail positions handed to the patcher functions; position TAIL is the one decided


class OnlinePatcher:
    """Decides whether each new position starts a patch (``PatcherArgs`` semantics)."""

    def __init__(self, args: PatcherArgs) -> None:
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
        lengths, _ = self.offline.patch(
            tokens[None].cpu(),
            include_next_token=True,
            entropies=None if entropies is None else entropies[None].cpu(),
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
        if mode == PatchingMode.byte:
            start = True
        elif mode == PatchingMode.static:
            start = position % int(self.args.patch_size) == 0
        elif position < 2:
            start = True
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
        limit = self.args.max_patch_length
        if limit is not None and not start and position - last_start >= limit:
            start = True
        return start
