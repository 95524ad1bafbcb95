"""Engines give next-byte logits for a batch of growing rows: cached (incremental) or recomputed.

``start(rows) -> logits [B, V]`` for each row's last token; ``advance(tokens [B], active [B])``
appends one token to the active rows and returns their next logits. ``patch_lengths(row, n)``
(BLT) are the patches of the row's final ``tokens`` as the model saw them.
"""

from __future__ import annotations

import torch
from torch import nn

from bytelatent.data.entropy import model_max_length
from bytelatent.data.patcher import Patcher, PatcherArgs
from bytelatent.eval.generation.blt import IncrementalBLT
from bytelatent.eval.generation.lm import IncrementalLM
from bytelatent.eval.generation.patching import OnlinePatcher
from bytelatent.model.blt import ByteLatentTransformer


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


class CachedEngine:
    """LM or BLT with KV caches (``IncrementalLM`` / ``IncrementalBLT``)."""

    def __init__(
        self,
        model: nn.Module,
        patcher_args: PatcherArgs | None,
        entropy_model: nn.Module | None,
        capacity: int,
    ) -> None:
        self.model, self.patcher_args, self.entropy_model = model, patcher_args, entropy_model
        self.capacity = capacity
        self.device = _device(model)
        self.impl: IncrementalLM | IncrementalBLT | None = None

    def start(self, rows: list[list[int]]) -> torch.Tensor:
        batch = len(rows)
        if isinstance(self.model, ByteLatentTransformer):
            online = OnlinePatcher(self.patcher_args)
            entropy = None
            if online.needs_entropies:
                window = model_max_length(self.entropy_model)
                entropy = IncrementalLM(self.entropy_model, batch, self.capacity, window)
            self.impl = IncrementalBLT(self.model, online, entropy, batch, self.capacity)
            logits = [self.impl.prefill(b, self._tensor(row)) for b, row in enumerate(rows)]
        else:
            self.impl = IncrementalLM(self.model, batch, self.capacity)
            logits = [self.impl.prefill(b, self._tensor(row))[-1] for b, row in enumerate(rows)]
        return torch.stack(logits)

    def _tensor(self, row: list[int]) -> torch.Tensor:
        return torch.tensor(row, dtype=torch.long, device=self.device)

    def advance(self, tokens: list[int], active: list[bool]) -> torch.Tensor:
        return self.impl.step(tokens, active)  # host lists: the caches keep their books there

    def patch_lengths(self, row: int, tokens: list[int]) -> list[int] | None:
        if isinstance(self.impl, IncrementalBLT):
            return self.impl.patch_lengths(row, len(tokens))
        return None


class RecomputeEngine:
    """The correctness oracle: every step re-runs the whole model (and the patcher) on each row,
    as the reference ``generate_blt`` does."""

    def __init__(
        self,
        model: nn.Module,
        patcher_args: PatcherArgs | None,
        entropy_model: nn.Module | None,
    ) -> None:
        self.model = model
        self.device = _device(model)
        self.patcher = None
        if isinstance(model, ByteLatentTransformer):
            args = patcher_args.model_copy(update={"realtime_patching": False})
            self.patcher = Patcher(args, entropy_model=entropy_model)
        self.rows: list[list[int]] = []

    @torch.no_grad()
    def _logits(self, row: list[int]) -> torch.Tensor:
        tokens = torch.tensor([row], dtype=torch.long, device=self.device)
        if self.patcher is None:
            return self.model(tokens)[0, -1]
        lengths, _ = self.patcher.patch(tokens, include_next_token=True)
        return self.model(tokens, lengths)[0, -1]

    def start(self, rows: list[list[int]]) -> torch.Tensor:
        self.rows = [list(row) for row in rows]
        return torch.stack([self._logits(row) for row in self.rows])

    def advance(self, tokens: list[int], active: list[bool]) -> torch.Tensor:
        out = []
        for row, token, on in zip(self.rows, tokens, active):
            if on:
                row.append(token)
                out.append(self._logits(row))
            else:
                out.append(None)
        like = next(o for o in out if o is not None)
        return torch.stack([o if o is not None else torch.zeros_like(like) for o in out])

    @torch.no_grad()
    def patch_lengths(self, row: int, tokens: list[int]) -> list[int] | None:
        if self.patcher is None:
            return None
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
        lengths, _ = self.patcher.patch(ids, include_next_token=False)
        return [int(x) for x in lengths[0] if x > 0]
