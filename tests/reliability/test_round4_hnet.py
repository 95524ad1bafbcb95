"""Issue 38, item 6: a collapsed H-Net router is warned about (and logged as a metric), and stage
targets that cannot fit the row, or non-finite ratios and loss weights, are config errors."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from bytelatent.archs.hnet.dc import monitor
from bytelatent.archs.hnet.dc.monitor import RouterCollapseMonitor, collapse_side
from bytelatent.archs.hnet.dc.routing import RoutingModule
from bytelatent.args import TrainArgs
from bytelatent.config import parse_args
from bytelatent.distributed.env import detect_env
from bytelatent.errors import ConfigError
from bytelatent.trainer.trainer import Trainer
from tests.paths import REPO

STAGE = "dim: 32, n_heads: 2, n_layers_encoder: 1, n_layers_decoder: 1, sliding_window: 16"
TINY_HNET = [f"config={REPO / 'configs' / 'hnet_debug.yaml'}", "arch_args.dim=32",
             "arch_args.n_layers=1", "arch_args.n_heads=2", "arch_args.max_seqlen=64",
             "arch_args.multiple_of=32", "data.seq_len=64", "data.batch_size=2",
             "data.load_async=false"]  # fmt: skip

# aux/chunk_len_mean/stage0 of configs/hnet_debug.yaml (target 4, warmup 20) at logging.freq=5,
# steps 5-100: the start-up overshoot, then near the target.
DEBUG_RUN = [11.57, 19.21, 114.1, 137.58, 61.83, 3.4, 1.46, 2.18, 3.4, 2.67, 4.57, 3.77, 3.64,
             3.38, 3.45, 2.58, 2.81, 2.85, 3.49, 3.52]  # fmt: skip


def _args(tmp_path, stages: str, *extra: str) -> TrainArgs:
    return parse_args(TrainArgs, [*TINY_HNET, f"dump_dir={tmp_path}",
                                  f"arch_args.stages=[{stages}]", *extra])  # fmt: skip


def _feed(mon: RouterCollapseMonitor, values: list[float], every: int = 5, start: int = 0):
    """The metric records of log steps start + every, start + 2 every, ... after `observe`."""
    records = []
    for i, value in enumerate(values, 1):
        metrics = {"aux/chunk_len_mean/stage0": value}
        mon.observe(start + i * every, metrics)
        records.append(metrics)
    return records


def test_the_rule_of_a_collapsed_router():
    assert collapse_side(250.9, 4.0) == "few" and collapse_side(16.1, 4.0) == "few"
    assert collapse_side(1.36, 4.0) == "many" and collapse_side(1.74, 4.0) == "many"
    for ok in (1.8, 2.5, 4.0, 9.0, 16.0):
        assert collapse_side(ok, 4.0) is None, ok


def test_a_collapsed_router_is_warned_about_once_and_logged(caplog):
    mon = RouterCollapseMonitor([4.0], [0.03], warmup=20)
    with caplog.at_level(logging.WARNING, logger="bytelatent"):
        records = _feed(mon, [250.9] * 40)  # no boundaries, steps 5-200
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("H-Net router collapse at step 125: stage 0 has 251 positions")
    assert "since step 25, target 4: almost no chunk boundaries" in warnings[0]
    assert "raise model.stages[0].ratio_loss_weight (now 0.03)" in warnings[0]
    flagged = [i for i, r in enumerate(records) if "hnet/router_collapse/stage0" in r]
    assert flagged == list(range(24, 40))  # from the warning on, every record while it lasts
    assert records[-1]["hnet/router_collapse/stage0"] == pytest.approx(250.9 / 4)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="bytelatent"):
        _feed(mon, [4.0] + [1.36] * 30, start=200)  # recovered, then a boundary everywhere
    assert len(caplog.records) == 1 and "a boundary almost everywhere" in caplog.messages[0]


def test_the_start_up_overshoot_of_the_debug_model_is_not_a_collapse(caplog):
    for every in (5, 1):  # at logging.freq=1 the overshoot lasts more log steps
        values = DEBUG_RUN if every == 5 else [v for v in DEBUG_RUN for _ in range(5)]
        mon = RouterCollapseMonitor([4.0], [0.03], warmup=20)
        with caplog.at_level(logging.WARNING, logger="bytelatent"):
            records = _feed(mon, values, every)
        assert not caplog.records and not any(len(r) > 1 for r in records), every
    mon = RouterCollapseMonitor([4.0], [0.03], warmup=0)  # even counted from step 1
    assert not any(len(r) > 1 for r in _feed(mon, DEBUG_RUN))


def test_the_episode_survives_a_resume():
    mon = RouterCollapseMonitor([4.0, 3.0], [0.03, 0.03])
    _feed(mon, [250.9] * 3)
    again = RouterCollapseMonitor([4.0, 3.0], [0.03, 0.03])
    again.load_state_dict(json.loads(json.dumps(mon.state_dict())))
    assert again.state_dict() == mon.state_dict()
    assert again.since == [5, None] and again.streaks == [3, 0]


def test_trainer_warns_and_logs_a_forced_collapse(tmp_path, corpus_root, monkeypatch, caplog):
    """No boundaries forced (every position looks like its neighbour to the router): the run warns
    in train.log's logger and metrics.jsonl carries the event."""
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(monitor, "MIN_STEPS", 2)
    monkeypatch.setattr(monitor, "PATIENCE", 3)
    original = RoutingModule.forward

    def no_boundaries(self, hidden_states, *args, **kwargs):
        first = hidden_states.narrow(-2, 0, 1) if hidden_states.dim() == 3 else hidden_states[:1]
        return original(self, first.expand_as(hidden_states), *args, **kwargs)

    monkeypatch.setattr(RoutingModule, "forward", no_boundaries)
    args = _args(tmp_path / "run", f"{{{STAGE}, target_ratio: 2.0}}", f"data.root_dir={corpus_root}",
                 "steps=6", "optim.warmup=0", "logging.freq=1", "checkpoint.dump.every=0",
                 "distributed.model_dtype=fp32", "logging.console=false")  # fmt: skip
    trainer = Trainer(args, detect_env())
    try:
        with caplog.at_level(logging.WARNING, logger="bytelatent"):
            trainer.train()
    finally:
        trainer.close(0)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert all(r["aux/chunk_len_mean/stage0"] > 8 for r in records)  # far above the target 2
    flagged = [r["global_step"] for r in records if "hnet/router_collapse/stage0" in r]
    assert flagged == [3, 4, 5, 6], flagged
    warned = [m for m in caplog.messages if m.startswith("H-Net router collapse at step 3")]
    assert len(warned) == 1 and "almost no chunk boundaries" in warned[0], caplog.messages


@pytest.mark.parametrize(
    ("stages", "says"),
    [(f"{{{STAGE}, target_ratio: 1000}}",
      "arch_args.stages[0].target_ratio: the targets of stage 0 (1000) make 1000 bytes per chunk, "
      "0.064 chunks in a row of data.seq_len=64 bytes (at least 2 needed)"),
     (",".join([f"{{{STAGE}, target_ratio: 4}}"] * 50),
      "arch_args.stages[2].target_ratio: the targets of stages 0-2 (4 x 4 x 4) make 64 bytes per "
      "chunk, 1 chunks in a row"),
     (f"{{{STAGE}, target_ratio: .inf}}", "arch_args.stages.0.target_ratio: Input should be a "
      "finite number"),
     (f"{{{STAGE}, ratio_loss_weight: .inf}}", "arch_args.stages.0.ratio_loss_weight: Input "
      "should be a finite number"),
     (f"{{{STAGE}, ratio_loss_weight: .nan}}", "arch_args.stages.0.ratio_loss_weight: Input "
      "should be a finite number")],
)  # fmt: skip
def test_targets_that_cannot_fit_the_row_and_non_finite_values_are_config_errors(
    tmp_path, stages, says
):
    with pytest.raises(ConfigError) as info:
        _args(tmp_path, stages)
    assert says in str(info.value) and "\n" not in str(info.value), str(info.value)
    assert _args(tmp_path, f"{{{STAGE}, target_ratio: 4}},{{{STAGE}, target_ratio: 4}}")  # fits


def test_the_debug_config_still_validates(tmp_path):
    args = parse_args(TrainArgs, [f"config={REPO / 'configs' / 'hnet_debug.yaml'}",
                                  f"dump_dir={tmp_path}"])  # fmt: skip
    assert args.model.cumulative_ratios() == [4.0]
    assert torch.isfinite(torch.tensor(args.model.stages[0].ratio_loss_weight))
