"""The dry run's advice when its estimate exceeds the device: each knob priced by the same
estimator as model-info.txt, and a mix that fits (issue 43, item 1)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bytelatent.args import TrainArgs
from bytelatent.config import parse_args
from bytelatent.trainer.build import build_parallel_model
from bytelatent.trainer.memory_advice import (
    CPU_DEFAULT_DEVICE_GIB,
    HEADROOM,
    MemoryPricer,
    advice_lines,
    device_memory_gib,
)
from bytelatent.trainer.model_info import GIB, estimate_memory, parameter_table

REPO = Path(__file__).resolve().parents[2]


def _args(tmp_path, *extra: str) -> TrainArgs:
    return parse_args(TrainArgs, ["config=configs/debug.yaml", f"dump_dir={tmp_path}", *extra])


def _total(args: TrainArgs) -> int:
    """The estimate of a model built afresh with `args` (what a dry run with them would print)."""
    model = build_parallel_model(args, None)
    return estimate_memory(model, parameter_table(model), args).total


def test_each_knob_is_priced_as_a_dry_run_with_it_would_estimate(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    args = _args(tmp_path, "data.batch_size=8")
    model = build_parallel_model(args, None)
    rows = parameter_table(model)
    mem = estimate_memory(model, rows, args)
    pricer = MemoryPricer(model, rows, args, {})
    knobs = {k.change: k.total for k in pricer.knobs()}
    assert pricer.total(args) == mem.total  # the same estimator, unchanged config
    for change, extra in [
        ("model.attn_impl=flex_attention", ["model.attn_impl=flex_attention"]),
        ("distributed.activation_checkpointing=selective",
         ["distributed.activation_checkpointing=selective"]),
        ("distributed.activation_checkpointing=full", ["distributed.activation_checkpointing=full"]),
        ("data.batch_size=4 grad_acc_steps=2", ["data.batch_size=4", "grad_acc_steps=2"]),
        ("data.batch_size=1 grad_acc_steps=8", ["data.batch_size=1", "grad_acc_steps=8"]),
    ]:  # fmt: skip
        assert knobs[change] == _total(_args(tmp_path, "data.batch_size=8", *extra)), change
        assert knobs[change] < mem.total, change
    # FSDP over 8 ranks: parameters, gradients and AdamW state / 8, plus two gathered units
    eight = knobs["distributed.dp_shard=8 (8 GPUs)"]
    states = mem.params + mem.grads + mem.optimizer
    assert mem.total - states + states // 8 < eight < mem.total


def test_advice_names_knobs_and_a_mix_that_fits_only_when_over(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    args = _args(tmp_path, "data.batch_size=8")
    model = build_parallel_model(args, None)
    rows = parameter_table(model)
    mem = estimate_memory(model, rows, args)
    roomy = mem.total / GIB / HEADROOM * 1.01
    assert advice_lines(model, rows, args, {}, mem, roomy, "test") == []
    device_gib = mem.total / GIB * 0.5  # only a mix of knobs gets under 85% of this
    lines = advice_lines(model, rows, args, {}, mem, device_gib, "test")
    assert lines[0].startswith(f"dry run: the estimate {mem.total / GIB:.2f} GiB per rank is over")
    assert any(line.startswith("  distributed.activation_checkpointing=full: ") for line in lines)
    together = next(line for line in lines if line.startswith("  together: "))
    changes = together.removeprefix("  together: ").rsplit(": ", 1)[0].split()
    overrides = [c for c in changes if "=" in c and not c.startswith("distributed.dp_shard")]
    assert overrides, together
    if not any(c.startswith("distributed.dp_shard") for c in changes):  # one device: check it
        assert (
            _total(_args(tmp_path, "data.batch_size=8", *overrides)) <= HEADROOM * device_gib * GIB
        )


def test_device_memory_comes_from_the_config_else_the_cpu_default(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    assert device_memory_gib(_args(tmp_path), "cpu") == (
        CPU_DEFAULT_DEVICE_GIB, "the CPU default: an 80 GiB H100; set distributed.device_memory_gib"
    )  # fmt: skip
    given = _args(tmp_path, "distributed.device_memory_gib=141")
    assert device_memory_gib(given, "cpu") == (141.0, "distributed.device_memory_gib")
    with pytest.raises(Exception, match="device_memory_gib"):
        _args(tmp_path, "distributed.device_memory_gib=0")
