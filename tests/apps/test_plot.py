"""`python -m apps.plot` on a finished tiny BLT run: non-empty PNGs with train and validation."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

from tests.extras import lazy_extra
from tests.limits import hang_limit

lazy_extra("matplotlib", reason="apps.plot needs matplotlib (the plot extra)")

REPO = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ORANGE = np.array([1.0, 0.498, 0.055])  # tab:orange, the validation line


def has_color(png: Path, rgb: np.ndarray) -> bool:
    import matplotlib.image

    pixels = matplotlib.image.imread(png)[..., :3]
    return bool((np.abs(pixels - rgb).max(axis=-1) < 0.02).any())


def test_plot_a_finished_blt_run(tiny_blt_run, tmp_path):
    rows = [json.loads(line) for line in (tiny_blt_run / "metrics.jsonl").read_text().splitlines()]
    assert rows and all(r["patch_len_mean"] > 1 and sum(r["patch_len_hist"]) > 0 for r in rows)
    assert (tiny_blt_run / "model-info.txt").read_text().startswith("model: ByteLatentTransformer")
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(tiny_blt_run / "metrics.jsonl", run / "metrics.jsonl")
    res = subprocess.run(
        [sys.executable, "-m", "apps.plot", str(run)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=hang_limit(120),
    )
    assert res.returncode == 0, res.stderr
    names = {Path(p).name for p in res.stdout.split()}
    assert names == {"loss.png", "bpb.png", "lr.png", "throughput.png", "patch_lengths.png"}
    for name in names:
        data = (run / "plots" / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000, name
    assert not has_color(run / "plots" / "bpb.png", ORANGE)  # no validation metrics yet
    with open(run / "metrics.eval.jsonl", "w") as f:
        for step, bpb in ((10, 6.0), (20, 5.0)):
            f.write(
                json.dumps({"global_step": step, "val/bpb": bpb, "val/loss": bpb * 0.69}) + "\n"
            )
    assert (
        subprocess.run(
            [sys.executable, "-m", "apps.plot", str(run), "--out", str(tmp_path / "p")],
            cwd=REPO,
            capture_output=True,
            timeout=hang_limit(120),
        ).returncode
        == 0
    )
    assert has_color(tmp_path / "p" / "bpb.png", ORANGE) and has_color(
        tmp_path / "p" / "loss.png", ORANGE
    )


def test_plot_of_a_folder_without_metrics_is_one_line(tmp_path):
    res = subprocess.run(
        [sys.executable, "-m", "apps.plot", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=hang_limit(120),
    )
    assert res.returncode == 2 and res.stderr.startswith("data error:")
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_resumed_run_keeps_one_record_per_step(tmp_path):
    from apps.plot import read_records

    lines = [
        {"global_step": 1, "loss": 3.0},
        {"global_step": 2, "loss": 2.0},
        {"global_step": 2, "loss": 1.5},
        {"global_step": 3, "loss": 1.0},
    ]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"global_st')
    assert [(r["global_step"], r["loss"]) for r in read_records(path)] == [
        (1, 3.0),
        (2, 1.5),
        (3, 1.0),
    ]
