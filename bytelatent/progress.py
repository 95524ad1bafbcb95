"""Progress bars for long command-line jobs: tqdm on a terminal (or when asked), silent otherwise.

`--progress auto` (the default) shows a bar when stderr is a terminal and otherwise (a log file,
a pipe) writes one line as the work starts and then one every 30 s, so a long job is never
silent and logs stay short; `on`
forces the bar (a SLURM log then gets tqdm's updates); `off` prints nothing. Without tqdm
installed (`pip install 'bytelatent[progress]'`) a bar degrades to those lines. `lines` (for
library callers such as the in-loop evaluation) writes only the lines.
"""

from __future__ import annotations

import sys
import time
from typing import Literal

ProgressMode = Literal["auto", "on", "off", "lines"]
PROGRESS_MODES = ("auto", "on", "off")  # the command-line choices
LINE_EVERY_S = 30.0


def progress_enabled(mode: ProgressMode) -> bool:
    """Whether `mode` shows a bar (tqdm) here."""
    if mode not in (*PROGRESS_MODES, "lines"):
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
        self.lines = self.enabled or mode in ("auto", "lines")  # lines where no bar shows
        self.count = 0
        self.started = self.last_print = time.monotonic()
        self.bar = None
        if mode == "auto" and not self.enabled:  # a command off a terminal: say what starts
            print(f"{description}: started", file=sys.stderr, flush=True)
        if self.enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                print(f"{description}: started", file=sys.stderr, flush=True)
                return
            self.bar = tqdm(
                desc=description, total=total, unit=unit, unit_scale=unit_scale, file=sys.stderr
            )

    def update(self, n: int = 1) -> None:
        self.count += n
        if self.bar is not None:
            self.bar.update(n)
        elif self.lines and time.monotonic() - self.last_print >= LINE_EVERY_S:
            self._line("")

    def _line(self, suffix: str) -> None:
        self.last_print = time.monotonic()
        elapsed = self.last_print - self.started
        rate = self.count / max(elapsed, 1e-9)
        print(
            f"{self.description}: {self.count} {self.unit} in {elapsed:.0f} s ({rate:.1f}/s){suffix}",
            file=sys.stderr,
            flush=True,
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        elif self.lines and self.last_print > self.started:  # lines were printed: say it ended
            self._line(", done")
            self.lines = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
