"""`launcher: slurm`: the runs of a phase as one SLURM job array, written by the project's own
launcher (`bytelatent.launch.slurm.render_script`: its header, signal forwarding and logs) with
`apps.compare.task` as the module each array task runs; then polled until every run has its
`done.json` (collected like a local run) or the array has ended with runs missing."""

from __future__ import annotations

import hashlib
import json
import subprocess
import time
from pathlib import Path

from apps.compare.args import CompareArgs
from apps.compare.runs import Job
from bytelatent.errors import UserError
from bytelatent.launch.slurm import render_script, submit, write_job_script


def write_array(jobs: list[Job], args: CompareArgs) -> Path:
    """out_dir/slurm/<hash>/{jobs.json, submit.slurm}; the script's path."""
    spec = {
        "threads": args.threads,
        "nice": args.nice,
        "jobs": [
            {"row": j.row, "lr": j.lr, "seed": j.seed, "dump_dir": str(j.dump_dir.resolve()),
             "argv": j.argv}
            for j in jobs
        ],
    }  # fmt: skip
    text = json.dumps(spec, indent=1)
    folder = (Path(args.out_dir) / "slurm" / hashlib.sha1(text.encode()).hexdigest()[:10]).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "jobs.json").write_text(text + "\n")
    slurm = args.slurm.model_copy(
        update={
            "module": "apps.compare.task",
            "sbatch_args": [*args.slurm.sbatch_args, f"--array=0-{len(jobs) - 1}%{args.parallel}"],
        }
    )
    script = render_script(slurm, [str(folder / "jobs.json")], slurm.job_name or "compare",
                           str(folder))  # fmt: skip
    # one log per array task (%A: the array's id, %a: the task's index)
    script = script.replace(f"--output={folder}/%j.out", f"--output={folder}/%A_%a.out")
    write_job_script(folder / "submit.slurm", script, private=False)
    return folder / "submit.slurm"


def _queued(job_id: str) -> bool:
    out = subprocess.run(["squeue", "-h", "-j", job_id], capture_output=True, text=True)
    return bool(out.stdout.strip()) and out.returncode == 0


def run_slurm(jobs: list[Job], args: CompareArgs) -> None:
    """Submit `jobs` as one array, print each run as it finishes, stop when the array ends."""
    script = write_array(jobs, args)
    job_id = submit(script)
    print(f"compare: submitted {len(jobs)} run(s) as SLURM array job {job_id} ({script}; "
          f"logs {script.parent}/{job_id}_<task>.out)", flush=True)  # fmt: skip
    pending, start = dict(enumerate(jobs)), time.monotonic()
    while pending:
        queued = _queued(job_id)
        for index, job in list(pending.items()):
            if (job.dump_dir / "done.json").exists():
                del pending[index]
                done = len(jobs) - len(pending)
                elapsed = time.monotonic() - start
                eta = elapsed / done * len(pending)
                print(f"compare: [{done}/{len(jobs)}] done  {job.label} (array task {index}); "
                      f"{len(pending)} left, ~{eta / 60:.1f} min at this pace", flush=True)  # fmt: skip
        if pending and not queued:
            index, job = next(iter(pending.items()))
            raise UserError(
                f"SLURM array job {job_id} ended without {job.label} (task {index}): see "
                f"{script.parent}/{job_id}_{index}.out and {job.dump_dir / 'train.out'}"
            )
        if pending:
            time.sleep(args.poll_s)
