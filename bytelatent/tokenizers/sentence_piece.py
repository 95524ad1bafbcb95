"""SentencePiece tokenizer (optional dependency `sentencepiece`, imported on first use)."""

from __future__ import annotations

from collections.abc import Sequence

from bytelatent.errors import ConfigError
from bytelatent.tokenizers.base import Tokenizer


def _import_sentencepiece():
    try:
        import sentencepiece
    except ImportError as exc:
        raise ConfigError(
            "tokenizer_args: the 'sp' tokenizer (and bpe_delim) needs the sentencepiece package; "
            "run `pip install sentencepiece`"
        ) from exc
    return sentencepiece


class SentencePieceTokenizer(Tokenizer):
    """Ids come from the model file; BOS/EOS are the model's."""

    def __init__(self, model_path: str, add_bos: bool = True, add_eos: bool = True) -> None:
        spm = _import_sentencepiece()
        import fsspec

        with fsspec.open(model_path, "rb") as f:
            proto = f.read()
        self.model_path = model_path
        self.sp_model = spm.SentencePieceProcessor(model_proto=proto)
        self.add_bos = add_bos
        self.add_eos = add_eos
        self.bos_id = self.sp_model.bos_id()
        self.eos_id = self.sp_model.eos_id()
        self.pad_id = self.sp_model.pad_id()

    def get_vocab_size(self) -> int:
        return self.sp_model.vocab_size()

    def encode(
        self, text: str, add_bos: bool | None = None, add_eos: bool | None = None
    ) -> list[int]:
        ids = list(self.sp_model.encode(text))
        if self.add_bos if add_bos is None else add_bos:
            ids.insert(0, self.bos_id)
        if self.add_eos if add_eos is None else add_eos:
            ids.append(self.eos_id)
        return ids

    def pieces(self, text: str) -> list[str]:
        """The model's pieces of `text` (no BOS/EOS)."""
        return [self.sp_model.id_to_piece(i) for i in self.sp_model.encode(text)]

    def decode(self, token_ids: Sequence[int]) -> str:
        special = {self.bos_id, self.eos_id, self.pad_id}
        return self.sp_model.decode([int(i) for i in token_ids if int(i) not in special])
