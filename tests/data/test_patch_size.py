"""python -m bytelatent.data.patch_size: the threshold for a target mean patch length."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from bytelatent.data.patch_size import find_threshold, load_sample, main, patch_lengths


def entropy_jsonl(path, n_docs: int = 30, seed: int = 0) -> None:
    """Documents with smooth random 'entropies' (one per token, BOS and EOS included)."""
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for i in range(n_docs):
            text = "".join(rng.choice(list("abcdef ghij.\n"), size=int(rng.integers(200, 900))))
            n = len(text.encode()) + 2
            walk = np.abs(np.cumsum(rng.normal(0, 0.4, n))) % 3.0
            f.write(
                json.dumps({"sample_id": str(i), "text": text, "entropies": walk.tolist()}) + "\n"
            )


def threshold_of(out: str) -> float:
    lines = [line for line in out.splitlines() if line.startswith("threshold=")]
    assert len(lines) == 1, out
    assert re.fullmatch(r"threshold=[-0-9.e]+", lines[0]), lines[0]
    return float(lines[0].split("=", 1)[1])


@pytest.mark.parametrize("monotonicity, max_len", [(False, None), (True, None), (False, 6)])
def test_cli_threshold_gives_the_target_mean_with_the_training_patcher(
    tmp_path, capsys, monotonicity, max_len
):
    shard = tmp_path / "ent.jsonl"
    entropy_jsonl(shard)
    argv = ["--target-mean", "3.5", "--entropies", str(shard)]
    argv += ["--monotonicity"] * monotonicity + ["--max-patch-length", str(max_len)] * bool(max_len)
    assert main(argv) == 0
    out = capsys.readouterr().out
    threshold = threshold_of(out)
    sample = load_sample(str(shard), 10**9)
    mean = patch_lengths(sample, threshold, monotonicity, max_len).mean()
    assert mean == pytest.approx(3.5, rel=0.02)
    assert "3-4" in out and len(out.splitlines()) >= 7  # header + target and 4 neighbours
    if max_len:
        assert patch_lengths(sample, threshold, monotonicity, max_len).max() <= max_len


def test_mean_grows_with_the_threshold_and_unreachable_targets_fail(tmp_path, capsys):
    shard = tmp_path / "ent.jsonl"
    entropy_jsonl(shard, n_docs=5)
    sample = load_sample(str(shard), 10**9)
    means = [patch_lengths(sample, t).mean() for t in (0.5, 1.0, 1.5, 2.0)]
    assert means == sorted(means) and means[0] < means[-1]
    t, mean = find_threshold(sample, 2.0)
    assert mean == pytest.approx(2.0, rel=0.02)
    assert main(["--target-mean", "500", "--entropies", str(shard)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("config error: --target-mean 500") and "\n" not in err


def test_text_without_entropies_needs_the_entropy_model(tmp_path, capsys):
    shard = tmp_path / "plain.jsonl"
    shard.write_text(json.dumps({"text": "hello world"}) + "\n")
    assert main(["--target-mean", "4", "--entropies", str(shard)]) == 2
    assert "no 'entropies'" in capsys.readouterr().err


def train_entropy_model(tmp_path, corpus_root):
    """The debug entropy model, briefly trained (50 steps at 64d x 2 layers), consolidated (in
    this process: the tool's and the trainer's runs below are the processes under test)."""
    from bytelatent.checkpoint.__main__ import main as checkpoint_main
    from tests.trainer.test_cli import TINY_ENTROPY, run_cli

    dump = tmp_path / "entropy"
    argv = [*TINY_ENTROPY, f"dump_dir={dump}", f"data.root_dir={corpus_root}", "steps=50"]
    argv += ["entropy_model.dim=64", "entropy_model.n_layers=2", "entropy_model.n_heads=4"]
    argv += ["data.batch_size=8", "optim.warmup=5", "logging.freq=20"]
    res = run_cli("bytelatent.train", argv)
    assert res.returncode == 0, res.stderr[-3000:]
    step = dump / "checkpoints" / f"{50:010d}"
    assert checkpoint_main(["consolidate", str(step)]) == 0
    return step / "consolidated"


def run_tool(model_dir, text, sample_bytes: int, capsys=None) -> tuple[float, float]:
    """The tool's threshold and mean patch length: as a process, or in this one with `capsys`."""
    from tests.trainer.test_cli import run_cli

    args = ["--target-mean", "4.5", "--entropy-model", str(model_dir), "--text", str(text)]
    args += ["--sample-bytes", str(sample_bytes)]
    if capsys is None:
        res = run_cli("bytelatent.data.patch_size", args)
        assert res.returncode == 0, res.stderr[-3000:]
        out = res.stdout
    else:
        capsys.readouterr()
        assert main(args) == 0
        out = capsys.readouterr().out
    mean = float(re.search(r"mean patch length ([0-9.]+)", out).group(1))
    return threshold_of(out), mean


@pytest.mark.slow
def test_debug_entropy_model_threshold_holds_in_training(tmp_path, corpus_root, capsys):
    from tests.trainer.test_cli import TINY_BLT, metrics, run_cli

    model_dir = train_entropy_model(tmp_path, corpus_root)
    val = corpus_root / "stdlib" / "stdlib.val.jsonl"
    _, val_mean = run_tool(model_dir, val, 10**6, capsys)
    assert val_mean == pytest.approx(4.5, rel=0.02)
    # The threshold for the text the BLT run reads: its 30 steps x 8 rows x 256 bytes are the
    # first ~61 kB of the training stream (documents in file order: shard shuffling and
    # interleaving are off and one stream feeds every row, shuffled only within a 16-window buffer). Per-document means vary from 3.4 to 5.9 bytes here, so the validation
    # file's 3 documents give a threshold ~0.02 nat off; the tool states the same for any text.
    threshold, _ = run_tool(
        model_dir, corpus_root / "stdlib" / "stdlib.chunk.*.jsonl", 30 * 8 * 256
    )

    blt = tmp_path / "blt"
    argv = [
        *TINY_BLT,
        f"dump_dir={blt}",
        f"data.root_dir={corpus_root}",
        "data.patcher_args.patching_mode=entropy",
        "data.patcher_args.realtime_patching=true",
        f"data.patcher_args.entropy_model_checkpoint_dir={model_dir}",
        "data.patcher_args.patching_device=cpu",
        f"data.patcher_args.threshold={threshold}",
        "data.batch_size=8",
        "data.shuffle_files=false",
        "data.open_files=1",
        "data.virtual_streams=1",
        "logging.freq=5",
        "steps=30",
    ]
    res = run_cli("bytelatent.train", argv)
    assert res.returncode == 0, res.stderr[-3000:]
    logged = [row["patch_len_mean"] for row in metrics(blt)]
    assert np.mean(logged) == pytest.approx(4.5, rel=0.05), logged


def test_a_missing_entropies_folder_names_the_option(tmp_path, capsys):
    from bytelatent.data.patch_size import main as patch_size_main

    assert patch_size_main(["--target-mean", "4.5", "--entropies", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"data error: --entropies {tmp_path / 'nope'}: does not exist"
