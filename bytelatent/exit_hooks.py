"""What must run before a process leaves through `os._exit` (which skips atexit handlers).

`cleanup_and_exit` (bytelatent/distributed/env.py) runs these hooks; modules register them here,
without importing torch (the data-loader worker registers one and may never import torch).
"""

from __future__ import annotations

from collections.abc import Callable

_HOOKS: list[Callable[[], None]] = []


def run_before_os_exit(hook: Callable[[], None]) -> Callable[[], None]:
    """Register `hook` to run in `cleanup_and_exit` (atexit handlers do not run under os._exit)."""
    _HOOKS.append(hook)
    return hook


def before_os_exit_hooks() -> list[Callable[[], None]]:
    """The registered hooks, in registration order."""
    return list(_HOOKS)
