"""Hung and dead peers: collective timeouts, and one line instead of a backend traceback.

`distributed.first_step_timeout_s` bounds init and the first step (compilation can take many
minutes), then `set_collective_timeouts(distributed.timeout_s)` shortens every process group's
timeout (torchtitan's init/train timeouts). When a collective then fails because a peer hung
(SIGSTOP, a stuck kernel) or died outside torchrun, `describe_peer_failure` turns the exception
into one line naming the ranks that did not answer and the step, and the trainer exits with
`PEER_FAILURE_EXIT_CODE` so the job can be requeued.

Which ranks: every survivor writes `bytelatent/alive/{rank}` into the rendezvous store and waits
`ROLL_CALL_S` for the others' keys; the ranks without a key are the ones named. If the store
itself does not answer, its host (rank 0) is the one that is gone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from datetime import timedelta

import torch.distributed as dist

logger = logging.getLogger("bytelatent")

PEER_FAILURE_EXIT_CODE = 4
ROLL_CALL_S = 3.0
# Fragments of gloo / NCCL / c10d store messages that mean "a peer did not answer".
_PEER_SIGNS = (
    "timed out", "connection closed by peer", "connection reset by peer", "broken pipe",
    "connection refused", "socket closed", "watchdog", "nccl communicator", "ncclremoteerror",
    "unexpected eof", "pair closure",
)  # fmt: skip


def set_collective_timeouts(seconds: float) -> None:
    """Set the timeout of every process group this process belongs to (after the first step)."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    from torch.distributed.distributed_c10d import _set_pg_timeout, _world

    for group in list(_world.pg_map):
        try:
            _set_pg_timeout(timedelta(seconds=seconds), group)
        except (ValueError, RuntimeError, AssertionError) as e:  # a group without a timeout knob
            logger.debug("collective timeout not set on %s: %s", group, e)


def is_peer_failure(exc: BaseException) -> bool:
    if not isinstance(exc, RuntimeError):  # DistBackendError, DistNetworkError, DistStoreError
        return False
    text = str(exc).lower()
    if isinstance(exc, dist.DistError) and ("timeout" in text or "read error" in text):
        return True  # c10d's own errors (store and backend), e.g. "Socket Timeout"
    return any(sign in text for sign in _PEER_SIGNS)


def describe_peer_failure(exc: BaseException, rank: int, world_size: int, step: str) -> str | None:
    """One line for a collective that failed because of a peer, or None for any other error."""
    if world_size < 2 or not is_peer_failure(exc):
        return None
    missing = _roll_call(rank, world_size)
    if missing is None:
        who = "rank 0 (it hosts the rendezvous store, which stopped answering)"
    elif missing:
        who = "rank" + ("s " if len(missing) > 1 else " ") + ",".join(map(str, missing))
    else:
        who = "a peer (every rank answered the roll call afterwards: a transient network fault?)"
    first = " ".join(str(exc).split())[:160]
    return (
        f"distributed error: rank {rank} at step {step}: {who} did not answer a collective "
        f"(hung or died; distributed.timeout_s bounds the wait). Stopping with exit code "
        f"{PEER_FAILURE_EXIT_CODE} so the job can be requeued. [{first}]"
    )


def _store_reachable() -> bool:
    """A plain TCP connect to the rendezvous store first: a store client call to a dead host makes
    c10d log a warning with a C++ stack trace, which is what this module exists to avoid."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT", "")
    if not host or not port.isdigit():
        return True  # another rendezvous (file://, a custom store): let the store call tell
    try:
        with socket.create_connection((host, int(port)), timeout=ROLL_CALL_S):
            return True
    except OSError:
        return False


def _short_timeout_store() -> dist.Store:
    """A client of the rendezvous store whose every call gives up after ROLL_CALL_S (the default
    store's timeout is the process group's, and a stopped host would block it that long)."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT", "")
    if host and port.isdigit():
        return dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False,
                             timeout=timedelta(seconds=ROLL_CALL_S))  # fmt: skip
    from torch.distributed.distributed_c10d import _get_default_store

    store = _get_default_store()
    store.set_timeout(timedelta(seconds=ROLL_CALL_S))
    return store


def _roll_call(rank: int, world_size: int) -> list[int] | None:
    """Ranks that did not check in within ROLL_CALL_S; None when the store does not answer.

    Runs in a daemon thread: a store client whose host is stopped (SIGSTOP) can block in its
    handshake whatever its timeout says, and the survivor must still say its line and leave.
    """
    if not _store_reachable():
        return None
    result: list = []
    thread = threading.Thread(
        target=lambda: result.append(_ask_store(rank, world_size)), daemon=True
    )
    with _stderr_to_devnull():  # a host that dies after the connect above: c10d's C++ stack trace
        thread.start()
        thread.join(timeout=3 * ROLL_CALL_S)
    return result[0] if result else None


@contextlib.contextmanager
def _stderr_to_devnull():
    """Meanwhile file descriptor 2 (where c10d's C++ logging writes) goes to /dev/null; this
    process is about to say its one line and leave."""
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def _ask_store(rank: int, world_size: int) -> list[int] | None:
    try:
        store = _short_timeout_store()
        store.set(f"bytelatent/alive/{rank}", "1")
        deadline = time.monotonic() + ROLL_CALL_S
        keys = [f"bytelatent/alive/{r}" for r in range(world_size)]
        while time.monotonic() < deadline and not store.check(keys):
            time.sleep(0.1)
        return [r for r, key in enumerate(keys) if not store.check([key])]
    except Exception:  # noqa: BLE001 - the store is gone with its host
        return None
