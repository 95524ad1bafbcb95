"""One writer per run directory: rank 0 of a job holds `dump_dir/.lock` while it trains.

The lock file is JSON {host, pid, pid_start, slurm_job_id, start_time, token}. It is created
atomically with `os.link` of a fully written private file (fails if `.lock` exists; atomic on
local disks, NFS and Lustre, unlike `flock`), so a reader never sees a half-written lock. A
background thread refreshes the file's mtime (the heartbeat) every `heartbeat_s`.

A lock is stale, and taken over with a warning, when
* its SLURM job id is ours (a requeued job restarting: the old incarnation is gone),
* it was taken on this host and its pid is dead (or reused by another process: `kill -9`),
* it was taken on another host and its heartbeat is older than `stale_after_s`.
A takeover renames the stale file to a private name first, so of two runs that both found it
stale only one can take it.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from bytelatent.errors import UserError

logger = logging.getLogger("bytelatent")

LOCK_NAME = ".lock"
_HELD: set[str] = set()  # lock paths held by this process (a second Trainer here is a conflict)


class RunLockError(UserError):
    kind = "run lock"

    def __init__(self, message: str, quiet: bool = False):
        super().__init__(message)
        self.quiet = quiet  # ranks other than 0 exit 2 without repeating rank 0's line


class RunLockArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(True, description="refuse to train in a dump_dir another run is using")
    heartbeat_s: float = Field(30.0, gt=0, description="how often the holder refreshes the lock")
    stale_after_s: float = Field(
        300.0, gt=0, description="a lock from another host whose heartbeat is this old is stale"
    )

    @model_validator(mode="after")
    def _check(self) -> RunLockArgs:
        if self.stale_after_s < 2 * self.heartbeat_s:
            raise ValueError(
                f"run_lock.stale_after_s ({self.stale_after_s:g}) must be at least twice "
                f"run_lock.heartbeat_s ({self.heartbeat_s:g}), or live runs look stale"
            )
        return self


def _pid_start(pid: int) -> str | None:
    """Start time of `pid` in clock ticks since boot (Linux), to tell a reused pid apart."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


@dataclass
class LockInfo:
    data: dict[str, Any]
    age_s: float  # seconds since the last heartbeat (file mtime)
    held_here: bool = False  # a RunLock of this very process holds it

    def describe(self) -> str:
        d = self.data
        job = f", SLURM job {d['slurm_job_id']}" if d.get("slurm_job_id") else ""
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(d.get("start_time", 0)))
        return (
            f"pid {d.get('pid')} on {d.get('host')}{job}, started {started}, "
            f"heartbeat {self.age_s:.0f}s ago"
        )


def stale_reason(info: LockInfo, stale_after_s: float) -> str | None:
    """Why the lock `info` may be taken over, or None if its holder may still be running."""
    d = info.data
    job = os.environ.get("SLURM_JOB_ID")
    if job and str(d.get("slurm_job_id")) == job:
        return f"same SLURM job {job} (requeued)"
    if d.get("host") == socket.gethostname():
        pid = int(d.get("pid", -1))
        if pid == os.getpid():
            return None if info.held_here else "left by an earlier run of this process"
        if not _pid_alive(pid):
            return f"pid {pid} is not running"
        if d.get("pid_start") and _pid_start(pid) not in (None, d["pid_start"]):
            return f"pid {pid} now belongs to another process"
        return None
    if info.age_s > stale_after_s:
        return f"heartbeat {info.age_s:.0f}s old (> run_lock.stale_after_s={stale_after_s:g})"
    return None


class RunLock:
    """`acquire()` or raise RunLockError naming the holder; `release()` at the end of the run."""

    def __init__(self, dump_dir: str, args: RunLockArgs | None = None):
        self.args = args or RunLockArgs()
        self.dir = os.path.abspath(dump_dir)
        self.path = os.path.join(self.dir, LOCK_NAME)
        self.token = uuid.uuid4().hex
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.held = False

    def _payload(self) -> str:
        return json.dumps(
            {
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "pid_start": _pid_start(os.getpid()),
                "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
                "start_time": time.time(),
                "token": self.token,
            }
        )

    def read(self, path: str | None = None) -> LockInfo | None:
        path = path or self.path
        try:
            with open(path) as f:
                text = f.read()
            age = time.time() - os.stat(path).st_mtime
        except FileNotFoundError:
            return None
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            data = {}
        return LockInfo(data if isinstance(data, dict) else {}, max(age, 0.0), path in _HELD)

    def _try_create(self) -> bool:
        """Atomically create the lock with our payload; False if it already exists."""
        tmp = f"{self.path}.{self.token}.tmp"
        with open(tmp, "w") as f:
            f.write(self._payload())
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, self.path)  # fails with EEXIST atomically, also over NFS
            return True
        except FileExistsError:
            return False
        finally:
            os.unlink(tmp)

    def _take_over(self, info: LockInfo, reason: str) -> None:
        aside = f"{self.path}.stale-{self.token}"
        try:
            os.rename(self.path, aside)  # only one contender's rename finds the file
        except FileNotFoundError:
            return
        moved = self.read(aside)
        if moved is not None and moved.data.get("token") != info.data.get("token"):
            # Someone took the stale lock between our read and our rename: give it back.
            try:
                os.link(aside, self.path)
            except FileExistsError:
                pass
        else:
            logger.warning(
                "run lock: taking over stale %s (%s: %s)", self.path, info.describe(), reason
            )
        os.unlink(aside)

    def acquire(self) -> None:
        os.makedirs(self.dir, exist_ok=True)
        for _ in range(5):
            if self._try_create():
                self.held = True
                _HELD.add(self.path)
                self._start_heartbeat()
                return
            info = self.read()
            if info is None:
                continue  # released meanwhile: try again
            reason = stale_reason(info, self.args.stale_after_s)
            if reason is None:
                raise RunLockError(
                    f"{self.dir} is in use by another run ({info.describe()}); wait for it, use "
                    f"another dump_dir, or delete {self.path} if that run is gone"
                )
            self._take_over(info, reason)
        raise RunLockError(f"{self.path}: could not take the lock (contended); try again")

    def _start_heartbeat(self) -> None:
        self._thread = threading.Thread(target=self._heartbeat, name="run-lock", daemon=True)
        self._thread.start()

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.args.heartbeat_s):
            info = self.read()
            if info is None or info.data.get("token") != self.token:
                holder = info.describe() if info else "nobody"
                logger.error("run lock %s was taken over (now: %s)", self.path, holder)
                return
            try:
                os.utime(self.path)
            except OSError as e:
                logger.warning("run lock heartbeat failed: %s", e)

    def release(self) -> None:
        """Stop the heartbeat and remove the lock if it is still ours."""
        if not self.held:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        info = self.read()
        if info is not None and info.data.get("token") == self.token:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        _HELD.discard(self.path)
        self.held = False


def hold_run_lock(
    dump_dir: str, args: RunLockArgs, rank: int, world_size: int, device
) -> RunLock | None:
    """Collective: rank 0 takes the lock, every rank learns whether it did (RunLockError if not)."""
    if not args.enabled or "://" in dump_dir:
        if args.enabled:
            logger.warning("run lock: %s is not a local path; not locking it", dump_dir)
        return None
    lock, error = None, None
    if rank == 0:
        lock = RunLock(dump_dir, args)
        try:
            lock.acquire()
        except (RunLockError, OSError) as e:
            error = e if isinstance(e, RunLockError) else RunLockError(f"{lock.path}: {e}")
    if world_size > 1:
        import torch
        import torch.distributed as dist

        flag = torch.tensor([0 if error is None else 1], device=device)
        dist.broadcast(flag, src=0)
        if rank != 0 and int(flag.item()):
            error = RunLockError("rank 0 could not take the run lock", quiet=True)
    if error is not None:
        raise error
    return lock
