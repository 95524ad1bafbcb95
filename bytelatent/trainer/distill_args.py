"""The `distill` section: a frozen token-level teacher whose next-token distributions the byte
model learns to reproduce (byteify stage 1, issue 42; docs/byteify.md). Torch-free: the checks
read the teacher folder's JSON files only, before any model is built."""

from __future__ import annotations

import json
import os
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

TEACHER_FILES = ("config.json", "tokenizer.json")


class DistillArgs(BaseModel):
    """A teacher (a Hugging Face `LlamaForCausalLM` folder with its `tokenizer.json`) and the
    weight of the distillation term `aux/distill` (KL from the teacher's byte-level next-byte
    distribution to the student's, nats per distilled byte)."""

    model_config = ConfigDict(extra="forbid")

    teacher: str = Field(
        ...,
        description="folder with config.json, *.safetensors and tokenizer.json (byte-level BPE) "
        "of the token model byteify starts from",
    )
    weight: float = Field(1.0, ge=0.0, description="weight of aux/distill in the objective")
    temperature: float = Field(1.0, gt=0.0, description="softmax temperature of the teacher")

    @field_validator("teacher")
    @classmethod
    def _non_empty(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("distill.teacher must be a folder (a Hugging Face LlamaForCausalLM)")
        return value

    def teacher_config(self) -> dict[str, Any]:
        with open(os.path.join(self.teacher, "config.json")) as f:
            return json.load(f)

    def tokenizer_vocab_size(self) -> int:
        """Tokens in tokenizer.json: the model vocabulary plus added (special) tokens."""
        with open(os.path.join(self.teacher, "tokenizer.json")) as f:
            tok = json.load(f)
        ids = set(tok.get("model", {}).get("vocab", {}).values())
        ids |= {t["id"] for t in tok.get("added_tokens", [])}
        return max(ids) + 1 if ids else 0

    def mismatches(self, student_width: int | None) -> list[str]:
        """What makes the teacher unusable for this student, one phrase each (empty: it fits).
        Read when the run starts, not when the config is parsed: a shipped config names a
        teacher folder a fresh clone makes later (scripts/train_token_teacher.py)."""
        missing = [f for f in TEACHER_FILES if not os.path.isfile(os.path.join(self.teacher, f))]
        if missing:
            return [
                f"no {' or '.join(missing)} there; give the folder of a Hugging Face "
                "LlamaForCausalLM saved with its tokenizer (scripts/train_token_teacher.py)"
            ]
        cfg = self.teacher_config()
        problems = []
        if "LlamaForCausalLM" not in cfg.get("architectures", ["LlamaForCausalLM"]):
            problems.append(f"architectures={cfg.get('architectures')} (need LlamaForCausalLM)")
        n_tokens, vocab = self.tokenizer_vocab_size(), cfg.get("vocab_size")
        if not isinstance(vocab, int) or vocab < n_tokens:
            problems.append(
                f"vocab_size={vocab} but tokenizer.json has {n_tokens} tokens (the teacher "
                "cannot score every token of its tokenizer)"
            )
        width = cfg.get("hidden_size")
        if student_width is not None and width != student_width:
            problems.append(
                f"hidden_size={width} but the student's global transformer is {student_width} "
                "wide (model.dim): byteify keeps the teacher's backbone"
            )
        return problems
