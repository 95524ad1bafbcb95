"""Two nodes emulated on one machine: two torchrun agents (`--nnodes 2`, one worker each) train
the tiny entropy model on 2 FSDP ranks, are preempted with SIGUSR2 and resume bitwise.

Each agent is a "node" whose only worker has LOCAL_RANK 0, so the second node's worker has
RANK 1 != LOCAL_RANK 0: whatever wrongly keys on the local rank (the run lock, the data shard,
checkpoint files) would show here. The first run meets through the c10d rendezvous (what the
SLURM launcher's srun script uses; it orders nodes itself), the resume through the static one
with `--node-rank`. Both runs must be bitwise the uninterrupted 2-rank single-node run: the same
losses at every step and the same data-loader state per rank.

The SLURM half runs the launcher's multi-node (`srun`) script on a two-node cluster whose
slurmd each live in a network namespace of their own (slurm_cluster.NetnsSlurmCluster): one
torchrun agent per node, USR2 to the batch shell, a save, a requeue and a bitwise resume; and
`srun -N2 python` without torchrun (ranks and rendezvous from SLURM's variables alone).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
from harness import (
    ENTRY,
    REPO_ROOT,
    TrainRun,
    child_env,
    env_of,
    losses_by_step,
    model_args,
    read_metrics,
)
from slurm_cluster import NetnsSlurmCluster, slurm_two_nodes_fixture  # noqa: F401 (the fixture)
from test_resume import PREEMPT_AT, STEP_DELAY, checkpoint_steps
from test_slurm import PREEMPTION_SIGNAL, preempt_requeue_resume

from tests.limits import hang_limit

NNODES = 2
STEPS = 20  # the reference run's length (harness.COMMON)
# Batches read in the trainer (no loader process: 5 s less per launch on 2 busy cores); they are
# the reference's batches, which reads them ahead in a process (the SLURM test below does too).
SYNC = "data.load_async=false"


def describe(nodes: list[TrainRun]) -> str:
    return "\n".join(f"=== node {i}: {node.describe()}" for i, node in enumerate(nodes))


def check_alive(nodes: list[TrainRun]) -> None:
    """Fail at once when an agent failed: its peer would otherwise wait in a collective."""
    for i, node in enumerate(nodes):
        if node.proc.poll() not in (None, 0):
            raise AssertionError(f"node {i} exited {node.proc.returncode}\n{describe(nodes)}")


def wait_for_step(nodes: list[TrainRun], step: int, timeout: float = hang_limit(240)) -> None:
    def reached() -> bool:
        check_alive(nodes)
        records = read_metrics(nodes[0].dump_dir)
        return bool(records) and records[-1]["global_step"] >= step

    nodes[0].wait_for(reached, f"step {step} in metrics.jsonl", timeout)


def wait_all_ok(nodes: list[TrainRun], timeout: float = hang_limit(240)) -> str:
    """Both agents exited 0; their outputs joined."""
    deadline = time.monotonic() + timeout
    while any(node.proc.poll() is None for node in nodes):
        check_alive(nodes)
        if time.monotonic() > deadline:
            raise AssertionError(f"runs timed out after {timeout}s\n{describe(nodes)}")
        time.sleep(0.05)
    check_alive(nodes)
    return "\n".join(node.output() for node in nodes)


def workers(nodes: list[TrainRun]) -> dict[int, tuple[int, int, dict[str, str]]]:
    """Global rank -> (node index, pid, environment) of every training worker."""
    found = {}
    for i, node in enumerate(nodes):
        pids = node.worker_pids()
        assert len(pids) == 1, f"node {i}: workers {pids}\n{describe(nodes)}"
        for rank, pid in pids.items():
            found[rank] = (i, pid, env_of(pid))
    return found


def data_states(folder) -> dict[int, dict]:
    """Rank -> its data pipeline's state (a prefetching loader's: the state it wraps)."""
    states = {}
    for rank in range(NNODES):
        state = json.loads((folder / f"train_state_{rank:05d}.json").read_text())["data_state"]
        states[rank] = state["base"] if state["type"] == "multiprocess" else state
    return states


@pytest.mark.slow
def test_two_nodes_preempt_then_resume_is_bitwise(runner, references) -> None:
    reference = references.dump_dir("entropy", NNODES)  # torchrun --standalone, 2 workers
    expected = losses_by_step(reference)
    args = [*model_args("entropy", NNODES), SYNC]

    first = runner.start_nodes("run", args, NNODES, rdzv="c10d", env=STEP_DELAY)
    dump_dir = first[0].dump_dir
    wait_for_step(first, PREEMPT_AT)
    ranks = workers(first)
    assert sorted(ranks) == [0, 1] and ranks[0][0] != ranks[1][0], ranks
    for rank, (_node, _pid, env) in ranks.items():
        assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"]) == (str(rank), "0", "2")
    lock = json.loads((dump_dir / ".lock").read_text())
    assert lock["pid"] == ranks[0][1], f"the run lock is not held by global rank 0: {lock}"

    node_of_rank1 = first[ranks[1][0]]
    node_of_rank1.signal_rank(1, signal.SIGUSR2)  # LOCAL_RANK 0 on its node, not global rank 0
    out = wait_all_ok(first)
    stopped = read_metrics(dump_dir)[-1]["global_step"]
    assert PREEMPT_AT <= stopped < STEPS, f"stopped at step {stopped}\n{describe(first)}"
    assert f"stopped at step {stopped}; run the same command again to resume" in out
    markers = checkpoint_steps(dump_dir)
    assert markers[stopped] is not None and "preempt" in markers[stopped]["kinds"], markers
    folder = dump_dir / "checkpoints" / f"{stopped:010d}"
    for rank in range(NNODES):  # every rank wrote its shard, manifest and train state
        for name in (f"__{rank}_0.distcp", f"manifest_{rank:05d}.json"):
            assert (folder / name).is_file(), sorted(p.name for p in folder.iterdir())
    assert not (dump_dir / ".lock").exists(), "the run lock outlived the run"

    second = runner.start_nodes("run", args, NNODES, rdzv="static")
    out = wait_all_ok(second)
    assert f"resumed from {folder} at step {stopped}" in out, describe(second)

    got = losses_by_step(dump_dir)  # both runs append to the same metrics.jsonl
    assert sorted(got) == list(range(1, STEPS + 1))
    mismatches = {s: (got[s], expected[s]) for s in got if got[s] != expected[s]}
    assert not mismatches, f"losses differ from the single-node run (got, expected): {mismatches}"
    # Each node read its own shard: the data-loader state of each rank is the single-node one's.
    final = dump_dir / "checkpoints" / f"{STEPS:010d}"
    states = data_states(final)
    assert states[0] != states[1], "both ranks read the same data"
    assert states == data_states(reference / "checkpoints" / f"{STEPS:010d}")
    assert not (dump_dir / ".lock").exists()


@pytest.mark.slow
@pytest.mark.slurm
def test_slurm_two_nodes_srun_preempt_requeue_resume(
    slurm_two_nodes: NetnsSlurmCluster, runner, references, tmp_path
) -> None:
    expected = losses_by_step(references.dump_dir("entropy", NNODES))
    options = [f"--nodes={NNODES}", "--nproc-per-node=1", "--cpus-per-task=1"]
    dump_dir = tmp_path / "job"
    text, job = preempt_requeue_resume(slurm_two_nodes, runner, options, dump_dir, expected)
    assert "srun --ntasks-per-node=1" in (dump_dir / "submit.slurm").read_text()
    assert job["NumNodes"] == str(NNODES), job
    assert "bytelatent: job" in text and f"on {slurm_two_nodes.nodes[0]} at" in text
    for rank in range(NNODES):  # both ranks logged, and both wrote their part of the checkpoint
        assert f"{rank}: INFO" in text, text[-4000:]
        assert (dump_dir / "checkpoints" / "0000000020" / f"__{rank}_0.distcp").is_file()


@pytest.mark.slow
@pytest.mark.slurm
def test_slurm_two_nodes_preemption_sigterm_saves_requeues_resumes(
    slurm_two_nodes: NetnsSlurmCluster, runner, references, tmp_path
) -> None:
    """What a preemption sends: SIGTERM to every task of the job on both nodes at once (torchrun
    agents, workers, data-loader processes), SIGKILL after KillWait. The job must save, requeue
    itself and resume bitwise, as with the time-limit warning."""
    expected = losses_by_step(references.dump_dir("entropy", NNODES))
    options = [f"--nodes={NNODES}", "--nproc-per-node=1", "--cpus-per-task=1"]
    dump_dir = tmp_path / "job"
    text, _job = preempt_requeue_resume(
        slurm_two_nodes, runner, options, dump_dir, expected, signal_args=PREEMPTION_SIGNAL
    )
    assert "received SIGTERM" in text


@pytest.mark.slow
@pytest.mark.slurm
def test_srun_python_on_two_nodes_matches_one_node(
    slurm_two_nodes: NetnsSlurmCluster, runner, references, tmp_path
) -> None:
    """`srun -N2 python -m bytelatent.train` without torchrun: each task finds its rank, the
    rendezvous host (the first node, by `scontrol show hostnames`) and port from SLURM alone."""
    expected = losses_by_step(references.dump_dir("entropy", NNODES))
    dump_dir = tmp_path / "srun"
    done = subprocess.run(
        [
            "srun", f"--nodes={NNODES}", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
            sys.executable, str(ENTRY), *runner.config(model_args("entropy", NNODES), dump_dir),
        ],
        cwd=REPO_ROOT,
        env=child_env(slurm_two_nodes.env()),
        capture_output=True,
        text=True,
        timeout=hang_limit(300),
    )  # fmt: skip
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert losses_by_step(dump_dir) == expected
