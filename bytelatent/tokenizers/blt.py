"""The BLT byte tokenizer: byte b -> id b+4, BOS=1 first, EOS=2 last, optional BPE delimiters (id 3).

Ids and the BPE-delimiter rule match the reference BLT (`BltTokenizer`), so data and checkpoints
are interchangeable with it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

from bytelatent.tokenizers.base import Tokenizer
from bytelatent.tokenizers.constants import (
    BOE_ID,
    BOS_ID,
    BPE_ID,
    BYTE_UNITS,
    EOS_ID,
    OFFSET,
    PAD_ID,
)
from bytelatent.tokenizers.sentence_piece import SentencePieceTokenizer

_BYTE_PIECE = re.compile(r"<0x[0-9a-fA-F]+>")
_SP_SPACE = "\u2581"  # SentencePiece's word-boundary marker


def _piece_bytes(piece: str) -> bytes:
    """Bytes of one SentencePiece piece; byte-fallback pieces look like `<0xE2>`."""
    if _BYTE_PIECE.match(piece):
        return bytes.fromhex(piece[3:-1])
    return piece.encode("utf-8", errors="ignore")


def _bpe_delimited_bytes(text: str, pieces: list[str]) -> list[int]:
    """Bytes of `text` with BPE_ID - OFFSET before every piece (so that +OFFSET gives BPE_ID).

    Leading whitespace pieces are merged into one piece that keeps the text's leading spaces, and
    the marker the SentencePiece normaliser puts before the first word is removed, as the
    reference does.
    """
    n_leading = 0
    while n_leading < len(pieces) and all(c == _SP_SPACE for c in pieces[n_leading]):
        n_leading += 1
    merged = ["".join(pieces[:n_leading])] + pieces[n_leading:]
    strings: list[str] = []
    for i, piece in enumerate(merged):
        only_spaces_so_far = len(strings) <= 1 and all(c == " " for s in strings for c in s)
        if only_spaces_so_far and not all(c == _SP_SPACE for c in piece):
            piece = piece.replace(_SP_SPACE, "")
        elif i == 0 and all(c == _SP_SPACE for c in piece):
            piece = " " * (len(text) - len(text.lstrip(" ")))
        else:
            piece = piece.replace(_SP_SPACE, " ")
        if piece:
            strings.append(piece)
    out: list[int] = []
    for piece in strings:
        out.append(BPE_ID - OFFSET)
        out.extend(_piece_bytes(piece))
    return out


class BltTokenizer(Tokenizer):
    """Byte tokenizer. `bpe_delim=True` inserts id 3 before each piece of a SentencePiece model."""

    def __init__(
        self,
        add_bos: bool = True,
        add_eos: bool = True,
        bpe_delim: bool = False,
        bpe_tokenizer_path: str | None = None,
        vocab_size_unit_1: int = BYTE_UNITS,
    ) -> None:
        if vocab_size_unit_1 != BYTE_UNITS:
            raise ValueError(
                f"vocab_size_unit_1 must be {BYTE_UNITS} (one id per byte), got {vocab_size_unit_1}"
            )
        self.add_bos = add_bos
        self.add_eos = add_eos
        self.bpe_delim = bpe_delim
        self.bpe_tokenizer_path = bpe_tokenizer_path
        self.boe_id, self.bos_id, self.eos_id, self.bpe_id, self.pad_id = (
            BOE_ID,
            BOS_ID,
            EOS_ID,
            BPE_ID,
            PAD_ID,
        )
        self.offset = OFFSET
        self._sp = None
        if bpe_delim:
            if not bpe_tokenizer_path:
                raise ValueError(
                    "bpe_delim=true needs bpe_tokenizer_path (a SentencePiece .model file)"
                )
            self._sp = SentencePieceTokenizer(bpe_tokenizer_path, add_bos=False, add_eos=False)

    def get_vocab_size(self) -> int:
        return BYTE_UNITS + OFFSET

    def _raw_bytes(self, text: str, errors: str) -> bytes | list[int]:
        if self._sp is None:
            return text.encode("utf-8", errors=errors)
        if errors == "strict":
            text.encode("utf-8")
        return _bpe_delimited_bytes(text, self._sp.pieces(text))

    def encode(
        self, text: str, add_bos: bool | None = None, add_eos: bool | None = None
    ) -> list[int]:
        """Reference behaviour: invalid code points (unpaired surrogates) are dropped."""
        ids = [b + OFFSET for b in self._raw_bytes(text, "ignore")]
        if self.add_bos if add_bos is None else add_bos:
            ids.insert(0, BOS_ID)
        if self.add_eos if add_eos is None else add_eos:
            ids.append(EOS_ID)
        return ids

    def encode_array(self, text: str, strict: bool = False, dtype=np.int64) -> np.ndarray:
        raw = self._raw_bytes(text, "strict" if strict else "ignore")
        body = (
            np.frombuffer(raw, dtype=np.uint8)
            if isinstance(raw, bytes)
            else np.asarray(raw, dtype=np.int64)
        )
        start = 1 if self.add_bos else 0
        out = np.empty(len(body) + start + (1 if self.add_eos else 0), dtype=dtype)
        if self.add_bos:
            out[0] = BOS_ID
        out[start : start + len(body)] = body
        out[start : start + len(body)] += OFFSET
        if self.add_eos:
            out[-1] = EOS_ID
        return out

    def decode(self, token_ids: Sequence[int], cut_at_eos: bool = False) -> str:
        """Drops special ids (< 4); stops after the first EOS when `cut_at_eos`."""
        ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        if cut_at_eos:
            eos = np.flatnonzero(ids == EOS_ID)
            if len(eos):
                ids = ids[: eos[0] + 1]
        body = ids[(ids >= OFFSET) & (ids < OFFSET + BYTE_UNITS)] - OFFSET
        return body.astype(np.uint8).tobytes().decode("utf-8", errors="ignore")

    def n_bytes(self, target_ids: np.ndarray, mask: np.ndarray | None = None) -> int:
        """Every unmasked target is one byte (BOS, EOS and BPE delimiters included), as in the reference."""
        if mask is None:
            return int((np.asarray(target_ids) != BOE_ID).sum())
        return int(np.asarray(mask, dtype=bool).sum())
