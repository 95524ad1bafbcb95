"""A real single-node SLURM cluster (munge + slurmctld + slurmd) in a temp dir, for tests.

Follows shared/reference/SLURM_RECIPE.md: Debian's slurm 22.05 and munge run as root without
systemd or cgroups (proctrack/linuxproc, task/none), on 127.0.0.1, with fast requeues
(`AuthInfo=cred_expire=5`, `sched_interval=1`). The config lives in the temp dir and is found
through SLURM_CONF (never /etc/slurm); the ports are picked free, so several clusters can coexist.
munged is started only when none answers, and then stopped again.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

DAEMONS = ("slurmctld", "slurmd", "sbatch", "munged", "pkill")


def slurm_missing() -> str | None:
    """Why a cluster cannot be started here, or None."""
    missing = [
        d for d in DAEMONS if shutil.which(d) is None and not Path(f"/usr/sbin/{d}").exists()
    ]
    if missing:
        return f"{', '.join(missing)} not installed (run scripts/ci_slurm_setup.sh as root)"
    if os.geteuid() != 0:
        return "the test cluster runs its daemons as root"
    return None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _alive(pid: int) -> bool:
    """Running and not a zombie (PID 1 here reaps orphans lazily, so zombies linger)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    state = next(
        (line.split()[1] for line in status.splitlines() if line.startswith("State:")), "Z"
    )
    return state != "Z"


def _stop_pid(pid: int, timeout: float = 10) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if _alive(pid):
        os.kill(pid, signal.SIGKILL)


def _sbin(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


class SlurmCluster:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.conf = self.root / "etc" / "slurm.conf"
        self.host = socket.gethostname().split(".")[0]
        self.started_munge = False

    # ------------------------------------------------------------------ lifecycle
    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}

    def _run(
        self, *command: str, timeout: float = 30, check: bool = True
    ) -> subprocess.CompletedProcess:
        return subprocess.run(
            command,
            env={**os.environ, **self.env()},
            capture_output=True,
            text=True,
            timeout=timeout,
            check=check,
        )

    def start(self) -> None:
        for sub in ("etc", "state/ctld", "state/d", "log", "run"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self._start_munge()
        self.conf.write_text(self._config())
        self._run(_sbin("slurmctld"), "-c", "-i", "-f", str(self.conf))
        self._run(_sbin("slurmd"), "-c", "-f", str(self.conf), "-N", self.host)
        deadline = time.monotonic() + 60
        while True:
            out = self._run("sinfo", "-h", "-o", "%T", check=False).stdout.strip()
            if out == "idle":
                return
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"slurm node not idle after 60 s (sinfo: {out!r})\n{self.logs()}"
                )
            time.sleep(0.1)

    def _munge_ok(self) -> bool:
        munge = subprocess.run(["munge", "-n"], capture_output=True, timeout=10)
        if munge.returncode != 0:
            return False
        return (
            subprocess.run(
                ["unmunge"], input=munge.stdout, capture_output=True, timeout=10
            ).returncode
            == 0
        )

    def _start_munge(self) -> None:
        if self._munge_ok():
            return
        run_dir = Path("/run/munge")
        run_dir.mkdir(parents=True, exist_ok=True)
        shutil.chown(run_dir, "munge", "munge")
        run_dir.chmod(0o755)
        if not Path("/etc/munge/munge.key").exists():
            subprocess.run(
                ["runuser", "-u", "munge", "--", "mungekey", "-c"], check=True, timeout=30
            )
        subprocess.run(["runuser", "-u", "munge", "--", _sbin("munged")], check=True, timeout=30)
        self.started_munge = True
        deadline = time.monotonic() + 10
        while not self._munge_ok():
            if time.monotonic() > deadline:
                raise RuntimeError("munged started but munge -n | unmunge keeps failing")
            time.sleep(0.1)

    def _config(self) -> str:
        r = self.root
        return "\n".join(
            [
                "ClusterName=bytelatent-test",
                f"SlurmctldHost={self.host}(127.0.0.1)",
                "SlurmUser=root",
                "SlurmdUser=root",
                f"SlurmctldPort={_free_port()}",
                f"SlurmdPort={_free_port()}",
                "AuthType=auth/munge",
                "CredType=cred/munge",
                "AuthInfo=cred_expire=5",  # also the wait before a requeued job restarts
                "MpiDefault=none",
                "MailProg=/bin/true",
                "ProctrackType=proctrack/linuxproc",
                "TaskPlugin=task/none",
                "JobAcctGatherType=jobacct_gather/none",
                "AccountingStorageType=accounting_storage/none",
                "JobCompType=jobcomp/filetxt",
                f"JobCompLoc={r}/log/jobcomp.log",
                "SchedulerType=sched/backfill",
                "SchedulerParameters=sched_interval=1,bf_interval=1",
                "SelectType=select/cons_tres",
                "SelectTypeParameters=CR_Core",
                "SlurmdParameters=config_overrides",
                "ReturnToService=2",
                "JobRequeue=1",
                "KillWait=5",
                "MinJobAge=3600",
                "InactiveLimit=0",
                f"StateSaveLocation={r}/state/ctld",
                f"SlurmdSpoolDir={r}/state/d",
                f"SlurmctldPidFile={r}/run/slurmctld.pid",
                f"SlurmdPidFile={r}/run/slurmd.pid",
                f"SlurmctldLogFile={r}/log/slurmctld.log",
                f"SlurmdLogFile={r}/log/slurmd.log",
                f"NodeName={self.host} NodeAddr=127.0.0.1 CPUs=4 RealMemory=4000 State=UNKNOWN",
                f"PartitionName=debug Nodes={self.host} Default=YES MaxTime=INFINITE State=UP",
                "",
            ]
        )

    def stop(self) -> None:
        """Cancel jobs, stop the daemons and any job process left; munged only if we started it."""
        if self.conf.exists():
            self._run("scancel", "--full", "--signal=KILL", "--user=root", check=False, timeout=10)
            self._run("scancel", "--user=root", check=False, timeout=10)
        for name in ("slurmd", "slurmctld"):
            pidfile = self.root / "run" / f"{name}.pid"
            if pidfile.exists():
                _stop_pid(int(pidfile.read_text().strip() or 0))
        for pid in self._processes_using_root():
            _stop_pid(pid, timeout=2)
        if self.started_munge:
            pidfile = Path("/run/munge/munged.pid")
            if pidfile.exists():
                _stop_pid(int(pidfile.read_text().strip() or 0))

    def _processes_using_root(self) -> list[int]:
        """slurmstepd and job processes: anything with a file open or a cwd/argument in our dir."""
        mine, marker = [], str(self.root)
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                links = [os.readlink(fd) for fd in (entry / "fd").iterdir()]
                cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if marker in cmdline or any(link.startswith(marker) for link in links):
                mine.append(int(entry.name))
        return mine

    # ------------------------------------------------------------------ jobs
    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job -o` as a dict (JobState, Restarts, ExitCode, ...)."""
        out = self._run("scontrol", "show", "job", "-o", job_id, check=False).stdout
        fields = {}
        for token in out.split():
            if "=" in token:
                key, value = token.split("=", 1)
                fields.setdefault(key, value)
        return fields

    def logs(self) -> str:
        parts = []
        for name in ("slurmctld.log", "slurmd.log"):
            path = self.root / "log" / name
            if path.exists():
                parts.append(f"--- {name} (tail)\n" + path.read_text(errors="replace")[-3000:])
        return "\n".join(parts)


@pytest.fixture(scope="module", name="slurm_cluster")
def slurm_cluster_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """A running single-node cluster for one test module; skips (or fails with
    BYTELATENT_REQUIRE_SLURM=1, as in CI) where SLURM cannot run."""
    reason = slurm_missing()
    if reason is not None:
        if os.environ.get("BYTELATENT_REQUIRE_SLURM") == "1":
            pytest.fail(f"BYTELATENT_REQUIRE_SLURM=1 but SLURM cannot run here: {reason}")
        pytest.skip(f"no SLURM: {reason}; set BYTELATENT_REQUIRE_SLURM=1 to fail instead")
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
