"""Engines give next-byte logits for a batch of growing rows: cached (incremental) or recomputed.

``start(rows) -> logits [B, V]`` for each row's last token; ``advance(tokens [B], active [B])``
appends one token to the active rows and returns their next logits. ``patch_lengths(row, n)``
(BLT) are the patches of the row's final ``tokens`` as the model saw them.
"""

from __future__ import annotations

import torch
from torch import nn

from bytelatent.data.patcher import Patcher, PatcherArgs
from bytelatent.errors import ConfigError
from bytelatent.eval.generation.patching import blt_patch_lengths
from bytelatent.model.patch_lengths import first_token_alone
from bytelatent.model.registry import ArchSpec, arch_of


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def model_spec(model: nn.Module) -> ArchSpec:
    """The registered architecture of `model` (generation asks it whether to patch and which
    cached engine runs it)."""
    spec = arch_of(model)
    if spec is None:
        raise ConfigError(f"{type(model).__name__}: not a registered architecture; cannot generate")
    return spec


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
        self.impl = None  # the spec's engine (IncrementalLM, IncrementalBLT, ...)

    def start(self, rows: list[list[int]]) -> torch.Tensor:
        spec = model_spec(self.model)
        engine = spec.generation_engine() if spec.generation_engine is not None else None
        if engine is None:
            raise ConfigError(f"arch {spec.name} has no cached generation engine; use recompute")
        self.impl = engine.for_engine(
            self.model, self.patcher_args, self.entropy_model, len(rows), self.capacity
        )
        tensors = [self._tensor(row) for row in rows]
        if hasattr(self.impl, "prefill_rows"):  # one padded forward for the batch (the byte LM)
            return self.impl.prefill_rows(tensors)
        return torch.stack([self.impl.prefill_last(b, row) for b, row in enumerate(tensors)])

    def _tensor(self, row: list[int]) -> torch.Tensor:
        # on the host: the engines copy prompts to the device from pinned memory, and read
        # their books (EOS flags, tokens) from the host copy without a device sync
        return torch.tensor(row, dtype=torch.long)

    def advance(self, tokens: list[int], active: list[bool]) -> torch.Tensor:
        return self.impl.step(tokens, active)  # host lists: the caches keep their books there

    def patch_lengths(self, row: int, tokens: list[int]) -> list[int] | None:
        return self.impl.patch_lengths(row, len(tokens))


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
        self.spec = model_spec(model)
        self.patcher = None
        if self.spec.patched:
            args = patcher_args.model_copy(update={"realtime_patching": False})
            self.patcher = Patcher(args, entropy_model=entropy_model)
        self.rows: list[list[int]] = []

    @torch.no_grad()
    def _logits(self, row: list[int]) -> torch.Tensor:
        tokens = torch.tensor([row], dtype=torch.long, device=self.device)
        if self.patcher is None:
            return self._forward(tokens)[0, -1]
        return self._forward(tokens, blt_patch_lengths(self.patcher, tokens))[0, -1]

    def _forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.spec.logits(self.model(*inputs))

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
        return [int(x) for x in first_token_alone(lengths)[0] if x > 0]
