"""`TokenizerArgs`: which tokenizer a run uses (`blt`/`bytes`, `sp`, `tiktoken`) and its kwargs."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from bytelatent.errors import ConfigError
from bytelatent.tokenizers.base import Tokenizer
from bytelatent.tokenizers.blt import BltTokenizer
from bytelatent.tokenizers.sentence_piece import SentencePieceTokenizer
from bytelatent.tokenizers.tiktoken_tokenizer import TikTokenTokenizer

TokenizerName = Literal["blt", "bytes", "sp", "tiktoken"]


class TokenizerArgs(BaseModel):
    """`bytes` is an alias of `blt` (the reference's default name)."""

    model_config = ConfigDict(extra="forbid")

    name: TokenizerName = Field(
        "blt",
        description="blt (or its alias bytes): UTF-8 bytes + 4; sp: SentencePiece; tiktoken: BPE",
    )
    init_kwargs: dict[str, Any] | None = Field(
        None,
        description="keyword arguments of the tokenizer's constructor (sp/tiktoken: model_path; "
        "blt: bpe_delim, bpe_tokenizer_path; add_bos/add_eos override data.add_bos/add_eos)",
    )

    def build(self) -> Tokenizer:
        kwargs = dict(self.init_kwargs or {})
        try:
            if self.name in ("blt", "bytes"):
                return BltTokenizer(**kwargs)
            if self.name == "sp":
                return SentencePieceTokenizer(**kwargs)
            return TikTokenTokenizer(**kwargs)
        except TypeError as exc:
            raise ConfigError(
                f"tokenizer_args.init_kwargs: {exc} (tokenizer '{self.name}')"
            ) from exc
        except ValueError as exc:
            raise ConfigError(f"tokenizer_args.init_kwargs: {exc}") from exc
        except FileNotFoundError as exc:
            raise ConfigError(
                f"tokenizer_args.init_kwargs: model file not found: {exc.filename or exc}"
            ) from exc
