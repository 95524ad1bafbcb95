"""Tokenize documents and (optionally) patch each one: on numpy (patch_rules), or with the
Patcher (torch) when patching needs a model or top-k (`PatcherArgs.needs_torch`).

Patches are computed per document with `include_next_token=False`, so a document's patch lengths
sum to its number of tokens. In entropy mode the entropies stored with the document (one per
token, BOS and EOS included) are used; a document without them is an error unless the patcher
computes entropies itself (`realtime_patching`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Literal

import numpy as np
from pydantic import Field

from bytelatent.data.chat import encode_conversation
from bytelatent.data.iterators.base import IteratorState, StatefulIterator
from bytelatent.data.iterators.file import (
    Document,
    FileIteratorState,
    LoopingIteratorState,
)
from bytelatent.data.patch_rules import patch_document
from bytelatent.data.patcher_args import PatcherArgs, PatchingMode
from bytelatent.errors import DataError
from bytelatent.tokenizers.args import TokenizerArgs
from bytelatent.tokenizers.blt import BltTokenizer

if TYPE_CHECKING:
    from bytelatent.data.patcher import Patcher

logger = logging.getLogger(__name__)

DocumentSourceState = Annotated[
    FileIteratorState | LoopingIteratorState, Field(discriminator="type")
]


class _NoTokens(Exception):
    pass


@dataclass
class TokenizedDocument:
    tokens: np.ndarray  # [n], the tokenizer's compact dtype (token_dtype)
    patch_lengths: np.ndarray | None  # int64 [p], sums to n; None when not patching
    path: str = ""  # where it was read (for errors)
    row: int = -1
    loss_mask: np.ndarray | None = None  # bool [n]: token i counts as a target; None: all do


class PreprocessIteratorState(IteratorState):
    type: Literal["preprocess"] = "preprocess"
    source: DocumentSourceState
    tokenizer_args: TokenizerArgs = Field(default_factory=TokenizerArgs)
    patcher_args: PatcherArgs | None = None  # None: no patch lengths (byte packing)
    skip_bad_records: bool = False
    n_skipped: int = 0

    def build(self) -> PreprocessIterator:
        return PreprocessIterator(self)


class PreprocessIterator(StatefulIterator[TokenizedDocument]):
    def __init__(self, state: PreprocessIteratorState) -> None:
        self.source = state.source.build()
        self.tokenizer_args = state.tokenizer_args
        self.patcher_args = state.patcher_args
        self.skip_bad_records = state.skip_bad_records
        self.n_skipped = state.n_skipped
        self.tokenizer = state.tokenizer_args.build()
        # documents stay in the smallest dtype of the ids until the batch is built (int64 there)
        self.token_dtype = self.tokenizer.token_dtype()
        self.patcher: Patcher | None = None  # only when patching needs torch (a model, top-k)
        if state.patcher_args is not None and state.patcher_args.needs_torch:
            # Here, not at the top: the other rules run on numpy (patch_rules), and a data-loader
            # worker that needs no torch never imports it.
            from bytelatent.data.patcher import Patcher  # noqa: PLC0415

            self.patcher = Patcher(state.patcher_args)

    def get_state(self) -> PreprocessIteratorState:
        return PreprocessIteratorState(
            source=self.source.get_state(),
            tokenizer_args=self.tokenizer_args,
            patcher_args=self.patcher_args,
            skip_bad_records=self.skip_bad_records,
            n_skipped=self.n_skipped,
        )

    def __next__(self) -> TokenizedDocument:
        while True:
            doc = next(self.source)
            problem = self._problem(doc)
            if problem is None:
                try:
                    return self._process(doc)
                except UnicodeEncodeError as exc:
                    problem = (
                        f"text is not valid Unicode (unpaired surrogate at character {exc.start})"
                    )
                except _NoTokens:
                    problem = "the tokenizer produced no tokens"
            if not self.skip_bad_records:
                raise DataError(
                    f"{doc.path}: row {doc.row}: {problem}; fix the record or set data.skip_bad_records=true"
                )
            self.n_skipped += 1
            logger.warning("skipping %s row %d: %s", doc.path, doc.row, problem)

    @staticmethod
    def _problem(doc: Document) -> str | None:
        if doc.turns is None and not doc.text:
            return "empty text"
        return None

    def _encode(self, doc: Document) -> tuple[np.ndarray, np.ndarray | None]:
        """(tokens, loss mask): a chat record through the chat template (data/chat.py)."""
        if doc.turns is None:
            return self.tokenizer.encode_array(doc.text, strict=True, dtype=self.token_dtype), None
        if not isinstance(self.tokenizer, BltTokenizer) or self.tokenizer.bpe_delim:
            raise DataError(
                "data.chat_template needs the byte tokenizer (tokenizer_args.name=blt, no bpe_delim)"
            )
        tokens, loss_mask = encode_conversation(
            doc.turns, self.tokenizer.add_bos, self.tokenizer.add_eos
        )
        return tokens.astype(self.token_dtype), loss_mask

    def _process(self, doc: Document) -> TokenizedDocument:
        tokens, loss_mask = self._encode(doc)
        if len(tokens) == 0:
            raise _NoTokens
        args = self.patcher_args
        if args is None:
            return TokenizedDocument(tokens, None, doc.path, doc.row, loss_mask)
        entropies = None
        if args.patching_mode == PatchingMode.entropy:
            entropies = self._entropies(doc, len(tokens))
        if self.patcher is None:
            patch_lengths = patch_document(args, tokens, entropies)
        else:
            patch_lengths = self.patcher.patch_document(tokens.astype(np.int64), entropies)
        return TokenizedDocument(tokens, patch_lengths, doc.path, doc.row, loss_mask)

    def _entropies(self, doc: Document, n_tokens: int) -> np.ndarray | None:
        if doc.entropies is None:
            if self.patcher is not None and self.patcher.entropy_model is not None:
                return None  # the patcher runs its entropy model
            raise DataError(
                f"{doc.path}: row {doc.row}: no 'entropies' for patching_mode=entropy; run "
                "apps/preprocess_entropies on this data or set data.patcher_args.patching_mode=space"
            )
        if len(doc.entropies) != n_tokens:
            raise DataError(
                f"{doc.path}: row {doc.row}: {len(doc.entropies)} entropies for {n_tokens} tokens "
                "(one per token incl. BOS/EOS expected); were they computed with another tokenizer?"
            )
        return np.ascontiguousarray(doc.entropies, dtype=np.float32)

    def close(self) -> None:
        self.source.close()
