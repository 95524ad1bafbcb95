"""Files of the run directory, written so that a crash or a full disk corrupts none of them.

* Whole files (`config.yaml`, `model-info.txt`): `write_text_atomic` writes a temporary sibling,
  fsyncs it and renames it over the old file: a reader sees the old file or the new one, never a
  prefix of it.
* Record logs (`metrics.jsonl`, `train.log`, the probe's JSONL): `LineAppender` appends whole
  lines only. A write that fails part-way (ENOSPC) is cut back to the last whole line before the
  error is raised; a partial last line left by a kill is cut off when the file is opened again
  (`repair_partial_line`, logged once with the number of bytes dropped).
* A resume from a checkpoint older than the last logged step moves the records of the steps it
  will log again from `metrics.jsonl` to `metrics.replayed.jsonl` (`set_aside_lines_after`):
  `metrics.jsonl` holds one record per step, and no record is lost.
* `metrics.eval.jsonl` has several writers (the trainer, async eval jobs): `append_shared_line`
  does the same under an exclusive `flock`, so one writer's cut-back never touches another's line.
* `train.log` is written by `RunLogHandler`, which stops at its first OS error instead of printing
  a "--- Logging error ---" traceback for every later line, and keeps the error so that the
  trainer ends the run with it (`raise_log_file_error`).

Every OS error while writing becomes one `DiskError` line naming the file:
`disk error: writing runs/x/metrics.jsonl: [Errno 28] No space left on device`.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import sys
import uuid
from pathlib import Path

from bytelatent.errors import DiskError

logger = logging.getLogger("bytelatent")

_TAIL_CHUNK = 1 << 16
REPLAYED_METRICS = "metrics.replayed.jsonl"  # records of steps a resume logged again


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Replace `path` with `text` atomically (tmp + fsync + rename); DiskError if it cannot."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(text.encode("utf-8"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        raise DiskError.writing(path, e) from e
    finally:
        if tmp.exists():
            tmp.unlink()


def repair_partial_line(path: str | os.PathLike) -> int:
    """Cut `path` back to its last newline (a record a kill or a full disk cut short); returns
    the number of bytes dropped (0 for a missing, empty or whole-line file)."""
    try:
        f = open(path, "rb+")
    except FileNotFoundError:
        return 0
    with f:
        size = f.seek(0, os.SEEK_END)
        end = size
        while end > 0:
            start = max(0, end - _TAIL_CHUNK)
            f.seek(start)
            chunk = f.read(end - start)
            if end == size and chunk.endswith(b"\n"):
                return 0
            newline = chunk.rfind(b"\n")
            if newline >= 0:
                end = start + newline + 1
                break
            end = start
        f.truncate(end)  # frees space: never fails for lack of it
        return size - end


def warn_dropped(path: str | os.PathLike, dropped: int) -> None:
    """Say that `repair_partial_line` cut `dropped` bytes off `path` (nothing when 0)."""
    if dropped:
        logger.warning(
            "%s: dropped %d bytes of a partial last line (a write cut short by a kill or a "
            "full disk)", path, dropped,
        )  # fmt: skip


class LineAppender:
    """Appends whole lines to one file (a single writer: the run lock's holder)."""

    def __init__(self, path: str | os.PathLike, repair: bool = True):
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            dropped = repair_partial_line(self.path) if repair else 0
            self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError as e:
            raise DiskError.writing(self.path, e) from e
        warn_dropped(self.path, dropped)

    def append(self, line: str) -> None:
        """Write `line` (newline added if missing) whole, or raise DiskError leaving no part of it."""
        if self._fd is None:
            raise DiskError(f"writing {self.path}: the file was closed after an earlier error")
        data = (line if line.endswith("\n") else line + "\n").encode("utf-8")
        size = os.fstat(self._fd).st_size
        try:
            written = 0
            while written < len(data):
                n = os.write(self._fd, data[written:])
                if n <= 0:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                written += n
        except OSError as e:
            self._cut_back(size)
            raise DiskError.writing(self.path, e) from e

    def sync(self) -> None:
        """fsync: the lines written so far survive a crash."""
        try:
            os.fsync(self._fd)
        except OSError as e:
            raise DiskError.writing(self.path, e) from e

    def _cut_back(self, size: int) -> None:
        try:
            os.ftruncate(self._fd, size)
        except OSError:
            pass  # the next open repairs a partial last line

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def append_line(path: str | os.PathLike, line: str) -> None:
    """Open, append one whole line, close (for files written now and then)."""
    appender = LineAppender(path)
    try:
        appender.append(line)
    finally:
        appender.close()


def append_shared_line(path: str | os.PathLike, line: str) -> None:
    """Append one whole line to a file that other processes append to as well
    (`metrics.eval.jsonl`: the trainer's in-loop evaluations and async eval jobs).

    `LineAppender`'s cut-back after a failed write is only safe while nobody appends behind it,
    so each writer holds an exclusive `flock` on the file for the repair of a partial last line
    (a writer that was killed), the write, and the cut-back: readers see whole lines only. On a
    file system without flock (some network mounts) the line is still one O_APPEND write."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    except OSError as e:
        raise DiskError.writing(path, e) from e
    try:
        locked = _lock(lock_fd)
        try:
            append_line(path, line)  # repairs a partial last line, writes whole or cuts back
        finally:
            if locked:
                fcntl.flock(lock_fd, fcntl.LOCK_UN)
    finally:
        os.close(lock_fd)


def _lock(fd: int) -> bool:
    """Exclusive flock on `fd` (waits for the other writer); False where flock is unsupported."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        return True
    except OSError as e:
        if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
            return False
        raise DiskError.writing(fd, e) from e


def set_aside_lines_after(path: str | os.PathLike, step: int, aside: str | os.PathLike) -> int:
    """Move the trailing records of `path` (JSONL) with `global_step` > `step` to the end of
    `aside`; returns how many moved. For a resume from an older checkpoint than the newest step
    logged: the run logs those steps again, so `path` keeps one record per step.

    Never loses a record: the lines are appended to `aside` (fsynced) before `path` is cut back,
    so a crash in between leaves them in both files. Cutting back (truncate) needs no space.
    Only the tail is scanned, back to the first record at or before `step`."""
    path = Path(path)
    warn_dropped(path, repair_partial_line(path))
    try:
        with open(path, "rb") as f:
            end = f.seek(0, os.SEEK_END)
            cut, moved = _tail_after(f, end, step)
    except FileNotFoundError:
        return 0
    except OSError as e:
        raise DiskError.writing(path, e) from e
    if not moved:
        return 0
    with open(path, "rb") as f:
        f.seek(cut)
        tail = f.read()
    lines = LineAppender(aside)
    try:
        for line in tail.decode("utf-8").splitlines():
            lines.append(line)
        lines.sync()
    finally:
        lines.close()
    try:
        os.truncate(path, cut)
    except OSError as e:
        raise DiskError.writing(path, e) from e
    return moved


def _tail_after(f, end: int, step: int) -> tuple[int, int]:
    """(offset where the trailing records after `step` begin, how many) in a whole-line JSONL
    file of `end` bytes; reads back from the end in doubling chunks until a record <= `step`."""
    size = _TAIL_CHUNK
    while True:
        start = max(0, end - size)
        f.seek(start)
        data = f.read(end - start)
        first = 0 if start == 0 else data.find(b"\n") + 1  # skip a line begun before `start`
        if start > 0 and first == 0:
            size *= 2  # one line longer than the chunk
            continue
        cut, moved = end, 0
        for line in reversed(data[first:].split(b"\n")[:-1]):
            try:
                record = json.loads(line)
            except ValueError:
                record = None
            if isinstance(record, dict) and isinstance(record.get("global_step"), int):
                if record["global_step"] <= step:
                    return cut, moved
            cut -= len(line) + 1
            moved += 1
        if start == 0:
            return cut, moved
        size *= 2


class RunLogHandler(logging.Handler):
    """`train.log`: one whole line per record; the first OS error stops it (kept in `error`)."""

    def __init__(self, path: str | os.PathLike):
        super().__init__()
        self.path = Path(path)
        self._lines: LineAppender | None = LineAppender(self.path, repair=True)
        self.error: DiskError | None = None
        self.last_message: str | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if self._lines is None:
            return
        try:
            text = self.format(record)
        except Exception:
            self.handleError(record)  # a formatting bug: the usual report
            return
        try:
            self._lines.append(text)
            self.last_message = record.getMessage()
        except DiskError as e:
            self.error = e
            self._lines.close()
            self._lines = None

    def close(self) -> None:
        if self._lines is not None:
            self._lines.close()
            self._lines = None
        super().close()


class QuietStreamHandler(logging.StreamHandler):
    """The console: a stream that fails (full disk under a redirected stdout, a closed pipe or file) is
    dropped silently instead of printing a traceback per line; the run's own files report it."""

    def __init__(self, stream):
        super().__init__(stream)
        self.failed = False

    def emit(self, record: logging.LogRecord) -> None:
        if not self.failed:
            super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:
        if isinstance(sys.exc_info()[1], OSError | ValueError):  # ValueError: a closed stream
            self.failed = True
        else:
            super().handleError(record)

    def flush(self) -> None:
        if not self.failed:
            try:
                super().flush()
            except (OSError, ValueError):
                self.failed = True


# Out of space, over quota, over the file size limit, a read-only mount: the disk, not a bug.
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS})


def disk_error_of(exc: BaseException) -> DiskError | None:
    """The one-line DiskError for an OS error of the disk that a writer outside this module let
    through (e.g. a JSONL shared with eval jobs), or None for any other exception."""
    if isinstance(exc, OSError) and exc.errno in DISK_ERRNOS:
        return DiskError.writing(exc.filename or "a file of the run", exc)
    return None


def run_log_handlers() -> list[RunLogHandler]:
    return [h for h in logging.getLogger("bytelatent").handlers if isinstance(h, RunLogHandler)]


def raise_log_file_error() -> None:
    """Raise the DiskError of a `train.log` that could not be written (see `RunLogHandler`)."""
    for handler in run_log_handlers():
        if handler.error is not None:
            raise handler.error


def log_final_error(line: str) -> None:
    """Write the run's closing error line to `train.log` (not the console: stderr has it),
    unless it is already the last line there (the checkpoint manager logs its own)."""
    record = logging.LogRecord("bytelatent", logging.ERROR, __file__, 0, "%s", (line,), None)
    for handler in run_log_handlers():
        if handler.last_message == line:
            continue
        if handler.error is None:
            handler.handle(record)
            continue
        try:  # the handler stopped at a full disk; the line may fit now (a cut-back freed space)
            append_line(handler.path, handler.format(record))
        except DiskError:
            pass
