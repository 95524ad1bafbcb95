"""The toy's cached generation engine: the toy sees a byte and the one before it, so a row's
cache is its last token."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class IncrementalToy:
    """`CachedEngine`'s protocol: `for_engine`, `prefill_last`, `step`, `patch_lengths`."""

    def __init__(self, model, batch: int) -> None:
        self.model = model
        self.last: list[int | None] = [None] * batch  # each row's last token (host)

    @classmethod
    def for_engine(cls, model, patcher_args, entropy_model, batch: int, capacity: int):
        return cls(model, batch)

    @torch.no_grad()
    def prefill_last(self, row: int, tokens: torch.Tensor) -> torch.Tensor:
        """The next token's logits [V] after the 1-D `tokens` (the full forward on them)."""
        device = next(self.model.parameters()).device
        logits, _ = self.model(tokens.to(device)[None])
        self.last[row] = int(tokens[-1])
        return logits[0, -1]

    @torch.no_grad()
    def step(self, tokens: list[int], active: list[bool]) -> torch.Tensor:
        """Append one token to every active row -> logits [B, V] (inactive rows: zeros)."""
        model = self.model
        device = next(model.parameters()).device
        emb = model.tok_embeddings
        h = emb(torch.tensor(tokens, device=device))
        previous = emb(torch.tensor([t or 0 for t in self.last], device=device))
        h = h + F.silu(model.mix(torch.cat([h, previous], dim=-1)))
        logits = model.output(model.norm(h)).float()
        for row, (token, on) in enumerate(zip(tokens, active, strict=True)):
            if on:
                self.last[row] = token
        return logits * torch.tensor(active, device=device)[:, None]

    def patch_lengths(self, row: int, n_tokens: int) -> None:
        return None  # no patches
