"""Byteify stage 1: `optim.groups` with `frozen: true` keeps the global transformer bitwise
unchanged for the whole run (an in-process tiny BLT) while the local models train; stage 2, a
new run warm-started from stage 1's checkpoint, starts from exactly those weights and moves the
backbone at its lower learning rate."""

from __future__ import annotations

import pytest
import torch

from bytelatent.args import TrainArgs
from bytelatent.config import parse_args
from bytelatent.distributed.env import detect_env
from bytelatent.errors import ConfigError
from bytelatent.trainer.trainer import Trainer
from tests.trainer.test_cli import TINY_BLT

BACKBONE = "global_transformer.*"


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def stage_args(dump, corpus_root, group: str, *extra: str) -> TrainArgs:
    return parse_args(
        TrainArgs,
        [
            *TINY_BLT,
            f"optim.groups=[{{params: '{BACKBONE}', {group}}}]",
            f"dump_dir={dump}",
            f"data.root_dir={corpus_root}",
            "distributed.model_dtype=fp32",
            "steps=4",
            "checkpoint.dump.every=0",
            *extra,
        ],
    )


def test_frozen_backbone_is_bitwise_unchanged_after_stage_1_steps(tmp_path, corpus_root):
    trainer = Trainer(stage_args(tmp_path / "stage1", corpus_root, "frozen: true"), detect_env())
    try:
        before = snapshot(trainer.model)
        trainer.train()
        after = snapshot(trainer.model)
        backbone = [n for n in before if n.startswith("global_transformer.")]
        assert backbone, "the tiny BLT has a global transformer"
        for name in backbone:
            assert torch.equal(before[name], after[name]), name  # bitwise, not approximately
        moved = [n for n in before if n not in backbone and not torch.equal(before[n], after[n])]
        assert any(n.startswith("local_encoder.") for n in moved), moved
        assert any(n.startswith("local_decoder.") for n in moved), moved
        params = dict(trainer.model.named_parameters())
        assert not any(params[n] in trainer.optimizer.state for n in backbone)  # no AdamW state
        assert trainer.state.step == 4
    finally:
        trainer.close()

    # stage 2: a new run from stage 1's final checkpoint, everything trains, the backbone at 0.1x
    (ckpt,) = sorted((tmp_path / "stage1" / "checkpoints").glob("0*"))
    args = stage_args(
        tmp_path / "stage2", corpus_root, "lr_scale: 0.1", f"checkpoint.init_ckpt_path={ckpt}"
    )
    stage2 = Trainer(args, detect_env())
    try:
        start = snapshot(stage2.model)
        assert start.keys() == after.keys()
        for name in after:
            assert torch.equal(start[name], after[name]), name  # stage 1's weights, bitwise
        stage2.train()
        end = snapshot(stage2.model)
        assert all(not torch.equal(start[n], end[n]) for n in backbone), "backbone must train"
    finally:
        stage2.close()


def test_frozen_and_freeze_until_step_together_is_a_config_error():
    with pytest.raises((ConfigError, ValueError), match="frozen=true and freeze_until_step=5"):
        parse_args(
            TrainArgs,
            [
                *TINY_BLT,
                f"optim.groups=[{{params: '{BACKBONE}', frozen: true, freeze_until_step: 5}}]",
            ],
        )
