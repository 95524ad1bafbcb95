"""The flex_attention backend (CUDA only; its CPU kernel has no backward).

Its one mask, ``FlexMask``, is a ``BlockMask`` built once per forward from per-query key
intervals (block-level document bounds for self-attention, patch bounds for cross-attention):
never an S x S or [P·k, N] tensor. The flex stack is imported only when a flex mask is built or
run, and ``flex_attention`` is compiled once per process (``compile_flex``).

Shapes: H-Net's inner widths and the BLT's patch counts depend on the data, and validation runs
other lengths and a short last batch. ``compile_flex`` lets dynamo's automatic dynamic shapes
handle them (the first shape compiles static, a second one compiles a graph with symbolic sizes
that every later one reuses: about one graph per head layout, tests/model/test_flex_recompile.py),
and compiles with ``fullgraph=True``, so that hitting the recompile limit raises instead of
running flex eagerly (unfused, the full score matrix in memory) without a word.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from bytelatent.model.attention.base import AttnMask, register_backend, wrong_backend
from bytelatent.model.attention.masks import (
    Causal,
    Dense,
    KeyIntervals,
    LocalBlockCausal,
    MaskSpec,
    first_visible_key,
)


@dataclass(eq=False)
class FlexMask(AttnMask):
    """A flex_attention ``BlockMask``; ``query_has_key`` flags the rows that see some key when
    some may see none (cross-attention to padded patches: flex leaves them empty)."""

    backend: ClassVar[str] = "flex_attention"
    block_mask: Any
    query_has_key: torch.Tensor | None = None


class FlexBackend:
    """``torch.nn.attention.flex_attention`` over BlockMasks built from key intervals."""

    name = "flex_attention"

    def unavailable_reason(self, device: torch.device) -> str | None:
        if device.type != "cuda":
            return f"it needs CUDA and the model is on {device.type}"
        return None

    def build(self, spec: MaskSpec) -> AttnMask:
        if isinstance(spec, Dense):
            raise ValueError(
                "flex_attention builds its masks from key intervals, not from a dense tensor; "
                "pass masks.KeyIntervals (or use backend='sdpa' for a dense mask)"
            )
        if isinstance(spec, KeyIntervals):
            block_mask = flex_interval_block_mask(spec.lo, spec.hi, spec.kv_len)
            return FlexMask(block_mask, query_has_key=(spec.hi > spec.lo)[:, None, :, None])
        if isinstance(spec, Causal):
            if spec.tokens is None:
                raise ValueError("a flex causal mask needs the rows: use self_attn_mask")
            return FlexMask(flex_self_block_mask(None, spec.tokens, 0, None))
        window = spec.window if isinstance(spec, LocalBlockCausal) else None
        kind = "block_causal" if window is None else "local_block_causal"
        return FlexMask(flex_self_block_mask(kind, spec.tokens, spec.eos_id, window))

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttnMask
    ) -> torch.Tensor:
        _require_cuda(q)
        if not isinstance(mask, FlexMask):
            raise wrong_backend(mask, self.name)
        try:
            return _compiled_flex()(q, k, v, block_mask=mask.block_mask)
        except Exception as e:
            if type(e).__name__ != "FailOnRecompileLimitHit":
                raise
            raise RuntimeError(
                f"flex_attention hit dynamo's recompile limit at q {tuple(q.shape)}, k "
                f"{tuple(k.shape)}, {q.dtype}: past it flex would run unfused (the full score "
                "matrix); raise distributed.compile_cache_size_limit, and report the shapes "
                "(TORCH_LOGS=recompiles names what changed)"
            ) from e


def _require_cuda(q: torch.Tensor) -> None:
    if not q.is_cuda:
        raise RuntimeError(
            "attention backend flex_attention needs CUDA tensors (its CPU kernel has no "
            "backward); use backend='sdpa' (resolve_backend does this for model configs)"
        )


# flex_attention's default sparse block size: masks are classified per (query block, key block)
FLEX_BLOCK = 128


def flex_self_block_mask(
    kind: str | None, tokens: torch.Tensor, eos_id: int, window: int | None, block: int = FLEX_BLOCK
) -> Any:
    """The flex_attention BlockMask of a self-attention mask kind for ``tokens`` [B,S].

    Query q sees exactly the keys ``first_visible_key(q) .. q``: an interval mask (see
    ``flex_interval_block_mask``). Only [B, S] and [B, S/block, S/block] tensors are built (never
    S x S). Works for CPU and CUDA tensors (flex runs only on CUDA).
    """
    bsz, seqlen = tokens.shape
    pos = torch.arange(seqlen, device=tokens.device)
    if kind in (None, "causal"):
        first = torch.zeros(bsz, seqlen, dtype=torch.long, device=tokens.device)
    else:
        first = first_visible_key(tokens, eos_id, window)
    return flex_interval_block_mask(first, (pos + 1).expand(bsz, seqlen), seqlen, block)


def flex_interval_block_mask(
    lo: torch.Tensor, hi: torch.Tensor, kv_len: int, block: int = FLEX_BLOCK
) -> Any:
    """The flex_attention BlockMask in which query q of row b sees keys ``lo[b,q] <= j < hi[b,q]``.

    ``lo``, ``hi`` [B, Q] never decrease with q and chain (``lo[b,q+1] <= hi[b,q]``), so the keys
    seen by a query block [a, e] are the one interval ``lo[a] .. hi[e]``: a (query block, key block
    [c, d]) pair is non-empty iff ``lo[a] <= d`` and ``hi[e] > c``, and full iff ``lo[e] <= c`` and
    ``hi[a] > d`` (blocks cut by a row end are never full). Without chaining the non-empty test
    only over-approximates, which ``mask_mod`` corrects. Only [B, Q] and [B, Q/block, K/block]
    tensors are built; ``mask_mod`` decides the partial blocks from ``lo``/``hi``.
    """
    from torch.nn.attention.flex_attention import BlockMask  # the flex stack: only when used

    q_len = lo.shape[1]

    def bounds(length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        starts = torch.arange(0, length, block, device=lo.device)
        lasts = (starts + block - 1).clamp(max=length - 1)
        return starts, lasts, starts + block <= length

    q_starts, q_lasts, q_complete = bounds(q_len)
    k_starts, k_lasts, k_complete = bounds(kv_len)
    lo_a, lo_e = lo[:, q_starts, None], lo[:, q_lasts, None]  # [B, nQ, 1]
    hi_a, hi_e = hi[:, q_starts, None], hi[:, q_lasts, None]
    nonempty = (lo_a <= k_lasts) & (hi_e > k_starts)
    full = (lo_e <= k_starts) & (hi_a > k_lasts) & q_complete[:, None] & k_complete

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx >= lo[b, q_idx]) & (kv_idx < hi[b, q_idx])

    return BlockMask.from_kv_blocks(
        *_ordered_blocks(nonempty & ~full),
        *_ordered_blocks(full),
        BLOCK_SIZE=block,
        mask_mod=mask_mod,
        seq_lengths=(q_len, kv_len),
    )


def _ordered_blocks(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, Q/blk, K/blk] bool -> BlockMask's (num_blocks [B,1,Q/blk], indices [B,1,Q/blk,K/blk])
    int32: per query block the count and, first, the indices of its set key blocks."""
    counts = blocks.sum(-1, dtype=torch.int32)
    order = torch.argsort((~blocks).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return counts[:, None], order[:, None]


_flex_fn: Any = None


def compile_flex(backend: str = "inductor") -> Any:
    """``flex_attention`` compiled as the backend runs it.

    ``dynamic=None`` (dynamo's automatic dynamic shapes): a static graph for the first shape,
    then one with symbolic sizes for every later length or batch size (H-Net's data-dependent
    widths, validation lengths): with ``dynamic=False`` each new width compiled again and the
    9th fell back to eager. ``fullgraph=True``: at the recompile limit dynamo raises
    ``FailOnRecompileLimitHit`` (``FlexBackend.attend`` says what to do) instead of running the
    unfused eager kernel. Only this function is affected (no global dynamo setting)."""
    # the flex stack (and its compile machinery): imported only when a flex mask is used
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, backend=backend, dynamic=None, fullgraph=True)


def _compiled_flex() -> Any:
    global _flex_fn  # compile once per process
    if _flex_fn is None:
        _flex_fn = compile_flex()
    return _flex_fn


BACKEND = register_backend(FlexBackend())
