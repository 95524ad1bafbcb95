"""Why a compiled model trains slower than eager (GPU): the 100M entropy model, eager then
`distributed.compile=true`, each 3 warm-up and 6 timed steps (CUDA events), with dynamo's graph
and graph-break counts and the top CUDA kernels of one profiled step of each.

    python3 bench/gpu/compile_diag.py            (on the lent machine; --quick: tiny, CPU)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(0, str(HERE))


def measure(ctx, compiled: bool) -> dict:
    import steps
    import torch
    from torch._dynamo.utils import counters

    counters.clear()
    flag = f"distributed.compile={str(compiled).lower()}"
    trainer = steps.make_trainer(ctx, f"diag_{compiled}", [*steps.entropy_argv(ctx), flag])
    try:
        for _ in range(3):
            trainer.train_step(trainer.next_batches())
        ctx.sync()
        batches = [trainer.next_batches() for _ in range(7)]
        t0 = time.perf_counter()
        for b in batches[:6]:
            trainer.train_step(b)
        ctx.sync()
        step_s = (time.perf_counter() - t0) / 6
        activity = [torch.profiler.ProfilerActivity.CPU]
        if ctx.cuda:
            activity.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activity) as prof:
            trainer.train_step(batches[6])
            ctx.sync()
        key = "self_cuda_time_total" if ctx.cuda else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=key, row_limit=18, max_name_column_width=70)
        return {
            "compiled": compiled,
            "step_s": round(step_s, 4),
            "graph_breaks": dict(counters["graph_break"]),
            "unique_graphs": counters["stats"].get("unique_graphs", 0),
            "frames_ok": counters["frames"].get("ok", 0),
            "recompiles": {k: v for k, v in counters["recompiles"].items()}
            if "recompiles" in counters
            else {},
            "table": table,
        }
    finally:
        trainer.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    opts = p.parse_args()
    import steps

    work = Path(tempfile.mkdtemp(prefix="compile_diag_"))
    ctx = steps.Ctx("cpu" if opts.quick else "cuda", opts.quick, work, work)
    for compiled in (False, True):
        row = measure(ctx, compiled)
        table = row.pop("table")
        print(json.dumps(row), flush=True)
        print(table, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
