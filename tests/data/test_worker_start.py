"""A data worker whose start fails (its forkserver died with the job's SIGTERM) is not joined:
`close()` raised "AssertionError: can only join a started process" on top of the real error, and a
two-rank run whose data is empty on one rank printed it after the one data error line (issue 22).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_multiprocess import make_args, take

from bytelatent.data.iterators.multiprocess import MultiprocessIterator
from tests.limits import hang_limit
from tests.tiny import ENTROPY_CONFIG, TINY_ENTROPY_MODEL

REPO = Path(__file__).resolve().parents[2]


def test_failed_worker_start_closes_cleanly_and_retries(corpus, monkeypatch):
    args = make_args(corpus)
    it = args.build_from_rank(0, 1)
    assert isinstance(it, MultiprocessIterator)
    process_class = type(mp.get_context(it.start_method).Process(target=print))
    real_start = process_class.start

    def dead_forkserver(self):
        raise EOFError("unexpected EOF")

    monkeypatch.setattr(process_class, "start", dead_forkserver)
    with pytest.raises(EOFError):
        next(it)
    it.close()  # used to raise AssertionError: can only join a started process
    assert it.worker_pid is None
    monkeypatch.setattr(process_class, "start", real_start)
    try:
        assert len(take(it, 2)) == 2  # a later next() starts a worker afresh
    finally:
        it.close()


@pytest.mark.slow
def test_two_ranks_one_without_data_says_only_the_data_error(tmp_path):
    data = tmp_path / "data" / "stdlib"
    data.mkdir(parents=True)
    # 3 documents, 4 virtual streams (2 per rank, interleaved): rank 1's stream 3 is empty
    (data / "one.jsonl").write_text(('{"text": "%s"}\n' % ("hello world " * 200)) * 3)
    args = [f"config={ENTROPY_CONFIG}", *TINY_ENTROPY_MODEL, "data.seq_len=128",
            "data.batch_size=2", f"dump_dir={tmp_path / 'run'}", f"data.root_dir={data.parent}",
            "steps=10", "distributed.dp_shard=2", "logging.console=false"]  # fmt: skip
    res = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         "-m", "bytelatent.train", *args],
        cwd=REPO, capture_output=True, text=True, timeout=hang_limit(400),
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO)),
    )  # fmt: skip
    output = res.stdout + res.stderr
    assert res.returncode != 0
    errors = [line for line in output.splitlines() if line.startswith("data error: ")]
    assert len(errors) == 1 and "the rows this data stream reads" in errors[0], output[-4000:]
    assert "use fewer data-parallel ranks" in errors[0]
    assert "can only join a started process" not in output, output[-4000:]
    assert not [line for line in output.splitlines() if line.startswith("[rank")], output[-4000:]
