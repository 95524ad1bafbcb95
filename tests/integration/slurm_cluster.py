"""A real single-node SLURM cluster (munge + slurmctld + slurmd) in a temp dir, for tests.

Follows shared/reference/SLURM_RECIPE.md: Debian's slurm 22.05 and munge run as root without
systemd or cgroups (proctrack/linuxproc, task/none), on 127.0.0.1, with fast requeues
(`AuthInfo=cred_expire=5`, `sched_interval=1`). The config lives in the temp dir and is found
through SLURM_CONF (never /etc/slurm); the ports are picked free, so several clusters can coexist.
munged is started only when none answers, and left running (clusters may overlap under xdist).
"""

from __future__ import annotations

import os
import random
import shlex
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.limits import hang_limit

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


def _stop_pid(pid: int, timeout: float = hang_limit(10)) -> None:
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
        self, *command: str, timeout: float = hang_limit(30), check: bool = True
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
        self._start_slurmd()
        deadline = time.monotonic() + hang_limit(60)
        while True:
            out = self._run("sinfo", "-h", "-N", "-o", "%T", check=False).stdout.split()
            if out == ["idle"] * len(self.node_names()):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"slurm nodes not idle after 60 s (sinfo: {out!r})\n{self.logs()}"
                )
            time.sleep(0.1)

    def node_names(self) -> list[str]:
        return [self.host]

    def _start_slurmd(self) -> None:
        self._run(_sbin("slurmd"), "-c", "-f", str(self.conf), "-N", self.host)

    def _placement(self) -> list[str]:
        """slurm.conf lines saying where the controller and the nodes are (here: all on this
        host, on 127.0.0.1)."""
        r = self.root
        return [
            f"SlurmctldHost={self.host}(127.0.0.1)",
            f"SlurmdSpoolDir={r}/state/d",
            f"SlurmdPidFile={r}/run/slurmd.pid",
            f"SlurmdLogFile={r}/log/slurmd.log",
            f"NodeName={self.host} NodeAddr=127.0.0.1 CPUs=4 RealMemory=4000 State=UNKNOWN",
            f"PartitionName=debug Nodes={self.host} Default=YES MaxTime=INFINITE State=UP",
        ]

    def _munge_ok(self) -> bool:
        munge = subprocess.run(["munge", "-n"], capture_output=True, timeout=hang_limit(10))
        if munge.returncode != 0:
            return False
        return (
            subprocess.run(
                ["unmunge"], input=munge.stdout, capture_output=True, timeout=hang_limit(10)
            ).returncode
            == 0
        )

    def _start_munge(self) -> None:
        """munged for every cluster on this machine: started once (under a lock, as clusters of
        other pytest-xdist workers may start at the same moment) and left running, since another
        cluster may be using it."""
        from filelock import FileLock  # noqa: PLC0415 - torch's dependency, only for clusters

        with FileLock("/run/bytelatent-test-munge.lock"):
            if not self._munge_ok():
                self._launch_munged()

    def _launch_munged(self) -> None:
        run_dir = Path("/run/munge")
        run_dir.mkdir(parents=True, exist_ok=True)
        shutil.chown(run_dir, "munge", "munge")
        run_dir.chmod(0o755)
        if not Path("/etc/munge/munge.key").exists():
            subprocess.run(
                ["runuser", "-u", "munge", "--", "mungekey", "-c"],
                check=True,
                timeout=hang_limit(30),
            )
        subprocess.run(
            ["runuser", "-u", "munge", "--", _sbin("munged")], check=True, timeout=hang_limit(30)
        )
        self.started_munge = True
        deadline = time.monotonic() + hang_limit(10)
        while not self._munge_ok():
            if time.monotonic() > deadline:
                raise RuntimeError("munged started but munge -n | unmunge keeps failing")
            time.sleep(0.1)

    def _config(self) -> str:
        r = self.root
        return "\n".join(
            [
                "ClusterName=bytelatent-test",
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
                f"SlurmctldPidFile={r}/run/slurmctld.pid",
                f"SlurmctldLogFile={r}/log/slurmctld.log",
                *self._placement(),
                "",
            ]
        )

    def stop(self) -> None:
        """Cancel jobs, stop the daemons and any job process left (munged stays: see _start_munge)."""
        if self.conf.exists():
            self._run(
                "scancel",
                "--full",
                "--signal=KILL",
                "--user=root",
                check=False,
                timeout=hang_limit(10),
            )
            self._run("scancel", "--user=root", check=False, timeout=hang_limit(10))
        for pattern in ("slurmd*.pid", "slurmctld.pid"):
            for pidfile in sorted((self.root / "run").glob(pattern)):
                _stop_pid(int(pidfile.read_text().strip() or 0))
        for pid in self._processes_using_root():
            _stop_pid(pid, timeout=2)

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
        for path in sorted((self.root / "log").glob("slurm*.log")):
            parts.append(f"--- {path.name} (tail)\n" + path.read_text(errors="replace")[-3000:])
        return "\n".join(parts)


@pytest.fixture(scope="module", name="slurm_cluster")
def slurm_cluster_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """A running single-node cluster for one test module; skips (or fails with
    BYTELATENT_REQUIRE_SLURM=1, as in CI) where SLURM cannot run."""
    yield from _cluster_fixture(SlurmCluster, tmp_path_factory)


class ClusterUnavailable(RuntimeError):
    """This machine cannot host the cluster (e.g. no network namespaces): skip, not fail."""


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=hang_limit(30))
    if result.returncode != 0:
        raise ClusterUnavailable(f"`ip {' '.join(args)}` failed: {result.stderr.strip()}")


class NetnsSlurmCluster(SlurmCluster):
    """Several SLURM nodes on one machine: each slurmd (and so each job step it starts) lives in
    a network namespace of its own, with its own address on a bridge, its own hostname (a UTS
    namespace) and its own /etc/hosts (bind-mounted in a private mount namespace) that names
    every node. slurmctld stays on the host, at the bridge's address. Processes of different
    nodes therefore only meet over the bridge, as on a real cluster: `localhost`, loopback ports
    and the hostname are per node. Names carry a random tag so clusters can coexist.
    """

    def __init__(self, root: Path, nnodes: int = 2):
        super().__init__(root)
        rng = random.Random()
        self.tag = f"{rng.randrange(16**4):04x}"
        self.subnet = ""  # 10.x.y (a /24), picked at start
        self.bridge = f"blbr{self.tag}"
        self.nodes = [f"bln{i + 1}" for i in range(nnodes)]
        self.netns = [f"bl{self.tag}n{i + 1}" for i in range(nnodes)]
        self.made: list[tuple[str, str]] = []  # ("netns"|"link", name), to undo at stop

    def node_names(self) -> list[str]:
        return list(self.nodes)

    def address(self, index: int) -> str:
        return f"{self.subnet}.{index + 1}"

    def _placement(self) -> list[str]:
        r = self.root
        return [
            f"SlurmctldHost={self.host}({self.subnet}.254)",
            f"SlurmdSpoolDir={r}/state/d/%n",  # %n: the node name, one of each per slurmd
            f"SlurmdPidFile={r}/run/slurmd.%n.pid",
            f"SlurmdLogFile={r}/log/slurmd.%n.log",
            *(
                f"NodeName={name} NodeAddr={self.address(i)} CPUs=2 RealMemory=4000 State=UNKNOWN"
                for i, name in enumerate(self.nodes)
            ),
            f"PartitionName=debug Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP",
        ]

    def start(self) -> None:
        for tool in ("ip", "nsenter", "unshare", "mount"):
            if shutil.which(tool) is None:
                raise ClusterUnavailable(f"{tool} not installed")
        self._make_network()
        hosts = self.root / "etc" / "hosts"
        hosts.parent.mkdir(parents=True, exist_ok=True)
        lines = ["127.0.0.1 localhost", f"{self.subnet}.254 {self.host}"]
        lines += [f"{self.address(i)} {name}" for i, name in enumerate(self.nodes)]
        hosts.write_text("\n".join(lines) + "\n")
        for name in self.nodes:
            (self.root / "state" / "d" / name).mkdir(parents=True, exist_ok=True)
        super().start()

    def _pick_subnet(self) -> str:
        """A 10.x.y.0/24 that no route of this host mentions."""
        routes = subprocess.run(["ip", "-4", "route"], capture_output=True, text=True).stdout
        rng = random.Random()
        for _ in range(50):
            subnet = f"10.{rng.randint(100, 250)}.{rng.randint(0, 255)}"
            if f"{subnet}." not in routes:
                return subnet
        raise ClusterUnavailable(f"no free 10.x.y.0/24 for the test nodes (routes: {routes!r})")

    def _make_network(self) -> None:
        self.subnet = self._pick_subnet()
        _ip("link", "add", self.bridge, "type", "bridge")
        self.made.append(("link", self.bridge))
        _ip("addr", "add", f"{self.subnet}.254/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i, ns in enumerate(self.netns):
            _ip("netns", "add", ns)
            self.made.append(("netns", ns))
            veth = f"blv{self.tag}{i + 1}"
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            self.made.append(("link", veth))
            _ip("link", "set", veth, "master", self.bridge, "up")
            _ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def _start_slurmd(self) -> None:
        hosts = self.root / "etc" / "hosts"
        for name, ns in zip(self.nodes, self.netns):
            # nsenter, not `ip netns exec`: that remounts /sys, and slurmd then finds no cgroup fs
            inner = (
                f"mount --bind {shlex.quote(str(hosts))} /etc/hosts && hostname {name} && "
                f"exec {_sbin('slurmd')} -c -f {shlex.quote(str(self.conf))} -N {name}"
            )
            self._run(
                "nsenter", f"--net=/run/netns/{ns}", "unshare", "--mount", "--uts",
                "sh", "-c", inner,
            )  # fmt: skip

    def stop(self) -> None:
        super().stop()
        made_netns = [name for kind, name in self.made if kind == "netns"]
        for ns in made_netns:  # anything still running on a node
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
            for pid in pids.stdout.split():
                _stop_pid(int(pid), timeout=2)
        for kind, name in reversed(self.made):
            command = (
                ["ip", "netns", "del", name] if kind == "netns" else ["ip", "link", "del", name]
            )
            subprocess.run(
                command, capture_output=True, timeout=hang_limit(30)
            )  # a veth goes with its netns
        self.made.clear()


def _cluster_fixture(make, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    reason = slurm_missing()
    cluster = None
    try:
        if reason is None:
            cluster = make(tmp_path_factory.mktemp("slurm"))
            try:
                cluster.start()
            except ClusterUnavailable as e:
                reason = str(e)
        if reason is not None:
            if os.environ.get("BYTELATENT_REQUIRE_SLURM") == "1":
                pytest.fail(f"BYTELATENT_REQUIRE_SLURM=1 but SLURM cannot run here: {reason}")
            pytest.skip(f"no SLURM: {reason}; set BYTELATENT_REQUIRE_SLURM=1 to fail instead")
        yield cluster
    finally:
        if cluster is not None:
            cluster.stop()


@pytest.fixture(scope="module", name="slurm_two_nodes")
def slurm_two_nodes_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """A running two-node cluster (network namespaces) for one test module; skips or fails like
    `slurm_cluster` where it cannot run."""
    yield from _cluster_fixture(NetnsSlurmCluster, tmp_path_factory)
