"""Supervised fine-tuning is an ordinary run (issue 41, docs/sft.md): configs/sft_debug.yaml
starts from a pretrained checkpoint with a fresh optimizer, resumes mid-epoch bitwise, and a
shortened recipe lifts exact match on held-out words well above the untuned model's; then
`python -m bytelatent.generate mode=chat` answers with the checkpoint's template."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from apps.sft_synthetic import build, write_jsonl
from tests.conftest import train_tiny
from tests.limits import hang_limit
from tests.tiny import TINY_BLT_MODEL

REPO = Path(__file__).resolve().parents[2]
SFT_CONFIG = REPO / "configs" / "sft_debug.yaml"


def synthetic(root: Path, n_train: int = 3000, n_eval: int = 30) -> Path:
    train, evals = build(n_train, n_eval, seed=0)
    write_jsonl(root / "train" / "train.jsonl", train)
    write_jsonl(root / "eval.jsonl", evals)
    return root


def sft_argv(data: Path, init: Path, *extra: str) -> list[str]:
    return [
        *TINY_BLT_MODEL,
        f"data.dataset_files=[{data / 'train'}]",
        f"eval.validation.sources=[{data / 'eval.jsonl'}]",
        f"eval.task_args.chat.file={data / 'eval.jsonl'}",
        "eval.validation.max_batches=1",
        "data.seq_len=24",
        "data.load_async=false",
        f"checkpoint.init_ckpt_path={init}",
        *extra,
    ]


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.slow
def test_sft_resume_mid_epoch_is_bitwise(tmp_path, tiny_blt_run) -> None:
    data = synthetic(tmp_path / "data")
    init = tiny_blt_run / "checkpoints" / "0000000020"
    argv = sft_argv(data, init, "eval.every=0", "eval.before_training=false", "logging.freq=1")
    straight = train_tiny(str(SFT_CONFIG), tmp_path / "straight", data, 8, argv)
    chained = tmp_path / "chained"
    train_tiny(str(SFT_CONFIG), chained, data, 8, [*argv, "max_steps=4", "checkpoint.dump.every=4"])  # fmt: skip
    train_tiny(str(SFT_CONFIG), chained, data, 8, argv)  # resumes at step 4, mid-epoch
    want = {r["global_step"]: r["loss"] for r in records(straight / "metrics.jsonl")}
    got = {r["global_step"]: r["loss"] for r in records(chained / "metrics.jsonl")}
    assert want.keys() == got.keys() == set(range(1, 9))
    assert got == want  # bitwise: the same floats at every step after the resume


@pytest.mark.slow
def test_shortened_recipe_lifts_exact_match_and_generate_chat_answers(tmp_path, tiny_blt_run):
    data = synthetic(tmp_path / "data")
    init = tiny_blt_run / "checkpoints" / "0000000020"
    steps = 150
    argv = sft_argv(data, init, f"eval.every={steps}", "eval.task_args.chat.limit=30",
                    "data.batch_size=4", "optim.lr=3e-3")  # fmt: skip
    dump = train_tiny(str(SFT_CONFIG), tmp_path / "sft", data, steps, argv)
    evals = {r["global_step"]: r for r in records(dump / "metrics.eval.jsonl")}
    before, after = evals[0], evals[steps]
    assert before["chat/exact_match"] <= 0.05  # the untuned model does not follow the template
    assert after["chat/template"] >= 0.9, after
    assert after["chat/exact_match"] >= before["chat/exact_match"] + 0.25, after
    ckpt = dump / "checkpoints" / f"{steps:010d}"
    res = subprocess.run(
        [sys.executable, "-m", "bytelatent.generate", f"ckpt={ckpt}", "mode=chat",
         "prompt=upper abc", "max_new_bytes=8"],
        cwd=REPO, capture_output=True, text=True, timeout=hang_limit(300),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.count("\n") == 1  # one answer line (what it says is the model's business)
