"""Shared fixtures: a small copy of the embedded stdlib corpus, built once per session."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.limits import hang_limit
from tests.paths import require_conformance
from tests.shared_fixtures import built_once
from tests.tiny import BLT_CONFIG, ENTROPY_CONFIG, TINY_BLT_MODEL, TINY_ENTROPY_MODEL

REPO = Path(__file__).resolve().parents[1]


# Test files that start two or more ranks as processes. On a CUDA host each rank takes the GPU of
# its LOCAL_RANK, so with fewer than two GPUs they cannot run: they skip there (CPU hosts run
# them over gloo, as CI does).
MULTIRANK_FILES = {
    "test_dry_run.py", "test_runs.py", "test_wandb.py", "test_slurm.py", "test_peer_faults.py",
    "test_corrupt_resume.py", "test_slurm_launcher.py", "test_resume.py", "test_async_eval.py",
    "test_single_device_fsdp.py", "test_multirank.py", "test_tp_run_warnings.py",
    "test_env_mesh.py", "test_hf_llama.py", "test_reshard.py", "test_elastic_resume.py",
    "test_kill_during_save.py", "test_checkpoint_multirank.py", "test_byteify.py",
    "test_worker_start.py",
    "test_two_nodes.py",
}  # fmt: skip


def _gpus_for_ranks() -> int | None:
    """The number of visible GPUs on a CUDA host; None on a CPU host (ranks use gloo)."""
    import torch  # noqa: PLC0415 - only when the hook runs

    return torch.cuda.device_count() if torch.cuda.is_available() else None


def multirank_skip_reason(file_name: str, gpus: int | None) -> str | None:
    """Why a test of `file_name` cannot run with `gpus` visible GPUs (None: a CPU host)."""
    if file_name in MULTIRANK_FILES and gpus is not None and gpus < 2:
        return f"starts 2 ranks: needs 2 GPUs on a CUDA host ({gpus} visible)"
    return None


def pytest_configure(config: pytest.Config) -> None:
    """Under `pytest -n N` (pytest-xdist, `--dist loadfile` in pytest.ini: a worker takes whole
    files) the workers share the cores: each (and what it starts) takes one thread."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ["OMP_NUM_THREADS"] = "1"
        import torch  # noqa: PLC0415 - only in xdist workers

        torch.set_num_threads(1)


# A file's expected worker-seconds for the order below: a `slow` test (a training run, several
# processes) takes ~5-60 s under `-n 3`, any other ~0.5 s (bench/RESULTS_test_suite.md).
SLOW_TEST_S, FAST_TEST_S = 20.0, 0.5


def file_cost(items: list[pytest.Item]) -> float:
    """Estimated worker-seconds of a test file's `items` (one file's, or any)."""
    return sum(SLOW_TEST_S if item.get_closest_marker("slow") else FAST_TEST_S for item in items)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The order in which `pytest -n N` hands out files (a worker takes whole files, pytest.ini):
    files with a `slurm` test first, then the most expensive files first (file_cost). SLURM tests
    mostly wait on the cluster (start, queue, requeue): early, the other workers fill that wait.
    Longest first is what keeps the end short: xdist gives a worker its next file while it still
    runs one, so a 40 s file handed out last can run after the other workers have finished, while
    the cheap files at the end even the workers out (by test count, the order before 2026-12-04,
    the single-test end-to-end files came last). A file's tests keep their order; serial runs
    keep the usual order."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    by_file: dict[Path, list[pytest.Item]] = {}
    for item in items:
        by_file.setdefault(item.path, []).append(item)
    slurm = {
        path for path, its in by_file.items() if any(i.get_closest_marker("slurm") for i in its)
    }
    cost = {path: file_cost(its) for path, its in by_file.items()}
    items.sort(key=lambda item: (item.path not in slurm, -cost[item.path]))  # stable


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """`@pytest.mark.conformance(files...)`: skip without the fixtures, fail under CI's env var.
    Multi-rank test files skip on a CUDA host with fewer than two GPUs."""
    for mark in item.iter_markers("conformance"):
        require_conformance(*mark.args)
    if item.path.name in MULTIRANK_FILES and (
        reason := multirank_skip_reason(item.path.name, _gpus_for_ranks())
    ):
        pytest.skip(reason)


@pytest.fixture(scope="session")
def corpus_root(tmp_path_factory) -> Path:
    """A folder holding `stdlib/` (JSONL shards of the stdlib corpus, ~1 MB); use as data.root_dir."""

    def build(root: Path) -> None:
        cmd = [sys.executable, "-m", "bytelatent.data.prepare", "--out", str(root / "stdlib"),
               "--max-mb", "1"]  # fmt: skip
        subprocess.run(cmd, check=True, capture_output=True, cwd=REPO)

    return built_once(tmp_path_factory, "corpus", build)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",  # not region_name in client_kwargs: moto rejects the bucket
}


@pytest.fixture(scope="session")
def moto_server():
    """A real S3 endpoint on 127.0.0.1 (a moto server subprocess); yields its URL."""
    pytest.importorskip("moto", reason="S3 tests need `pip install 'moto[server]' 's3fs[boto3]'`")
    pytest.importorskip("s3fs", reason="S3 tests need `pip install 'moto[server]' 's3fs[boto3]'`")
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + hang_limit(30)
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail("moto server did not start")
            time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    proc.terminate()
    try:
        proc.wait(timeout=hang_limit(10))
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture
def s3_env(moto_server, monkeypatch):
    """AWS environment pointing at the moto server, as users configure it (inherited by subprocesses)."""
    import s3fs

    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_server)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    for key, value in S3_ENV.items():
        monkeypatch.setenv(key, value)
    s3fs.S3FileSystem.clear_instance_cache()
    yield moto_server
    s3fs.S3FileSystem.clear_instance_cache()


# Tiny trained runs shared by evaluation, generation and export tests (built once per session).
TINY_BLT = [*TINY_BLT_MODEL, "data.seq_len=48", "data.batch_size=2", "data.load_async=false"]
TINY_ENTROPY = [
    *TINY_ENTROPY_MODEL,
    "data.seq_len=128",
    "data.batch_size=2",
    "data.load_async=false",
]


def train_tiny(config: str, dump_dir: Path, data_root: Path, steps: int, extra: list[str]) -> Path:
    """Train `config` for `steps` steps in a subprocess; returns dump_dir (checkpoint at `steps`)."""
    cmd = [
        sys.executable,
        "-m",
        "bytelatent.train",
        f"config={config}",
        f"dump_dir={dump_dir}",
        f"data.root_dir={data_root}",
        f"steps={steps}",
        "logging.freq=5",
        "logging.console=false",
        "checkpoint.dump.every=0",
        *extra,
    ]
    proc = subprocess.run(
        cmd,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=hang_limit(600),
        env={**__import__("os").environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return dump_dir


@pytest.fixture(scope="session")
def tiny_blt_run(tmp_path_factory, corpus_root) -> Path:
    """A tiny debug BLT (space patching) trained 20 steps: dump_dir with checkpoints/0000000020."""
    return built_once(tmp_path_factory, "tiny_blt",
                      lambda d: train_tiny(str(BLT_CONFIG), d, corpus_root, 20, TINY_BLT))  # fmt: skip


@pytest.fixture(scope="session")
def tiny_entropy_run(tmp_path_factory, corpus_root) -> Path:
    """A tiny entropy model trained 20 steps: dump_dir with checkpoints/0000000020."""
    return built_once(tmp_path_factory, "tiny_entropy",
                      lambda d: train_tiny(str(ENTROPY_CONFIG), d, corpus_root, 20, TINY_ENTROPY))  # fmt: skip


# configs/debug.yaml (tiny widths) for 200 steps with validation every 50 and before training:
# long enough for patches of a few bytes. The eval tests read its evaluations and checkpoints,
# speculative decoding its step-200 model (one run for both: ~20 CPU-s each).
BLT_200_LOOP = [
    "steps=200", "eval.every=50", "eval.before_training=true", "eval.validation.max_batches=8",
    "logging.freq=50", "checkpoint.dump.every=100",
]  # fmt: skip


@pytest.fixture(scope="session")
def blt_200_run(tmp_path_factory, corpus_root) -> Path:
    """dump_dir of the 200-step BLT_200_LOOP run (checkpoints at 100 and 200), shared by test
    files on several xdist workers: tests only read it (or add beside its files: test_eval_cli
    writes `consolidated/` into the step-200 folder, which loading that folder ignores)."""
    from tests.trainer.test_cli import TINY_BLT as CLI_BLT  # noqa: PLC0415 - a test module
    from tests.trainer.test_cli import run_cli  # noqa: PLC0415

    def build(dump: Path) -> None:
        argv = [*CLI_BLT, f"dump_dir={dump}", f"data.root_dir={corpus_root}", *BLT_200_LOOP]
        res = run_cli("bytelatent.train", argv)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]

    return built_once(tmp_path_factory, "blt_200", build)


@pytest.fixture(scope="session")
def fake_cuda_shim(tmp_path_factory) -> Path:
    """The fake-CUDA shim (tests/distributed/fake_cuda/shim.py), built once per test run; the test
    skips, saying why, where it cannot be built (no g++, no torch headers, a GPU build of torch)."""
    from tests.distributed.fake_cuda.shim import LIBRARY, build_shim, shim_skip_reason

    if reason := shim_skip_reason():
        pytest.skip(reason)
    folder = built_once(
        tmp_path_factory, "fake_cuda", lambda out: build_shim(out, timeout=hang_limit(120))
    )
    return folder / LIBRARY
