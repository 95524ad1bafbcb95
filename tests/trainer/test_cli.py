"""The CLI end to end: trains, writes metrics/config/checkpoints, resumes, and fails in one line."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.limits import hang_limit
from tests.tiny import BLT_CONFIG, ENTROPY_CONFIG, TINY_BLT_MODEL, TINY_ENTROPY_MODEL

REPO = Path(__file__).resolve().parents[2]

TINY_ENTROPY = [
    f"config={ENTROPY_CONFIG}",
    *TINY_ENTROPY_MODEL,
    "data.seq_len=128",
    "data.batch_size=4",
    "data.load_async=false",
    "optim.lr=1e-2",
    "optim.warmup=2",
    "logging.freq=1",
]

TINY_BLT = [
    f"config={BLT_CONFIG}",
    *TINY_BLT_MODEL,
    "data.seq_len=48",
    "data.load_async=false",
    "optim.lr=1e-2",
    "optim.warmup=2",
    "logging.freq=1",
]


def run_cli(
    module: str, args: list[str], timeout: float = hang_limit(300)
) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def metrics(dump_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (dump_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_entropy_model_trains_and_bpb_falls(tmp_path, corpus_root):
    dump = tmp_path / "run"
    res = run_cli(
        "bytelatent.train",
        [*TINY_ENTROPY, f"dump_dir={dump}", f"data.root_dir={corpus_root}", "steps=30"],
    )
    assert res.returncode == 0, res.stderr[-3000:]
    rows = metrics(dump)
    assert [r["global_step"] for r in rows] == list(range(1, 31))
    for key in (
        "loss",
        "bpb",
        "n_bytes",
        "lr",
        "grad_norm",
        "bytes_per_s",
        "step_time_s",
        "data_time_s",
        "peak_mem_gib",
    ):
        assert key in rows[0], key
    first, last = sum(r["bpb"] for r in rows[:5]) / 5, sum(r["bpb"] for r in rows[-5:]) / 5
    assert last < first - 0.5, (first, last)
    assert (dump / "config.yaml").exists() and (dump / "train.log").exists()
    assert (dump / "checkpoints" / f"{30:010d}" / ".complete").exists()
    # running the same command again finds the run complete, says so, and trains nothing more
    res = run_cli(
        "bytelatent.train",
        [*TINY_ENTROPY, f"dump_dir={dump}", f"data.root_dir={corpus_root}", "steps=30"],
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert (
        res.stdout.strip()
        == f"{dump} is complete at step 30 (steps=30); raise steps or use another dump_dir"
    )
    assert len(metrics(dump)) == 30


@pytest.mark.slow
def test_blt_trains_and_bpb_falls(tmp_path, corpus_root):
    dump = tmp_path / "run"
    res = run_cli(
        "bytelatent.train",
        [*TINY_BLT, f"dump_dir={dump}", f"data.root_dir={corpus_root}", "steps=25"],
    )
    assert res.returncode == 0, res.stderr[-3000:]
    rows = metrics(dump)
    first, last = sum(r["bpb"] for r in rows[:5]) / 5, sum(r["bpb"] for r in rows[-5:]) / 5
    assert last < first - 0.5, (first, last)


def param_count(argv: list[str]) -> int:
    import torch

    from bytelatent.args import TrainArgs
    from bytelatent.config import parse_args
    from bytelatent.trainer.build import build_model

    args = parse_args(TrainArgs, argv)
    with torch.device("meta"):
        model = build_model(args)
    return sum(p.numel() for p in model.parameters())


def test_model_dim_changes_what_is_built(monkeypatch):
    monkeypatch.chdir(REPO)
    base = param_count(["config=configs/debug.yaml"])
    assert param_count(["config=configs/debug.yaml", "model.dim=64"]) < base
    assert param_count(["config=configs/debug.yaml", "model.n_layers=3"]) > base
    ent = param_count(["config=configs/entropy_debug.yaml"])
    assert param_count(["config=configs/entropy_debug.yaml", "entropy_model.dim=64"]) < ent


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "model.cross_atn_k=2",
            "config error: model.cross_atn_k: unknown key (did you mean model.cross_attn_k?)",
        ),
        ("optim.lr=fast", "config error: optim.lr:"),
        ("config=configs/does_not_exist.yaml", "config error:"),
        ("distributed.dp_shard=3", "config error: distributed:"),
    ],
)
def test_user_errors_are_one_line_and_exit_2(tmp_path, override, message):
    res = run_cli(
        "bytelatent.train",
        ["config=configs/debug.yaml", f"dump_dir={tmp_path}", override],
        timeout=hang_limit(120),
    )
    assert res.returncode == 2, (res.stdout[-2000:], res.stderr[-2000:])
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(message), res.stderr


def test_missing_data_is_one_line_and_exit_2(tmp_path):
    res = run_cli(
        "bytelatent.train",
        ["config=configs/debug.yaml", f"dump_dir={tmp_path}", f"data.root_dir={tmp_path / 'nope'}"],
        timeout=hang_limit(120),
    )
    assert res.returncode == 2, res.stderr[-2000:]
    assert (
        res.stderr.strip().startswith("data error:") and len(res.stderr.strip().splitlines()) == 1
    ), res.stderr
    # the default corpus is missing: the message names the command that builds it
    assert f"python -m bytelatent.data.prepare --out {tmp_path / 'nope' / 'stdlib'}" in res.stderr


def test_print_config_resolves_overrides():
    res = run_cli(
        "bytelatent.print_config",
        ["config=configs/debug.yaml", "optim.lr=0.123", "model.dim=96"],
        timeout=hang_limit(120),
    )
    assert res.returncode == 0, res.stderr
    assert "lr: 0.123" in res.stdout and "dim: 96" in res.stdout


def test_print_config_redacts_secrets():
    argv = ["config=configs/debug.yaml", "env.WANDB_API_KEY=abc123secret", "dump_dir=x"]
    res = run_cli("bytelatent.print_config", argv, timeout=hang_limit(120))
    assert res.returncode == 0, res.stderr
    assert "WANDB_API_KEY" in res.stdout and "abc123secret" not in res.stdout
