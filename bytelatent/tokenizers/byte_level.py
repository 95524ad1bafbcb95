"""GPT-2's byte-level alphabet: the printable character that stands for each byte in byte-level
BPE vocabularies (HF's ByteLevel pre-tokenizer). Our HF tokenizer export writes it; byteify's
distillation reads a teacher's vocabulary through it."""

from __future__ import annotations


def byte_to_unicode() -> dict[int, str]:
    """Byte -> its printable stand-in character (the 188 printable bytes map to themselves, the
    rest to 256, 257, ... in byte order)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {byte: chr(c) for byte, c in zip(printable, chars)}
