"""Where a host sync comes from (GPU only): sync-debug "warn" over an empty window (does the
switch itself warn?), then one debug-BLT training step under "error" (the sync raises with its
traceback) and under "warn" with every warning's stack and thread printed.

    python3 bench/gpu/sync_origin.py     (on the lent machine; the check's train_step step
                                          could only name torch/cuda/__init__.py)
"""

from __future__ import annotations

import sys
import tempfile
import threading
import traceback
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(0, str(HERE))


def window(fn) -> list:
    import torch

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return [w for w in caught if "synchroniz" in str(w.message)]


def main() -> int:
    import steps
    import torch

    work = Path(tempfile.mkdtemp(prefix="sync_origin_"))
    ctx = steps.Ctx("cuda", False, work, work)
    trainer = steps.make_trainer(ctx, "origin", steps.blt_argv(ctx))
    trainer.train_step(trainer.next_batches())
    torch.cuda.synchronize()
    print("threads:", [t.name for t in threading.enumerate()], flush=True)
    print("empty window:", [(w.filename, w.lineno) for w in window(lambda: None)], flush=True)
    x = torch.ones(4, device="cuda")
    print("one .item():", [(w.filename, w.lineno) for w in window(lambda: x.sum().item())])
    batches = trainer.next_batches()
    torch.cuda.set_sync_debug_mode("error")
    try:
        trainer.train_step(batches)
        print("error mode: no error", flush=True)
    except RuntimeError:
        print("error mode raised:", flush=True)
        traceback.print_exc()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    trainer.optimizer.zero_grad(set_to_none=True)
    original = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            print(f"--- sync warning at {filename}:{lineno} in thread "
                  f"{threading.current_thread().name}", flush=True)  # fmt: skip
            traceback.print_stack(limit=14)
        else:
            original(message, category, filename, lineno, file, line)

    batches = trainer.next_batches()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            trainer.train_step(batches)
            torch.cuda.synchronize()  # a known sync: the stack printing works
        finally:
            torch.cuda.set_sync_debug_mode(0)
    trainer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
