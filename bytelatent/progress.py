"""Progress bars for long command-line jobs: tqdm on a terminal (or when asked), silent otherwise.

`--progress auto` (the default) shows a bar only when stderr is a terminal, so logs of batch jobs
and test output stay clean; `on` forces it (a SLURM log then gets tqdm's updates); `off` never.
Without tqdm installed (`pip install 'bytelatent[progress]'`) an enabled bar degrades to a line
on stderr every 30 s.
"""

from __future__ import annotations

import sys
import time
from typing import Literal

ProgressMode = Literal["auto", "on", "off"]
PROGRESS_MODES = ("auto", "on", "off")
_FALLBACK_EVERY_S = 30.0


def progress_enabled(mode: ProgressMode) -> bool:
    if mode not in PROGRESS_MODES:
        raise ValueError(f"progress mode {mode!r}: expected one of {', '.join(PROGRESS_MODES)}")
    if mode == "auto":
        return bool(getattr(sys.stderr, "isatty", lambda: False)())
    return mode == "on"


class Progress:
    """`update(n)` / `close()` (also a context manager); does nothing when disabled."""

    def __init__(
        self,
        description: str,
        *,
        total: int | None = None,
        unit: str = "it",
        unit_scale: bool = False,
        mode: ProgressMode = "auto",
    ) -> None:
        self.description = description
        self.unit = unit
        self.enabled = progress_enabled(mode)
        self.count = 0
        self.started = self.last_print = time.monotonic()
        self.bar = None
        if self.enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                return
            self.bar = tqdm(
                desc=description, total=total, unit=unit, unit_scale=unit_scale, file=sys.stderr
            )

    def update(self, n: int = 1) -> None:
        self.count += n
        if self.bar is not None:
            self.bar.update(n)
        elif self.enabled and time.monotonic() - self.last_print >= _FALLBACK_EVERY_S:
            self.last_print = time.monotonic()
            rate = self.count / max(self.last_print - self.started, 1e-9)
            print(f"{self.description}: {self.count} {self.unit} ({rate:.1f}/s)", file=sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
