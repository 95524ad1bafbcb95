"""Run `bytelatent.train` in subprocesses (plain or under torchrun) and watch them from a test.

Every run gets its own session/process group, a log file and a deadline; `Runner.cleanup()`
kills whatever group is still alive, so a failing test leaves no process behind.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from tests.limits import hang_limit
from tests.tiny import BLT_CONFIG, ENTROPY_CONFIG, TINY_BLT_MODEL, TINY_ENTROPY_MODEL

REPO_ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
ENTRY = HERE / "train_entry.py"
PROBE = HERE / "probe_checkpoint.py"

# Launcher/cluster variables of an enclosing job must not leak into the runs under test.
_LEAKY_PREFIXES = ("SLURM_", "SLURMD_", "SRUN_", "SBATCH_", "TORCHELASTIC_")
_LEAKY_NAMES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)

# Tiny models so that a whole run (start-up included) takes seconds on 2 shared cores.
ENTROPY_TINY = [f"config={ENTROPY_CONFIG}", *TINY_ENTROPY_MODEL, "data.seq_len=64"]
BLT_TINY = [f"config={BLT_CONFIG}", *TINY_BLT_MODEL, "data.seq_len=24"]
# Shared by every run: exact numerics (fp32), a loss per step, the prefetching data loader on,
# a periodic checkpoint at step 10 (the resharding tests resume from it).
COMMON = [
    "steps=20",
    "optim.warmup=5",
    "distributed.model_dtype=fp32",
    "logging.freq=1",
    "data.load_async=true",
    "data.buffer_size=4",
    "data.prefetch_size=4",
    "num_threads=1",
    "checkpoint.dump.every=10",
]
GLOBAL_BATCH = 2  # rows per optimizer step; each of N data-parallel ranks gets GLOBAL_BATCH / N
MODELS = {"entropy": ENTROPY_TINY, "blt": BLT_TINY}


def model_args(model: str, nproc: int) -> list[str]:
    """Tiny `model` ("entropy" or "blt") on `nproc` FSDP ranks with the same global batch."""
    return [
        *MODELS[model],
        f"data.batch_size={GLOBAL_BATCH // nproc}",
        f"distributed.dp_shard={nproc}",
    ]


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(_LEAKY_PREFIXES) and k not in _LEAKY_NAMES
    }
    paths = [str(REPO_ROOT), str(HERE), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def train_command(args: Sequence[str], nproc: int = 1, script: Path = ENTRY) -> list[str]:
    """`python script args`, or the same under `torchrun --standalone` for nproc > 1."""
    if nproc == 1:
        return [sys.executable, str(script), *args]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(script),
        *args,
    ]


def free_port() -> int:
    """A free TCP port on 127.0.0.1 below Linux's ephemeral range (32768-60999), where outgoing
    connections could take it between this check and the rendezvous binding it (EADDRINUSE)."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randint(20000, 32767)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-32767")


def node_commands(
    args: Sequence[str], nnodes: int, rdzv: str, port: int, script: Path = ENTRY
) -> list[list[str]]:
    """One torchrun agent per emulated node (one worker each) meeting on 127.0.0.1:`port`.

    rdzv "c10d": the dynamic rendezvous the SLURM launcher uses (node ranks follow join order,
    `--node-rank` is ignored); "static": `--node-rank i` and the master address, so node i's
    worker is rank i. Either way every worker has LOCAL_RANK 0, so RANK != LOCAL_RANK off node 0.
    """
    if rdzv == "c10d":
        where = ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={port}"]
    elif rdzv == "static":
        where = ["--rdzv-backend=static", "--master-addr=127.0.0.1", f"--master-port={port}"]
    else:
        raise ValueError(f"rdzv={rdzv!r}: expected c10d or static")
    launcher = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}"]

    def node(i: int) -> list[str]:
        rank = [f"--node-rank={i}"] if rdzv == "static" else []
        return [*launcher, "--nproc-per-node=1", *where, *rank, str(script), *args]

    return [node(i) for i in range(nnodes)]


def read_metrics(dump_dir: str | os.PathLike) -> list[dict]:
    path = Path(dump_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written right now
            break
    return records


def metric_by_step(dump_dir: str | os.PathLike, key: str) -> dict[int, float]:
    """global_step -> `key` of the records that have it (e.g. an `aux/...` term)."""
    return {r["global_step"]: r[key] for r in read_metrics(dump_dir) if key in r}


def losses_by_step(dump_dir: str | os.PathLike) -> dict[int, float]:
    """global_step -> loss; fails on a step logged twice (a resume must not repeat steps)."""
    out: dict[int, float] = {}
    for record in read_metrics(dump_dir):
        step = record["global_step"]
        assert step not in out, f"step {step} logged twice in {dump_dir}/metrics.jsonl"
        out[step] = record["loss"]
    return out


def children_of(pid: int) -> list[int]:
    kids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may contain spaces, so split after the last ')'
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            kids.append(int(entry.name))
    return sorted(kids)


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (torchrun's workers run in sessions of their own)."""
    found, frontier = [], [pid]
    while frontier:
        kids = [k for parent in frontier for k in children_of(parent)]
        found.extend(kids)
        frontier = kids
    return found


def cmdline_of(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def env_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(
        item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item
    )


class TrainRun:
    """One training command running in its own process group."""

    def __init__(self, command: list[str], dump_dir: Path, nproc: int, env: dict[str, str] | None):
        self.dump_dir = Path(dump_dir)
        self.nproc = nproc
        self.dump_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.dump_dir.parent / f"{self.dump_dir.name}.{time.monotonic_ns()}.log"
        self._log = open(self.log_path, "w")
        self.command = command
        self.agent = "torch.distributed.run" in command  # torchrun: workers are its children
        self.proc = subprocess.Popen(
            self.command,
            cwd=REPO_ROOT,
            env=child_env(env),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def output(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def describe(self) -> str:
        return f"command: {' '.join(self.command)}\n--- output (tail):\n{self.output()[-6000:]}"

    def wait(self, timeout: float = hang_limit(300)) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"run timed out after {timeout:.0f}s\n{self.describe()}") from None

    def wait_ok(self, timeout: float = hang_limit(300)) -> str:
        rc = self.wait(timeout)
        assert rc == 0, f"run exited {rc}\n{self.describe()}"
        return self.output()

    def wait_for(self, condition, what: str, timeout: float = hang_limit(240)) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"run exited ({self.proc.returncode}) before {what}\n{self.describe()}"
                )
            if time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"timed out waiting for {what}\n{self.describe()}")
            time.sleep(0.02)

    def wait_for_step(self, step: int, timeout: float = hang_limit(240)) -> None:
        def reached() -> bool:
            records = read_metrics(self.dump_dir)
            return bool(records) and records[-1]["global_step"] >= step

        self.wait_for(reached, f"step {step} in metrics.jsonl", timeout)

    def worker_pids(self) -> dict[int, int]:
        """rank -> pid of the training processes (the process itself, or torchrun's workers)."""
        if not self.agent:
            return {0: self.proc.pid}
        ranks = {}
        for pid in children_of(self.proc.pid):
            try:
                rank = env_of(pid).get("RANK")
            except OSError:
                continue
            if rank is not None:
                ranks[int(rank)] = pid
        return ranks

    def signal_rank(self, rank: int, sig: int = signal.SIGUSR2) -> None:
        pids = self.worker_pids()
        assert rank in pids, f"no process for rank {rank} (found {pids})\n{self.describe()}"
        os.kill(pids[rank], sig)

    def kill(self) -> None:
        """SIGKILL the launcher and every process below it (workers, data-loader processes)."""
        for _ in range(2):  # a second pass catches anything started while the first one ran
            for pid in [*descendants(self.proc.pid), self.proc.pid]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=hang_limit(30))
        except subprocess.TimeoutExpired:
            pass

    def close(self) -> None:
        self.kill()
        self._log.close()


class Runner:
    """Starts training runs for one test and kills their process groups at teardown."""

    def __init__(self, data_root: Path, tmp: Path):
        self.data_root = data_root
        self.tmp = tmp
        self.runs: list[TrainRun] = []

    def config(self, args: Sequence[str], dump_dir: Path) -> list[str]:
        """`args` (config=... first) with the shared settings, this test's data and dump_dir."""
        return [
            *args[:1],
            *COMMON,
            f"data.root_dir={self.data_root}",
            *args[1:],
            f"dump_dir={dump_dir}",
        ]

    def start(
        self,
        name: str,
        args: Sequence[str],
        nproc: int = 1,
        env: dict[str, str] | None = None,
    ) -> TrainRun:
        dump_dir = self.tmp / name
        run = TrainRun(train_command(self.config(args, dump_dir), nproc), dump_dir, nproc, env)
        self.runs.append(run)
        return run

    def start_nodes(
        self,
        name: str,
        args: Sequence[str],
        nnodes: int,
        rdzv: str,
        env: dict[str, str] | None = None,
    ) -> list[TrainRun]:
        """`nnodes` torchrun agents, one worker each, as if on `nnodes` machines sharing `name`'s
        dump_dir (see `node_commands`); each agent has its own log."""
        dump_dir = self.tmp / name
        commands = node_commands(self.config(args, dump_dir), nnodes, rdzv, free_port())
        nodes = [TrainRun(command, dump_dir, 1, env) for command in commands]
        self.runs.extend(nodes)
        return nodes

    def probe(
        self,
        name: str,
        args: Sequence[str],
        checkpoint: Path,
        nproc: int,
        batch_world: int,
        batch_size: int,
    ) -> dict:
        """probe_checkpoint.py on `nproc` ranks: losses before/after one step on a fixed batch."""
        dump_dir = self.tmp / name
        out = self.tmp / f"{name}.json"
        config = self.config([*args, f"checkpoint.load_path={checkpoint}"], dump_dir)
        command = train_command(
            [str(out), str(batch_world), str(batch_size), *config], nproc, script=PROBE
        )
        run = TrainRun(command, dump_dir, nproc, None)
        self.runs.append(run)
        run.wait_ok()
        return json.loads(out.read_text())

    def cleanup(self) -> None:
        for run in self.runs:
            run.close()
        # Safety net: anything still running with this test's temp dir on its command line.
        marker = str(self.tmp).encode()
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and int(entry.name) != os.getpid():
                try:
                    if marker in (entry / "cmdline").read_bytes():
                        os.kill(int(entry.name), signal.SIGKILL)
                except (OSError, ProcessLookupError):
                    continue
