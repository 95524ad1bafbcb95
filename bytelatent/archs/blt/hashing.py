"""Hash n-gram embeddings of the BLT local encoder (reference-compatible).

For every hash function ``f`` and n-gram size ``n`` the encoder owns one embedding table
``encoder_hash_tok_embedding.{f * len(sizes) + size_index}``. The id of byte position ``t`` in that
table is a rolling polynomial hash of the ``n`` token ids ending at ``t``:

    hash_t = sum_{j=0}^{n-1} w_j * prime_f ** j      (int64, wrapping modulo 2**64)
    id_t   = hash_t mod vocab                         (floor-mod, so 0 <= id_t < vocab)

where ``w_0`` is the *oldest* token of the window (the reference code, which the released weights
follow, gives exponent 0 to the oldest byte) and the sequence is left-padded with ``n - 1`` zeros.
The int64 wrap-around is part of the function: ``prime ** j`` overflows for ``j >= 3``.

Gradients (CPU): the tables are large (six 50002 x 256 tables in the BLT configs) but one step
touches at most B*N rows of each. ``nn.Embedding``'s backward allocates and zero-fills a dense
fp32 gradient per table every step (hundreds of MB, page faults included) and then scatters into
it. ``compute_hash_embeddings`` instead routes the lookups of plain CPU tables through
``_HashLookup``, whose backward scatters (``index_add_``) into one persistent gradient buffer per
table and hands that buffer to ``weight.grad``; before reuse only the rows written by the
previous step are zeroed. The gradient is the same dense tensor with the same values (sums of the
same terms), so the optimizer step (dense AdamW, every row) is unchanged. Tables that are
DTensors (FSDP/TP), on another device, have gradient hooks, or are traced by torch.compile use
plain ``nn.Embedding`` lookups (``HASH_GRAD_BUFFER = False`` turns the fast path off).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from bytelatent.compat import eager_only
from bytelatent.distributed.env import host_tensor_to_device
from bytelatent.model.args import HASH_PRIMES

# the persistent-buffer gradient path of CPU hash tables (see the module docstring)
HASH_GRAD_BUFFER = True

_UINT64 = 1 << 64


def _wrapped_prime_powers(prime: int, n: int) -> list[int]:
    """prime**j for j < n as signed int64 values (the exact powers modulo 2**64)."""
    powers = []
    for j in range(n):
        value = pow(prime, j, _UINT64)
        powers.append(value - _UINT64 if value >= 1 << 63 else value)
    return powers


def byte_group_hash(
    tokens: torch.Tensor, group_size: int, hash_func_nb: int = 0, vocab: int = 30000
) -> torch.Tensor:
    """Hash ids [B,N] in [0, vocab) of the ``group_size``-grams ending at each position of tokens [B,N]."""
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be [B,N], got shape {tuple(tokens.shape)}")
    if group_size < 1:
        raise ValueError(f"hash n-gram size must be >= 1, got {group_size}")
    if not 0 <= hash_func_nb < len(HASH_PRIMES):
        raise ValueError(
            f"hash function number must be in [0, {len(HASH_PRIMES)}), got {hash_func_nb}"
        )
    tokens = tokens.to(torch.int64)
    powers = _wrapped_prime_powers(HASH_PRIMES[hash_func_nb], group_size)
    padded = nn.functional.pad(tokens, (group_size - 1, 0), value=0)
    seq_len = tokens.shape[1]
    # accumulate sum_j w_j * p^j one shifted view at a time; int64 arithmetic wraps like the reference
    hashes = torch.zeros_like(tokens)
    for j, power in enumerate(powers):
        hashes = hashes + padded[:, j : j + seq_len] * power
    return torch.remainder(hashes, vocab)


def hash_table_specs(sizes: Sequence[int], nb_functions: int) -> list[tuple[int, int]]:
    """(hash function number, n-gram size) of each table, in table-index order."""
    return [(func_nb, size) for func_nb in range(nb_functions) for size in sizes]


def _table_specs(
    hash_embeddings: nn.ModuleList, sizes: Sequence[int], nb_functions: int
) -> list[tuple[int, int]]:
    """``hash_table_specs``, checked against the tables there are."""
    specs = hash_table_specs(sizes, nb_functions)
    if len(specs) != len(hash_embeddings):
        raise ValueError(
            f"{len(hash_embeddings)} hash tables for {len(specs)} (function, size) pairs"
        )
    return specs


def compute_hash_embeddings(
    tokens: torch.Tensor,
    tok_embeddings: nn.Embedding,
    hash_embeddings: nn.ModuleList | None,
    sizes: Sequence[int] | None,
    nb_functions: int,
    vocab: int,
) -> torch.Tensor:
    """Byte embeddings plus the sum of all hash n-gram embeddings: [B,N,D]."""
    embeds = tok_embeddings(tokens)
    if hash_embeddings is None or not sizes:
        return embeds
    specs = _table_specs(hash_embeddings, sizes, nb_functions)
    if HASH_GRAD_BUFFER and torch.compiler.is_compiling() and tokens.device.type == "cpu":
        # the buffer path writes .grad from backward, which compiled autograd cannot trace: run the
        # lookups eagerly (the compiled BLT forward's one graph break) rather than lose it. The
        # traceable alternative (plain nn.Embedding, dense gradients) costs more than the break:
        # at bench/blt_cpu.py's shapes (6 x 50002 x 256 tables, 4 x 1024 bytes, 1 thread) the
        # lookups' forward + backward take 45 ms of CPU eagerly with the buffer, 154 ms compiled
        # without it (bench/RESULTS_blt_cpu.md, issue 31). HASH_GRAD_BUFFER = False: no break.
        return _hash_lookups_eager(embeds, tokens, hash_embeddings, specs, vocab)
    return _hash_lookups(embeds, tokens, hash_embeddings, specs, vocab)


@functools.lru_cache(maxsize=16)
def _last_position_powers(
    specs: tuple[tuple[int, int], ...], window: int, device: torch.device
) -> torch.Tensor:
    """[n_tables, window] int64 on ``device``: prime**j of each table's n-gram (the exponent 0 on
    its oldest byte), aligned to the window's end, zeros before the n-gram. Built once per
    device (a pinned, non-blocking copy): generation's per-byte embedding never copies it."""
    powers = torch.zeros(len(specs), window, dtype=torch.int64)
    for index, (func_nb, size) in enumerate(specs):
        powers[index, window - size :] = torch.tensor(
            _wrapped_prime_powers(HASH_PRIMES[func_nb], size), dtype=torch.int64
        )
    return host_tensor_to_device(powers, device)


def last_position_hash_embeddings(
    window: torch.Tensor,
    tok_embeddings: nn.Embedding,
    hash_embeddings: nn.ModuleList | None,
    sizes: Sequence[int] | None,
    nb_functions: int,
    vocab: int,
) -> torch.Tensor:
    """``compute_hash_embeddings(window, ...)[:, -1:]`` for ``window`` [B, W] (W at least the
    longest n-gram; 0 before a row's start, the n-grams' own padding), with the hash ids of every
    table from one product: sum_j w_j * prime**j wraps in int64 exactly as ``byte_group_hash``
    accumulates it (generation embeds one byte per step)."""
    embeds = tok_embeddings(window[:, -1:])
    if hash_embeddings is None or not sizes:
        return embeds
    specs = tuple(_table_specs(hash_embeddings, sizes, nb_functions))
    if window.shape[1] < max(size for _, size in specs):
        raise ValueError(f"a window of {window.shape[1]} bytes is shorter than the longest n-gram")
    powers = _last_position_powers(specs, window.shape[1], window.device)
    ids = torch.remainder((window.to(torch.int64)[:, None, :] * powers).sum(-1), vocab)
    for index, table in enumerate(hash_embeddings):
        embeds = embeds + table(ids[:, index : index + 1])
    return embeds


def _hash_lookups(
    embeds: torch.Tensor,
    tokens: torch.Tensor,
    hash_embeddings: nn.ModuleList,
    specs: list[tuple[int, int]],
    vocab: int,
) -> torch.Tensor:
    with torch.no_grad():
        ids = [byte_group_hash(tokens, size, func_nb, vocab) for func_nb, size in specs]
    weights = [table.weight for table in hash_embeddings]
    if _use_grad_buffer(weights):
        return _HashLookup.apply(embeds, torch.stack(ids), *weights)
    for table, table_ids in zip(hash_embeddings, ids):
        embeds = embeds + table(table_ids)
    return embeds


_hash_lookups_eager = eager_only(_hash_lookups)


class _GradBuffer:
    """The persistent gradient tensor of one table and the rows the last backward wrote."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.grad = torch.zeros_like(weight, memory_format=torch.contiguous_format)
        # ids of the rows written since the buffer was last zeroed; None: too many to list
        # (more ids than rows, e.g. many backwards between zero_grad(set_to_none=False) calls),
        # then the whole buffer is zeroed. Memory stays bounded whatever the caller does.
        self.dirty: list[torch.Tensor] | None = []
        self._n_dirty = 0

    def mark(self, ids: torch.Tensor) -> None:
        if self.dirty is None:
            return
        self._n_dirty += ids.numel()
        if self._n_dirty > self.grad.shape[0]:
            self.dirty = None
        else:
            self.dirty.append(ids)

    def clear(self) -> None:
        """Zero what was written (only those rows: the rest of the buffer is still zero)."""
        if self.dirty is None:
            self.grad.zero_()
        elif self.dirty:
            self.grad.index_fill_(0, torch.cat(self.dirty), 0.0)
        self.dirty, self._n_dirty = [], 0


_grad_buffers: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _use_grad_buffer(weights: list[torch.Tensor]) -> bool:
    if not HASH_GRAD_BUFFER or not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return False
    return all(
        type(w) is nn.Parameter  # not a DTensor / tensor subclass
        and w.requires_grad
        and w.device.type == "cpu"
        and w.is_contiguous()
        and not w._backward_hooks  # noqa: SLF001  (hooks expect autograd's own gradient)
        and not getattr(w, "_post_accumulate_grad_hooks", None)
        for w in weights
    )


def _accumulate_rows(weight: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor) -> None:
    """weight.grad += scatter of ``rows`` [M,D] at ``ids`` [M] (what embedding backward adds)."""
    rows = rows.to(weight.dtype)
    if weight.grad is not None:
        state = _grad_buffers.get(weight)
        if state is not None and weight.grad is state.grad:
            state.mark(ids)  # accumulation into our buffer (micro-batches, zero_grad to zeros)
        weight.grad.index_add_(0, ids, rows)
        return
    state = _grad_buffers.get(weight)
    if state is None or state.grad.shape != weight.shape or state.grad.dtype != weight.dtype:
        state = _grad_buffers[weight] = _GradBuffer(weight)
    else:
        state.clear()
    state.mark(ids)
    state.grad.index_add_(0, ids, rows)
    weight.grad = state.grad


class _HashLookup(torch.autograd.Function):
    """embeds + weights[0][ids[0]] + weights[1][ids[1]] + ... (summed in this order, as the
    plain path), with a backward that writes each ``weight.grad`` directly."""

    @staticmethod
    def forward(  # noqa: ANN001
        ctx, embeds: torch.Tensor, ids: torch.Tensor, *weights: torch.Tensor
    ) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.weights = weights
        out = embeds
        for table_ids, weight in zip(ids, weights):
            out = out + nn.functional.embedding(table_ids, weight)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # noqa: ANN001
        (ids,) = ctx.saved_tensors
        rows = grad_out.reshape(-1, grad_out.shape[-1])
        for table_ids, weight in zip(ids, ctx.weights):
            _accumulate_rows(weight, table_ids.reshape(-1), rows)
        grad_embeds = grad_out if ctx.needs_input_grad[0] else None
        return (grad_embeds, None) + (None,) * len(ctx.weights)
