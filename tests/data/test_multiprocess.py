"""The prefetching worker process: exact state without restarts, errors, cleanup."""

import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from datagen import batches_equal, write_jsonl

from bytelatent.data.args import DataArgs
from bytelatent.data.iterators.multiprocess import MultiprocessIterator, RemoteTraceback
from bytelatent.errors import DataError
from tests.limits import hang_limit

REPO = Path(__file__).resolve().parents[2]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def wait_gone(pid: int, seconds: float = hang_limit(10)) -> bool:
    deadline = time.time() + seconds
    while time.time() < deadline:
        if not pid_alive(pid):
            return True
        time.sleep(0.1)
    return False


def make_args(root, **overrides) -> DataArgs:
    base = {
        "root_dir": str(root),
        "sources": {"a": 1.0, "b": 1.0},
        "batch_size": 2,
        "seq_len": 12,
        "max_encoder_seq_length": 32,
        "buffer_size": 3,
        "load_async": True,
        "prefetch_size": 3,
        "patcher_args": {"patching_mode": "space"},
    }
    return DataArgs(**(base | overrides))


def take(it, n):
    return [next(it) for _ in range(n)]


def test_state_is_exact_while_the_worker_keeps_running(corpus):
    args = make_args(corpus)
    sync = args.model_copy(update={"load_async": False})
    straight = take(sync.build_from_rank(0, 1), 16)
    with args.build_from_rank(0, 1) as it:
        assert isinstance(it, MultiprocessIterator)
        head = take(it, 5)
        pid = it.worker_pid
        time.sleep(0.5)  # let the worker run ahead and fill the queue
        state_after_5 = it.get_state().model_dump_json()
        middle = take(it, 6)
        state_after_11 = it.get_state().model_dump_json()
        assert it.worker_pid == pid and pid_alive(pid)  # no restart for a state
        tail = take(it, 5)
    assert wait_gone(pid)
    assert batches_equal(head + middle + tail, straight)
    # resuming from either state, synchronously, gives exactly the rest of the stream
    assert batches_equal(take(sync.build_from_rank(0, 1, state=state_after_5), 11), straight[5:])
    assert json.loads(state_after_11)["type"] == "multiprocess"
    resumed = args.build_from_rank(0, 1, state=state_after_11)  # and through a new worker
    try:
        assert batches_equal(take(resumed, 5), straight[11:])
    finally:
        resumed.close()


def test_worker_error_reraises_with_its_traceback(tmp_path):
    bad = tmp_path / "s" / "s.chunk.00.jsonl"
    write_jsonl(bad, "s", range(3))
    with open(bad, "a") as f:
        f.write('{"text": broken\n')
    args = make_args(tmp_path, sources={"s": 1.0}, seq_len=4)
    it = args.build_from_rank(0, 1)
    with pytest.raises(DataError, match=r"s\.chunk\.00\.jsonl: row 3: malformed JSON") as info:
        take(it, 1000)
    assert isinstance(info.value.__cause__, RemoteTraceback)
    assert "Traceback" in str(info.value.__cause__) and "readers/jsonl.py" in str(
        info.value.__cause__
    )
    assert it._process is None and not mp.active_children()
    with pytest.raises(StopIteration):
        next(it)


def test_killed_worker_raises_instead_of_hanging(corpus):
    it = make_args(corpus).build_from_rank(0, 1)
    next(it)
    pid = it.worker_pid
    os.kill(pid, signal.SIGKILL)
    start = time.time()
    with pytest.raises(RuntimeError, match="exited with code -9"):
        take(it, 100)  # queued batches first, then the error
    assert time.time() - start < hang_limit(30)  # raised, not hung
    assert not pid_alive(pid)


def test_close_reaps_and_next_restarts_from_state(corpus):
    args = make_args(corpus)
    straight = take(args.model_copy(update={"load_async": False}).build_from_rank(0, 1), 6)
    it = args.build_from_rank(0, 1)
    first = take(it, 3)
    pid = it.worker_pid
    it.close()
    it.close()  # idempotent
    assert not pid_alive(pid) and not mp.active_children()
    rest = take(it, 3)  # a fresh worker continues from the exact state
    assert it.worker_pid != pid
    it.close()
    assert batches_equal(first + rest, straight)


@pytest.mark.slow
def test_python_dash_m_entry_point_and_exit_without_close(corpus, tmp_path):
    module = tmp_path / "loader_main.py"
    module.write_text(
        textwrap.dedent(
            f"""
            from bytelatent.data.args import DataArgs

            def main():
                args = DataArgs(root_dir={str(corpus)!r}, sources={{"a": 1.0}}, batch_size=2, seq_len=8,
                                max_encoder_seq_length=32, prefetch_size=2,
                                patcher_args={{"patching_mode": "space"}})
                it = args.build_from_rank(0, 1)
                batch = next(it)
                print("pid", it.worker_pid, "shape", tuple(batch.x.shape), flush=True)
                # no close(): interpreter exit must reap the worker

            if __name__ == "__main__":
                main()
            """
        )
    )
    env = os.environ | {
        "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}",
        "OMP_NUM_THREADS": "1",
    }
    done = subprocess.run(
        [sys.executable, "-m", "loader_main"],
        capture_output=True,
        check=False,
        text=True,
        env=env,
        timeout=hang_limit(120),
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    words = done.stdout.split()
    assert words[0] == "pid" and words[3:] == ["(2,", "32)"]
    assert wait_gone(int(words[1]))


def test_wire_format_round_trips_packed_and_other_batches():
    from bytelatent.data.batch import Batch
    from bytelatent.data.iterators.multiprocess import _decode, _encode

    x = np.array([[5, 6, 7, 0], [8, 9, 10, 11], [0, 0, 0, 0]])
    y = np.array([[6, 7, 12, 0], [9, 10, 11, 13], [0, 0, 0, 0]])
    mask = np.array([[1, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]], dtype=bool)
    pl = np.array([[1, 4, 0], [1, 2, 2], [1, 4, 0]])
    packed = Batch(x=x, y=y, mask=mask, patch_lengths=pl)
    assert _encode(packed)[0] == "shifted"
    assert _decode(_encode(packed)).equals(packed)
    for other in (
        Batch(x=x, y=y + 1, mask=mask),  # y is not x shifted
        Batch(x=x, y=y, mask=mask[:, ::-1].copy()),  # mask not a prefix
        Batch(x=x * 1000, y=y * 100000, mask=mask),  # ids beyond int16
    ):
        again = _decode(_encode(other))
        assert again.equals(other) and again.x.dtype == np.int64


def _run_module(tmp_path, name: str, **kwargs) -> subprocess.CompletedProcess:
    """`python -m name` for a script written to tmp_path, with this repo importable, one thread."""
    env = os.environ | {"PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", name], capture_output=True, text=True, env=env,
                          timeout=hang_limit(120), cwd=tmp_path, **kwargs)  # fmt: skip


@pytest.mark.parametrize("leave", ["close(); os._exit(0)", "cleanup_and_exit(0)"])
def test_os_exit_leaks_no_semaphores(corpus, tmp_path, leave):
    """Distributed runs leave through os._exit (no atexit, no finalizers): close() must release
    the queue's and the stop event's semaphores itself, or the resource tracker warns; and
    cleanup_and_exit closes iterators nobody closed."""
    (tmp_path / "loader_exit.py").write_text(
        textwrap.dedent(
            f"""
            import os
            from bytelatent.data.args import DataArgs
            from bytelatent.distributed.env import cleanup_and_exit

            def main():
                args = DataArgs(root_dir={str(corpus)!r}, sources={{"a": 1.0}}, batch_size=2, seq_len=8,
                                max_encoder_seq_length=32, prefetch_size=2,
                                patcher_args={{"patching_mode": "space"}})
                it = args.build_from_rank(0, 1)
                next(it)
                print("closed", flush=True)
                {leave.replace("close()", "it.close()")}

            if __name__ == "__main__":
                main()
            """
        )
    )
    done = _run_module(tmp_path, "loader_exit")
    assert done.returncode == 0 and "closed" in done.stdout, done.stderr
    assert "leaked semaphore" not in done.stderr, done.stderr


@pytest.mark.slow
def test_step_wide_usr2_spares_the_loader_helpers(corpus, tmp_path):
    """Under `srun` a preemption signal reaches every process of the step (the launcher's
    multi-node script does `scancel --signal=USR2 $SLURM_JOB_ID`): the resource tracker and the
    fork server must survive it (a dead tracker is relaunched and prints a KeyError traceback per
    semaphore), while the trainer still gets the signal and the batches keep coming."""
    (tmp_path / "loader_usr2.py").write_text(
        textwrap.dedent(
            f"""
            import os, signal
            from bytelatent.data.args import DataArgs

            def main():
                got = []
                signal.signal(signal.SIGUSR2, lambda signum, frame: got.append(signum))
                args = DataArgs(root_dir={str(corpus)!r}, sources={{"a": 1.0}}, batch_size=2, seq_len=8,
                                max_encoder_seq_length=32, prefetch_size=2,
                                patcher_args={{"patching_mode": "space"}})
                it = args.build_from_rank(0, 1)
                next(it)
                os.killpg(0, signal.SIGUSR2)  # this process, the worker and every helper
                for _ in range(4):
                    next(it)
                it.close()
                print("handled", len(got), flush=True)

            if __name__ == "__main__":
                main()
            """
        )
    )
    # its own process group: the signal goes nowhere else
    done = _run_module(tmp_path, "loader_usr2", start_new_session=True)
    assert done.returncode == 0, done.stderr
    assert "handled 1" in done.stdout, (done.stdout, done.stderr)
    for noise in ("resource_tracker", "Traceback", "leaked semaphore"):
        assert noise not in done.stderr, done.stderr
