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
boundary, fewer tokens deeper in).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import torch

from bytelatent.tokenizers.byte_level import byte_to_unicode

N_BYTES = 256
END = N_BYTES  # the class index of "the token ends here" (a token boundary follows)
N_CLASSES = N_BYTES + 1


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

    def token_targets(self, probs: torch.Tensor, token_ids: Sequence[int]) -> torch.Tensor:
        """Targets for the bytes of a tokenized text: `probs[i]` ([T, V]) is the teacher's
        distribution for token i given tokens < i; returns [sum of token lengths, 257], row j
        the target for the byte at position j given the bytes before it (its own token's
        prefix and, through the teacher, the earlier tokens)."""
        if probs.shape[0] != len(token_ids):
            raise ValueError(f"{probs.shape[0]} teacher distributions for {len(token_ids)} tokens")
        rows = []
        for dist, token in zip(self.sorted_probs(probs), token_ids):
            data = self.vocab[int(token)]
            rows.extend(self.next_byte_target(dist, data[:k]) for k in range(len(data)))
        if not rows:
            return probs.new_zeros((0, N_CLASSES))
        return torch.stack(rows)


def token_end_probs(
    trie: TokenByteTrie, probs: torch.Tensor, token_ids: Sequence[int]
) -> torch.Tensor:
    """[T]: P(END | all bytes of token i) under the teacher's distribution for token i, the
    factor that closes the product of token i's byte probabilities (see the module docstring);
    with `TokenByteTrie.token_targets` rows, prod_k row_k[t_i[k]] * end[i] = probs[i, t_i]."""
    sorted_probs = trie.sorted_probs(probs)
    return torch.stack(
        [trie.next_byte_target(d, trie.vocab[int(t)])[END] for d, t in zip(sorted_probs, token_ids)]
    )


def token_boundaries(token_ids: Sequence[int], vocab: Sequence[bytes]) -> list[int]:
    """The byte offset at which each token starts (the teacher tokenizer's patch boundaries)."""
    starts, offset = [], 0
    for token in token_ids:
        starts.append(offset)
        offset += len(vocab[int(token)])
    return starts


def boundary_mask(token_ids: Sequence[int], vocab: Sequence[bytes]) -> torch.Tensor:
    """Bool [n_bytes]: True at the first byte of each non-empty token (a patch starts there)."""
    n_bytes = sum(len(vocab[int(t)]) for t in token_ids)
    mask = torch.zeros(n_bytes, dtype=torch.bool)
    starts = [s for s, t in zip(token_boundaries(token_ids, vocab), token_ids) if vocab[int(t)]]
    mask[torch.tensor(starts, dtype=torch.long)] = True
    return mask


def byte_level_vocab(tokenizer) -> list[bytes]:
    """A Hugging Face `tokenizers.Tokenizer`'s vocabulary as byte strings, by token id.

    Only byte-level BPE (GPT-2 / Llama 3 style: each byte written as one printable character)
    is supported; special tokens (added tokens) map to b"" (they stand for no text bytes).
    """
    from tokenizers import pre_tokenizers

    table = {char: byte for byte, char in byte_to_unicode().items()}
    special = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
    if not isinstance(tokenizer.pre_tokenizer, pre_tokenizers.ByteLevel):
        raise ValueError(
            "the teacher tokenizer is not byte-level BPE (pre_tokenizer "
            f"{type(tokenizer.pre_tokenizer).__name__}); only byte-level vocabularies are supported"
        )
    vocab = [b""] * tokenizer.get_vocab_size(with_added_tokens=True)
    for token, index in tokenizer.get_vocab(with_added_tokens=True).items():
        if token in special:
            continue
        try:
            vocab[index] = bytes(table[char] for char in token)
        except KeyError:
            raise ValueError(f"token {token!r} (id {index}) is not a byte-level token") from None
    return vocab
