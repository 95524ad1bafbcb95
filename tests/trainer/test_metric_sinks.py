"""MetricLogger fans one call out to its sinks; Timings; the wandb sink never stops training."""

from __future__ import annotations

import json
import logging

import pytest

from bytelatent.trainer.args import LoggingArgs
from bytelatent.trainer.metrics import ConsoleSink, JsonlSink, MetricLogger, Timings
from bytelatent.trainer.wandb_sink import RUN_FILE, WandbArgs, WandbSink


@pytest.fixture
def bl_log(caplog):
    """Records of the `bytelatent` logger, each once."""
    logger = logging.getLogger("bytelatent")
    logger.addHandler(caplog.handler)
    old = logger.level, logger.propagate
    logger.setLevel(logging.INFO)
    logger.propagate = False  # else the root logger's capture handler sees each record twice
    yield caplog
    logger.level, logger.propagate = old
    logger.removeHandler(caplog.handler)


class ListSink:
    def __init__(self):
        self.records, self.closed = [], None

    def log(self, metrics):
        self.records.append(dict(metrics))

    def close(self, exit_code=0):
        self.closed = exit_code


def test_one_log_call_reaches_every_sink(tmp_path):
    a, b = ListSink(), ListSink()
    m = MetricLogger(tmp_path / "metrics.jsonl", sinks=[a, b])
    m.log({"global_step": 1, "loss": 2.0})
    m.log({"global_step": 1, "val/bpb": 1.5})
    m.close(exit_code=3)
    assert (
        a.records
        == b.records
        == [{"global_step": 1, "loss": 2.0}, {"global_step": 1, "val/bpb": 1.5}]
    )
    assert a.closed == b.closed == 3
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("val/bpb") for r in lines] == [None, 1.5] and "created_at" in lines[0]


def test_build_gives_rank0_jsonl_and_console_and_other_ranks_nothing(tmp_path):
    rank0 = MetricLogger.build(LoggingArgs(), str(tmp_path), 0, "n", {})
    assert [type(s) for s in rank0.sinks] == [JsonlSink, ConsoleSink]
    rank1 = MetricLogger.build(LoggingArgs(console=True), str(tmp_path / "r1"), 1, "n", {})
    assert rank1.sinks == [] and not (tmp_path / "r1").exists()
    rank0.close()


def test_console_sink_prints_eval_records_too(bl_log):
    ConsoleSink().log({"global_step": 7, "val/bpb": 1.23456})
    assert "step      7 | val/bpb 1.235" in bl_log.text


TRAIN_RECORD = {"global_step": 30, "loss": 2.0, "bpb": 2.9, "grad_norm": 0.5, "lr": 1e-3,
                "bytes_per_s": 1000.0, "flops_per_s": 2e9, "step_time_s": 0.2,
                "data_time_s": 0.01, "peak_mem_gib": 0.5}  # fmt: skip


def test_step_line_carries_the_architectures_health_fields(bl_log):
    from bytelatent.model.registry import get_arch

    hnet = {**TRAIN_RECORD, "aux/ratio_loss": 0.03, "aux/ratio_loss/stage0": 1.01,
            "aux/ratio_loss/stage1": 1.02, "aux/chunk_len_mean/stage0": 2.5,
            "aux/chunk_len_mean/stage1": 2.1, "aux/bytes_per_chunk/stage0": 2.5,
            "aux/bytes_per_chunk/stage1": 5.25}  # fmt: skip
    ConsoleSink(get_arch("hnet").aux_metrics).log(hnet)
    line = bl_log.text.strip().splitlines()[-1]
    assert line.endswith(
        "mem 0.50 GiB | ratio_loss 1.01/1.02 | chunk_len_mean 2.5/2.1 | bytes_per_chunk 2.5/5.25"
    ), line
    blt = {**TRAIN_RECORD, "patch_len_mean": 4.567, "patch_len_hist": [1, 2]}
    ConsoleSink(get_arch("blt").aux_metrics).log(blt)
    assert bl_log.text.strip().splitlines()[-1].endswith("mem 0.50 GiB | patch 4.57 B")
    ConsoleSink(get_arch("entropy").aux_metrics).log(TRAIN_RECORD)  # no health numbers: none shown
    assert bl_log.text.strip().splitlines()[-1].endswith("data 10 ms | mem 0.50 GiB")


def test_timings_report_once_and_sum_within_an_interval():
    t = Timings()
    t.record("init_or_restore_s", 2.0)
    with t.measure("checkpoint_save_s"):
        pass
    t.record("checkpoint_save_s", 1.0)
    first = t.pop(steps=4)
    assert first["timing/init_or_restore_s"] == 2.0
    assert 1.0 <= first["timing/checkpoint_save_s"] < 1.5
    assert first["timing/steps_per_s"] > 0
    assert set(t.pop(steps=1)) == {"timing/steps_per_s"}  # nothing reported twice


def test_wandb_failing_to_start_is_one_warning_and_logging_goes_on(tmp_path, monkeypatch, bl_log):
    wandb = pytest.importorskip("wandb")

    def broken_init(**kwargs):
        raise RuntimeError("no network")

    monkeypatch.setattr(wandb, "init", broken_init)
    sink = WandbSink(WandbArgs(mode="online"), str(tmp_path), "run", {})
    for step in range(1, 4):
        sink.log({"global_step": step, "loss": 1.0})
    sink.close()
    warnings = [r for r in bl_log.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "no network" in warnings[0].getMessage()
    assert not (tmp_path / RUN_FILE).exists()


def test_wandb_losing_its_connection_is_one_warning(tmp_path, monkeypatch, bl_log):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    sink = WandbSink(WandbArgs(mode="offline"), str(tmp_path), "run", {})
    assert sink.run is not None
    sink.log({"global_step": 1, "loss": 1.0})

    def lost(*args, **kwargs):
        raise ConnectionError("connection lost")

    monkeypatch.setattr(type(sink.run), "log", lost)
    try:
        for step in range(2, 5):
            sink.log({"global_step": step, "loss": 1.0})
    finally:
        wandb.finish()
    warnings = [r for r in bl_log.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "connection lost" in warnings[0].getMessage()
    assert json.loads((tmp_path / RUN_FILE).read_text())["last_step"] == 1


def test_wandb_resume_continues_the_stored_run_without_repeating_steps(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    from tests.trainer.wandb_offline import offline_runs

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    args, dump = WandbArgs(mode="offline"), str(tmp_path)

    def one_process(start_step: int, steps: range) -> None:
        sink = WandbSink(args, dump, "run", {"lr": 0.1}, start_step=start_step)
        for step in steps:
            sink.log({"global_step": step, "loss": 1.0 / step})
            sink.log({"global_step": step, "val/bpb": 2.0})  # eval at the same step: same row
        sink.close()
        wandb.teardown()  # as at process exit: the service flushes the run's file before it ends

    one_process(0, range(1, 6))
    # Killed after logging step 5 with the last checkpoint at 3: steps 4 and 5 are trained again.
    one_process(3, range(4, 9))
    first, second = offline_runs(tmp_path / "wandb")
    assert first.run_id == second.run_id
    steps = [row["_step"] for row in first.history + second.history]
    assert steps == list(range(1, 9))
    assert all(row["val/bpb"] == 2.0 and "loss" in row for row in first.history + second.history)
    # A run that starts from step 0 in the same dump_dir is a new trajectory: a new wandb run.
    one_process(0, range(1, 3))
    new_id = json.loads((tmp_path / RUN_FILE).read_text())["id"]
    assert new_id != first.run_id and list((tmp_path / "wandb").glob(f"offline-run-*-{new_id}"))
