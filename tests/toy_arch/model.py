"""The toy architecture's model (`tests/toy_arch/__init__.py` names it lazily)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ToyByteLM(nn.Module):
    """tokens [B, S] -> (logits [B, S, V] float32, {"act_l2": mean square of the hidden state})."""

    def __init__(self, args) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.mix = nn.Linear(2 * args.dim, args.dim)  # this byte and the previous one
        self.norm = nn.LayerNorm(args.dim)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        h = self.tok_embeddings(tokens)
        previous = F.pad(h, (0, 0, 1, 0))[:, :-1]  # causal: position t sees t and t-1
        h = h + F.silu(self.mix(torch.cat([h, previous], dim=-1)))
        logits = self.output(self.norm(h)).float()
        return logits, {"act_l2": h.float().pow(2).mean()}

    @torch.no_grad()
    def init_weights(self) -> None:
        std = self.args.dim**-0.5
        for module in (self.tok_embeddings, self.mix, self.output):
            nn.init.normal_(module.weight, std=std)
        nn.init.zeros_(self.mix.bias)
        self.norm.reset_parameters()

    def fsdp_units(self) -> list[nn.Module]:
        return [self.tok_embeddings, self.mix, self.output]


def toy_flops(model_args, data_args):
    """6 FLOPs per matmul parameter per token (forward + backward)."""
    d, v = model_args.dim, model_args.vocab_size
    per_token = 6 * (2 * d * d + d * v)
    return lambda tokens, patches: tokens * per_token
