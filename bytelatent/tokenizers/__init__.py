"""Tokenizers: BLT bytes (+ optional BPE delimiters), SentencePiece and tiktoken."""

from bytelatent.tokenizers.args import TokenizerArgs
from bytelatent.tokenizers.base import Tokenizer
from bytelatent.tokenizers.blt import BltTokenizer

__all__ = ["BltTokenizer", "Tokenizer", "TokenizerArgs"]
