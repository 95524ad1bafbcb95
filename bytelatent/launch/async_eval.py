"""Async evals: every `checkpoint.eval` save is evaluated by a separate job; training never waits.

`eval.async_launch.mode`:
* `local`: a detached process (`python -m bytelatent.eval`, torchrun when `nproc > 1`) in its own
  session, on `devices` (CUDA_VISIBLE_DEVICES) or the CPU, logging to `evals/{step}/eval.log`;
* `slurm`: an sbatch job rendered by `bytelatent.launch.slurm` (same partition/account/... options
  under `eval.async_launch.slurm`, its own time limit), log `evals/{step}/{jobid}.out`.

The job writes `dump_dir/evals/{step:010d}/results.json` and appends its results line to
`dump_dir/metrics.eval.jsonl`. Before launching, the trainer writes a reader lease
`{checkpoint}/.lease.eval` (JSON: pid or SLURM job id, host); checkpoint retention never deletes a
leased folder, nor one whose eval is owed (no results: failed, or never ran), and the job removes
the lease when it ends. The trainer polls its jobs without
blocking (`poll_interval_s`): a job that ended without results is logged as failed, its lease
removed, and training goes on. On (re)start, `launch_owed` launches the eval of every complete eval
checkpoint without results, except those whose leased job is still alive (adopted, not rerun).
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bytelatent.checkpoint import fs as cfs
from bytelatent.checkpoint.manager import LEASE_PREFIX, step_folder_name
from bytelatent.errors import ConfigError, UserError
from bytelatent.eval.args import AsyncLaunchArgs
from bytelatent.launch.slurm import (
    carries_environment,
    render_script,
    submit,
    write_job_script,
)

logger = logging.getLogger("bytelatent")

LEASE_NAME = LEASE_PREFIX + "eval"
EVALS_DIR = "evals"
# Variables that would make the eval job believe it is a rank of the training job (torchrun's,
# and srun's: see bytelatent.distributed.env.detect_env).
_LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                  "ROLE_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
                  "SLURM_STEP_ID", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_STEP_NUM_TASKS")  # fmt: skip
_SLURM_ACTIVE = {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED", "REQUEUED",
                 "RESIZING", "REQUEUE_HOLD", "REQUEUE_FED", "SIGNALING", "STAGE_OUT"}  # fmt: skip


def eval_dir(dump_dir: str | os.PathLike, step: int) -> Path:
    return Path(dump_dir) / EVALS_DIR / step_folder_name(step)


def results_file(dump_dir: str | os.PathLike, step: int) -> Path:
    return eval_dir(dump_dir, step) / "results.json"


@dataclass
class EvalJob:
    step: int
    folder: str
    lease: str
    pid: int | None = None
    job_id: str | None = None
    proc: subprocess.Popen | None = None  # None when adopted from a previous trainer


def training_gpus(environ: Any) -> list[str] | None:
    """The GPUs (as CUDA_VISIBLE_DEVICES names them) this node's training ranks use, or None when
    that cannot be told (no CUDA, or no launcher variables)."""
    import torch

    if not torch.cuda.is_available():
        return None
    local = environ.get("LOCAL_WORLD_SIZE") or environ.get("SLURM_NTASKS_PER_NODE")
    n_local = int(local) if local and local.isdigit() else 1
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    names = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    return [name.strip() for name in names[:n_local]]


def check_eval_devices(devices: str, environ: Any, used: list[str] | None = None) -> None:
    """`eval.async_launch.devices` replaces the eval's CUDA_VISIBLE_DEVICES: refuse GPUs that
    this node's training ranks use (the eval would take their memory and time)."""
    used = training_gpus(environ) if used is None else used
    if not used:
        return
    shared = [d.strip() for d in devices.split(",") if d.strip() in used]
    if shared:
        raise ConfigError(
            f"eval.async_launch.devices={devices!r} includes GPU(s) {','.join(shared)} that "
            f"training uses on this node ({','.join(used)}, from CUDA_VISIBLE_DEVICES="
            f"{environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}); give the eval other GPUs, or "
            "leave devices unset to evaluate on CPU"
        )


def _pid_alive(pid: int) -> bool:
    """Running (not a zombie) and still an eval process (pids are reused)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    state = next((ln.split()[1] for ln in status.splitlines() if ln.startswith("State:")), "Z")
    return state != "Z" and b"bytelatent.eval" in cmdline


def slurm_job_state(job_id: str) -> tuple[str | None, str | None]:
    """(JobState, ExitCode) from `scontrol show job`, (None, None) once SLURM forgot the job."""
    try:
        out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True,
                             text=True, timeout=20, check=False).stdout  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return "UNKNOWN", None  # cannot tell: treat as alive, ask again next poll
    fields = dict(t.split("=", 1) for t in out.split() if "=" in t)
    return fields.get("JobState"), fields.get("ExitCode")


class AsyncEvalLauncher:
    """Rank 0's launcher (a disabled one elsewhere); the trainer calls `on_checkpoint`, `poll`."""

    def __init__(
        self,
        args: AsyncLaunchArgs,
        dump_dir: str,
        name: str,
        enabled: bool,
        checkpoints: Any = None,
    ) -> None:
        self.args = args
        self.checkpoints = checkpoints  # a CheckpointManager: hooked, scanned, retained
        self.dump_dir = str(Path(dump_dir).resolve())
        self.name = name
        self.enabled = enabled and args.mode != "none"
        self.jobs: dict[int, EvalJob] = {}
        self.failed: list[int] = []
        self._last_poll = 0.0
        # The run's own config names a plugin arch: its evals may import that module (the eval
        # job would otherwise refuse the checkpoint's "pkg.module:name", docs/reliability.md).
        self.allow_arch_import = False

    @classmethod
    def for_training(cls, args: Any, rank: int, checkpoints: Any) -> AsyncEvalLauncher:
        """Rank 0 launches; every rank hooks its manager (the hook is a no-op off rank 0)."""
        launch = args.eval.async_launch
        if launch.mode == "local" and launch.devices:
            check_eval_devices(launch.devices, os.environ)
        launcher = cls(launch, args.dump_dir, args.name, rank == 0, checkpoints)
        launcher.allow_arch_import = ":" in getattr(args, "arch", "")
        checkpoints.on_complete = launcher.on_checkpoint
        checkpoints.hold = launcher.retention_hold
        return launcher

    def retention_hold(self, step: int, folder: str, kinds: list[str]) -> str | None:
        """Why retention must keep `folder`: its eval is owed (no results yet: failed or not run).

        A failed eval's checkpoint stays until an eval of it succeeds (`launch_owed` relaunches
        it on the next start); then retention may take it.
        """
        if self.enabled and "eval" in kinds and not results_file(self.dump_dir, step).exists():
            return f"its async eval is owed (no {results_file(self.dump_dir, step)})"
        return None

    # ------------------------------------------------------------------ launching
    def on_checkpoint(self, step: int, folder: str, kinds: list[str]) -> None:
        """The checkpoint manager's hook, called once a save is complete (marker written)."""
        if self.enabled and "eval" in kinds:
            self.launch(step, folder)

    def launch_owed(self) -> None:
        """Evals a previous run of this training owes: complete eval checkpoints without results."""
        if not self.enabled:
            return
        for step, folder, kinds in self.checkpoints.complete_checkpoints():
            if "eval" not in kinds:
                continue
            job = self._adopt(step, folder)
            if job is not None:
                logger.info(
                    "async eval of step %d still running (from before); not relaunched", step
                )
                self.jobs[step] = job
                continue
            # A lease left by a job that is gone: nobody reads the folder, retention may have it.
            self._release(EvalJob(step, folder, cfs.join(folder, LEASE_NAME)))
            if not results_file(self.dump_dir, step).exists():
                logger.info("async eval of step %d is owed: launching it", step)
                self.launch(step, folder)

    def _adopt(self, step: int, folder: str) -> EvalJob | None:
        """The job of a live lease left by an earlier trainer, or None (no lease, or stale)."""
        lease = cfs.join(folder, LEASE_NAME)
        fs = cfs.get_fs(lease)
        if not cfs.exists(fs, lease):
            return None
        try:
            info = json.loads(cfs.read_text(fs, lease))
        except (json.JSONDecodeError, UnicodeDecodeError, OSError):
            info = {}
        job = EvalJob(step, folder, lease, pid=info.get("pid"), job_id=info.get("job_id"))
        if job.job_id is not None:
            alive = slurm_job_state(job.job_id)[0] in _SLURM_ACTIVE | {"UNKNOWN"}
        else:
            alive = (
                job.pid is not None
                and info.get("host") == socket.gethostname()
                and _pid_alive(job.pid)
            )
        return job if alive else None

    def launch(self, step: int, folder: str) -> None:
        """Start the eval of checkpoint `folder`; a failure to start is logged, never raised."""
        if "://" not in folder:
            folder = os.path.abspath(folder)  # the job may run elsewhere (SLURM workdir)
        out = eval_dir(self.dump_dir, step)
        out.mkdir(parents=True, exist_ok=True)
        lease = cfs.join(folder, LEASE_NAME)
        argv = [
            f"ckpt={folder}", f"dump_dir={out}", f"step={step}", f"lease={lease}",
            f"metrics_file={Path(self.dump_dir) / 'metrics.eval.jsonl'}", "eval.progress=false",
            *(["allow_arch_import=true"] if self.allow_arch_import else []),
            *self.args.overrides,
        ]  # fmt: skip
        job = EvalJob(step, folder, lease)
        fs = cfs.get_fs(lease)
        try:
            # The lease exists before the job does: retention can never race its first read.
            self._write_lease(fs, job)
            if self.args.mode == "local":
                self._start_local(job, argv, out)
            else:
                self._submit_slurm(job, argv, out)
            self._write_lease(fs, job)
        except (OSError, UserError, ValueError) as e:  # ValueError: a NUL byte in an argument
            logger.error("async eval of step %d could not start: %s", step, e)
            self.failed.append(step)
            self._release(job)
            return
        self.jobs[step] = job
        where = f"SLURM job {job.job_id}" if job.job_id else f"pid {job.pid}"
        logger.info("async eval of step %d launched (%s), results in %s", step, where, out)

    def _write_lease(self, fs: Any, job: EvalJob) -> None:
        info = {"step": job.step, "pid": job.pid, "job_id": job.job_id,
                "host": socket.gethostname(), "time": time.time()}  # fmt: skip
        cfs.write_text_atomic(fs, job.lease, json.dumps(info))

    def _command(self, argv: list[str]) -> list[str]:
        if self.args.nproc == 1:
            return [self.args.python, "-m", "bytelatent.eval", *argv]
        return [self.args.python, "-m", "torch.distributed.run", "--standalone",
                f"--nproc-per-node={self.args.nproc}", "-m", "bytelatent.eval", *argv]  # fmt: skip

    def _start_local(self, job: EvalJob, argv: list[str], out: Path) -> None:
        env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
        env["CUDA_VISIBLE_DEVICES"] = self.args.devices or ""  # "" hides every GPU: CPU eval
        threads = self.args.num_threads or (None if self.args.devices else 1)
        if threads:  # a CPU job shares the trainer's cores: one thread unless told otherwise
            env["OMP_NUM_THREADS"] = str(threads)
        env.update(self.args.env)
        command = self._command(argv)
        if self.args.nice:
            command = ["nice", "-n", str(self.args.nice), *command]
        with open(out / "eval.log", "ab") as log:
            job.proc = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                start_new_session=True,  # survives the trainer (and its Ctrl-C / kill)
            )  # fmt: skip
        job.pid = job.proc.pid

    def _submit_slurm(self, job: EvalJob, argv: list[str], out: Path) -> None:
        slurm = self.args.slurm.model_copy(
            update={"module": "bytelatent.eval", "nproc_per_node": self.args.nproc, "nodes": 1,
                    "python": self.args.python, "requeue": False}
        )  # fmt: skip
        # sbatch passes the trainer's environment on; the eval job is not one of its ranks.
        setup = ["unset " + " ".join(_LAUNCHER_VARS), *slurm.setup]
        env = {"OMP_NUM_THREADS": str(self.args.num_threads)} if self.args.num_threads else {}
        env.update(self.args.env)
        setup += [f"export {k}={shlex.quote(v)}" for k, v in env.items()]
        slurm = slurm.model_copy(update={"setup": setup})
        job_name = f"{slurm.job_name or self.name}-eval-{job.step}"
        script = out / "eval.slurm"
        private = bool(env) or bool(self.args.slurm.setup) or carries_environment(argv)
        write_job_script(script, render_script(slurm, argv, job_name, str(out)), private)
        job.job_id = submit(script)

    # ------------------------------------------------------------------ polling
    def poll(self, force: bool = False) -> None:
        """Reap ended jobs (non-blocking; at most every `poll_interval_s` unless forced)."""
        if not self.jobs:
            return
        now = time.monotonic()
        if not force and now - self._last_poll < self.args.poll_interval_s:
            return
        self._last_poll = now
        released = False
        for step, job in list(self.jobs.items()):
            ended, code = self._ended(job)
            if not ended:
                continue
            del self.jobs[step]
            self._release(job)
            released = True
            results = results_file(self.dump_dir, step)
            if results.exists() and code in (None, 0):
                bpb = json.loads(results.read_text()).get("val/bpb")
                logger.info("async eval of step %d done: val/bpb %s", step, bpb)
            else:
                self.failed.append(step)
                log = eval_dir(self.dump_dir, step) / (
                    "eval.log" if job.job_id is None else f"{job.job_id}.out"
                )
                logger.error("async eval of step %d failed (exit code %s); see %s; training goes on",
                             step, code, log)  # fmt: skip
        if released and self.checkpoints is not None:
            self.checkpoints.retain()  # folders kept for a reader may go now

    def _ended(self, job: EvalJob) -> tuple[bool, int | str | None]:
        if job.proc is not None:
            code = job.proc.poll()
            return code is not None, code
        if job.job_id is not None:
            state, exit_code = slurm_job_state(job.job_id)
            if state in _SLURM_ACTIVE or state == "UNKNOWN":
                return False, None
            code = None if exit_code in (None, "0:0") else f"{state} {exit_code}"
            return True, code
        return job.pid is None or not _pid_alive(job.pid), None

    def _release(self, job: EvalJob) -> None:
        """Remove the lease (the job does it itself; this covers jobs that died without it)."""
        try:
            fs = cfs.get_fs(job.lease)
            if cfs.exists(fs, job.lease):
                cfs.rm(fs, job.lease, recursive=False)
        except OSError as e:
            logger.warning("could not remove eval lease %s: %s", job.lease, e)

    def close(self) -> None:
        """At the end of training: wait up to `wait_on_exit_s` for jobs, report what is left."""
        if not self.enabled:
            return
        deadline = time.monotonic() + self.args.wait_on_exit_s
        self.poll(force=True)
        while self.jobs and time.monotonic() < deadline:
            time.sleep(min(0.5, self.args.poll_interval_s))
            self.poll(force=True)
        for step in sorted(self.jobs):
            logger.info("async eval of step %d still running; results will land in %s",
                        step, results_file(self.dump_dir, step))  # fmt: skip
