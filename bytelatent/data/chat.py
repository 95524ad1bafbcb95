"""The byte-level chat template and chat records: the one definition that training, generation
(`python -m bytelatent.generate mode=chat`) and the lm-eval harness all use (docs/sft.md).

A conversation is a list of turns (role, content). It becomes the token row

    BOS  <role> content <end>  <role> content <end>  ...  EOS

where `<role>` is one of three marker ids (system, user, assistant) and `<end>` closes a turn.
The markers are the ids of bytes that never occur in UTF-8 text (0xF8..0xFB: no UTF-8 sequence
uses them), so no text can forge a turn, the vocabulary stays the BLT's 260 ids and a pretrained
checkpoint fine-tunes without a resized embedding.

Loss mask: a target counts when it is an assistant turn's content byte or that turn's `<end>`
(the model learns to answer and to stop); BOS, every role marker, system and user turns and the
final EOS are context only.

Boundaries: a patch (BLT) or chunk (H-Net) starts right after every marker (`turn_starts`), so
the marker that opens a turn starts a patch of its own (it follows the previous turn's `<end>`)
and the turn's content starts the next one: no patch spans two turns. The rule looks only at the
previous token, so generation decides it online exactly as training did.

Text form (`render_chat`, `text_tokens`): interfaces that carry prompts as Python strings (the
lm-eval harness's `apply_chat_template`) write each marker as a private-use character
(U+F00F8..U+F00FB, the marker's byte + 0xF0000); `text_tokens` maps those characters back to
the marker ids, so the harness scores and generates exactly the rows training saw.

Records (`conversation_of`): `{"messages": [{"role", "content"}, ...]}`, `{"prompt",
"response"}` (also `completion`) and `{"instruction", "input", "output"}` (Alpaca: instruction
and input joined by a blank line as the user turn). A record that is not one of these, has an
unknown role, no turns, an empty or non-string content, or no assistant turn with content, is a
`BadConversation` naming the problem (one line, or a counted skip with data.skip_bad_records).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from bytelatent.tokenizers.constants import BOS_ID, EOS_ID, OFFSET

TEMPLATE_NAME = "bytelatent-chat-v1"  # stored in the run's config (data.chat_template)
ROLES = ("system", "user", "assistant")
ROLE_BYTES = {"system": 0xF8, "user": 0xF9, "assistant": 0xFA}  # never valid in UTF-8
END_BYTE = 0xFB
ROLE_IDS = {role: byte + OFFSET for role, byte in ROLE_BYTES.items()}
END_ID = END_BYTE + OFFSET
MARKER_IDS = np.array(sorted([*ROLE_IDS.values(), END_ID]), dtype=np.int64)

Turn = tuple[str, str]  # (role, content)
MARKER_CHAR_BASE = 0xF0000  # marker byte b is written as chr(MARKER_CHAR_BASE + b) in text form


class BadConversation(ValueError):
    """A chat record that cannot be trained on (the reader makes it a BadRecord with its row)."""


def is_marker(tokens: np.ndarray) -> np.ndarray:
    """Bool mask of the chat-template marker ids in `tokens` (any shape)."""
    return np.isin(tokens, MARKER_IDS)


def turn_starts(tokens: np.ndarray, length: int) -> np.ndarray:
    """[B, length] bool: position p starts a patch/chunk because token p - 1 is a marker
    (`tokens` [B, N], length N or N + 1 with the next token)."""
    starts = np.zeros((tokens.shape[0], length), dtype=bool)
    if length > 1:
        starts[:, 1:] = is_marker(tokens[:, : length - 1])
    return starts


def _content_ids(content: str) -> np.ndarray:
    return np.frombuffer(content.encode("utf-8"), dtype=np.uint8).astype(np.int64) + OFFSET


def encode_conversation(
    turns: list[Turn], add_bos: bool = True, add_eos: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """(tokens int64 [n], loss_mask bool [n]); loss_mask[i] says whether tokens[i] is a target
    that counts (an assistant content byte or its turn's end marker)."""
    parts: list[np.ndarray] = []
    weights: list[np.ndarray] = []
    if add_bos:
        parts.append(np.array([BOS_ID], dtype=np.int64))
        weights.append(np.zeros(1, dtype=bool))
    for role, content in turns:
        body = _content_ids(content)
        parts += [np.array([ROLE_IDS[role]]), body, np.array([END_ID])]
        answer = role == "assistant"
        weights += [np.zeros(1, bool), np.full(len(body), answer), np.array([answer])]
    if add_eos:
        parts.append(np.array([EOS_ID], dtype=np.int64))
        weights.append(np.zeros(1, dtype=bool))
    return np.concatenate(parts).astype(np.int64), np.concatenate(weights)


def encode_chat_prompt(turns: list[Turn]) -> list[int]:
    """The row generation continues: BOS, the turns so far, then the assistant marker (the
    answer's bytes and its end marker are what the model produces)."""
    tokens, _ = encode_conversation(turns, add_bos=True, add_eos=False)
    return [*tokens.tolist(), ROLE_IDS["assistant"]]


def answer_of(generated: list[int]) -> tuple[bytes, bool]:
    """(the answer's bytes, whether it was closed by the end marker) from generated ids."""
    data = bytearray()
    for token in generated:
        if token == END_ID:
            return bytes(data), True
        if OFFSET <= token < OFFSET + 256 and token not in ROLE_IDS.values():
            data.append(token - OFFSET)
        elif token in (EOS_ID, *ROLE_IDS.values()):
            break
    return bytes(data), False


def _marker_char(token: int) -> str:
    return chr(MARKER_CHAR_BASE + token - OFFSET)


def render_chat(turns: list[Turn], add_generation_prompt: bool = True) -> str:
    """The template in text form (markers as private-use characters), without BOS/EOS: what
    `text_tokens` turns back into `encode_chat_prompt`'s row (minus its BOS)."""
    parts = [
        _marker_char(ROLE_IDS[role]) + content + _marker_char(END_ID) for role, content in turns
    ]
    if add_generation_prompt:
        parts.append(_marker_char(ROLE_IDS["assistant"]))
    return "".join(parts)


_CHAR_TO_ID = {_marker_char(int(t)): int(t) for t in MARKER_IDS}


def has_markers(text: str) -> bool:
    """Whether `text` holds template markers in text form."""
    return any(ch in text for ch in _CHAR_TO_ID)


def text_tokens(text: str) -> list[int]:
    """Byte ids of `text`, with the template's text-form markers as their marker ids."""
    if not has_markers(text):
        return [b + OFFSET for b in text.encode("utf-8")]
    out: list[int] = []
    for ch in text:
        marker = _CHAR_TO_ID.get(ch)
        if marker is not None:
            out.append(marker)
        else:
            out.extend(b + OFFSET for b in ch.encode("utf-8"))
    return out


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise BadConversation(f"{where} must be a string, got {type(value).__name__}")
    return value


def _messages(messages: Any) -> list[Turn]:
    if not isinstance(messages, list) or not messages:
        raise BadConversation("'messages' must be a non-empty list of {role, content} objects")
    turns = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise BadConversation(f"messages[{index}] must be an object with 'role' and 'content'")
        role = message["role"]
        if role not in ROLES:
            raise BadConversation(
                f"messages[{index}]: unknown role {role!r} (expected one of {', '.join(ROLES)})"
            )
        turns.append((role, _text(message["content"], f"messages[{index}].content")))
    return turns


def conversation_of(record: dict) -> list[Turn]:
    """The turns of a chat record in any supported shape; BadConversation says why not."""
    if "messages" in record:
        turns = _messages(record["messages"])
    elif "prompt" in record and ("response" in record or "completion" in record):
        answer = record.get("response", record.get("completion"))
        turns = [("user", _text(record["prompt"], "'prompt'")), ("assistant", _text(answer, "'response'"))]  # fmt: skip
    elif "instruction" in record and "output" in record:
        user = _text(record["instruction"], "'instruction'")
        extra = record.get("input") or ""
        if extra:
            user = user + "\n\n" + _text(extra, "'input'")
        turns = [("user", user), ("assistant", _text(record["output"], "'output'"))]
    else:
        raise BadConversation(
            "not a chat record: expected 'messages', 'prompt' + 'response', or 'instruction' + "
            f"'output' (keys: {', '.join(sorted(record)) or 'none'})"
        )
    if not any(role == "assistant" and content for role, content in turns):
        raise BadConversation("no answer: the conversation has no assistant turn with content")
    return turns
