"""The default corpus: the running Python's standard-library sources, one document per .py file.

Needs no download, is a few MB of real text (code, docstrings, comments), and is the same on
every machine with the same Python. Selection and the train/validation split depend only on each
file's path relative to the stdlib directory, so they are deterministic.
"""

from __future__ import annotations

import os
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

# Third-party code and generated caches are not the standard library.
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


@dataclass(frozen=True)
class CorpusDocument:
    sample_id: str  # path relative to the stdlib directory, with '/' separators
    text: str


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _stable_hash(name: str) -> int:
    return zlib.crc32(name.encode("utf-8"))


def stdlib_documents(max_bytes: int = 8_000_000, root: Path | None = None) -> list[CorpusDocument]:
    """Up to `max_bytes` of UTF-8 .py sources, sorted by path.

    Files are taken in a pseudo-random but fixed order (a hash of the path) until the budget is
    used, so the sample spans the whole library rather than the first letters of the alphabet.
    """
    root = root or stdlib_dir()
    candidates: list[tuple[str, Path]] = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in _SKIP_DIRS)
        for name in files:
            if name.endswith(".py"):
                path = Path(directory) / name
                candidates.append((path.relative_to(root).as_posix(), path))
    candidates.sort(key=lambda item: (_stable_hash(item[0]), item[0]))
    chosen: list[CorpusDocument] = []
    used = 0
    for rel, path in candidates:
        try:
            raw = path.read_bytes()
            text = raw.decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue  # unreadable or not UTF-8 (a few test fixtures): not useful text
        if not text.strip() or used + len(raw) > max_bytes:
            continue
        chosen.append(CorpusDocument(sample_id=rel, text=text))
        used += len(raw)
    return sorted(chosen, key=lambda doc: doc.sample_id)


def is_validation(sample_id: str, val_fraction: float) -> bool:
    """Deterministic split by path hash (about `val_fraction` of the documents)."""
    return (_stable_hash(sample_id) % 10_000) < val_fraction * 10_000


def split_documents(
    docs: list[CorpusDocument], val_fraction: float = 0.05
) -> tuple[list[CorpusDocument], list[CorpusDocument]]:
    """(train, validation), both in path order."""
    train = [d for d in docs if not is_validation(d.sample_id, val_fraction)]
    val = [d for d in docs if is_validation(d.sample_id, val_fraction)]
    return train, val
