"""One task of the comparison's SLURM job array: `python -m apps.compare.task JOBS.json` trains
run number `$SLURM_ARRAY_TASK_ID` of the list (written by apps/compare/slurm.py) exactly as the
local launcher would (`train_job`: its log, then `done.json` with wall and CPU seconds)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from apps.compare.runs import Job, train_job
from bytelatent.errors import UserError


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or "SLURM_ARRAY_TASK_ID" not in os.environ:
        print("usage: SLURM_ARRAY_TASK_ID=N python -m apps.compare.task JOBS.json", file=sys.stderr)
        return 2
    spec = json.loads(Path(argv[0]).read_text())
    record = spec["jobs"][int(os.environ["SLURM_ARRAY_TASK_ID"])]
    job = Job(record["row"], record["lr"], record["seed"], Path(record["dump_dir"]), record["argv"])
    print(f"compare task: {job.label} in {job.dump_dir}", flush=True)
    try:
        done = train_job(job, spec["threads"], spec["nice"])
    except UserError as e:
        print(e.one_line(), file=sys.stderr)
        return 1
    print(f"compare task: done in {done['wall_s']:.0f} s wall, {done['cpu_s']:.0f} CPU-s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
