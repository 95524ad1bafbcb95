"""A data file that changed between a save and a resume ends the resume with one line, in bounded
time, and a data-loader worker never outlives its trainer (issue 38, item 2)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from datagen import write_jsonl

from bytelatent.data.iterators.file import FileIteratorState, LoopingIteratorState
from bytelatent.data.iterators.preprocess import PreprocessIteratorState
from bytelatent.data.iterators.sequence import SequenceArgs, SequenceIteratorState
from bytelatent.data.iterators.states import load_state
from bytelatent.data.patcher_args import PatcherArgs
from bytelatent.errors import DataError
from tests.limits import hang_limit

REPO = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def deadline(seconds: int):
    """Fail instead of spinning forever (the bug this file tests was an endless loop)."""

    def expire(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def file_state(path: Path) -> FileIteratorState:
    return FileIteratorState(shards=[{"path": str(path), "format": "json"}])


def read_some(path: Path, n: int) -> FileIteratorState:
    it = file_state(path).build()
    for _ in range(n):
        next(it)
    return it.get_state()


def shorten_to_first_line(path: Path) -> None:
    path.write_bytes(path.read_bytes().split(b"\n", 1)[0] + b"\n")


def test_shortened_file_resume_names_the_file(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", "d", range(20))
    saved = read_some(path, 12)
    assert saved.fingerprint is not None and saved.position["row"] == 12
    shorten_to_first_line(path)
    with deadline(int(hang_limit(20))), pytest.raises(DataError) as err:
        next(load_state(saved.model_dump_json()).build())
    line = err.value.one_line()
    assert line.startswith(f"data error: {path}: it has ") and "changed since" in line
    assert "\n" not in line


def test_same_size_rewrite_is_refused(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", "d", range(20))
    saved = read_some(path, 5)
    data = bytearray(path.read_bytes())
    data[-3] = ord("#") if data[-3] != ord("#") else ord("%")  # same size, another last record
    path.write_bytes(bytes(data))
    with pytest.raises(DataError, match="differ \\(same size"):
        next(saved.build())


def test_unchanged_file_resumes_exactly_and_old_states_load(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", "d", range(20))
    saved = read_some(path, 7)
    expected = [d.sample_id for d in file_state(path).build()][7:]
    assert [d.sample_id for d in load_state(saved.model_dump_json()).build()] == expected
    # a state saved before fingerprints existed loads and resumes, with nothing to compare
    old = json.loads(saved.model_dump_json())
    del old["fingerprint"]
    assert [d.sample_id for d in load_state(old).build()] == expected


def test_old_state_past_the_end_of_a_shortened_file_is_one_error(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", "d", range(20))
    old = json.loads(read_some(path, 12).model_dump_json())
    del old["fingerprint"]
    shorten_to_first_line(path)
    with (
        deadline(int(hang_limit(20))),
        pytest.raises(DataError, match="but the saved position is byte"),
    ):
        next(load_state(old).build())


@pytest.mark.parametrize("mode", ["bytes", "patches"])
def test_position_past_a_documents_end_is_bounded(tmp_path, mode):
    """A sequence state whose token offset lies past its document's end (the data changed under
    a state of an older version, which has no fingerprints) raises at once: the window loop used
    to wait for `cursor == len(tokens)` forever, growing its window."""
    path = write_jsonl(tmp_path / "d.jsonl", "d", range(4))
    patcher = PatcherArgs(patching_mode="space") if mode == "patches" else None
    state = SequenceIteratorState(
        args=SequenceArgs(mode=mode, seq_len=8, max_length=32 if patcher else None),
        source=PreprocessIteratorState(
            source=LoopingIteratorState(file_state=file_state(path)), patcher_args=patcher
        ),
        doc_offset=10**6,
    )
    with (
        deadline(int(hang_limit(20))),
        pytest.raises(DataError, match="row 0 has .* tokens, but the saved"),
    ):
        next(state.build())


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _wait_gone(pid: int, seconds: float) -> bool:
    deadline_at = time.monotonic() + seconds
    while time.monotonic() < deadline_at:
        if not _alive(pid):
            return True
        time.sleep(0.1)
    return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_worker_never_outlives_its_trainer(tmp_path):
    """A worker blocked where it never reaches the queue (here: opening a FIFO nobody writes)
    keeps running while its trainer lives, SIGTERM included (a step-wide signal is the trainer's
    to handle), and ends once the trainer is killed (it used to linger as an orphan, PPID 1)."""
    fifo = tmp_path / "stuck.jsonl"
    os.mkfifo(fifo)
    script = tmp_path / "trainer_main.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import time
            from bytelatent.data.iterators.states import load_state

            def main():
                files = {{"type": "file", "shards": [{{"path": {str(fifo)!r}, "format": "json"}}]}}
                documents = {{"type": "preprocess", "source": {{"type": "looping", "file_state": files}}}}
                sequences = {{"type": "sequence", "args": {{"seq_len": 8}}, "source": documents}}
                batches = {{"type": "packing", "args": {{"batch_size": 2, "seq_len": 8}}, "source": sequences}}
                it = load_state({{"type": "multiprocess", "base": batches, "prefetch_size": 2}}).build()
                it._start()
                print("worker", it.worker_pid, flush=True)
                time.sleep(600)

            if __name__ == "__main__":
                main()
            """
        )
    )
    env = os.environ | {"PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}", "OMP_NUM_THREADS": "1"}
    trainer = subprocess.Popen(
        [sys.executable, "-m", "trainer_main"],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    worker = None
    try:
        words = trainer.stdout.readline().split()
        assert words[:1] == ["worker"], words
        worker = int(words[1])
        time.sleep(1.0)  # the worker is blocked opening the FIFO
        os.kill(worker, signal.SIGTERM)
        assert not _wait_gone(worker, 1.5), "SIGTERM ended a worker whose trainer is alive"
        trainer.kill()
        trainer.wait(timeout=hang_limit(10))
        assert _wait_gone(worker, hang_limit(10)), "the worker outlived its trainer"
    finally:
        trainer.kill()
        if worker is not None and _alive(worker):
            os.kill(worker, signal.SIGKILL)


def _processes_with(marker: str) -> list[int]:
    """Processes whose environment holds `marker` (a trainer's, its fork server's, its workers')."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and entry.name != str(os.getpid()):
            try:
                if marker.encode() in (entry / "environ").read_bytes() and _alive(int(entry.name)):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_training_resume_after_a_file_got_shorter(tmp_path):
    """The issue's case end to end: train with a checkpoint, cut a data file to its first line,
    run the same command again: one `data error:` line naming the file, rc != 0, no process left."""
    from tests.tiny import BLT_CONFIG, TINY_BLT_MODEL

    root = tmp_path / "data"
    for chunk in range(2):
        write_jsonl(
            root / "s" / f"s.chunk.{chunk:02d}.jsonl", "s", range(chunk * 80, chunk * 80 + 80)
        )
    marker = f"BYTELATENT_TEST_MARK_{os.getpid()}_{time.monotonic_ns()}"
    env = os.environ | {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", marker: "1"}
    command = [
        sys.executable, "-m", "bytelatent.train", f"config={BLT_CONFIG}", *TINY_BLT_MODEL,
        f"data.root_dir={root}", "data.sources={s: 1.0}", f"dump_dir={tmp_path / 'run'}",
        "distributed.model_dtype=fp32", "data.seq_len=16", "checkpoint.dump.every=6",
    ]  # fmt: skip
    first = subprocess.run(
        [*command, "steps=6"], env=env, capture_output=True, text=True, timeout=hang_limit(120)
    )
    assert first.returncode == 0, first.stderr[-3000:]
    shortened = root / "s" / "s.chunk.00.jsonl"
    shorten_to_first_line(shortened)
    second = subprocess.run(
        [*command, "steps=12"], env=env, capture_output=True, text=True, timeout=hang_limit(60)
    )
    out = second.stdout + second.stderr
    assert second.returncode != 0, out[-3000:]
    errors = [line for line in out.splitlines() if "data error:" in line]
    assert len(errors) == 1 and errors[0].startswith(f"data error: {shortened}: "), out[-3000:]
    assert "Traceback" not in out
    deadline_at = time.monotonic() + hang_limit(10)
    while _processes_with(marker) and time.monotonic() < deadline_at:
        time.sleep(0.2)
    assert _processes_with(marker) == [], "a process of the run outlived it"


def test_preflight_finds_the_changed_file_in_a_saved_pipeline_state(tmp_path):
    """What `python -m bytelatent.train` checks before it builds the model on a resume."""
    from bytelatent.data.args import DataArgs
    from bytelatent.data.changed_files import changed_files

    files = [write_jsonl(tmp_path / f"d{i}.jsonl", "d", range(i * 40, i * 40 + 40)) for i in (0, 1)]
    args = DataArgs(
        dataset_files=[str(p) for p in files],
        batch_size=2,
        seq_len=8,
        max_encoder_seq_length=32,
        load_async=False,
        patcher_args={"patching_mode": "space"},
    )
    it = args.build_from_rank(0, 1)
    for _ in range(6):
        next(it)
    saved = json.loads(it.get_state().model_dump_json())
    assert changed_files(saved) is None
    shorten_to_first_line(files[1])
    shorten_to_first_line(files[0])
    error = changed_files(saved)
    assert isinstance(error, DataError)
    assert error.one_line().startswith("data error: ")
    assert re.search(r"d[01]\.jsonl: it has \d+ bytes", str(error))
