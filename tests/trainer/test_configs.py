"""Shipped configs parse, and the reference shapes have the reference's exact parameter counts."""

from pathlib import Path

import pytest
import torch

from bytelatent.args import TrainArgs
from bytelatent.config import parse_args
from bytelatent.trainer.build import build_model

REPO = Path(__file__).resolve().parents[2]
FILLED = ["dump_dir=x", "data.root_dir=x", "data.sources={s: 1.0}", "data.preprocess_dir=x"]


def n_params(config: str) -> int:
    args = parse_args(TrainArgs, [f"config={REPO / config}", *FILLED])
    with torch.device("meta"):
        return sum(p.numel() for p in build_model(args).parameters())


@pytest.mark.parametrize(
    "config, expected",
    [
        # BLT_REFERENCE_FACTS §3.11: 1B-like config 4,533,879,808; entropy model 99,512,064
        ("configs/blt_1b.yaml", 4_533_879_808),
        ("configs/entropy_model.yaml", 99_512_064),
    ],
)
def test_reference_shapes_match_parameter_counts(config, expected):
    assert n_params(config) == expected


@pytest.mark.parametrize("config", sorted(p.name for p in (REPO / "configs").glob("*.yaml")))
def test_every_shipped_config_parses(config):
    if config.startswith("compare"):  # the comparison recipe's own args (apps.compare)
        from apps.compare.args import CompareArgs

        assert parse_args(CompareArgs, [f"config={REPO / 'configs' / config}"]).out_dir
        return
    args = parse_args(TrainArgs, [f"config={REPO / 'configs' / config}", *FILLED])
    assert args.dump_dir


@pytest.mark.parametrize("config", ["debug.yaml", "hnet_debug.yaml", "entropy_debug.yaml"])
def test_debug_configs_report_validation_bpb_cheaply(config):
    """The quick start shows a validation bpb beside the training one (a training bpb that rises
    late is then read against held-out data), at a cost of a few seconds per evaluation."""
    args = parse_args(TrainArgs, [f"config={REPO / 'configs' / config}"])
    assert args.eval.enabled and 0 < args.eval.every <= args.steps // 2
    assert args.steps % args.eval.every == 0  # the last step is validated
    assert args.eval.validation.max_batches is not None and args.eval.validation.max_batches <= 25
