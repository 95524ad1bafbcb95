"""Attention masks and the backends that run them (the only place masks are built).

Mask semantics (reference BLT, xformers masks; see docs/architecture.md):

- ``causal``: query i sees keys j <= i.
- ``block_causal``: rows are packed documents. A document ends at and including an EOS token; the
  token after an EOS starts a new document. Query i sees keys j <= i of its own document (and the
  end of a row also ends a document, so rows never see each other).
- ``local_block_causal``: block_causal and additionally j > i - window, i.e. a query sees itself
  plus the ``window - 1`` previous positions. This is xformers'
  ``BlockDiagonalCausalMask.make_local_attention(window)`` (its mask keeps
  ``triu(diagonal=1 - window)`` of the causal mask), which the reference uses.

Backends: ``sdpa`` (``F.scaled_dot_product_attention``, CPU and CUDA), ``flex_attention`` (CUDA
only) and ``xformers`` (optional, CUDA only, imported lazily). A config asking for flex or xformers
on a machine that cannot run them falls back to sdpa with the same mask (see ``resolve_backend``);
``attend`` itself never silently changes the mask. A mask carries the backend it was built for
and only the representation that backend reads: flex a BlockMask (built from block-level document
bounds, never an S×S tensor; masks are built once per forward and shared by every layer), xformers
a block-diagonal bias over the flattened batch, whose document lengths come from the batch's host
arrays when the caller hands them over (``HostDocuments``; the training forward always does), so
building it needs no device-to-host copy.

Cost on sdpa: a mask is built once per forward and shared by every layer. Plain causal uses the
``is_causal`` kernel (no tensor); document masks are a dense bool [B,1,S,S]; a local mask over a
row much longer than its window is stored banded (``BandedMask``: per query block only the
``chunk + lookback`` keys it can see), so memory and work grow as S·window instead of S².

On CPU two execution plans ride along with a dense document mask (the dense tensor stays the
definition; the plans only skip work that the mask zeroes, so the function is the same):

- ``sdpa_causal``: every row is one document (no EOS before its last position) and any window
  covers the row, so the mask *is* plain causal and sdpa runs ``is_causal``;
- ``chunks`` (``ChunkPlan``): queries are cut into chunks of ``SDPA_CHUNK`` positions; a chunk
  of a row only attends to keys from the start of the earliest document (or window) its queries
  can see up to its last query, so blocks above the diagonal and before document starts are
  never computed. ``_ChunkedAttention`` runs the CPU flash kernel per chunk, forward and
  backward, accumulating dK/dV in place.

GQA: ``attend`` accepts k/v with fewer heads than q (n_heads must be a multiple of n_kv_heads);
query head h uses kv head ``h // (n_heads // n_kv_heads)``, as the reference ``repeat_kv`` does.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from bytelatent.compat import eager_only
from bytelatent.model.args import BACKENDS

logger = logging.getLogger(__name__)

SELF_ATTN_KINDS = (None, "causal", "block_causal", "local_block_causal")

_warned_fallbacks: set[tuple[str, str]] = set()


@dataclass
class AttnMask:
    """A mask for q [B,H,Q,D] x k [B,H,K,D], in the representation its ``backend`` runs.

    At most one of ``is_causal`` (no tensor), ``dense`` (bool, broadcastable to [B,1,Q,K],
    True = attend) or ``band`` (a sliding-window self-attention mask stored block by block, see
    BandedMask) describes the mask; a flex or xformers self-attention mask may instead be only
    its ``block_mask`` (flex_attention BlockMask) or ``xformers_bias`` (an xformers attention
    bias), so that no dense [B,1,S,S] tensor exists for backends that never read it.
    ``query_has_key`` ([B,1,Q,1] bool) is set when some query rows may allow no key at all:
    those rows were opened up in ``dense`` (so no kernel ever sees an empty row, which some
    produce NaN for; a flex BlockMask leaves them empty) and ``attend`` writes zeros to them. ``backend`` is the backend ``attend``
    runs the mask on (the one it was built for).
    """

    is_causal: bool = False
    dense: torch.Tensor | None = None
    band: BandedMask | None = None
    backend: str = "sdpa"
    # CPU execution plans of ``dense`` (see the module docstring); never change the function
    sdpa_causal: bool = False
    chunks: ChunkPlan | None = None
    query_has_key: torch.Tensor | None = None
    block_mask: Any = None
    xformers_bias: Any = None
    # for xformers block-diagonal biases q/k/v are flattened to one row [1, B*S, H, D]
    xformers_flatten: bool = False

    def __post_init__(self) -> None:
        _check_backend(self.backend)
        given = int(self.is_causal) + (self.dense is not None) + (self.band is not None)
        backend_only = self.block_mask is not None or self.xformers_bias is not None
        if given > 1 or (given == 0 and not backend_only):
            raise ValueError(
                "AttnMask needs exactly one of is_causal=True, a dense bool tensor or a band "
                "(or only a flex block_mask / xformers bias)"
            )
        if self.dense is not None and self.dense.dtype != torch.bool:
            raise ValueError(f"AttnMask.dense must be a bool tensor, got {self.dense.dtype}")

    @classmethod
    def causal(cls, backend: str = "sdpa") -> AttnMask:
        """Plain causal attention (query i sees keys j <= i, aligned at the top-left)."""
        return cls(is_causal=True, backend=backend)

    @classmethod
    def from_dense(
        cls, allowed: torch.Tensor, may_have_empty_rows: bool = True, backend: str = "sdpa"
    ) -> AttnMask:
        """Wrap a bool tensor [B|1, 1, Q, K] (True = attend).

        With ``may_have_empty_rows`` (e.g. cross-attention to padded patches) query rows that
        allow no key produce exact zeros (and zero gradients) instead of NaN.
        """
        if allowed.dtype != torch.bool:
            raise ValueError(f"mask must be bool, got {allowed.dtype}")
        if allowed.dim() != 4:
            raise ValueError(f"mask must have 4 dims [B,1,Q,K], got shape {tuple(allowed.shape)}")
        if not may_have_empty_rows:
            return cls(dense=allowed, backend=backend)
        has_key = allowed.any(dim=-1, keepdim=True)
        return cls(dense=allowed | ~has_key, query_has_key=has_key, backend=backend)


@dataclass
class BandedMask:
    """A local (sliding-window) self-attention mask stored per query block.

    Queries are cut into blocks of ``chunk`` positions; block j only needs the keys from
    ``j * chunk - lookback`` to ``(j + 1) * chunk``, so attention runs as one batched sdpa call
    over [B * n_blocks, H, chunk, chunk + lookback] instead of [B, H, S, S]. ``allowed`` is the
    bool mask of those blocks, [B * n_blocks, 1, chunk, chunk + lookback].
    """

    chunk: int
    lookback: int
    seqlen: int
    allowed: torch.Tensor

    @property
    def n_blocks(self) -> int:
        return -(-self.seqlen // self.chunk)

    @property
    def key_len(self) -> int:
        return self.chunk + self.lookback


# query chunk of the block-sparse CPU plan: fewer, larger chunks keep the flash kernel's blocks big
SDPA_CHUNK = 256


@dataclass
class ChunkPlan:
    """Block-sparse execution plan of a dense self-attention mask [B,1,S,S].

    ``pieces`` are (row_start, row_end, q_start, q_end, k_start): queries ``q_start:q_end`` of
    rows ``row_start:row_end`` attend to keys ``k_start:q_end`` under ``allowed[i]`` (the bool
    mask of that block); every key outside the block is masked for those queries.
    """

    seqlen: int
    pieces: list[tuple[int, int, int, int, int]]
    allowed: list[torch.Tensor]
    _additive: dict[torch.dtype, list[torch.Tensor]] = field(default_factory=dict, repr=False)

    def additive(self, dtype: torch.dtype) -> list[torch.Tensor]:
        """The blocks as additive masks (0 / -inf) of ``dtype``, built once per forward."""
        if dtype not in self._additive:
            self._additive[dtype] = [
                torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill_(~m, float("-inf"))
                for m in self.allowed
            ]
        return self._additive[dtype]


def first_visible_key(tokens: torch.Tensor, eos_id: int, window: int | None) -> torch.Tensor:
    """[B,S]: the earliest key position query i may see (its document start, or the window)."""
    bsz, seqlen = tokens.shape
    pos = torch.arange(seqlen, device=tokens.device).expand(bsz, seqlen)
    starts = torch.zeros_like(tokens, dtype=torch.bool)
    starts[:, 0] = True
    starts[:, 1:] = tokens[:, :-1] == eos_id  # the token after an EOS starts a document
    first = torch.where(starts, pos, 0).cummax(dim=1).values
    if window is not None:
        first = torch.maximum(first, pos - (window - 1))
    return first


def chunk_plan(
    dense: torch.Tensor, tokens: torch.Tensor, eos_id: int, window: int | None, chunk: int
) -> ChunkPlan:
    """The ChunkPlan of ``dense`` (the block_causal / local_block_causal mask of ``tokens``)."""
    bsz, seqlen = tokens.shape
    first = first_visible_key(tokens, eos_id, window)[:, ::chunk].tolist()  # one host sync
    pieces, allowed = [], []
    for j, q_start in enumerate(range(0, seqlen, chunk)):
        q_end = min(seqlen, q_start + chunk)
        starts = [row[j] for row in first]
        # rows that share the first key run as one call (e.g. single documents with a window)
        groups = (
            [(0, bsz, starts[0])]
            if len(set(starts)) == 1
            else [(b, b + 1, starts[b]) for b in range(bsz)]
        )
        for row_start, row_end, k_start in groups:
            pieces.append((row_start, row_end, q_start, q_end, k_start))
            rows = dense[row_start:row_end] if dense.shape[0] > 1 else dense
            allowed.append(rows[:, :, q_start:q_end, k_start:q_end])
    return ChunkPlan(seqlen=seqlen, pieces=pieces, allowed=allowed)


@eager_only
def _is_single_document(tokens: torch.Tensor, eos_id: int) -> bool:
    # a host sync: only taken for CPU tensors (see self_attn_mask)
    return not bool((tokens[:, :-1] == eos_id).any())


def band_chunk(seqlen: int, window: int) -> int | None:
    """Query block size for a banded local mask, or None when the dense mask is as cheap.

    The band computes chunk + lookback keys per query instead of S; it is used when that is at
    most half of S (so for long rows: the reference entropy model has S=8192, window 512).
    """
    chunk = max(64, min(512, 1 << max(0, (window - 1).bit_length() - 1)))
    lookback = -(-(window - 1) // chunk) * chunk
    if 2 * (chunk + lookback) > seqlen:
        return None
    return chunk


def banded_self_attn_mask(tokens: torch.Tensor, eos_id: int, window: int, chunk: int) -> BandedMask:
    """The local_block_causal mask of ``tokens`` [B,S] as a BandedMask with blocks of ``chunk``."""
    bsz, seqlen = tokens.shape
    lookback = -(-(window - 1) // chunk) * chunk  # keys before a block that its queries may see
    n_blocks = -(-seqlen // chunk)
    padded = n_blocks * chunk
    key_len = chunk + lookback
    device = tokens.device
    q_pos = torch.arange(padded, device=device).view(n_blocks, chunk, 1)
    k_pos = (
        torch.arange(n_blocks, device=device).view(n_blocks, 1, 1) * chunk
        - lookback
        + torch.arange(key_len, device=device).view(1, 1, key_len)
    )
    allowed = (k_pos >= 0) & (k_pos <= q_pos) & (q_pos - k_pos < window)
    doc = document_ids(tokens, eos_id)
    # padded keys get document -1 and padded queries -2: they never match a real position
    key_doc = F.pad(doc, (lookback, padded - seqlen), value=-1).unfold(1, key_len, chunk)
    query_doc = F.pad(doc, (0, padded - seqlen), value=-2).view(bsz, n_blocks, chunk)
    allowed = allowed[None] & (query_doc[..., None] == key_doc[:, :, None, :])
    # padded queries (sliced off afterwards) attend everything so that no row is empty
    allowed = allowed | (q_pos >= seqlen)[None]
    allowed = allowed.reshape(bsz * n_blocks, 1, chunk, key_len)
    return BandedMask(chunk=chunk, lookback=lookback, seqlen=seqlen, allowed=allowed)


def document_ids(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Per-position document index within each row; a document ends at and including EOS."""
    is_eos = (tokens == eos_id).to(torch.int32)
    # exclusive cumulative sum: the EOS itself still belongs to the document it closes
    return torch.cumsum(is_eos, dim=1) - is_eos


def dense_self_attn_mask(
    kind: str | None, tokens: torch.Tensor, eos_id: int = 2, window: int | None = None
) -> torch.Tensor:
    """The bool mask [B,1,S,S] (True = attend) of a self-attention mask kind."""
    _check_kind(kind, window)
    seqlen = tokens.shape[1]
    pos = torch.arange(seqlen, device=tokens.device)
    allowed = pos[None, :] <= pos[:, None]  # [S(q), S(k)] causal
    if kind == "local_block_causal":
        allowed = allowed & (pos[None, :] > pos[:, None] - window)
    allowed = allowed[None, None]
    if kind in ("block_causal", "local_block_causal"):
        doc = document_ids(tokens, eos_id)
        allowed = allowed & (doc[:, None, :, None] == doc[:, None, None, :])
    return allowed


def self_attn_mask(
    kind: str | None,
    tokens: torch.Tensor,
    eos_id: int = 2,
    window: int | None = None,
    backend: str = "sdpa",
    docs: HostDocuments | None = None,
) -> AttnMask:
    """Build the self-attention mask of ``kind`` for packed rows ``tokens`` [B,S] once per forward.

    kind: None/"causal", "block_causal" or "local_block_causal" (needs ``window``). Each backend
    gets only the representation it runs: sdpa a causal flag, a dense mask (plus a CPU plan) or,
    for a local mask over a row much longer than the window, a band (see BandedMask); flex a
    BlockMask built from per-position document starts (never an S x S tensor); xformers a
    block-diagonal bias over the flattened batch, whose document lengths come from ``docs`` (the
    batch's host copy: no device sync) when given, else from ``tokens`` (one device-to-host copy).
    """
    _check_kind(kind, window)
    _check_backend(backend)
    if docs is not None:
        docs.check_shape(tokens)
    if backend == "xformers":
        return _xformers_self_mask(kind, tokens, eos_id, window, docs)
    if backend == "flex_attention":
        return AttnMask(
            block_mask=flex_self_block_mask(kind, tokens, eos_id, window), backend=backend
        )
    chunk = band_chunk(tokens.shape[1], window) if kind == "local_block_causal" else None
    if kind in (None, "causal"):
        return AttnMask.causal()
    if chunk is not None:
        return AttnMask(band=banded_self_attn_mask(tokens, eos_id, window, chunk))
    mask = AttnMask(dense=dense_self_attn_mask(kind, tokens, eos_id, window))
    if tokens.device.type == "cpu":
        _add_cpu_plan(mask, kind, tokens, eos_id, window)
    return mask


def _add_cpu_plan(
    mask: AttnMask, kind: str | None, tokens: torch.Tensor, eos_id: int, window: int | None
) -> None:
    """Attach the cheapest exact CPU execution plan to a dense document mask."""
    seqlen = tokens.shape[1]
    if (window is None or window >= seqlen) and _is_single_document(tokens, eos_id):
        mask.sdpa_causal = True
    elif seqlen > SDPA_CHUNK and not torch.compiler.is_compiling():
        mask.chunks = chunk_plan(mask.dense, tokens, eos_id, window, SDPA_CHUNK)


def resolve_backend(attn_impl: str, device: torch.device | str) -> str:
    """The backend to actually run ``attn_impl`` on ``device``.

    flex_attention and xformers need CUDA (and xformers must be importable); elsewhere this logs
    once and falls back to sdpa, which runs exactly the same masks.
    """
    _check_backend(attn_impl)
    device = torch.device(device)
    reason = None
    if attn_impl in ("flex_attention", "xformers") and device.type != "cuda":
        reason = f"it needs CUDA and the model is on {device.type}"
    elif attn_impl == "xformers" and not _xformers_available():
        reason = "xformers is not installed or cannot load its CUDA kernels"
    if reason is None:
        return attn_impl
    if (attn_impl, device.type) not in _warned_fallbacks:
        _warned_fallbacks.add((attn_impl, device.type))
        logger.warning("attn_impl=%s: %s; using sdpa with the same masks", attn_impl, reason)
    return "sdpa"


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: AttnMask,
    backend: str | None = None,
) -> torch.Tensor:
    """Softmax attention of q [B,H,Q,D] over k/v [B,Hkv,K,D] under ``mask``; returns [B,H,Q,D].

    Runs on ``mask.backend`` (``backend``, when given, overrides it).
    """
    backend = mask.backend if backend is None else backend
    _check_backend(backend)
    n_heads, n_kv_heads = q.shape[1], k.shape[1]
    if n_heads != n_kv_heads:
        if n_heads % n_kv_heads != 0:
            raise ValueError(f"n_heads={n_heads} is not a multiple of n_kv_heads={n_kv_heads}")
        k = k.repeat_interleave(n_heads // n_kv_heads, dim=1)
        v = v.repeat_interleave(n_heads // n_kv_heads, dim=1)
    if backend == "sdpa":
        out = _attend_sdpa(q, k, v, mask)
    elif backend == "flex_attention":
        out = _attend_flex(q, k, v, mask)
    else:
        out = _attend_xformers(q, k, v, mask)
    if mask.query_has_key is not None:
        out = out * mask.query_has_key.to(out.dtype)
    return out


def _attend_banded(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, band: BandedMask
) -> torch.Tensor:
    bsz, n_heads, seqlen, head_dim = q.shape
    if seqlen != band.seqlen or k.shape[2] != band.seqlen:
        raise ValueError(
            f"banded mask is for {band.seqlen} positions, got q/k of {seqlen}/{k.shape[2]}"
        )
    n_blocks, chunk, key_len = band.n_blocks, band.chunk, band.key_len
    tail = n_blocks * chunk - seqlen

    def key_blocks(t: torch.Tensor) -> torch.Tensor:
        # [B,H,S,D] -> overlapping windows [B*n_blocks, H, key_len, D]
        padded = F.pad(t, (0, 0, band.lookback, tail))
        windows = padded.unfold(2, key_len, chunk)  # [B,H,n_blocks,D,key_len]
        return windows.permute(0, 2, 1, 4, 3).reshape(bsz * n_blocks, n_heads, key_len, head_dim)

    q_blocks = F.pad(q, (0, 0, 0, tail)).view(bsz, n_heads, n_blocks, chunk, head_dim)
    q_blocks = q_blocks.transpose(1, 2).reshape(bsz * n_blocks, n_heads, chunk, head_dim)
    out = F.scaled_dot_product_attention(
        q_blocks, key_blocks(k), key_blocks(v), attn_mask=band.allowed
    )
    out = out.view(bsz, n_blocks, n_heads, chunk, head_dim).transpose(1, 2)
    return out.reshape(bsz, n_heads, n_blocks * chunk, head_dim)[:, :, :seqlen]


def _attend_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttnMask) -> torch.Tensor:
    if mask.is_causal:
        if q.shape[2] != k.shape[2]:
            raise ValueError("is_causal masks need as many queries as keys; pass a dense mask")
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if mask.band is not None:
        return _attend_banded(q, k, v, mask.band)
    if mask.sdpa_causal and q.shape[2] == k.shape[2]:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if mask.chunks is not None and q.device.type == "cpu" and q.shape[2] == mask.chunks.seqlen:
        return _attend_chunked(q, k, v, mask.chunks)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.dense)


@eager_only  # python loop over a data-dependent plan: runs eagerly inside compiled code
def _attend_chunked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: ChunkPlan
) -> torch.Tensor:
    if k.shape[2] != plan.seqlen:
        raise ValueError(f"chunk plan is for {plan.seqlen} keys, got {k.shape[2]}")
    return _ChunkedAttention.apply(q, k, v, plan)


_flash_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_flash_cpu_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


class _ChunkedAttention(torch.autograd.Function):
    """Softmax attention run piece by piece over a ChunkPlan (CPU flash kernel)."""

    @staticmethod
    def forward(  # noqa: ANN001
        ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: ChunkPlan
    ) -> torch.Tensor:
        masks = plan.additive(q.dtype)
        out = q.new_empty(q.shape)
        outs, lses = [], []
        for (r0, r1, q0, q1, k0), mask in zip(plan.pieces, masks):
            o, lse = _flash_cpu(
                q[r0:r1, :, q0:q1], k[r0:r1, :, k0:q1], v[r0:r1, :, k0:q1], attn_mask=mask
            )
            out[r0:r1, :, q0:q1] = o
            outs.append(o)
            lses.append(lse)
        ctx.save_for_backward(q, k, v, *outs, *lses)
        ctx.plan = plan
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # noqa: ANN001
        plan = ctx.plan
        q, k, v, *rest = ctx.saved_tensors
        n = len(plan.pieces)
        outs, lses = rest[:n], rest[n:]
        masks = plan.additive(q.dtype)
        dq = torch.empty_like(q)
        dk = torch.zeros_like(k)
        dv = torch.zeros_like(v)
        for i, (r0, r1, q0, q1, k0) in enumerate(plan.pieces):
            gq, gk, gv = _flash_cpu_backward(
                grad_out[r0:r1, :, q0:q1],
                q[r0:r1, :, q0:q1],
                k[r0:r1, :, k0:q1],
                v[r0:r1, :, k0:q1],
                outs[i],
                lses[i],
                0.0,
                False,
                attn_mask=masks[i],
            )
            dq[r0:r1, :, q0:q1] = gq
            dk[r0:r1, :, k0:q1] += gk
            dv[r0:r1, :, k0:q1] += gv
        return dq, dk, dv, None


def _attend_flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttnMask) -> torch.Tensor:
    if not q.is_cuda:
        raise RuntimeError(
            "attention backend flex_attention needs CUDA tensors (its CPU kernel has no "
            "backward); use backend='sdpa' (resolve_backend does this for model configs)"
        )
    if mask.block_mask is None:
        raise ValueError(
            "flex_attention needs an AttnMask with a block_mask (build it with backend='flex_attention')"
        )
    return _compiled_flex()(q, k, v, block_mask=mask.block_mask)


def _attend_xformers(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttnMask
) -> torch.Tensor:
    if not q.is_cuda:
        raise RuntimeError(
            "attention backend xformers needs CUDA tensors (it has no CPU kernel); "
            "use backend='sdpa' (resolve_backend does this for model configs)"
        )
    if mask.band is not None:
        raise ValueError("banded masks run on sdpa only; build the mask with backend='xformers'")
    fmha = _import_xformers_fmha()
    bsz, n_heads, seqlen, head_dim = q.shape
    if mask.xformers_bias is not None:
        bias = mask.xformers_bias
    elif mask.is_causal:
        bias = fmha.attn_bias.LowerTriangularMask()
    elif mask.dense is None:
        raise ValueError(
            "this mask has no xformers representation; build it with backend='xformers'"
        )
    else:
        # a dense bool mask becomes an additive bias (slow path, but the same function)
        bias = torch.zeros(mask.dense.shape, dtype=q.dtype, device=q.device)
        bias = bias.masked_fill(~mask.dense, float("-inf"))
        bias = bias.expand(bsz, n_heads, seqlen, k.shape[2])
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # xformers wants [B,S,H,D]
    if mask.xformers_flatten:
        q, k, v = (t.reshape(1, -1, n_heads, head_dim) for t in (q, k, v))
    out = fmha.memory_efficient_attention(q, k, v, attn_bias=bias)
    return out.reshape(bsz, seqlen, n_heads, head_dim).transpose(1, 2)


def _check_kind(kind: str | None, window: int | None) -> None:
    if kind not in SELF_ATTN_KINDS:
        raise ValueError(f"unknown attention mask kind {kind!r}; expected one of {SELF_ATTN_KINDS}")
    if kind == "local_block_causal" and (window is None or window < 1):
        raise ValueError(f"local_block_causal needs a sliding window >= 1, got {window!r}")


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        hint = (
            " (fmha attends without any mask in the reference; use sdpa)"
            if backend == "fmha"
            else ""
        )
        raise ValueError(f"unknown attention backend {backend!r}; expected one of {BACKENDS}{hint}")


@functools.cache
def _xformers_available() -> bool:
    try:
        _import_xformers_fmha()
    except RuntimeError:
        return False
    return True


def _import_xformers_fmha() -> Any:
    try:
        from xformers.ops import fmha  # optional GPU dependency, imported lazily
    except ImportError as err:
        raise RuntimeError(
            f"attention backend xformers is not installed ({err}); pip install 'bytelatent[gpu]' "
            "or use attn_impl=sdpa"
        ) from err
    return fmha


def _xformers_self_mask(
    kind: str | None,
    tokens: torch.Tensor,
    eos_id: int,
    window: int | None,
    docs: HostDocuments | None,
) -> AttnMask:
    if kind in (None, "causal"):
        return AttnMask.causal(backend="xformers")
    fmha = _import_xformers_fmha()
    seqlens = document_lengths(tokens, eos_id) if docs is None else docs.lengths()
    bias = fmha.attn_bias.BlockDiagonalCausalMask.from_seqlens(seqlens)
    if kind == "local_block_causal":
        bias = bias.make_local_attention(window)
    return AttnMask(xformers_bias=bias, xformers_flatten=True, backend="xformers")


def document_lengths(tokens: torch.Tensor, eos_id: int) -> list[int]:
    """Lengths of the documents of the flattened batch (row ends also end a document).

    xformers' block-diagonal biases take these as host integers: this costs one device-to-host
    copy of the [B*S] end flags (none for CPU tokens). The training forward avoids it by handing
    the model the batch's host tokens (see HostDocuments).
    """
    ends = tokens == eos_id
    ends[:, -1] = True
    flat_ends = ends.reshape(-1).cpu().nonzero().flatten()
    return torch.diff(flat_ends, prepend=flat_ends.new_full((1,), -1)).tolist()


class HostBatch(Protocol):
    """The host (numpy) arrays of a batch, as the data pipeline produced them before the copy to
    the device (``bytelatent.data.batch.Batch`` is one). Models read them for masks that need host
    integers (see HostDocuments)."""

    x: np.ndarray  # tokens [B, S]
    patch_lengths: np.ndarray | None  # [B, P] (BLT patch mode)


class HostDocuments:
    """Where the documents of each row of a batch end, known on the host.

    ``ends`` is a numpy bool [B, S] (True where a document ends; the end of a row always ends one),
    e.g. ``tokens == eos_id`` of the numpy tokens the data pipeline produced before they went to the
    device. xformers' block-diagonal biases need document lengths as host integers; reading them
    here instead of from the device tokens costs no device-to-host copy. Only the shape can be
    checked against the device tokens (the contents would need a copy): the caller promises they
    are the same rows. A plain object, not a tensor, so that no wrapper moves it to the device.
    """

    def __init__(self, ends: np.ndarray) -> None:
        ends = np.array(ends, dtype=bool)  # a copy: the caller's array is left alone
        if ends.ndim != 2 or ends.shape[1] == 0:
            raise ValueError(f"document ends must be [batch, positions], got shape {ends.shape}")
        ends[:, -1] = True
        self.ends = ends

    @classmethod
    def from_tokens(cls, tokens: np.ndarray, eos_id: int) -> HostDocuments:
        """Documents of host tokens [B, S]: each ends at and including an EOS."""
        return cls(np.asarray(tokens) == eos_id)

    def lengths(self) -> list[int]:
        """Lengths of the documents of the flattened batch (xformers' ``seqlens``)."""
        flat_ends = np.flatnonzero(self.ends.reshape(-1))
        return np.diff(flat_ends, prepend=-1).tolist()

    def check_shape(self, tokens: torch.Tensor) -> None:
        if self.ends.shape != tuple(tokens.shape):
            raise ValueError(
                f"host documents are for rows of shape {self.ends.shape}, the tokens have "
                f"{tuple(tokens.shape)}: pass the host copy of these tokens"
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


def _compiled_flex() -> Any:
    global _flex_fn  # compile once per process
    if _flex_fn is None:
        # the flex stack (and its compile machinery): imported only when a flex mask is used
        from torch.nn.attention.flex_attention import flex_attention

        _flex_fn = torch.compile(flex_attention, dynamic=False)
    return _flex_fn
