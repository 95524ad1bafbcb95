"""Generation settings and next-byte sampling (greedy, temperature, top-k, top-p)."""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator


class GenerationArgs(BaseModel):
    """How to continue prompts. ``temperature=0`` is greedy; ``seed`` seeds every row alike, so a
    prompt's continuation does not depend on the other prompts of its batch."""

    model_config = ConfigDict(extra="forbid")

    max_new_bytes: int = Field(200, ge=0, description="most bytes generated per prompt")
    temperature: float = Field(0.0, ge=0.0, description="sampling temperature; 0: greedy")
    top_k: int | None = Field(None, ge=1, description="sample from the k likeliest tokens only")
    top_p: float | None = Field(
        None, gt=0.0, le=1.0, description="nucleus sampling: the smallest set of mass >= top_p"
    )
    seed: int = Field(0, description="sampling seed, the same for every row")
    stop: list[str] = Field(
        default_factory=list,
        description="stop after any of these strings (cut from the continuation)",
    )
    stop_at_eos: bool = Field(True, description="stop a row when it generates EOS")
    stop_ids: list[int] = Field(
        [],
        description="stop a row after any of these token ids (kept in its tokens; chat "
        "mode stops at the template's end-of-turn id)",
    )
    use_cache: bool = Field(
        True, description="incremental (cached) decoding; false: re-run the whole model every byte"
    )
    batch_size: int = Field(8, ge=1, description="prompts generated together")
    speculative_k: int = Field(
        0,
        ge=0,
        description="BLT self-speculative decoding: draft up to k bytes past patch boundaries "
        "with the local models, verify them in one step; 0: off",
    )

    @model_validator(mode="after")
    def _check_stop(self) -> GenerationArgs:
        if any(s == "" for s in self.stop):
            raise ValueError("stop strings must not be empty")
        if self.speculative_k > 0 and not self.use_cache:
            raise ValueError("speculative_k > 0 needs use_cache=true (it rolls the caches back)")
        return self


def filter_logits(logits: torch.Tensor, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """Logits [V] with everything outside the top-k / nucleus top-p set at -inf."""
    logits = logits.clone()
    if top_k is not None and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits[logits < kth] = float("-inf")
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the tokens before it already reach top_p (the first always stays)
        drop = torch.cumsum(probs, dim=-1) - probs >= top_p
        logits[order[drop]] = float("-inf")
    return logits


def sample_rows(
    logits: torch.Tensor,
    args: GenerationArgs,
    generators: list[torch.Generator],
    rows: list[int],
) -> dict[int, int]:
    """One token id for each of ``rows`` of logits [B, V], with one device-to-host copy in all
    (greedy: the argmaxes; sampling: the logits, then each row's own generator on the host)."""
    if args.temperature == 0.0:
        picks = torch.argmax(logits, dim=-1).tolist()
        return {b: picks[b] for b in rows}
    host = logits.float().cpu()
    return {b: sample_next(host[b], args, generators[b]) for b in rows}


def sample_next(logits: torch.Tensor, args: GenerationArgs, generator: torch.Generator) -> int:
    """One token id from logits [V] (float32)."""
    if args.temperature == 0.0:
        return int(torch.argmax(logits))
    scaled = filter_logits(logits.float().cpu() / args.temperature, args.top_k, args.top_p)
    probs = torch.softmax(scaled, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))
