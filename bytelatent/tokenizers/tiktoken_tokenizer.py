"""tiktoken BPE tokenizer with the Llama-3 split pattern (optional dependency `tiktoken`)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from bytelatent.errors import ConfigError
from bytelatent.tokenizers.base import Tokenizer

# Llama-3's pre-tokenisation pattern.
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
NUM_SPECIAL_TOKENS = 256
_NAMED_SPECIAL = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
]
# tiktoken's encoder is slow on very long inputs; encode in chunks of this many characters.
_CHUNK_CHARS = 400_000


def _import_tiktoken():
    try:
        import tiktoken
    except ImportError as exc:
        raise ConfigError(
            "tokenizer_args: the 'tiktoken' tokenizer needs `pip install tiktoken`"
        ) from exc
    return tiktoken


class TikTokenTokenizer(Tokenizer):
    """BPE ranks from a tiktoken file; 256 special tokens follow them (BOS = n, EOS = n + 1)."""

    def __init__(self, model_path: str, add_bos: bool = True, add_eos: bool = True) -> None:
        tiktoken = _import_tiktoken()
        import fsspec

        with fsspec.open(model_path, "rb") as f:
            ranks = _parse_bpe_ranks(f.read())
        n = len(ranks)
        names = _NAMED_SPECIAL + [
            f"<|reserved_special_token_{i}|>"
            for i in range(NUM_SPECIAL_TOKENS - len(_NAMED_SPECIAL))
        ]
        self.model_path = model_path
        self.encoding = tiktoken.Encoding(
            name=model_path,
            pat_str=LLAMA3_PATTERN,
            mergeable_ranks=ranks,
            special_tokens={name: n + i for i, name in enumerate(names)},
        )
        self.n_words = n + NUM_SPECIAL_TOKENS
        self.n_ordinary = n
        self.bos_id, self.eos_id = n, n + 1
        self.add_bos, self.add_eos = add_bos, add_eos

    def get_vocab_size(self) -> int:
        return self.n_words

    def encode(
        self, text: str, add_bos: bool | None = None, add_eos: bool | None = None
    ) -> list[int]:
        chunks = [text[i : i + _CHUNK_CHARS] for i in range(0, len(text), _CHUNK_CHARS)]
        ids = [i for part in self.encoding.encode_ordinary_batch(chunks) for i in part]
        if self.add_bos if add_bos is None else add_bos:
            ids.insert(0, self.bos_id)
        if self.add_eos if add_eos is None else add_eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, token_ids: Sequence[int]) -> str:
        ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        return self.encoding.decode(ids[ids < self.n_ordinary].tolist())


def _parse_bpe_ranks(contents: bytes) -> dict[bytes, int]:
    """tiktoken's `.tiktoken` format: one `base64(token) rank` per line."""
    import base64

    ranks: dict[bytes, int] = {}
    for line in contents.splitlines():
        if line.strip():
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks
