"""The tokenizer interface shared by the byte (BLT), SentencePiece and tiktoken tokenizers."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import numpy as np


class Tokenizer(ABC):
    """Text <-> token ids, plus the byte count that bits-per-byte divides by."""

    bos_id: int
    eos_id: int

    @abstractmethod
    def encode(
        self, text: str, add_bos: bool | None = None, add_eos: bool | None = None
    ) -> list[int]:
        """Token ids of `text` (BOS/EOS per the tokenizer's defaults unless given)."""

    @abstractmethod
    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of `token_ids`; special tokens are dropped."""

    @abstractmethod
    def get_vocab_size(self) -> int:
        """Number of ids the model's embedding and output layers need."""

    def encode_array(self, text: str, strict: bool = False, dtype=np.int64) -> np.ndarray:
        """`encode(text)` as an array of `dtype` (one that holds every id: `token_dtype`);
        `strict` raises UnicodeEncodeError on unpaired surrogates."""
        if strict:
            text.encode("utf-8")
        return np.asarray(self.encode(text), dtype=dtype)

    def token_dtype(self) -> np.dtype:
        """The smallest integer dtype that holds every id (the data pipeline keeps documents in
        it: 2 bytes per byte-token instead of 8)."""
        return np.dtype(np.int16 if self.get_vocab_size() <= np.iinfo(np.int16).max else np.int32)

    def n_bytes(self, target_ids: np.ndarray, mask: np.ndarray | None = None) -> int:
        """Number of bytes the targets stand for: UTF-8 bytes of their text plus one per BOS/EOS.

        This is the denominator of bits-per-byte for subword tokenizers; the byte tokenizer
        overrides it with the count of unmasked targets.
        """
        ids = np.asarray(target_ids)
        if ids.ndim == 1:
            ids = ids[None]
        keep = (
            np.ones(ids.shape, dtype=bool)
            if mask is None
            else np.asarray(mask, dtype=bool).reshape(ids.shape)
        )
        total = 0
        for row, row_keep in zip(ids, keep):
            kept = row[row_keep]
            special = np.isin(kept, [self.bos_id, self.eos_id])
            total += int(special.sum())
            total += len(self.decode(kept[~special].tolist()).encode("utf-8"))
        return total
