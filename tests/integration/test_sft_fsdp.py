"""Supervised fine-tuning under FSDP (issue 41): the chat data, the answer-only loss mask and the
target count behave as in pretraining, so 2 FSDP ranks give the losses of 1 process with the
same global batch."""

from __future__ import annotations

import pytest
from harness import losses_by_step, metric_by_step

from tests.trainer.test_sft_run import SFT_CONFIG, sft_argv, synthetic


@pytest.mark.slow
def test_sft_on_two_fsdp_ranks_matches_one_process(runner, tmp_path, tiny_blt_run) -> None:
    data = synthetic(tmp_path / "data", n_train=200, n_eval=10)
    init = tiny_blt_run / "checkpoints" / "0000000020"

    def args(nproc: int) -> list[str]:
        return [
            f"config={SFT_CONFIG}",
            *sft_argv(data, init, "eval.every=0", "eval.before_training=false"),
            "steps=4",
            "checkpoint.dump.every=0",
            f"data.batch_size={4 // nproc}",
            f"distributed.dp_shard={nproc}",
        ]

    one = runner.start("one", args(1))
    one.wait_ok()
    two = runner.start("two", args(2), nproc=2)
    two.wait_ok()
    single, sharded = losses_by_step(one.dump_dir), losses_by_step(two.dump_dir)
    assert sorted(single) == sorted(sharded) == [1, 2, 3, 4]
    for step, loss in single.items():
        assert sharded[step] == pytest.approx(loss, rel=1e-4), (step, single, sharded)
    # the answer bytes counted over both ranks are the single process's
    assert metric_by_step(two.dump_dir, "n_bytes") == metric_by_step(one.dump_dir, "n_bytes")
