"""Hash n-gram embeddings of the BLT local encoder (reference-compatible).

For every hash function ``f`` and n-gram size ``n`` the encoder owns one embedding table
``encoder_hash_tok_embedding.{f * len(sizes) + size_index}``. The id of byte position ``t`` in that
table is a rolling polynomial hash of the ``n`` token ids ending at ``t``:

    hash_t = sum_{j=0}^{n-1} w_j * prime_f ** j      (int64, wrapping modulo 2**64)
    id_t   = hash_t mod vocab                         (floor-mod, so 0 <= id_t < vocab)

where ``w_0`` is the *oldest* token of the window (the reference code, which the released weights
follow, gives exponent 0 to the oldest byte) and the sequence is left-padded with ``n - 1`` zeros.
The int64 wrap-around is part of the function: ``prime ** j`` overflows for ``j >= 3``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

# one prime per hash function, indexed by function number (reference values)
HASH_PRIMES = (
    1000000007,
    5915587277,
    1500450271,
    3267000013,
    5754853343,
    4093082899,
    9576890767,
    3628273133,
    2860486313,
    5463458053,
    3367900313,
)

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
    specs = hash_table_specs(sizes, nb_functions)
    if len(specs) != len(hash_embeddings):
        raise ValueError(
            f"{len(hash_embeddings)} hash tables for {len(specs)} (function, size) pairs"
        )
    with torch.no_grad():
        ids = [byte_group_hash(tokens, size, func_nb, vocab) for func_nb, size in specs]
    for table, table_ids in zip(hash_embeddings, ids):
        embeds = embeds + table(table_ids)
    return embeds
