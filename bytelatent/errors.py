"""Errors a user can cause. The CLI prints `<kind> error: <message>` on one line and exits 2."""

from __future__ import annotations


class UserError(Exception):
    """An error caused by the user's configuration, data or files (not a bug in bytelatent)."""

    kind = "error"

    def one_line(self) -> str:
        text = " ".join(str(self).split())
        return f"{self.kind} error: {text}"


class ConfigError(UserError):
    kind = "config"


class DataError(UserError):
    kind = "data"


class CheckpointError(UserError):
    kind = "checkpoint"


class DiskError(UserError):
    """A file of the run could not be written (a full disk, a quota, a read-only mount)."""

    kind = "disk"

    @classmethod
    def writing(cls, path: object, error: OSError) -> DiskError:
        """`writing PATH: [Errno 28] No space left on device` (the path once, not repeated)."""
        reason = f"[Errno {error.errno}] {error.strerror}" if error.errno else str(error)
        return cls(f"writing {path}: {reason}")


# `logger.error(..., extra=FILE_ONLY)`: for the run's log file only; the console does not show
# the record (the line reaches the user once, on stderr, from the error that ends the run).
FILE_ONLY = {"file_only": True}
