"""The data loader's process context, and starting its fork server before the trainer imports torch.

A data-loader worker (data/iterators/multiprocess.py) is forked from multiprocessing's fork server,
which preloads the worker module (torch-free) and, for a run whose patching needs torch (a model
or top-k: `PatcherArgs.needs_torch`), the patcher and so torch; other workers never import it.
Started lazily at the first batch, that import (seconds) comes after the trainer's own and
delays step 1; `start_early(argv)`, called by `python -m bytelatent.train` before it imports
anything heavy, starts the server at once so that both imports run side by side. This module
imports only the standard library, the config parser and `PatcherArgs`, so calling it costs
nothing measurable.

A fork server started early has the environment of that moment, not the one the trainer sets up
afterwards (`env:` keys, thread counts); workers therefore apply the trainer's environment as it
is when they start (`worker_environment()`), whichever process forked them.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import sys
from multiprocessing import forkserver

from bytelatent.config.parser import load_config_tree
from bytelatent.data.patcher_args import PatcherArgs

WORKER_MODULE = "bytelatent.data.iterators.multiprocess"  # torch-free
PATCHER_MODULE = "bytelatent.data.patcher"  # torch: preloaded only for runs that patch with it
# What `srun` delivers to every process of a step (preemption, the end of the job).
STEP_SIGNALS = (signal.SIGUSR2, signal.SIGTERM)


@contextlib.contextmanager
def step_signals_blocked():
    """Block `STEP_SIGNALS` in this thread meanwhile. Processes started meanwhile (the resource
    tracker and fork server, started on first use) inherit the blocked mask across fork and exec
    and keep it, so a USR2 to the whole step cannot kill them; here a signal that arrives
    meanwhile is only deferred until the block ends."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, STEP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


@contextlib.contextmanager
def main_module_hidden():
    """Meanwhile, a spawn or forkserver child does not re-run this process's `__main__`.

    multiprocessing runs the parent's main module (`python -m bytelatent.train`: torch and the
    whole trainer) in every such child, to find what it defines. The worker's code lives in an
    importable module, so that import only cost each worker ~3 CPU-s and delayed the first batch
    by seconds; hiding the main module's spec and file while the child starts skips it."""
    main = sys.modules.get("__main__")
    saved = {k: getattr(main, k) for k in ("__spec__", "__file__") if hasattr(main, k)}
    for key in saved:
        if key == "__spec__":
            main.__spec__ = None
        else:
            delattr(main, key)
    try:
        yield
    finally:
        for key, value in saved.items():
            setattr(main, key, value)


def default_start_method() -> str:
    """forkserver (else spawn); fork only when the main module cannot be re-imported (stdin, REPL
    files that are gone), which spawn and forkserver need."""
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    if main_file is not None and not os.path.exists(main_file):
        return "fork"
    return "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"


def worker_context(start_method: str | None = None, patching: bool = True):
    """The multiprocessing context data workers start from. The fork server preloads the worker
    module and, when `patching`, the patcher with torch (a server already running keeps what it
    preloaded)."""
    method = start_method or default_start_method()
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload([WORKER_MODULE, *([PATCHER_MODULE] if patching else [])])
    return ctx


def _data_section(argv: list[str]) -> dict | None:
    """The `data:` section as the config files and overrides give it, without validating them
    (the real parse reports any problem); None when no data loader will start: the usage line,
    a dry run, `data.load_async=false`, or a config that does not load."""
    if not argv:
        return None  # the usage line
    try:
        tree = load_config_tree(argv)
    except Exception:  # noqa: BLE001 - any config problem: start nothing, let the parse say it
        return None
    data = tree.get("data") if isinstance(tree.get("data"), dict) else {}
    if tree.get("dry_run") is True or data.get("load_async", True) is False:
        return None
    return data


def will_load_async(argv: list[str]) -> bool:
    """Whether this training command will start a data-loader worker."""
    return _data_section(argv) is not None


def patches_with_torch(data: dict) -> bool:
    """Whether the data pipeline of this `data:` section patches with torch: it patches unless
    `add_patches` is false (DataArgs), with torch when `PatcherArgs.needs_torch` (a model, or
    top-k). Entropy-model runs and the usual BLT runs (space patching, or entropies read from the
    data) do not. It only decides what the fork server preloads: were it wrong, a worker would
    import the patcher itself (or have it preloaded for nothing), with the same batches."""
    patcher = data.get("patcher_args") if isinstance(data.get("patcher_args"), dict) else {}
    if data.get("add_patches", True) is False:
        return False
    try:
        return PatcherArgs.model_validate(patcher).needs_torch
    except ValueError:  # the real parse reports it
        return False


def start_early(argv: list[str]) -> bool:
    """Start the fork server now if this command will need it; True when started."""
    data = _data_section(argv)
    if default_start_method() != "forkserver" or data is None:
        return False
    with step_signals_blocked():
        worker_context("forkserver", patching=patches_with_torch(data))
        forkserver.ensure_running()
    return True


def worker_environment() -> dict[str, str]:
    """The trainer's environment, handed to each worker it starts (see the module docstring)."""
    return dict(os.environ)


def apply_environment(env: dict[str, str]) -> None:
    """In the worker: take the trainer's environment as it was when the worker was started."""
    os.environ.clear()
    os.environ.update(env)
