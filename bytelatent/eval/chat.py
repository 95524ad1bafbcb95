"""Chat generation with the template a run was trained with, and the `chat` eval task (exact
match of generated answers over held-out conversations), in the loop and standalone.

    eval:
      tasks: [bpb, chat]
      task_args:
        chat: {file: data/sft_synth/eval.jsonl, limit: 200, max_new_bytes: 32}

A file of the task holds chat records (any shape `data/chat.py` reads); a record's last assistant
turn is the reference and the turns before it are the prompt. Metrics: `chat/exact_match` (the
answer, closed by the end-of-turn marker, equals the reference byte for byte), `chat/template`
(the share of answers closed by the end-of-turn marker before `max_new_bytes`) and `chat/n`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from bytelatent.data.chat import (
    END_ID,
    TEMPLATE_NAME,
    BadConversation,
    Turn,
    answer_of,
    conversation_of,
    encode_chat_prompt,
)
from bytelatent.errors import ConfigError, DataError
from bytelatent.eval.generation import GenerationArgs, Generator
from bytelatent.eval.tasks import EvalContext, register_task
from bytelatent.model.registry import arch_of


@dataclass
class ChatAnswer:
    text: str  # the answer's bytes as text (invalid UTF-8 replaced)
    data: bytes
    closed: bool  # ended by the template's end-of-turn marker (it followed the template)
    finish_reason: str


def chat_template_of(params: dict) -> str | None:
    """The chat template a checkpoint's run was trained with (its data.chat_template), or None."""
    return ((params or {}).get("data") or {}).get("chat_template")


def check_template(name: str | None, where: str) -> None:
    """Chat generation needs a run trained with this code's template."""
    if name is None:
        raise ConfigError(
            f"{where}: the run was not trained on chat data (data.chat_template is not set); "
            "fine-tune it first (docs/sft.md) or use mode=complete"
        )
    if name != TEMPLATE_NAME:
        raise ConfigError(f"{where}: chat template {name!r} is unknown here (this code has {TEMPLATE_NAME!r})")  # fmt: skip


def generate_answers(
    generator: Generator, conversations: list[list[Turn]], args: GenerationArgs
) -> list[ChatAnswer]:
    """The assistant's next turn for each conversation (the template of data/chat.py)."""
    stop_ids = sorted({*args.stop_ids, END_ID})
    args = args.model_copy(update={"stop_ids": stop_ids})
    rows = [encode_chat_prompt(turns) for turns in conversations]
    too_long = [i for i, row in enumerate(rows) if len(row) > generator.max_tokens - 1]
    if too_long:
        raise DataError(
            f"conversation {too_long[0]} has {len(rows[too_long[0]])} tokens with the template; "
            f"the model takes at most {generator.max_tokens - 1}"
        )
    answers: list[ChatAnswer] = []
    for first in range(0, len(rows), args.batch_size):
        for result in generator.generate_tokens(rows[first : first + args.batch_size], args):
            data, closed = answer_of(result.tokens)
            text = data.decode("utf-8", errors="replace")
            answers.append(ChatAnswer(text, data, closed, result.finish_reason))
    return answers


def read_examples(path: str, limit: int | None = None) -> list[tuple[list[Turn], str]]:
    """(prompt turns, reference answer) of each record of a chat JSONL file."""
    if not Path(path).is_file():
        raise DataError(f"{path}: chat eval file does not exist")
    examples = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                turns = conversation_of(json.loads(line))
            except (json.JSONDecodeError, AttributeError, TypeError) as exc:
                raise DataError(f"{path}:{number}: not a JSON object ({exc})") from None
            except BadConversation as exc:
                raise DataError(f"{path}:{number}: {exc}") from None
            last = max(i for i, (role, _) in enumerate(turns) if role == "assistant")
            examples.append((turns[:last], turns[last][1]))
            if limit is not None and len(examples) >= limit:
                break
    if not examples:
        raise DataError(f"{path}: no examples")
    return examples


def exact_match(
    generator: Generator, examples: list[tuple[list[Turn], str]], args: GenerationArgs
) -> dict[str, float]:
    """Greedy answers to `examples`: exact match and template-following rates."""
    answers = generate_answers(generator, [turns for turns, _ in examples], args)
    right = sum(a.closed and a.text == ref for a, (_, ref) in zip(answers, examples))
    closed = sum(a.closed for a in answers)
    n = len(examples)
    return {"chat/exact_match": right / n, "chat/template": closed / n, "chat/n": float(n)}


class ChatTaskArgs(BaseModel):
    """eval.task_args.chat.*"""

    model_config = ConfigDict(extra="forbid")

    file: str = Field(..., description="held-out chat records (JSONL); the last answer is the reference")  # fmt: skip
    limit: int | None = Field(None, ge=1, description="examples to use; null: all")
    max_new_bytes: int = Field(64, ge=1, description="longest answer generated")
    batch_size: int = Field(16, ge=1, description="conversations generated together")


def _generator(ctx: EvalContext) -> Generator:
    model: nn.Module = ctx.model
    spec = arch_of(model)
    patcher_args = None
    if spec is not None and spec.patched:
        patcher_args = ctx.data_args.patcher_args.model_copy(
            update={"patching_device": "auto", "device": "auto", "realtime_patching": False}
        )
    return Generator(model, patcher_args)


def chat_eval_task(ctx: EvalContext) -> dict[str, float]:
    """The `chat` eval task: every rank generates the same answers (FSDP needs every rank in
    every forward); the model's requires_grad flags are restored for the training loop."""
    check_template(ctx.data_args.chat_template, "eval.tasks: chat")
    args: ChatTaskArgs = ctx.task_args
    examples = read_examples(args.file, args.limit)
    flags = [(p, p.requires_grad) for p in ctx.model.parameters()]
    try:
        gen_args = GenerationArgs(
            max_new_bytes=args.max_new_bytes, temperature=0.0, batch_size=args.batch_size
        )
        with torch.no_grad():
            return exact_match(_generator(ctx), examples, gen_args)
    finally:
        for param, flag in flags:
            param.requires_grad_(flag)


register_task("chat", chat_eval_task, args_model=ChatTaskArgs)
