"""Subword embeddings of a byteified BLT (`model.subword_vocab_size`, docs/byteify.md).

Byteify keeps a token model's layers as the BLT's global transformer; those layers were trained
on the token model's input embeddings. Bolmo (arXiv 2512.15586) adds the token model's embedding
of the longest vocabulary token ending at each byte to that byte's representation. Here it is
added where the frozen layers read it: to each patch's representation, the embedding of the
longest vocabulary token that ends at the patch's last byte and starts inside the patch. With the
teacher's token boundaries as patch boundaries that token is the patch itself, so the global
transformer starts from exactly the inputs it was trained on; with other patches it is the
patch's longest token suffix. It depends on the patch's own bytes only (causal).

The lookup is a tensor search, no Python per byte: every vocabulary token has a 62-bit key (two
polynomial hashes of its bytes and its length); the n-grams ending at each position are hashed
for every length up to `max_bytes` and searched in the sorted keys. Two different byte strings
of one length share a key with probability about 2^-56, and the keys of the vocabulary itself
are checked to be distinct when they are set (`set_vocabulary`). Tokens longer than `max_bytes`
(runs of spaces in a code vocabulary) are never looked up: a patch equal to one gets its longest
shorter suffix token; `set_vocabulary` returns how many there are.

The local encoder's patch representation is added scaled by `encoder_scale` (a parameter that
starts at 0): at the first step the global transformer sees the teacher's embeddings alone.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import nn

from bytelatent.archs.blt.patch_utils import patch_ids_from_lengths
from bytelatent.model.cpu_bf16 import Linear
from bytelatent.tokenizers.constants import OFFSET

_P1, _B1 = 1_000_000_007, 911_382_323  # < 2^30
_P2, _B2 = 67_108_859, 47_266_351  # < 2^26
_LEN_BITS = 6  # lengths up to 63 bytes
MAX_BYTES_LIMIT = (1 << _LEN_BITS) - 1
_NO_KEY = -1  # never a key (keys are >= 0): what an unset vocabulary holds


def _key(h1, h2, length: int):
    """The key of a byte string of `length` bytes from its two hashes (ints or tensors)."""
    return ((h1 * _P2 + h2) << _LEN_BITS) + length


def ngram_keys(tokens: torch.Tensor, max_bytes: int) -> Iterator[tuple[int, torch.Tensor]]:
    """For length = 1, 2, ... up to `max_bytes` (and the row width): (length, [B, N] keys of the
    n-gram of that many bytes ending at each position, `_NO_KEY` where it would start before the
    row or span a token that is not a byte). `tokens` are byte ids (`OFFSET` + byte)."""
    n = tokens.shape[1]
    is_byte = (tokens >= OFFSET) & (tokens < OFFSET + 256)
    value = (tokens - OFFSET + 1).clamp(min=0)
    h1, h2 = torch.zeros_like(tokens), torch.zeros_like(tokens)
    valid = torch.ones_like(is_byte)
    for length in range(1, min(max_bytes, n) + 1):
        shift = length - 1  # the n-gram's first byte sits `shift` positions back
        first = nn.functional.pad(value[:, : n - shift], (shift, 0))
        valid = valid & nn.functional.pad(is_byte[:, : n - shift], (shift, 0), value=False)
        h1 = (h1 * _B1 + first) % _P1  # the Horner order of `token_keys`
        h2 = (h2 * _B2 + first) % _P2
        yield length, torch.where(valid, _key(h1, h2, length), _NO_KEY)


def token_keys(vocab: Sequence[bytes]) -> torch.Tensor:
    """[V] int64: the key of each token's byte string (`_NO_KEY` for an empty token)."""
    keys = torch.full((len(vocab),), _NO_KEY, dtype=torch.long)
    for i, token in enumerate(vocab):
        if not token or len(token) > MAX_BYTES_LIMIT:
            continue
        h1 = h2 = 0
        for byte in reversed(token):  # the same Horner order as `longest_suffix_tokens`
            h1 = (h1 * _B1 + byte + 1) % _P1
            h2 = (h2 * _B2 + byte + 1) % _P2
        keys[i] = _key(h1, h2, len(token))
    return keys


def longest_suffix_tokens(
    tokens: torch.Tensor,
    room: torch.Tensor,
    sorted_keys: torch.Tensor,
    sorted_ids: torch.Tensor,
    max_bytes: int,
) -> torch.Tensor:
    """[B, N] int64: the id of the longest vocabulary token equal to the bytes ending at each
    position and starting at most `room` [B, N] bytes before it (-1: none, e.g. a special token).
    `tokens` are byte ids (`OFFSET` + byte); the vocabulary is `sorted_keys` (ascending) with
    the token id of each key in `sorted_ids`."""
    found = torch.full_like(tokens, -1)
    last = max(sorted_keys.numel() - 1, 0)
    for length, key in ngram_keys(tokens, max_bytes):
        index = torch.searchsorted(sorted_keys, key).clamp(max=last)
        hit = (key != _NO_KEY) & (room >= length - 1) & (sorted_keys[index] == key)
        found = torch.where(hit, sorted_ids[index], found)
    return found


class SubwordEmbedding(nn.Module):
    """The token model's embedding table and vocabulary keys (filled by the warm start from
    `model.global_init`, kept in checkpoints), and the scale of the encoder's patch
    representation. `forward(patches, tokens, patch_lengths)` -> the global model's input."""

    def __init__(self, n_tokens: int, dim: int, max_bytes: int) -> None:
        super().__init__()
        self.max_bytes = max_bytes
        self.table = nn.Embedding(n_tokens, dim)
        self.encoder_scale = nn.Parameter(torch.zeros(()))
        self.register_buffer("sorted_keys", torch.full((n_tokens,), _NO_KEY, dtype=torch.long))
        self.register_buffer("sorted_ids", torch.zeros(n_tokens, dtype=torch.long))

    @torch.no_grad()
    def set_vocabulary(self, vocab: Sequence[bytes]) -> int:
        """Key the token byte strings (`vocab[i]`: token id i); returns how many tokens are
        longer than `max_bytes` (never looked up). Raises ValueError when the table is too small
        or two tokens share a key."""
        if len(vocab) > self.table.num_embeddings:
            raise ValueError(
                f"{len(vocab)} tokens, the subword table has {self.table.num_embeddings} rows "
                "(model.subword_vocab_size)"
            )
        too_long = sum(len(t) > self.max_bytes for t in vocab)
        keys = token_keys([b"" if len(t) > self.max_bytes else t for t in vocab])
        present = keys[keys != _NO_KEY]
        if present.unique().numel() != present.numel():
            raise ValueError("two vocabulary tokens share a subword key; report this vocabulary")
        padded = torch.full((self.table.num_embeddings,), _NO_KEY, dtype=torch.long)
        padded[: len(vocab)] = keys
        order = torch.argsort(padded)
        self.sorted_keys.copy_(padded[order].to(self.sorted_keys.device))
        self.sorted_ids.copy_(order.to(self.sorted_ids.device))
        return too_long

    @torch.no_grad()
    def init_weights(self, std: float) -> None:
        nn.init.trunc_normal_(self.table.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)
        self.encoder_scale.zero_()
        self.sorted_keys.fill_(_NO_KEY)  # no vocabulary: nothing matches until one is set
        self.sorted_ids.zero_()

    def patch_token_ids(self, tokens: torch.Tensor, patch_lengths: torch.Tensor) -> torch.Tensor:
        """[B, P]: the id of the longest vocabulary token ending at each patch's last byte and
        starting inside the patch (-1: none, or an empty patch)."""
        n = tokens.shape[1]
        starts = torch.cumsum(patch_lengths, 1) - patch_lengths
        positions = torch.arange(n, device=tokens.device).expand(tokens.shape[0], n)
        room = positions - starts.gather(1, patch_ids_from_lengths(patch_lengths, n))
        ids = longest_suffix_tokens(tokens, room, self.sorted_keys, self.sorted_ids, self.max_bytes)
        last = (starts + patch_lengths - 1).clamp(min=0, max=n - 1)
        patch_ids = ids.gather(1, last)
        return torch.where(patch_lengths > 0, patch_ids, torch.full_like(patch_ids, -1))

    def forward(
        self, patches: torch.Tensor, tokens: torch.Tensor, patch_lengths: torch.Tensor
    ) -> torch.Tensor:
        """patches [B, P, dim] (the encoder's representation) -> the global model's input."""
        ids = self.patch_token_ids(tokens, patch_lengths[:, : patches.shape[1]])
        emb = self.table(ids.clamp(min=0)) * (ids >= 0).unsqueeze(-1).to(patches.dtype)
        return patches * self.encoder_scale.to(patches.dtype) + emb.to(patches.dtype)


class TeacherHead(nn.Module):
    """The token model's final norm and LM head as a prior over a boundary-head BLT's classes
    (`model.teacher_head`, docs/byteify.md): the exact byte-level form of its next-token
    distribution, added to the decoder's logits.

    Position q predicts byte q + 1 and whether its patch ends there. It reads the global state
    of the last complete patch, h; the bytes s of the current patch before q + 1 are its prefix.
    With p = softmax(head(norm(h))) over the token vocabulary, the prior is

        P(b, goes | s) = sum of p(t) over tokens t longer than |s| + 1 that start with s + b
        P(b, ends | s) = p(s + b)

    renormalised over the tokens that start with s and are longer than s (the previous class
    said the patch goes on): the teacher's distribution for the next token, read one byte at a
    time. On the teacher's token patches the product over a token's bytes is p(token), so a
    student whose global states are the teacher's (subword embeddings, frozen layers) and whose
    decoder adds nothing scores exactly the teacher's token log-likelihood. A prefix no token
    starts with (a patch the tokenizer did not make) gets no prior (0: the decoder alone), nor
    do the bytes of a row's first two patches (its first byte and the rest of the token the
    window cut). The prior is mixed with a uniform 1e-4 (`SMOOTHING`): a byte where the data's
    patches and the tokenizer disagree costs ~15 nats, which the decoder can learn to lower.
    Special classes get `SPECIAL_LOG_PRIOR`; the decoder learns where a document ends.

    Cost per row: one head matmul per patch and a [bytes, vocabulary] gather and scatter, like
    a token model's LM head over every byte position: meant for the small vocabularies of a CPU
    recipe or a few tens of thousands of tokens.
    """

    SPECIAL_LOG_PRIOR = -10.0
    SMOOTHING = 1e-4  # mixed-in uniform share: a class the tokens rule out costs ~15 nats, not 69

    def __init__(self, n_tokens: int, dim: int, max_bytes: int, eps: float) -> None:
        super().__init__()
        self.max_bytes = max_bytes
        self.norm = nn.RMSNorm(dim, eps=eps)
        self.head = Linear(dim, n_tokens, bias=False)
        # token t's byte k (-1 past its end), its length (0: special), the key of its first k
        self.register_buffer("token_bytes", torch.full((n_tokens, max_bytes), -1))
        self.register_buffer("token_len", torch.zeros(n_tokens, dtype=torch.long))
        self.register_buffer("prefix_keys", torch.full((n_tokens, max_bytes), _NO_KEY))

    @torch.no_grad()
    def init_weights(self, std: float) -> None:
        self.norm.reset_parameters()
        nn.init.trunc_normal_(self.head.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)
        self.token_bytes.fill_(-1)
        self.token_len.zero_()  # no vocabulary: every token is special, no prior anywhere
        self.prefix_keys.fill_(_NO_KEY)

    @torch.no_grad()
    def set_vocabulary(self, vocab: Sequence[bytes]) -> None:
        """Tokens longer than `max_bytes` are left out (as specials: they carry no prior mass)."""
        n = self.head.out_features
        token_bytes = torch.full((n, self.max_bytes), -1, dtype=torch.long)
        token_len = torch.zeros(n, dtype=torch.long)
        prefix_keys = torch.full((n, self.max_bytes), _NO_KEY, dtype=torch.long)
        for i, token in enumerate(vocab[:n]):
            if not token or len(token) > self.max_bytes:
                continue
            token_bytes[i, : len(token)] = torch.tensor(list(token))
            token_len[i] = len(token)
            prefix_keys[i, 1 : len(token)] = token_keys([token[:k] for k in range(1, len(token))])
        self.token_bytes.copy_(token_bytes.to(self.token_bytes.device))
        self.token_len.copy_(token_len.to(self.token_len.device))
        self.prefix_keys.copy_(prefix_keys.to(self.prefix_keys.device))

    def log_prior(
        self, h: torch.Tensor, tokens: torch.Tensor, patch_lengths: torch.Tensor
    ) -> torch.Tensor:
        """h [B, P, dim] global states -> log prior [B, N, 512] (byte b going on: b; ending its
        patch: 256 + b) of each position's next byte; 0 where no token has the prefix."""
        bsz, n = tokens.shape
        patch_of = patch_ids_from_lengths(patch_lengths, n + 1)[:, 1:]  # of byte q + 1
        starts = torch.cumsum(patch_lengths, 1) - patch_lengths
        target = torch.arange(1, n + 1, device=tokens.device).expand(bsz, n)
        depth = target - starts.gather(1, patch_of)  # bytes of the prefix
        read = (patch_of - 1).clamp(min=0)  # the last complete patch
        # the key of each prefix: the n-gram of `depth` bytes ending at q
        key = torch.full_like(tokens, _NO_KEY)
        for length, keys in ngram_keys(tokens, self.max_bytes - 1):
            key = torch.where(depth == length, keys, key)
        depth_c = depth.clamp(max=self.max_bytes - 1)
        lens = self.token_len
        # [B, N, V]: the tokens that start with the prefix and are longer than it
        longer = lens > depth_c.unsqueeze(-1)
        match = self.prefix_keys.t()[depth_c] == key.unsqueeze(-1)
        consistent = (
            longer & (match | (depth_c == 0).unsqueeze(-1)) & (depth < self.max_bytes).unsqueeze(-1)
        )
        classes = self.token_bytes.t()[depth_c].clamp(min=0) + 256 * (
            lens == depth_c.unsqueeze(-1) + 1
        )
        probs = torch.softmax(self.head(self.norm(h)).float(), -1)
        probs = probs.gather(1, read.unsqueeze(-1).expand(-1, -1, probs.shape[-1]))
        mass = torch.zeros(bsz, n, 512, dtype=probs.dtype, device=probs.device)
        mass = mass.scatter_add(-1, classes, probs * consistent)
        total = mass.sum(-1, keepdim=True)
        share = mass / total.clamp_min(1e-30)
        log_prior = torch.log((1.0 - self.SMOOTHING) * share + self.SMOOTHING / 512)
        # a row's first two patches are its first byte and the rest of a token the window cut:
        # no token prefix to read, so no prior (nor where no token has the prefix)
        known = (total > 0) & (patch_of >= 2).unsqueeze(-1)
        return torch.where(known, log_prior, torch.zeros_like(log_prior))

    def add_prior(
        self,
        logits: torch.Tensor,
        h: torch.Tensor,
        tokens: torch.Tensor,
        patch_lengths: torch.Tensor,
    ) -> torch.Tensor:
        """The decoder's logits [B, N, 260 + 256] plus the prior on the byte classes and
        `SPECIAL_LOG_PRIOR` on the special ones."""
        prior = self.log_prior(h, tokens, patch_lengths)
        special = torch.full(
            (*prior.shape[:2], OFFSET),
            self.SPECIAL_LOG_PRIOR,
            dtype=prior.dtype,
            device=prior.device,
        )
        return logits + torch.cat([special, prior[..., :256], prior[..., 256:]], -1)
