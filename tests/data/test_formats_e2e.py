"""FineWeb-like Parquet and DCLM-like .jsonl.zst folders end to end: entropy preprocessing reads
both; the debug BLT trains on them from S3 (moto) and, entropy-patched, on the preprocessed
output."""

import os
import subprocess
import sys

import pyarrow as pa
import pytest
from test_formats import make_corpus, write_bad_utf8

import apps.preprocess_entropies as prep
from tests.apps.test_preprocess_entropies import make_model_dir
from tests.limits import hang_limit
from tests.trainer.test_cli import REPO, TINY_BLT, run_cli


def preprocess(tmp_path):
    make_model_dir(tmp_path / "em")
    raw = tmp_path / "raw"
    expected = {kind: make_corpus(raw, kind) for kind in ("parquet", "zst")}
    out = tmp_path / "pre"
    for kind in ("parquet", "zst"):
        argv = [
            "--input",
            str(raw / kind),
            "--output-dir",
            str(out),
            "--entropy-model-name",
            "tiny",
        ]
        argv += ["--entropy-model", str(tmp_path / "em"), "--device", "cpu", "--no-progress"]
        assert prep.main(argv) == 0
    return raw, out, expected


def shard_ids(folder) -> list[str]:
    ids = []
    for shard in sorted(folder.glob("*.arrow")):
        assert (folder / f"{shard.name}.complete").exists()
        with pa.memory_map(str(shard)) as source:
            table = pa.ipc.open_file(source).read_all()
        assert all(
            len(e) == len(t.encode()) + 2
            for e, t in zip(table.column("entropies").to_pylist(), table.column("text").to_pylist())
        )
        ids += table.column("sample_id").to_pylist()
    return ids


def test_preprocess_entropies_reads_parquet_and_zst(tmp_path):
    _, out, expected = preprocess(tmp_path)
    for kind in ("parquet", "zst"):
        assert sorted(shard_ids(out / kind / "tiny")) == sorted(expected[kind])


def upload(local_root, bucket: str) -> str:
    import s3fs

    fs = s3fs.S3FileSystem()
    fs.mkdir(bucket)
    for directory, _, files in os.walk(local_root):
        for name in files:
            path = os.path.join(directory, name)
            fs.put_file(path, f"{bucket}/{os.path.relpath(path, local_root)}")
    return f"s3://{bucket}"


def train(dump_dir, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "bytelatent.train", *TINY_BLT, f"dump_dir={dump_dir}", "steps=3"]
    cmd += ["checkpoint.dump.every=0", "logging.console=false", "data.batch_size=2", *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


@pytest.mark.slow
@pytest.mark.s3
def test_blt_trains_on_parquet_and_zst_from_s3_and_on_their_entropies(tmp_path, s3_env):
    raw, pre, _ = preprocess(tmp_path)
    bucket = upload(raw, "fineweb-dclm")
    sources = "data.sources={parquet: 1.0, zst: 1.0}"
    runs = {
        "s3": train(tmp_path / "s3", f"data.root_dir={bucket}", sources),
        "entropy": train(
            tmp_path / "entropy", f"data.root_dir={raw}", sources, f"data.preprocess_dir={pre}",
            "data.entropy_model_name=tiny", "data.patcher_args.patching_mode=entropy",
            "data.patcher_args.threshold=1.0",
        ),
    }  # fmt: skip
    for name, proc in runs.items():
        output, _ = proc.communicate(timeout=hang_limit(300))
        assert proc.returncode == 0, (name, output[-3000:])
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        assert len(lines) == 3, name


@pytest.mark.slow
def test_a_parquet_row_of_invalid_utf8_is_one_line_or_skipped(tmp_path):
    """Issue 29.5: one data error line (exit 2, no traceback), in the trainer's process and from
    the data-loader worker; with skip_bad_records the run trains to its last step."""
    root = tmp_path / "data"
    (root / "fw").mkdir(parents=True)
    path = write_bad_utf8(root / "fw" / "part-0.parquet", n=40, bad=3)
    base = [*TINY_BLT, f"data.root_dir={root}", "data.sources={fw: 1.0}", "data.batch_size=2"]
    base += ["steps=3", "checkpoint.dump.every=0", "logging.console=false"]
    for load_async in ("false", "true"):
        res = run_cli(
            "bytelatent.train", [*base, f"dump_dir={tmp_path / load_async}",
                                 f"data.load_async={load_async}"])  # fmt: skip
        assert res.returncode == 2, (load_async, res.stderr[-3000:])
        assert "Traceback" not in res.stderr + res.stdout, (load_async, res.stderr[-3000:])
        lines = [line for line in res.stderr.splitlines() if line.strip()]
        assert lines[-1] == (
            f"data error: {path}: row 3: column 'text': invalid UTF-8 at byte 3; "
            "fix the file or set data.skip_bad_records=true"
        ), (load_async, lines[-5:])
        assert sum("data error:" in line for line in lines) == 1, (load_async, lines)
    for load_async in ("false", "true"):
        dump = tmp_path / f"skip-{load_async}"
        res = run_cli("bytelatent.train", [*base, f"dump_dir={dump}", "data.skip_bad_records=true",
                                           f"data.load_async={load_async}"])  # fmt: skip
        assert res.returncode == 0, (load_async, res.stderr[-3000:])
        assert len((dump / "metrics.jsonl").read_text().splitlines()) == 3, load_async
        assert "Traceback" not in res.stderr + res.stdout, (load_async, res.stderr[-3000:])
    warning = f"skipping bad record {path} row 3: column 'text': invalid UTF-8 at byte 3"
    assert warning in (tmp_path / "skip-false" / "train.log").read_text()
