"""Submit a training run to SLURM: `python -m bytelatent.launch.slurm [options] config=... key=value ...`

Writes `{dump_dir}/submit.slurm` and submits it with sbatch (`--dry-run` only writes it). The
script asks for USR2 `signal_seconds` before the time limit (`--signal=B:USR2@N`), is requeueable
(`--requeue`) and appends to one log per job (`--open-mode=append`) so that every restart of a
requeued job lands in the same file. How the signal reaches the training processes
(docs/slurm.md has the details):

* one node (`direct`): the batch shell runs torchrun (or python for one process) in the
  background and forwards USR2/TERM to torchrun's worker processes (`pkill -P`). torchrun starts
  its workers in sessions of their own, so a signal to the batch shell's process group (what
  `scancel --signal=USR2 --full` and `--signal=USR2@N` without `B:` do for a batch script)
  never reaches them; forwarding does.
* several nodes (`srun`): one `srun` task per node runs torchrun with USR2 and TERM ignored and
  torchrun's own SIGTERM handler off (the workers install their own handler); the batch shell
  forwards USR2 to the whole srun step on every node with `scancel --signal=USR2 $SLURM_JOB_ID`
  (job steps only, not the batch shell). A preemption's SIGTERM (slurmctld signals every
  process of the job's steps, then SIGKILL after KillWait) reaches the workers directly.

The workers then agree on the signal at the next step boundary, save a "preempt" checkpoint,
and rank 0 asks for a requeue by writing the job id to `$BYTELATENT_REQUEUE_FILE`; once training
has exited, the script runs `scontrol requeue` (requeueing SIGTERMs the whole job: a torchrun
still running would print a SignalException traceback). The job restarts with the same id and
resumes from the checkpoint.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from pathlib import Path

from pydantic import ValidationError

from bytelatent.args import TrainArgs
from bytelatent.config.parser import parse_args
from bytelatent.config.redact import redact_argv
from bytelatent.distributed.signals import REQUEUE_FILE_ENV
from bytelatent.errors import ConfigError, UserError
from bytelatent.launch.args import SlurmArgs

SCRIPT_NAME = "submit.slurm"


def _sbatch_header(args: SlurmArgs, job_name: str, log_dir: str) -> list[str]:
    options = [
        f"--job-name={job_name}",
        f"--nodes={args.nodes}",
        "--ntasks-per-node=1",
        f"--output={log_dir}/%j.out",
        "--open-mode=append",
        f"--signal=B:USR2@{args.signal_seconds}",
        "--requeue" if args.requeue else "--no-requeue",
    ]
    optional = {
        "gpus-per-node": args.gpus_per_node,
        "cpus-per-task": args.cpus_per_task,
        "mem": args.mem,
        "time": args.time,
        "partition": args.partition,
        "account": args.account,
        "qos": args.qos,
        "constraint": args.constraint,
    }
    options += [f"--{key}={value}" for key, value in optional.items() if value is not None]
    options += args.sbatch_args
    for option in options:
        # A line break would end the `#SBATCH` comment and run the rest as a shell command.
        if any(c in option for c in "\n\r\0"):
            raise ConfigError(f"sbatch option {option!r}: line breaks are not allowed")
    return ["#!/bin/bash", *(f"#SBATCH {option}" for option in options)]


# torchrun's agent raises on the signals listed in its `--signals-to-handle` (read from
# PET_SIGNALS_TO_HANDLE too; default SIGTERM,SIGINT,SIGHUP,SIGQUIT), which it passes to its
# process context as TORCHELASTIC_SIGNALS_TO_HANDLE (what torch versions without the option read).
TORCHRUN_SIGNALS_ENV = ("PET_SIGNALS_TO_HANDLE", "TORCHELASTIC_SIGNALS_TO_HANDLE")
AGENT_SIGNALS = "SIGINT,SIGHUP,SIGQUIT"


def _direct_launch(args: SlurmArgs, train_argv: list[str]) -> tuple[str, str]:
    """(command, how to forward signal $1) for one node: torchrun (or python) as a child."""
    if args.nproc_per_node == 1:
        command = [args.python, "-m", args.module, *train_argv]
        return shlex.join(command), 'kill -"$1" "$child" 2>/dev/null || true'
    command = [
        args.python, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={args.nproc_per_node}", "-m", args.module, *train_argv,
    ]  # fmt: skip
    # torchrun's workers are its children, in sessions of their own.
    return shlex.join(command), 'pkill -"$1" -P "$child" || true'


def _srun_launch(args: SlurmArgs, train_argv: list[str]) -> tuple[str, str]:
    """(command, how to forward signal $1) for several nodes: one torchrun agent per node via srun."""
    torchrun = shlex.join([args.python, "-m", "torch.distributed.run"])
    rendezvous = (
        ' --nnodes="$SLURM_NNODES" --rdzv-backend=c10d --rdzv-id="$SLURM_JOB_ID"'
        ' --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT"'
    )
    rest = shlex.join([f"--nproc-per-node={args.nproc_per_node}", "-m", args.module, *train_argv])
    # The agent ignores USR2 and TERM (an ignored signal stays ignored across exec), and torchrun
    # is told not to install its own SIGTERM handler (which would raise in the agent, take the
    # workers down and fail the srun task): a preemption SIGTERMs every process of the step on
    # every node, and the workers (which set their own handlers) save, requeue and exit 0.
    per_node = (
        f"trap '' USR2 TERM; export {' '.join(f'{k}={AGENT_SIGNALS}' for k in TORCHRUN_SIGNALS_ENV)}; "
        f"exec {torchrun}{rendezvous} {rest}"
    )
    command = (
        'MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"\n'
        'export MASTER_ADDR MASTER_PORT="$((20000 + SLURM_JOB_ID % 12768))"\n'
        f"srun --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c {shlex.quote(per_node)}"
    )
    # Every process of the srun steps on every node (SLURM signals the whole step), not this shell;
    # once, in case a SLURM version also signals the batch shell (the trap would loop).
    forward = (
        'if [ "$1" = USR2 ] && [ -z "${usr2_sent:-}" ]; then usr2_sent=1; '
        'scancel --signal=USR2 "$SLURM_JOB_ID" || true; fi'
    )
    return command, forward


def render_script(args: SlurmArgs, train_argv: list[str], job_name: str, log_dir: str) -> str:
    """The sbatch script for `train_argv` (the training config as key=value arguments)."""
    launch = _direct_launch if args.resolved_launcher() == "direct" else _srun_launch
    command, forward = launch(args, train_argv)
    body = [
        "# Written by `python -m bytelatent.launch.slurm` (see docs/slurm.md).",
        "set -u",
        f"cd {shlex.quote(args.workdir)}",
        "echo \"bytelatent: job $SLURM_JOB_ID restart ${SLURM_RESTART_COUNT:-0} on $(hostname) at $(date '+%F %T')\"",
        *args.setup,
        "forward() {",
        '    echo "bytelatent: SIG$1 received; forwarding it to the training processes"',
        f"    {forward}",
        "}",
        # bash runs a trap only between commands, so training runs in the background and the
        # shell sits in `wait`, which a trapped signal interrupts.
        "trap 'forward USR2' USR2",
        "trap 'forward TERM' TERM",
        # Rank 0 writes the job id here on preemption; the requeue waits until torchrun has
        # exited, because it SIGTERMs the whole job (a live torchrun agent would print a
        # SignalException traceback).
        f'export {REQUEUE_FILE_ENV}={shlex.quote(log_dir)}/requeue."$SLURM_JOB_ID"',
        f'rm -f "${REQUEUE_FILE_ENV}"',
        f"{command} &",
        "child=$!",
        "while :; do",
        '    wait "$child"; status=$?',
        '    if [ "$status" -gt 128 ] && kill -0 "$child" 2>/dev/null; then continue; fi',
        "    break",
        "done",
        'echo "bytelatent: training exited with status $status (restart ${SLURM_RESTART_COUNT:-0})"',
        f'if [ -s "${REQUEUE_FILE_ENV}" ]; then',
        f'    job="$(cat "${REQUEUE_FILE_ENV}")"; rm -f "${REQUEUE_FILE_ENV}"',
        "    trap '' TERM USR2  # the requeue's SIGTERM to this shell is expected",
        '    if scontrol requeue "$job"; then echo "bytelatent: requeued SLURM job $job";',
        '    else echo "bytelatent: scontrol requeue $job failed; resubmit by hand"; fi',
        "fi",
        'exit "$status"',
    ]
    return "\n".join([*_sbatch_header(args, job_name, log_dir), "", *body, ""])


def write_script(args: SlurmArgs, train_argv: list[str]) -> Path:
    """Validate the training config, then write `{dump_dir}/submit.slurm`; returns its path."""
    train = parse_args(TrainArgs, train_argv)  # fail here, not minutes later in the queue
    # The job runs in `workdir`, so relative paths in the config are relative to it.
    dump_dir = (Path(args.workdir) / train.dump_dir).resolve()
    log_dir = (Path(args.workdir) / args.log_dir).resolve() if args.log_dir else dump_dir / "slurm"
    log_dir.mkdir(parents=True, exist_ok=True)
    dump_dir.mkdir(parents=True, exist_ok=True)  # with --log-dir elsewhere it may not exist yet
    script = dump_dir / SCRIPT_NAME
    text = render_script(args, train_argv, args.job_name or train.name, str(log_dir))
    write_job_script(script, text, private=bool(args.setup) or carries_environment(train_argv))
    return script


def carries_environment(argv: list[str]) -> bool:
    """Whether `key=value` arguments set environment variables or secret-looking values."""
    sets_env = any("env" in arg.partition("=")[0].split(".") for arg in argv)
    return sets_env or redact_argv(argv) != argv


def write_job_script(path: Path, text: str, private: bool) -> None:
    """Write a job script; a `private` one (environment values, secrets) is 0600 from the start."""
    if not private:
        path.write_text(text)
        return
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        os.fchmod(handle.fileno(), 0o600)  # an existing script keeps no wider mode
        handle.write(text)


def submit(script: Path, sbatch: str = "sbatch") -> str:
    """`sbatch --parsable script`; returns the job id."""
    try:
        result = subprocess.run(
            [sbatch, "--parsable", str(script)], capture_output=True, text=True, check=False
        )
    except FileNotFoundError:
        raise ConfigError(
            f"{sbatch}: not found; run on a SLURM login node or use --dry-run"
        ) from None
    if result.returncode != 0:
        raise ConfigError(
            f"sbatch {script} failed: {result.stderr.strip() or result.stdout.strip()}"
        )
    return result.stdout.strip().split(";")[0]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bytelatent.launch.slurm",
        allow_abbrev=False,  # `--gpus=8` must be an error, not --gpus-per-node
        description="Write {dump_dir}/submit.slurm for a training config and submit it with sbatch.",
        epilog="Everything of the form key=value (config=... first) is the training config.",
    )
    for name, field in SlurmArgs.model_fields.items():
        flag = "--" + name.replace("_", "-")
        if name in ("setup", "sbatch_args"):
            parser.add_argument(flag, action="append", default=None, help=field.description)
        elif name == "requeue":
            parser.add_argument(
                "--no-requeue",
                dest="requeue",
                action="store_false",
                default=None,
                help="#SBATCH --no-requeue (default: --requeue)",
            )
        else:
            parser.add_argument(flag, default=None, help=field.description)
    parser.add_argument("--dry-run", action="store_true", help="write the script, do not submit it")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    options, rest = _parser().parse_known_args(argv)
    bad = [a for a in rest if a.startswith("-") or "=" not in a]
    try:
        if bad:
            raise ConfigError(f"{bad[0]}: not a launcher option nor a key=value training argument")
        given = {k: v for k, v in vars(options).items() if v is not None and k != "dry_run"}
        try:
            args = SlurmArgs.model_validate(given)
        except ValidationError as e:
            err = e.errors()[0]
            raise ConfigError(
                f"--{'-'.join(map(str, err['loc'])).replace('_', '-')}: {err['msg']}"
            ) from None
        script = write_script(args, rest)
        if options.dry_run:
            print(f"bytelatent: wrote {script} (not submitted)")
            return 0
        job_id = submit(script)
    except UserError as e:
        print(e.one_line(), file=sys.stderr)
        return 2
    print(f"bytelatent: submitted job {job_id} ({script})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
