"""Preemption signals: a handler that only sets a flag; ranks agree on it at step boundaries.

An interactive Ctrl-C (SIGINT) is treated as a preemption too: the run saves at the next step
boundary and exits as a preempted run does; a second Ctrl-C stops the process at once (exit 130,
no save: the previous complete checkpoint stays the one a rerun resumes from).

Torch-free (torch is imported where the ranks agree): `python -m bytelatent.train` installs the
process's flag on its first line (`early_flag`), so a SIGUSR2/SIGTERM while the run starts
(config, process group, model build, checkpoint restore, data set-up) is kept, not fatal: the
trainer takes the same flag and stops cleanly at its first boundary.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess

logger = logging.getLogger("bytelatent")

PREEMPTION_SIGNALS = (signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)
INTERRUPT_EXIT_CODE = 128 + int(signal.SIGINT)  # a second Ctrl-C: the shell's convention


class PreemptionFlag:
    """Set asynchronously by SIGUSR2/SIGTERM/SIGINT; `agreed()` all-reduces it so every rank stops together.

    A rank-local flag would let ranks that did not receive the signal keep training while the
    others stop, and the job would hang in the next collective; the decision is a MAX all-reduce.
    """

    def __init__(self):
        self.received: int | None = None
        self._previous = {}

    def install(self) -> PreemptionFlag:
        """Handle the preemption signals from now on (a second call changes nothing)."""
        for sig in PREEMPTION_SIGNALS:
            if sig in self._previous:
                continue
            # A shell starts `cmd &` with SIGINT ignored: that job is not the terminal's to stop.
            if sig == signal.SIGINT and signal.getsignal(sig) is signal.SIG_IGN:
                continue
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:  # noqa: ARG002 - signal handler signature
        # Logging from a handler is unsafe (re-entrant locks); write straight to the fd.
        if signum == signal.SIGINT and self.received is not None:
            # A second Ctrl-C (or one after a preemption signal): the user wants out now.
            os.write(2, b"\nbytelatent: second Ctrl-C: stopping now, without saving\n")
            os._exit(INTERRUPT_EXIT_CODE)
        if self.received is not None:
            return
        self.received = signum
        if signum == signal.SIGINT:
            line = "\nbytelatent: Ctrl-C: saving at the next step boundary (Ctrl-C again to stop now)\n"
        else:
            line = f"bytelatent: received {signal.Signals(signum).name}; saving at the next step boundary\n"
        os.write(2, line.encode())

    @property
    def interactive(self) -> bool:
        """Whether the stop was asked for by Ctrl-C (SIGINT) rather than a scheduler."""
        return self.received == signal.SIGINT

    def agreed(self, device, group=None) -> bool:
        """True on every rank iff any rank received a signal (one tiny all-reduce when distributed)."""
        import torch
        import torch.distributed as dist

        local = 1 if self.received is not None else 0
        if not (dist.is_available() and dist.is_initialized()):
            return bool(local)
        flag = torch.tensor([local], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item())


_EARLY: PreemptionFlag | None = None


def early_flag() -> PreemptionFlag:
    """This process's flag, installed on first use: the train entry calls it on its first line."""
    global _EARLY
    if _EARLY is None or not _EARLY._previous:
        _EARLY = PreemptionFlag().install()
    return _EARLY


def under_slurm() -> bool:
    return "SLURM_JOB_ID" in os.environ


# Set by the batch script `bytelatent.launch.slurm` writes: requeue by writing the job id here and
# let the script run `scontrol requeue` once training has exited.
REQUEUE_FILE_ENV = "BYTELATENT_REQUEUE_FILE"


def requeue_slurm_job(is_rank0: bool) -> bool:
    """Rank 0 asks SLURM to requeue this job (same job id); returns whether the request succeeded.

    Under the launcher's batch script the request goes to the script instead: a requeue makes
    SLURM SIGTERM every process of the job at once, and a torchrun agent still waiting for its
    workers then dies with a `SignalException` traceback that reads like a crash. The script
    requeues after torchrun has exited, when only the batch shell is left to receive it.
    """
    if not is_rank0 or not under_slurm():
        return False
    job_id = os.environ.get("SLURM_ARRAY_JOB_ID", os.environ["SLURM_JOB_ID"])
    if "SLURM_ARRAY_TASK_ID" in os.environ:
        job_id = f"{job_id}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    if os.environ.get(REQUEUE_FILE_ENV):
        try:
            with open(os.environ[REQUEUE_FILE_ENV], "w") as f:
                f.write(job_id + "\n")
        except OSError as e:
            logger.error("could not ask the batch script to requeue job %s: %s", job_id, e)
            return False
        logger.info("requeue of SLURM job %s requested: the batch script runs it on exit", job_id)
        return True
    try:
        result = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True)
    except OSError as e:  # no scontrol on this node: the checkpoint is saved, requeue by hand
        logger.error("scontrol requeue %s failed: %s", job_id, e)
        return False
    if result.returncode != 0:
        logger.error("scontrol requeue %s failed: %s", job_id, result.stderr.strip())
        return False
    logger.info("requeued SLURM job %s", job_id)
    return True
