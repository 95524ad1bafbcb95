"""A run that runs out of space (issue 22.5), end to end through `python -m bytelatent.train`.

Two real limits, no mocks: a small tmpfs mounted for the test (needs root and a kernel that lets
this container mount; skipped otherwise), and `RLIMIT_FSIZE` (any user: a write past the limit
fails with EFBIG, part-way like ENOSPC). Either way the run must end with exactly one line naming
the file and the OS error, exit non-zero, print no "--- Logging error ---" traceback, leave every
JSONL file as whole lines and release `.lock`.
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from bytelatent.trainer.run_files import REPLAYED_METRICS
from bytelatent.trainer.run_lock import LOCK_NAME
from tests.limits import hang_limit
from tests.trainer.test_cli import REPO, TINY_ENTROPY

pytestmark = pytest.mark.slow

FULL = "[Errno 28] No space left on device"
TOO_LARGE = "[Errno 27] File too large"


def _train(dump: Path, corpus_root: Path, extra: list[str], fsize: int | None = None):
    def limit():
        if fsize is not None:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a kill
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))

    args = [*TINY_ENTROPY, f"dump_dir={dump}", f"data.root_dir={corpus_root}",
            "checkpoint.eval.every=0", *extra]  # fmt: skip
    return subprocess.run(
        [sys.executable, "-m", "bytelatent.train", *args], cwd=REPO, capture_output=True,
        text=True, timeout=hang_limit(300), env=dict(os.environ, OMP_NUM_THREADS="1"), preexec_fn=limit,
    )  # fmt: skip


def _assert_one_line_end(res, dump: Path, pattern: str) -> str:
    output = res.stdout + res.stderr
    assert res.returncode != 0, output[-3000:]
    assert "Logging error" not in output and "Traceback" not in output, output[-3000:]
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and re.fullmatch(pattern, lines[0]), res.stderr[-3000:]
    assert lines[0] not in res.stdout  # said once, not also as a console log line
    assert not (dump / LOCK_NAME).exists()
    for name in ("metrics.jsonl", "train.log"):
        path = dump / name
        if path.exists() and path.stat().st_size:
            assert path.read_bytes().endswith(b"\n"), name  # whole lines only
    rows = (dump / "metrics.jsonl").read_text().splitlines()
    assert rows and all(json.loads(row)["global_step"] for row in rows)
    return lines[0]


class SmallDisk:
    """A tmpfs mounted at `path`; `resize` changes its size."""

    def __init__(self, path: Path):
        self.path = path

    def resize(self, size: str) -> None:
        subprocess.run(["mount", "-o", f"remount,size={size}", str(self.path)], check=True)


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 48 KiB tmpfs (skipped where this container may not mount one)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if shutil.which("mount") is None or os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48k", "tmpfs", str(mnt)],
                         capture_output=True, text=True)  # fmt: skip
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
    try:
        yield SmallDisk(mnt)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_full_tmpfs_metrics(small_tmpfs, corpus_root):
    dump = small_tmpfs.path / "run"
    res = _train(
        dump, corpus_root, ["steps=400", "checkpoint.dump.every=0", "logging.console=false"]
    )
    line = _assert_one_line_end(
        res, dump, re.escape(f"disk error: writing {dump / 'metrics.jsonl'}: {FULL}")
    )
    assert (dump / "train.log").read_text().splitlines()[-1].endswith(line)  # also in train.log
    yaml_text = (dump / "config.yaml").read_text()
    assert "dump_dir:" in yaml_text and yaml_text.endswith("\n")  # written whole, before


def test_full_tmpfs_console_and_train_log(small_tmpfs, corpus_root):
    """With the console on, train.log and metrics.jsonl grow together: whichever the disk refuses
    first is named; nothing is printed per failed log line."""
    dump = small_tmpfs.path / "run"
    res = _train(dump, corpus_root, ["steps=400", "checkpoint.dump.every=0"])
    files = "|".join(re.escape(str(dump / n)) for n in ("metrics.jsonl", "train.log"))
    _assert_one_line_end(res, dump, f"disk error: writing ({files}): {re.escape(FULL)}")


def test_full_tmpfs_checkpoint_then_resume(small_tmpfs, corpus_root):
    """A checkpoint that does not fit: one line (the checkpoint's, with the OS error); with more
    space the same command trains on and appends whole records."""
    small_tmpfs.resize("192k")
    dump = small_tmpfs.path / "run"
    extra = ["steps=20", "checkpoint.dump.every=10", "logging.console=false"]
    res = _train(dump, corpus_root, extra)
    folder = re.escape(str(dump / "checkpoints" / "0000000010"))
    _assert_one_line_end(
        res, dump, f"checkpoint error: {folder}: cannot write the checkpoint .*{re.escape(FULL)}.*"
    )
    small_tmpfs.resize("4m")
    res = _train(dump, corpus_root, extra)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    rows = [json.loads(r) for r in (dump / "metrics.jsonl").read_text().splitlines()]
    assert [r["global_step"] for r in rows][-20:] == list(range(1, 21))


def test_file_size_limit(tmp_path, corpus_root):
    """No root needed: RLIMIT_FSIZE cuts metrics.jsonl's writes at 40 KB."""
    dump = tmp_path / f"run-{uuid.uuid4().hex[:6]}"
    res = _train(dump, corpus_root, ["steps=400", "checkpoint.dump.every=0", "logging.console=false"],
                 fsize=40_000)  # fmt: skip
    line = _assert_one_line_end(
        res, dump, re.escape(f"disk error: writing {dump / 'metrics.jsonl'}: {TOO_LARGE}")
    )
    assert (dump / "metrics.jsonl").stat().st_size <= 40_000
    assert (dump / "train.log").read_text().splitlines()[-1].endswith(line)
    # A kill in the middle of a record (simulated): the next start cuts it off and says so.
    n_rows = len((dump / "metrics.jsonl").read_text().splitlines())
    with open(dump / "metrics.jsonl", "a") as f:
        f.write('{"created_at": "2026-')
    res = _train(dump, corpus_root, ["steps=3", "checkpoint.dump.every=0", "logging.console=false"])
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    rows = [json.loads(r) for r in (dump / "metrics.jsonl").read_text().splitlines()]
    # no checkpoint was saved, so the rerun starts over: the dead attempt's records move aside
    assert [r["global_step"] for r in rows] == [1, 2, 3]
    aside = (dump / REPLAYED_METRICS).read_text().splitlines()
    assert len(aside) == n_rows and all(json.loads(r)["global_step"] for r in aside)
    assert "dropped 21 bytes of a partial last line" in (dump / "train.log").read_text()
