"""Byte-level distillation targets from a subword teacher (issue 42, stage 1 of byteify).

A teacher's next-token distribution `p` at a token boundary says how the next token's bytes
continue. Inside that token, after the bytes `s` of it already seen, the next byte is `b` with
the probability of the tokens that start with `s + b`, and the token ends (a boundary, the
`END` class) with the probability of the token that is exactly `s`:

    mass(s)          = sum of p(t) over tokens t whose byte string starts with s  (mass(b"") = 1)
    P(b   | s)       = mass(s + b) / mass(s)
    P(END | s)       = p(s) / mass(s)

so each row sums to 1 over the 257 classes (256 bytes, then END), and for any token t of n
bytes the product P(t[0] | b"") * ... * P(t[n-1] | t[:n-1]) * P(END | t) telescopes to p(t):
the teacher's token probability. Without the END factor the product is mass(t), which equals
p(t) only when t is the prefix of no other token ("a" is, when "ab" is also in the vocabulary).

The vocabulary is kept sorted by byte string, so the tokens under any prefix form one
contiguous range: a target row costs one scatter over that range (the whole vocabulary at a
boundary, fewer tokens deeper in), and the ranges of every prefix of every token are
precomputed, so the targets of a whole text are one gather and one scatter.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import torch

from bytelatent.tokenizers.hf_bpe import token_boundaries

N_BYTES = 256
END = N_BYTES  # the class index of "the token ends here" (a token boundary follows)
N_CLASSES = N_BYTES + 1
JOINT_CLASSES = 2 * N_BYTES  # byte b going on (b), or byte b ending its token (256 + b)


class TokenByteTrie:
    """The teacher vocabulary (token id -> byte string) as sorted ranges over its byte strings.

    Tokens with an empty byte string (special tokens such as BOS) belong to no prefix: they
    never carry mass, so a teacher that gives them probability has its byte targets
    renormalised over the other tokens.
    """

    def __init__(self, vocab: Sequence[bytes]) -> None:
        self.vocab = [bytes(token) for token in vocab]
        ids = sorted((i for i, t in enumerate(self.vocab) if t), key=lambda i: self.vocab[i])
        self.sorted_ids = torch.tensor(ids, dtype=torch.long)
        self.sorted_bytes = [self.vocab[i] for i in ids]
        max_len = max((len(t) for t in self.sorted_bytes), default=0)
        # byte_at[j, k]: byte k of sorted token j, END if the token has exactly k bytes, -1 if fewer
        byte_at = torch.full((len(ids), max_len + 1), -1, dtype=torch.long)
        for j, token in enumerate(self.sorted_bytes):
            byte_at[j, : len(token)] = torch.tensor(list(token), dtype=torch.long)
            byte_at[j, len(token)] = END
        self.byte_at = byte_at
        self.token_len = torch.tensor([len(t) for t in self.vocab], dtype=torch.long)
        position = torch.full((len(self.vocab),), -1, dtype=torch.long)
        position[self.sorted_ids] = torch.arange(len(ids))
        self.position = position  # token id -> its row in the sorted vocabulary (-1: empty)
        self.range_lo, self.range_hi = self._prefix_ranges(max_len)

    def _prefix_ranges(self, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[V', max_len + 1] each: for sorted token j and k <= len(token j), the range [lo, hi) of
        the tokens that start with token j's first k bytes (sorted order keeps them together)."""
        n = len(self.sorted_bytes)
        # lcp[j]: common prefix length of sorted tokens j - 1 and j (-1 before the first one)
        lcp = torch.full((n,), -1, dtype=torch.long)
        for j in range(1, n):
            a, b = self.sorted_bytes[j - 1], self.sorted_bytes[j]
            k = 0
            while k < min(len(a), len(b)) and a[k] == b[k]:
                k += 1
            lcp[j] = k
        positions = torch.arange(n)
        lo = torch.empty((n, max_len + 1), dtype=torch.long)
        hi = torch.empty_like(lo)
        for k in range(max_len + 1):
            group = torch.cumsum(lcp < k, 0)  # tokens sharing their first k bytes: one group
            starts = positions[lcp < k]  # group g starts at starts[g - 1]
            lo[:, k] = starts[group - 1]
            hi[:, k] = torch.cat([starts[1:], torch.tensor([n])])[group - 1]
        return lo, hi

    def prefix_range(self, prefix: bytes) -> tuple[int, int]:
        """[lo, hi): the sorted positions of the tokens whose byte string starts with `prefix`."""
        lo = bisect.bisect_left(self.sorted_bytes, prefix)
        # longer than any token: every token that starts with `prefix` sorts below it
        ceiling = prefix + b"\xff" * (self.byte_at.shape[1] + 1)
        return lo, bisect.bisect_left(self.sorted_bytes, ceiling, lo)

    def sorted_probs(self, probs: torch.Tensor) -> torch.Tensor:
        """`probs[..., V]` (token ids) reordered to the sorted vocabulary (empty tokens dropped)."""
        return probs.index_select(-1, self.sorted_ids.to(probs.device))

    def next_byte_target(self, sorted_probs: torch.Tensor, prefix: bytes) -> torch.Tensor:
        """The 257-class target after `prefix` (bytes of the current token already seen), from
        one boundary's teacher distribution already in sorted order (`sorted_probs`, [V'])."""
        lo, hi = self.prefix_range(prefix)
        if hi <= lo:
            raise ValueError(f"no token of the teacher vocabulary starts with {prefix!r}")
        classes = self.byte_at[lo:hi, len(prefix)].to(sorted_probs.device)
        target = torch.zeros(N_CLASSES, dtype=sorted_probs.dtype, device=sorted_probs.device)
        target.scatter_add_(0, classes, sorted_probs[lo:hi])
        return target / target.sum().clamp_min(torch.finfo(target.dtype).tiny)

    def token_rows(
        self, probs: torch.Tensor, token_ids: Sequence[int] | torch.Tensor, end_rows: bool = False
    ) -> torch.Tensor:
        """The 257-class targets of every byte of every token, as one scatter (no Python loop
        over bytes): `probs[i]` ([T, V]) is the teacher's distribution for token i. Rows per
        token: one per byte (the target for byte k given bytes < k), and with `end_rows` one
        more (the target after its last byte, whose END entry closes the token)."""
        ids = torch.as_tensor(token_ids, dtype=torch.long).cpu()
        if probs.shape[0] != ids.numel():
            raise ValueError(f"{probs.shape[0]} teacher distributions for {ids.numel()} tokens")
        if ids.numel() and bool((self.position[ids] < 0).any()):
            raise ValueError("a token with no bytes (a special token) has no byte targets")
        n_rows = self.token_len[ids] + int(end_rows)
        token_of_row = torch.repeat_interleave(torch.arange(ids.numel()), n_rows)
        first_row = torch.cumsum(n_rows, 0) - n_rows
        depth = torch.arange(token_of_row.numel()) - first_row[token_of_row]
        device = probs.device
        sorted_probs = self.sorted_probs(probs)
        flat = torch.zeros(token_of_row.numel() * N_CLASSES, dtype=probs.dtype, device=device)
        rows = flat.view(-1, N_CLASSES)
        # a token's first byte sees the whole vocabulary: one index_add over the sorted tokens'
        # first bytes gives those rows for every token at once (T x V' adds, no index math)
        first_rows = torch.zeros((ids.numel(), N_CLASSES), dtype=probs.dtype, device=device)
        first_rows.index_add_(1, self.byte_at[:, 0].to(device), sorted_probs)
        rows[first_row.to(device)] = first_rows
        # deeper rows see few tokens: every (row, sorted token in [lo, hi)) pair, flattened
        deep = (depth > 0).nonzero().flatten()
        sorted_row = self.position[ids][token_of_row[deep]]
        lo, hi = self.range_lo[sorted_row, depth[deep]], self.range_hi[sorted_row, depth[deep]]
        width = hi - lo
        pair = torch.repeat_interleave(torch.arange(deep.numel()), width)
        pair_start = torch.cumsum(width, 0) - width
        pair_token = lo[pair] + torch.arange(pair.numel()) - pair_start[pair]
        classes = self.byte_at[pair_token, depth[deep][pair]]
        values = sorted_probs[token_of_row[deep][pair].to(device), pair_token.to(device)]
        flat.scatter_add_(0, (deep[pair] * N_CLASSES + classes).to(device), values)
        return rows / rows.sum(-1, keepdim=True).clamp_min(torch.finfo(rows.dtype).tiny)

    def joint_rows(
        self, probs: torch.Tensor, token_ids: Sequence[int] | torch.Tensor
    ) -> torch.Tensor:
        """The 512-class targets of a boundary-head student (`model.boundary_head`): one row per
        byte of every token, class `b` for "byte b, the token goes on" and `256 + b` for "byte b
        ends the token" (`JOINT_CLASSES`). Row k of token i is the teacher's distribution for
        token i (`probs[i]`) over the tokens that start with its first k bytes and are longer
        than k (the token did not end after byte k - 1: that was the previous row's choice):

            P(b, ends | s)  = p(s + b) / (mass(s) - p(s))
            P(b, goes | s)  = (mass(s + b) - p(s + b)) / (mass(s) - p(s))

        so the product of a token's n rows at its own bytes (the last one in the `ends` half)
        telescopes to `probs[i, token i]` with no separate END factor. Returns [sum of token
        lengths, 512]."""
        ids = torch.as_tensor(token_ids, dtype=torch.long).cpu()
        if probs.shape[0] != ids.numel():
            raise ValueError(f"{probs.shape[0]} teacher distributions for {ids.numel()} tokens")
        if ids.numel() and bool((self.position[ids] < 0).any()):
            raise ValueError("a token with no bytes (a special token) has no byte targets")
        device = probs.device
        sorted_probs = self.sorted_probs(probs)
        sorted_len = self.token_len[self.sorted_ids]
        n_rows = self.token_len[ids]
        token_of_row = torch.repeat_interleave(torch.arange(ids.numel()), n_rows)
        first_row = torch.cumsum(n_rows, 0) - n_rows
        depth = torch.arange(token_of_row.numel()) - first_row[token_of_row]
        flat = torch.zeros(token_of_row.numel() * JOINT_CLASSES, dtype=probs.dtype, device=device)
        rows = flat.view(-1, JOINT_CLASSES)
        # depth 0: every sorted token by its first byte, in the `ends` half when it has one byte
        first_class = self.byte_at[:, 0] + N_BYTES * (sorted_len == 1).long()
        first_rows = torch.zeros((ids.numel(), JOINT_CLASSES), dtype=probs.dtype, device=device)
        first_rows.index_add_(1, first_class.to(device), sorted_probs)
        rows[first_row.to(device)] = first_rows
        # deeper rows: the tokens under the row's prefix, without the prefix itself (byte_at END)
        deep = (depth > 0).nonzero().flatten()
        sorted_row = self.position[ids][token_of_row[deep]]
        d = depth[deep]
        lo, hi = self.range_lo[sorted_row, d], self.range_hi[sorted_row, d]
        width = hi - lo
        pair = torch.repeat_interleave(torch.arange(deep.numel()), width)
        pair_start = torch.cumsum(width, 0) - width
        pair_token = lo[pair] + torch.arange(pair.numel()) - pair_start[pair]
        pair_depth = d[pair]
        byte = self.byte_at[pair_token, pair_depth]
        longer = byte != END
        classes = byte + N_BYTES * (sorted_len[pair_token] == pair_depth + 1).long()
        values = sorted_probs[token_of_row[deep][pair].to(device), pair_token.to(device)]
        index = (deep[pair] * JOINT_CLASSES + classes)[longer]
        flat.scatter_add_(0, index.to(device), values[longer.to(device)])
        return rows / rows.sum(-1, keepdim=True).clamp_min(torch.finfo(rows.dtype).tiny)

    def joint_class(self, token_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """[sum of token lengths]: each byte's class in `joint_rows` (its last byte: `256 + b`)."""
        ids = torch.as_tensor(token_ids, dtype=torch.long).cpu()
        data = b"".join(self.vocab[int(i)] for i in ids)
        classes = torch.tensor(list(data), dtype=torch.long)
        ends = torch.cumsum(self.token_len[ids], 0) - 1
        classes[ends] += N_BYTES
        return classes

    def token_targets(
        self, probs: torch.Tensor, token_ids: Sequence[int] | torch.Tensor
    ) -> torch.Tensor:
        """Targets for the bytes of a tokenized text: `probs[i]` ([T, V]) is the teacher's
        distribution for token i given tokens < i; returns [sum of token lengths, 257], row j
        the target for the byte at position j given the bytes before it (its own token's
        prefix and, through the teacher, the earlier tokens)."""
        return self.token_rows(probs, token_ids)


def token_end_probs(
    trie: TokenByteTrie, probs: torch.Tensor, token_ids: Sequence[int] | torch.Tensor
) -> torch.Tensor:
    """[T]: P(END | all bytes of token i) under the teacher's distribution for token i, the
    factor that closes the product of token i's byte probabilities (see the module docstring);
    with `TokenByteTrie.token_targets` rows, prod_k row_k[t_i[k]] * end[i] = probs[i, t_i]."""
    ids = torch.as_tensor(token_ids, dtype=torch.long).cpu()
    rows = trie.token_rows(probs, ids, end_rows=True)
    last = torch.cumsum(trie.token_len[ids] + 1, 0) - 1
    return rows[last.to(rows.device), END]


def boundary_mask(token_ids: Sequence[int], vocab: Sequence[bytes]) -> torch.Tensor:
    """Bool [n_bytes]: True at the first byte of each non-empty token (a patch starts there)."""
    n_bytes = sum(len(vocab[int(t)]) for t in token_ids)
    mask = torch.zeros(n_bytes, dtype=torch.bool)
    starts = [s for s, t in zip(token_boundaries(token_ids, vocab), token_ids) if vocab[int(t)]]
    mask[torch.tensor(starts, dtype=torch.long)] = True
    return mask
