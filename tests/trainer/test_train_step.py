"""Gradient accumulation: the update depends on the bytes seen, not on how they are split."""

import numpy as np
import pytest
import torch

from bytelatent.args import TrainArgs
from bytelatent.config import parse_args
from bytelatent.data.batch import Batch
from bytelatent.distributed.env import detect_env
from bytelatent.trainer.trainer import Trainer
from tests.trainer.test_cli import REPO, TINY_ENTROPY


def make_trainer(tmp_path, corpus_root, grad_acc: int) -> Trainer:
    argv = [
        *TINY_ENTROPY,
        f"dump_dir={tmp_path}",
        f"data.root_dir={corpus_root}",
        "distributed.model_dtype=fp32",
        f"grad_acc_steps={grad_acc}",
        "optim.clip=0.5",
    ]
    return Trainer(parse_args(TrainArgs, argv), detect_env())


def batch(rng: np.random.Generator, rows: int, length: int = 128) -> Batch:
    x = rng.integers(4, 260, size=(rows, length)).astype(np.int64)
    y = np.roll(x, -1, axis=1)
    mask = np.ones_like(x, dtype=bool)
    mask[:, -rng.integers(1, 40) :] = False  # different amounts of padding per micro-batch
    return Batch(x=x, y=y, mask=mask)


def test_accumulation_equals_one_big_batch(tmp_path, corpus_root, monkeypatch):
    monkeypatch.chdir(REPO)
    rng = np.random.default_rng(0)
    b1, b2 = batch(rng, 2), batch(rng, 2)
    merged = Batch(
        x=np.concatenate([b1.x, b2.x]),
        y=np.concatenate([b1.y, b2.y]),
        mask=np.concatenate([b1.mask, b2.mask]),
    )
    split = make_trainer(tmp_path / "a", corpus_root, grad_acc=2)
    whole = make_trainer(tmp_path / "b", corpus_root, grad_acc=1)
    try:
        for a, b in zip(split.model.parameters(), whole.model.parameters()):
            assert torch.equal(a, b)  # same seed, same init
        out_split = split.train_step([b1, b2])
        out_whole = whole.train_step([merged])
        assert out_split.n_bytes == out_whole.n_bytes == int(merged.mask.sum())
        assert float(out_split.loss_sum) == pytest.approx(float(out_whole.loss_sum), rel=1e-6)
        assert float(out_split.grad_norm) == pytest.approx(float(out_whole.grad_norm), rel=1e-5)
        for a, b in zip(split.model.parameters(), whole.model.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    finally:
        split.close()
        whole.close()
