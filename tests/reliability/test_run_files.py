"""Files of the run directory under a full disk and after a kill (`bytelatent/trainer/run_files.py`):
whole lines or nothing, a partial last line repaired on the next start, atomic whole files, and a
train.log handler that stops quietly (issue 22.5). End to end: test_disk_full.py."""

from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
import sys

import pytest

from bytelatent.errors import DiskError
from bytelatent.eval.validate import append_jsonl
from bytelatent.trainer import run_files
from bytelatent.trainer.metrics import JsonlSink, setup_logging
from bytelatent.trainer.run_files import (
    LineAppender,
    log_final_error,
    raise_log_file_error,
    repair_partial_line,
    write_text_atomic,
)
from tests.limits import hang_limit
from tests.paths import REPO

ENOSPC_LINE = "[Errno 28] No space left on device"


def _full_after(monkeypatch, budget: int) -> None:
    """os.write in run_files writes at most `budget` more bytes, then fails with ENOSPC (a short
    write first, as a real full disk does)."""
    left = {"n": budget}
    real_write = os.write

    def write(fd, data):
        if left["n"] <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        n = real_write(fd, bytes(data[: left["n"]]))
        left["n"] -= n
        return n

    monkeypatch.setattr(run_files.os, "write", write)


@pytest.mark.parametrize(
    ("content", "kept", "dropped"),
    [
        (b'{"a": 1}\n{"a": 2}\n', b'{"a": 1}\n{"a": 2}\n', 0),
        (b'{"a": 1}\n{"a": 2}\n{"a"', b'{"a": 1}\n{"a": 2}\n', 4),
        (b'{"a": 1', b"", 7),
        (b"", b"", 0),
    ],
)
def test_repair_partial_line(tmp_path, content, kept, dropped):
    path = tmp_path / "m.jsonl"
    path.write_bytes(content)
    assert repair_partial_line(path) == dropped
    assert path.read_bytes() == kept
    assert repair_partial_line(tmp_path / "missing.jsonl") == 0


def test_repair_scans_back_over_a_long_partial_line(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_bytes(b"whole\n" + b"x" * 200_000)  # longer than one read-back chunk
    assert repair_partial_line(path) == 200_000
    assert path.read_bytes() == b"whole\n"


def test_metrics_sink_repairs_partial_last_line_and_says_so(tmp_path, caplog):
    """A kill (or a full disk on an older version) left half a record: the next run's first record
    must not be glued to it (that made both unreadable)."""
    path = tmp_path / "metrics.jsonl"
    partial = '{"global_step": 2, "lo'
    path.write_text(json.dumps({"global_step": 1}) + "\n" + partial)
    with caplog.at_level(logging.WARNING, logger="bytelatent"):
        sink = JsonlSink(path)
        sink.log({"global_step": 2})
        sink.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["global_step"] for r in rows] == [1, 2]
    warnings = [r.getMessage() for r in caplog.records if "partial last line" in r.getMessage()]
    assert warnings == [
        f"{path}: dropped {len(partial)} bytes of a partial last line "
        "(a write cut short by a kill or a full disk)"
    ]


def test_metrics_sink_full_disk_leaves_whole_lines_and_one_line_error(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    sink = JsonlSink(path)
    sink.log({"global_step": 1})
    _full_after(monkeypatch, 30)  # the next record is cut short on the disk, then ENOSPC
    with pytest.raises(DiskError) as info:
        sink.log({"global_step": 2, "loss": 1.5})
    sink.close()
    assert info.value.one_line() == f"disk error: writing {path}: {ENOSPC_LINE}"
    lines = path.read_text().splitlines(keepends=True)
    assert len(lines) == 1 and lines[0].endswith("\n") and json.loads(lines[0])["global_step"] == 1


def test_write_text_atomic_keeps_the_old_file_on_a_full_disk(tmp_path, monkeypatch):
    path = tmp_path / "config.yaml"
    write_text_atomic(path, "a: 1\n")
    real_fsync = os.fsync

    def full(fd):
        real_fsync(fd)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(run_files.os, "fsync", full)
    with pytest.raises(DiskError) as info:
        write_text_atomic(path, "a: 2\n" * 1000)
    assert info.value.one_line() == f"disk error: writing {path}: {ENOSPC_LINE}"
    assert path.read_text() == "a: 1\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]  # no temporary left


def test_train_log_on_a_full_disk_stops_quietly_and_ends_the_run(tmp_path, monkeypatch, capsys):
    setup_logging(str(tmp_path), rank=0)
    logger = logging.getLogger("bytelatent")
    try:
        logger.info("before")
        _full_after(monkeypatch, 10)
        for i in range(50):
            logger.info("step %d", i)
        err = capsys.readouterr().err
        assert "Logging error" not in err and "Traceback" not in err, err
        with pytest.raises(DiskError) as info:
            raise_log_file_error()
        assert (
            info.value.one_line() == f"disk error: writing {tmp_path / 'train.log'}: {ENOSPC_LINE}"
        )
        text = (tmp_path / "train.log").read_text()
        assert text.endswith("before\n") and "step" not in text  # the cut-short line was removed
        monkeypatch.undo()  # space again: the closing line is written once, the console skipped
        log_final_error(info.value.one_line())
        last = (tmp_path / "train.log").read_text().splitlines()[-1]
        assert last.endswith(info.value.one_line()) and " ERROR " in last
        assert info.value.one_line() not in capsys.readouterr().out
    finally:
        setup_logging(None, rank=0)


def test_file_only_records_skip_the_console(tmp_path, capsys):
    from bytelatent.errors import FILE_ONLY

    setup_logging(str(tmp_path), rank=0)
    try:
        logging.getLogger("bytelatent").error("checkpoint error: x", extra=FILE_ONLY)
        log_final_error("checkpoint error: x")  # already the last line: not written twice
    finally:
        setup_logging(None, rank=0)
    assert "checkpoint error" not in capsys.readouterr().out
    assert (tmp_path / "train.log").read_text().count("checkpoint error: x") == 1


def test_line_appender_refuses_after_close(tmp_path):
    appender = LineAppender(tmp_path / "x.jsonl")
    appender.close()
    with pytest.raises(DiskError, match="closed"):
        appender.append("{}")


def test_disk_errors_from_other_writers_become_one_line():
    from bytelatent.trainer.run_files import disk_error_of

    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/runs/x/metrics.eval.jsonl")
    assert disk_error_of(full).one_line() == (
        f"disk error: writing /runs/x/metrics.eval.jsonl: {ENOSPC_LINE}"
    )
    quota = OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))
    assert disk_error_of(quota).one_line().startswith("disk error: writing a file of the run: ")
    assert disk_error_of(FileNotFoundError(errno.ENOENT, "gone", "/x")) is None
    assert disk_error_of(RuntimeError("bug")) is None


def test_console_on_a_closed_stream_is_dropped_quietly():
    """A console whose stream was closed (a test's captured stderr, a closed terminal) neither
    raises from flush() nor prints a logging traceback; the run's files still say everything."""
    import io
    import logging

    from bytelatent.trainer.run_files import QuietStreamHandler

    stream = io.StringIO()
    handler = QuietStreamHandler(stream)
    stream.close()
    handler.flush()
    handler.emit(logging.LogRecord("bytelatent", logging.INFO, __file__, 1, "hello", None, None))
    assert handler.failed


# ---------------------------------------------------------------- issue 29 item 8e: metrics.eval.jsonl
def test_eval_metrics_line_cut_by_a_file_size_limit_leaves_whole_lines(tmp_path):
    """RLIMIT_FSIZE makes a real short write then EFBIG: the line is cut back, one DiskError."""
    path = tmp_path / "metrics.eval.jsonl"
    path.write_text('{"global_step": 1}\n')
    script = (
        "import resource, signal, sys\n"
        "from bytelatent.errors import DiskError\n"
        "from bytelatent.eval.validate import append_jsonl\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))\n"
        "try:\n"
        f"    append_jsonl({str(path)!r}, {{'global_step': 2, 'pad': 'x' * 10000}})\n"
        "except DiskError as e:\n"
        "    print(e.one_line()); sys.exit(3)\n"
    )
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         cwd=REPO, timeout=hang_limit(120))  # fmt: skip
    assert res.returncode == 3, res.stderr[-2000:]
    assert res.stdout.strip() == f"disk error: writing {path}: [Errno 27] File too large"
    assert path.read_text() == '{"global_step": 1}\n'


def test_eval_metrics_after_a_killed_writer_start_on_a_line_of_their_own(tmp_path):
    path = tmp_path / "metrics.eval.jsonl"
    path.write_text('{"global_step": 1}\n{"global_step": 2, "val/b')  # an eval job killed mid-line
    append_jsonl(path, {"global_step": 3})
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["global_step"] for r in records] == [1, 3]


def test_eval_metrics_from_concurrent_writers_are_whole_lines(tmp_path):
    path = tmp_path / "metrics.eval.jsonl"
    script = (
        "import sys\n"
        "from bytelatent.eval.validate import append_jsonl\n"
        "for i in range(20):\n"
        f"    append_jsonl({str(path)!r}, {{'global_step': i, 'w': sys.argv[1] * 70000}})\n"
    )
    procs = [subprocess.Popen([sys.executable, "-c", script, w], cwd=REPO) for w in "abc"]
    assert [p.wait(timeout=hang_limit(120)) for p in procs] == [0, 0, 0]
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(records) == 60 and all(len(set(r["w"])) == 1 for r in records)


# ---------------------------------------------------------------- issue 29 item 8b: replayed steps
def _records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.parametrize("chunk", [1 << 16, 7])  # 7: lines longer than a read-back chunk
def test_records_after_the_resume_step_move_aside_whole(tmp_path, monkeypatch, chunk):
    monkeypatch.setattr(run_files, "_TAIL_CHUNK", chunk)
    path, aside = tmp_path / "metrics.jsonl", tmp_path / "metrics.replayed.jsonl"
    lines = [json.dumps({"global_step": s, "loss": 1.0 / s}) for s in range(1, 11)]
    path.write_text("\n".join(lines) + "\n" + '{"global_step": 11, "lo')  # + a killed write
    assert run_files.set_aside_lines_after(path, 6, aside) == 4
    assert [r["global_step"] for r in _records(path)] == [1, 2, 3, 4, 5, 6]
    assert aside.read_text() == "\n".join(lines[6:]) + "\n"  # verbatim: nothing lost
    assert run_files.set_aside_lines_after(path, 6, aside) == 0  # nothing after step 6 now
    assert run_files.set_aside_lines_after(path, 0, aside) == 6
    assert path.read_text() == "" and [r["global_step"] for r in _records(aside)] == [
        7, 8, 9, 10, 1, 2, 3, 4, 5, 6,
    ]  # fmt: skip
    assert run_files.set_aside_lines_after(tmp_path / "none.jsonl", 3, aside) == 0


@pytest.mark.slow
def test_resume_from_an_older_checkpoint_leaves_one_record_per_step(tmp_path, corpus_root):
    import shutil

    from tests.conftest import TINY_ENTROPY
    from tests.trainer.test_cli import run_cli

    dump = tmp_path / "run"
    argv = ["config=configs/entropy_debug.yaml", *TINY_ENTROPY, f"dump_dir={dump}",
            f"data.root_dir={corpus_root}", "logging.freq=1", "steps=4", "checkpoint.dump.every=2"]  # fmt: skip
    assert run_cli("bytelatent.train", argv).returncode == 0
    first = _records(dump / "metrics.jsonl")
    shutil.rmtree(dump / "checkpoints" / f"{4:010d}")  # the newest save is lost: resume from 2
    res = run_cli("bytelatent.train", argv)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "metrics.jsonl: 2 records after step 2" in res.stdout
    assert [r["global_step"] for r in _records(dump / "metrics.jsonl")] == [1, 2, 3, 4]
    assert _records(dump / "metrics.replayed.jsonl") == first[2:]
