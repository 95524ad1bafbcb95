"""Block-structured execution plans that run on sdpa and skip the work a mask zeroes.

- ``BandedMask`` (any device): a local (sliding-window) mask over a row much longer than its
  window, stored per query block (only the ``chunk + lookback`` keys a block can see), so memory
  and work grow as S·window instead of S².
- ``ChunkPlan`` (CPU): a dense document mask cut into query chunks of ``SDPA_CHUNK`` positions;
  a chunk of a row only attends to keys from the start of the earliest document (or window) its
  queries can see up to its last query, so blocks above the diagonal and before document starts
  are never computed. ``_ChunkedAttention`` runs the CPU flash kernel per chunk, forward and
  backward, accumulating dK/dV in place.
- ``is_single_document`` (CPU): every row is one document, so a document mask *is* plain causal.

The dense tensor stays the definition of a chunked mask; the plans only skip work that the mask
zeroes, so the function is the same. sdpa (``sdpa.py``) decides which plan a mask gets; these
names are read through this module at call time (benchmarks swap ``SDPA_CHUNK``/``chunk_plan``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import register_flop_formula

from bytelatent.compat import eager_only
from bytelatent.model.attention.masks import MaskCache, document_ids, first_visible_key


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
    mask of that block); every key outside the block is masked for those queries. The pieces
    cover every (row, query) once. ``table`` holds them as an int64 [n, 5] tensor and
    ``additive`` the mask as 0 / -inf [B|1,1,S,S] per dtype: what the ``bytelatent::chunked_
    attention`` op reads, so that a compiled block traces it as one opaque call.
    """

    seqlen: int
    pieces: list[tuple[int, int, int, int, int]]
    allowed: list[torch.Tensor]
    additive: MaskCache = field(default_factory=MaskCache, repr=False)

    def __post_init__(self) -> None:
        self.table = torch.tensor(self.pieces, dtype=torch.int64).reshape(-1, 5)

    def additive_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """The mask as 0 / -inf of ``dtype``: built once per plan and dtype in eager code (the
        forward's mask builder prepares the autocast dtype); inside a compiled region a
        missing dtype is built in the graph, never stored (no side effect for dynamo)."""
        built = self.additive.masks.get(dtype)
        if built is None:
            built = self._build_additive(dtype)
            if not torch.compiler.is_compiling():
                self.additive.masks[dtype] = built
        return built

    def _build_additive(self, dtype: torch.dtype) -> torch.Tensor:
        rows = max(r1 for _, r1, _, _, _ in self.pieces)
        device = self.allowed[0].device
        shape = (rows, 1, self.seqlen, self.seqlen)
        mask = torch.full(shape, float("-inf"), dtype=dtype, device=device)
        for (r0, r1, q0, q1, k0), block in zip(self.pieces, self.allowed):
            mask[r0:r1, :, q0:q1, k0:q1].masked_fill_(block, 0.0)
        return mask


def compute_dtype(device_type: str) -> torch.dtype:
    """The dtype attention will run in here: autocast's when it is on, else the default."""
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return torch.get_default_dtype()


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
    plan = ChunkPlan(seqlen=seqlen, pieces=pieces, allowed=allowed)
    plan.additive_mask(compute_dtype(tokens.device.type))  # once per forward, for every layer
    return plan


@eager_only
def is_single_document(tokens: torch.Tensor, eos_id: int) -> bool:
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


def attend_banded(
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


def attend_chunked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: ChunkPlan
) -> torch.Tensor:
    """Attention over ``plan`` (CPU flash kernel per piece, forward and backward).

    One custom op (``bytelatent::chunked_attention``) that a compiled block traces as a single
    call: the plan reaches it as tensors (the piece table, the additive mask), so a new plan
    (new document boundaries) is new data, not a new graph, and nothing breaks the graph."""
    if k.shape[2] != plan.seqlen:
        raise ValueError(f"chunk plan is for {plan.seqlen} keys, got {k.shape[2]}")
    out, _ = chunked_attention(q, k, v, plan.additive_mask(q.dtype), plan.table)
    return out


_flash_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_flash_cpu_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)  # the flash kernel's accumulation type


def _rows(mask: torch.Tensor, r0: int, r1: int) -> torch.Tensor:
    return mask[r0:r1] if mask.shape[0] > 1 else mask


@torch.library.custom_op("bytelatent::chunked_attention", mutates_args=())
def chunked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, table: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B,H,S,D], logsumexp [B,H,S] fp32, fp64 for fp64) of q/k/v [B,H,S,D] under the additive ``mask``
    [B|1,1,S,S], computed piece by piece over ``table`` (``ChunkPlan.table``)."""
    bsz, n_heads, seqlen, _ = q.shape
    out = torch.empty_like(q)
    lse = q.new_empty((bsz, n_heads, seqlen), dtype=_lse_dtype(q.dtype))
    for r0, r1, q0, q1, k0 in table.tolist():
        o, piece_lse = _flash_cpu(
            q[r0:r1, :, q0:q1],
            k[r0:r1, :, k0:q1],
            v[r0:r1, :, k0:q1],
            attn_mask=_rows(mask, r0, r1)[:, :, q0:q1, k0:q1],
        )
        out[r0:r1, :, q0:q1] = o
        lse[r0:r1, :, q0:q1] = piece_lse
    return out, lse


@chunked_attention.register_fake
def _(q, k, v, mask, table):  # noqa: ANN001, ANN202
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=_lse_dtype(q.dtype))


@torch.library.custom_op("bytelatent::chunked_attention_backward", mutates_args=())
def chunked_attention_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    mask: torch.Tensor,
    table: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of ``chunked_attention``; dK/dV accumulate over the pieces that share keys."""
    dq = torch.empty_like(q)
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    for r0, r1, q0, q1, k0 in table.tolist():
        gq, gk, gv = _flash_cpu_backward(
            grad_out[r0:r1, :, q0:q1],
            q[r0:r1, :, q0:q1],
            k[r0:r1, :, k0:q1],
            v[r0:r1, :, k0:q1],
            out[r0:r1, :, q0:q1],
            lse[r0:r1, :, q0:q1],
            0.0,
            False,
            attn_mask=_rows(mask, r0, r1)[:, :, q0:q1, k0:q1],
        )
        dq[r0:r1, :, q0:q1] = gq
        dk[r0:r1, :, k0:q1] += gk
        dv[r0:r1, :, k0:q1] += gv
    return dq, dk, dv


@chunked_attention_backward.register_fake
def _(grad_out, q, k, v, out, lse, mask, table):  # noqa: ANN001, ANN202
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output) -> None:  # noqa: ANN001
    q, k, v, mask, table = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, mask, table)


def _backward(ctx, grad_out, grad_lse):  # noqa: ANN001, ANN202
    q, k, v, out, lse, mask, table = ctx.saved_tensors
    dq, dk, dv = chunked_attention_backward(grad_out.contiguous(), q, k, v, out, lse, mask, table)
    return dq, dk, dv, None, None


chunked_attention.register_autograd(_backward, setup_context=_setup_context)


def _allowed_pairs(q: torch.Tensor, mask: torch.Tensor, table: torch.Tensor) -> int:
    """(query, key) pairs the pieces of ``table`` attend under ``mask``, over batch and heads."""
    pairs = 0
    for r0, r1, q0, q1, k0 in table.tolist():
        piece = _rows(mask, r0, r1)[:, :, q0:q1, k0:q1]
        allowed = int((piece > float("-inf")).sum())
        pairs += allowed * ((r1 - r0) if piece.shape[0] == 1 else 1)
    return pairs * q.shape[1]


@register_flop_formula(torch.ops.bytelatent.chunked_attention, get_raw=True)
def _chunked_attention_flops(q, k, v, mask, table, *_, **__) -> int:  # noqa: ANN001
    """q·kᵀ and p·v over the pairs the mask allows (the model-FLOPs convention of
    model/flops.py), so FlopCounterMode (HFU, bench/gpu/check.py) sees the chunked path."""
    return 2 * _allowed_pairs(q, mask, table) * (q.shape[-1] + v.shape[-1])


@register_flop_formula(torch.ops.bytelatent.chunked_attention_backward, get_raw=True)
def _chunked_attention_backward_flops(grad_out, q, k, v, out, lse, mask, table, *_, **__) -> int:  # noqa: ANN001
    """Twice the forward's (the gradients of q, k, v and the scores)."""
    return 2 * _chunked_attention_flops(q, k, v, mask, table)
