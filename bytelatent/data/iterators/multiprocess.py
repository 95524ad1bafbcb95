"""Prefetch batches in a background process, with an exact state that costs nothing to read.

The worker process runs the packing iterator and sends (batch, state after that batch) pairs
through a bounded queue. The consumer's state is the state attached to the last batch it
consumed, so `get_state()` is exact at any moment, never stops or restarts the worker, and
batches still queued are simply produced again by whoever resumes from that state.

* Start method: `forkserver` where available, else `spawn`: both work under `python -m ...`,
  under torchrun and with threads (gloo, CUDA) already running, unlike `fork`; the entry point
  needs the usual `if __name__ == "__main__":` guard. The fork server preloads this module
  (torch-free) and, when the run patches, the patcher (torch), so only the first worker of a
  process pays for the imports and a worker that does not patch never imports torch; `python -m
  bytelatent.train` starts that server before its own imports (data/worker_server.py). The
  worker receives the state as JSON and the trainer's environment.
* A worker error re-raises in the consumer as the same exception (DataError stays DataError),
  chained to a `RemoteTraceback` holding the worker's traceback. A worker that dies without a
  word (killed, segfault) raises RuntimeError with its exit code. Nothing waits forever.
* `close()`, the context manager, garbage collection and interpreter exit stop the worker; the
  worker also exits by itself when its parent dies, whatever it is doing (a thread waits on the
  parent's sentinel; on Linux, PR_SET_PDEATHSIG as well). It ignores SIGINT, and SIGTERM/SIGUSR2
  while its trainer lives (under `srun`, SLURM signals every process of the step), so that a
  Ctrl-C or a preemption signal reaches only the trainer, which then saves the (already exact)
  state; an orphan ends on them. The helpers that
  multiprocessing starts for it (the resource tracker, the fork server) are started with those
  signals blocked, which they inherit: a USR2 to the whole step would otherwise kill them, and
  the tracker's restart prints a KeyError traceback for every semaphore it never saw.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import multiprocessing as mp
import os
import pickle
import queue
import signal
import sys
import threading
import traceback
import weakref
from typing import Literal

import numpy as np
from pydantic import BaseModel, Field

from bytelatent.data.batch import Batch
from bytelatent.data.iterators.base import IteratorState, StatefulIterator
from bytelatent.data.iterators.packing import PackingIteratorState
from bytelatent.data.iterators.preprocess import PreprocessIteratorState
from bytelatent.data.worker_server import (
    apply_environment,
    default_start_method,
    main_module_hidden,
    step_signals_blocked,
    worker_context,
    worker_environment,
)
from bytelatent.exit_hooks import run_before_os_exit

_LIVE: weakref.WeakSet[MultiprocessIterator] = weakref.WeakSet()
_POLL_S = 0.5
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_ORPHANED_EXIT = 3  # exit code of a worker whose trainer is gone


class RemoteTraceback(Exception):
    """The data-loader worker's traceback, attached as the cause of the re-raised error."""

    def __str__(self) -> str:
        return "\n" + self.args[0]


class MultiprocessIteratorState(IteratorState):
    type: Literal["multiprocess"] = "multiprocess"
    base: PackingIteratorState  # the state after the last batch the consumer took
    prefetch_size: int = Field(64, ge=1)

    def build(self) -> MultiprocessIterator:
        return MultiprocessIterator(self)


def _compact(array: np.ndarray) -> np.ndarray:
    """Smallest integer dtype that holds the ids (the queue pickles bytes; int64 wastes 4-8x)."""
    if array.size == 0:
        return array
    low, high = int(array.min()), int(array.max())
    if -(2**15) <= low and high < 2**15:
        return array.astype(np.int16)
    return array.astype(np.int32) if -(2**31) <= low and high < 2**31 else array


def _shifted_targets(x: np.ndarray, lengths: np.ndarray, last: np.ndarray, pad: int) -> np.ndarray:
    """y rebuilt from x: y[:, :n-1] = x[:, 1:n], y[:, n-1] = each row's final target, pad after."""
    y = np.empty_like(x)
    y[:, :-1] = x[:, 1:]
    for row, n in enumerate(lengths.tolist()):  # rows are few; slicing beats a [B, L] mask
        y[row, max(n - 1, 0) :] = pad
        if n:
            y[row, n - 1] = last[row]
    return y


def _encode(batch: Batch) -> tuple:
    """A small picklable form: the pipe is the prefetcher's bottleneck, so send as few bytes as
    possible. Packed batches are x plus row lengths (y is x shifted, mask a prefix); anything
    else travels in full."""
    x, y, mask = batch.x, batch.y, batch.mask
    patch_lengths = None if batch.patch_lengths is None else _compact(batch.patch_lengths)
    lengths = mask.sum(axis=1)
    padding = ~mask
    pad = int(x[padding][0]) if padding.any() else 0
    last = y[np.arange(len(x)), np.maximum(lengths - 1, 0)]
    is_prefix = np.array_equal(mask, np.arange(x.shape[1]) < lengths[:, None])
    if is_prefix and np.array_equal(_shifted_targets(x, lengths, last, pad), y):
        if np.all(x[padding] == pad):
            return ("shifted", _compact(x), lengths, last, pad, patch_lengths, batch.loss_mask)
    return ("full", _compact(x), _compact(y), mask, patch_lengths, batch.loss_mask)


def _decode(payload: tuple) -> Batch:
    if payload[0] == "shifted":
        _, x, lengths, last, pad, patch_lengths, loss_mask = payload
        x = x.astype(np.int64)
        mask = np.arange(x.shape[1]) < lengths[:, None]
        y = _shifted_targets(x, lengths, last, pad)
    else:
        _, x, y, mask, patch_lengths, loss_mask = payload
        x, y = x.astype(np.int64), y.astype(np.int64)
    return Batch(
        x=x,
        y=y,
        mask=mask,
        patch_lengths=None if patch_lengths is None else patch_lengths.astype(np.int64),
        loss_mask=loss_mask,
    )


def _patches_with_torch(state: object) -> bool:
    """Whether a document stage under this state patches with torch (`PatcherArgs.needs_torch`):
    what a fork server started here preloads (a wrong guess only moves an import)."""
    if isinstance(state, PreprocessIteratorState):
        return state.patcher_args is not None and state.patcher_args.needs_torch
    if isinstance(state, BaseModel):
        return any(_patches_with_torch(value) for value in vars(state).values())
    if isinstance(state, list | tuple):
        return any(_patches_with_torch(value) for value in state)
    if isinstance(state, dict):
        return any(_patches_with_torch(value) for value in state.values())
    return False


def _put(q, item, stop) -> bool:
    """Put unless asked to stop or orphaned; False means: exit now."""
    parent = mp.parent_process()
    while not stop.is_set():
        try:
            q.put(item, timeout=_POLL_S)
            return True
        except queue.Full:
            if parent is not None and not parent.is_alive():
                break
    # Leaving early: exiting must not wait for nobody to drain what is still buffered. (A normal
    # exit does wait, so that the final "end"/"error" message reaches the consumer.)
    q.cancel_join_thread()
    return False


def _one_thread() -> None:
    """The worker computes with one thread (the trainer has the cores): torch's setting when the
    fork server preloaded it (patching runs), else the environment torch reads if patching ever
    imports it."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)


def _die_with_parent() -> None:
    """The worker never outlives the trainer that started it, whatever it is doing (a loop that
    does not reach a `_put`, a long C call): a thread waits on the parent's sentinel (a pipe that
    closes when the trainer dies) and ends the process; on Linux the kernel also kills it when
    its parent process (the trainer, or the fork server that dies with the trainer) exits."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    parent = mp.parent_process()
    if parent is None:
        return

    def watch() -> None:
        parent.join()  # returns once the parent's end of the pipe is closed: it has exited
        os._exit(_ORPHANED_EXIT)

    threading.Thread(target=watch, name="bytelatent-data-parent-watch", daemon=True).start()


def _on_terminate(signum: int, frame: object) -> None:
    """SIGTERM/SIGUSR2 are the trainer's to handle (see the module docstring); an orphan ends."""
    parent = mp.parent_process()
    if parent is None or not parent.is_alive():
        os._exit(_ORPHANED_EXIT)


def _worker(state_json: str, q, stop, env: dict[str, str]) -> None:
    """Body of the worker process: produce (batch, state) pairs until stopped or done."""
    apply_environment(env)
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _on_terminate)
    signal.signal(signal.SIGUSR2, _on_terminate)
    try:
        _one_thread()
        iterator = PackingIteratorState.model_validate_json(state_json).build()
        for batch in iterator:
            if not _put(
                q,
                ("batch", _encode(batch), iterator.get_state().model_dump_json()),
                stop,
            ):
                return
        _put(q, ("end", None, None), stop)
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the consumer
        text = traceback.format_exc()
        try:
            blob = pickle.dumps(exc)
            pickle.loads(blob)
        except Exception:  # noqa: BLE001 - unpicklable exceptions travel as text
            blob = None
        _put(q, ("error", (blob, f"{type(exc).__name__}: {exc}", text), None), stop)


class MultiprocessIterator(StatefulIterator[Batch]):
    """Batches from a background process (see module docstring)."""

    def __init__(self, state: MultiprocessIteratorState, start_method: str | None = None) -> None:
        self.prefetch_size = state.prefetch_size
        self.start_method = start_method or default_start_method()
        # state after the last consumed batch, as JSON from the worker (None: nothing consumed)
        self._state_json: str | None = None
        self._initial = state.base
        self._process = None
        self._queue = None
        self._stop = None
        self._finished = False

    def _start(self) -> None:
        with step_signals_blocked():  # see the module docstring
            ctx = worker_context(self.start_method, patching=_patches_with_torch(self._initial))
            self._queue = ctx.Queue(maxsize=self.prefetch_size)
            self._stop = ctx.Event()
            base_json = self._state_json or self._initial.model_dump_json()
            process = ctx.Process(
                target=_worker,
                args=(base_json, self._queue, self._stop, worker_environment()),
                name="bytelatent-data",
                daemon=True,
            )
            try:
                # fails if the job is being torn down (its forkserver got SIGTERM)
                with main_module_hidden():
                    process.start()
            except BaseException:
                self._queue.close()
                self._queue.cancel_join_thread()
                self._queue = self._stop = None
                raise
        self._process = process  # only a started process: close() joins it
        _LIVE.add(self)

    def __next__(self) -> Batch:
        if self._finished:
            raise StopIteration
        if self._process is None:
            self._start()
        kind, payload, state_json = self._receive()
        if kind == "batch":
            self._state_json = state_json
            return _decode(payload)
        self._finished = True
        self.close()
        if kind == "end":
            raise StopIteration
        self._raise_remote(payload)

    def _receive(self) -> tuple:
        while True:
            try:
                return self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                if self._process.is_alive():
                    continue
                try:  # it may have put its last item just before exiting
                    return self._queue.get(timeout=_POLL_S)
                except queue.Empty:
                    code = self._process.exitcode
                    self._finished = True
                    self.close()
                    raise RuntimeError(
                        f"data loader worker exited with code {code} without reporting an error "
                        "(see its output above; killed? out of memory?)"
                    ) from None

    @staticmethod
    def _raise_remote(payload: tuple) -> None:
        blob, summary, text = payload
        remote = RemoteTraceback(text)
        if blob is not None:
            raise pickle.loads(blob) from remote
        raise RuntimeError(f"data loader worker failed: {summary}") from remote

    def get_state(self) -> MultiprocessIteratorState:
        base = (
            self._initial
            if self._state_json is None
            else PackingIteratorState.model_validate_json(self._state_json)
        )
        return MultiprocessIteratorState(base=base, prefetch_size=self.prefetch_size)

    @property
    def worker_pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def close(self) -> None:
        """Stop and reap the worker (idempotent); the state stays readable."""
        process, self._process = self._process, None
        if process is None:
            return
        self._stop.set()
        process.join(timeout=2 * _POLL_S + 1)
        if process.is_alive():
            process.kill()
            process.join(timeout=5)
        self._queue.close()
        self._queue.cancel_join_thread()
        # Drop the queue's and the event's semaphores now: their finalizers unlink them and tell
        # the resource tracker. Left for interpreter exit, they are never released on the
        # `os._exit` path of distributed runs, and the tracker warns about "leaked semaphores".
        self._queue = self._stop = None
        _LIVE.discard(self)
        if not self._finished:
            self._initial = self.get_state().base  # a later next() restarts from here
            self._state_json = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown may have torn down mp
            self.close()


@atexit.register
@run_before_os_exit  # distributed runs leave through os._exit, which skips atexit
def _close_all() -> None:
    for iterator in list(_LIVE):
        iterator.close()
