"""A Hugging Face byte-level BPE (`tokenizer.json`) read without torch: its vocabulary as byte
strings and where its tokens start in a text's bytes.

Byteify uses it twice: the distillation targets (`bytelatent/trainer/distill.py`) spell the
teacher's tokens byte by byte, and `patching_mode=tokenizer` (`bytelatent/data/patch_rules.py`,
in data-loader workers) starts a patch at each of the teacher's token starts. `tokenizers` is
imported when a tokenizer is loaded, not with this module.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

import numpy as np

from bytelatent.errors import ConfigError
from bytelatent.tokenizers.byte_level import byte_to_unicode


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


def token_boundaries(token_ids: Sequence[int], vocab: Sequence[bytes]) -> list[int]:
    """The byte offset at which each token starts (the teacher tokenizer's patch boundaries)."""
    starts, offset = [], 0
    for token in token_ids:
        starts.append(offset)
        offset += len(vocab[int(token)])
    return starts


def tokenizer_json(path: str) -> str:
    """`path` itself when it is a file, else `path/tokenizer.json`; a config error when absent."""
    file = path if os.path.isfile(path) else os.path.join(path, "tokenizer.json")
    if not os.path.isfile(file):
        raise ConfigError(
            f"data.patcher_args.tokenizer_path={path}: no tokenizer.json there; give a Hugging Face tokenizer "
            "folder or its tokenizer.json (e.g. hf/stdlib-teacher)"
        )
    return file


class ByteLevelBPE:
    """A loaded byte-level BPE: `token_starts(data)` gives the byte offsets of its tokens.

    For patching, a special (added) token found in the text (`<s>` written in a document) stands
    for its own bytes, so the tokens of any text spell it exactly unless a normalizer changed
    the text (`token_starts` then returns None and the caller falls back).
    """

    PROBE = "def f(x):\n    return 'héllo wörld ☃' + x  # 2 spaces\n"

    def __init__(self, path: str) -> None:
        file = tokenizer_json(path)
        try:
            from tokenizers import Tokenizer  # noqa: PLC0415
        except ImportError:
            raise ConfigError(
                "patching_mode=tokenizer needs the tokenizers package: pip install tokenizers"
            ) from None
        try:
            self.tokenizer = Tokenizer.from_file(file)
        except Exception as exc:  # noqa: BLE001 (the library raises a bare Exception)
            raise ConfigError(
                f"data.patcher_args.tokenizer_path={path}: {file} is not a tokenizer: {exc}"
            ) from None
        try:
            vocab = byte_level_vocab(self.tokenizer)
        except ValueError as exc:
            raise ConfigError(f"data.patcher_args.tokenizer_path={path}: {exc}") from None
        for added in self.tokenizer.get_added_tokens_decoder().values():
            if added.special:
                vocab[self.tokenizer.token_to_id(added.content)] = added.content.encode()
        self.lengths = np.array([len(token) for token in vocab], dtype=np.int64)
        self.vocab = vocab
        if self.token_starts(self.PROBE.encode()) is None:
            raise ConfigError(
                f"data.patcher_args.tokenizer_path={path}: its tokens do not spell the text they encode (a "
                "normalizer or add_prefix_space changes it); patching_mode=tokenizer needs a "
                "tokenizer whose tokens are the text's bytes"
            )

    def token_starts(self, data: bytes) -> np.ndarray | None:
        """int64 byte offsets where the tokens of `data` (valid UTF-8) start, or None when the
        tokens do not spell `data` (a normalizer changed it)."""
        ids = self.tokenizer.encode(data.decode("utf-8"), add_special_tokens=False).ids
        lengths = self.lengths[np.asarray(ids, dtype=np.int64)]
        if int(lengths.sum()) != len(data) or b"".join(self.vocab[i] for i in ids) != data:
            return None
        starts = np.cumsum(lengths) - lengths
        return starts[lengths > 0]


@functools.lru_cache(maxsize=4)
def load_byte_level_bpe(path: str) -> ByteLevelBPE:
    """The tokenizer at `path`, loaded once per process (each data-loader worker loads its own)."""
    return ByteLevelBPE(path)
