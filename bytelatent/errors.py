"""Errors a user can cause. The CLI prints `<kind> error: <message>` on one line and exits 2."""


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
