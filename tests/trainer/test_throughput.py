"""Honest MFU: FLOPs from each batch's real sizes, padding reported, exact peak table, device-aware
step clock, and the analytic count of a debug step against torch's FlopCounterMode."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from bytelatent.args import TrainArgs
from bytelatent.config import parse_args
from bytelatent.data.batch import Batch
from bytelatent.distributed.parallelize import init_model_weights
from bytelatent.model.loss import batch_loss_sum
from bytelatent.trainer import metrics as metrics_module
from bytelatent.trainer.build import build_model
from bytelatent.trainer.interval import IntervalMetrics, StepOutput
from bytelatent.trainer.metrics import Timings, peak_flops_per_device
from bytelatent.trainer.throughput import BatchSizes, FlopsCounter, StepClock
from tests.conftest import TINY_ENTROPY
from tests.trainer.test_cli import REPO


def padded_batch() -> Batch:
    """Two rows of 8 positions: the first all real, the second 3 real then padding."""
    x = np.arange(16, dtype=np.int64).reshape(2, 8)
    mask = np.ones((2, 8), dtype=bool)
    mask[1, 3:] = False
    # rows sum to 9 (8 + the next token); row 1: patches start at 0, 1, 3, 6 -> two hold real bytes
    lengths = np.array([[1, 4, 4, 0], [1, 2, 3, 3]], dtype=np.int64)
    return Batch(x, x.copy(), mask, lengths)


def test_batch_sizes_count_padding_apart():
    sizes = BatchSizes.of(padded_batch())
    assert (sizes.tokens, sizes.real_tokens) == (16, 11)
    # columns run by the global model: 8; real patches: row 0 three (the 0 column is padding),
    # row 1 the ones starting at 0 and 1 (start 3 is the first padded position)
    assert (sizes.patches, sizes.real_patches) == (8, 5)


def args_for(tmp_path, *extra: str) -> TrainArgs:
    return parse_args(TrainArgs, [f"dump_dir={tmp_path}", *extra])


def test_entropy_model_flops_scale_with_real_tokens(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    args = args_for(tmp_path, "config=configs/entropy_debug.yaml", *TINY_ENTROPY)
    counter = FlopsCounter(args)
    sizes = BatchSizes(tokens=256, real_tokens=64, patches=0, real_patches=0)
    assert counter.executed(sizes) == pytest.approx(4 * counter.useful(sizes))


def test_blt_useful_flops_use_the_real_patch_size(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    counter = FlopsCounter(args_for(tmp_path, "config=configs/debug.yaml"))
    full = BatchSizes(tokens=2048, real_tokens=2048, patches=384, real_patches=384)
    assert counter.useful(full) == pytest.approx(counter.executed(full))
    # the same bytes in fewer, longer patches: less global work
    longer = BatchSizes(tokens=2048, real_tokens=2048, patches=384, real_patches=200)
    assert counter.useful(longer) < counter.executed(longer)
    half = BatchSizes(tokens=2048, real_tokens=1024, patches=384, real_patches=192)
    assert counter.useful(half) == pytest.approx(counter.executed(full) / 2, rel=0.01)


@pytest.mark.parametrize(
    "name, dtype, tf32, tflops",
    [
        ("NVIDIA H100 80GB HBM3", "bf16", False, 989.4),
        ("NVIDIA H100 PCIe", "bf16", False, 756.5),
        ("NVIDIA H100 PCIe", "fp32", False, 51.2),
        ("NVIDIA H100 PCIe", "fp32", True, 378.0),
        ("NVIDIA H200", "bf16", False, 989.4),
        ("NVIDIA A100-SXM4-80GB", "fp32", False, 19.5),
        ("NVIDIA H100 Something New", "bf16", False, None),
    ],
)
def test_peak_is_the_exact_device_and_the_runs_dtype(monkeypatch, name, dtype, tf32, tflops):
    monkeypatch.setattr(metrics_module.torch.cuda, "get_device_name", lambda device=None: name)
    peak = peak_flops_per_device(torch.device("cuda", 0), None, dtype, tf32)
    assert peak == (None if tflops is None else pytest.approx(tflops * 1e12))
    assert peak_flops_per_device(torch.device("cpu"), None, dtype, tf32) is None
    assert peak_flops_per_device(torch.device("cpu"), 123.0, dtype, tf32) == 123e12


def test_step_clock_sums_steps_on_cpu():
    """Only the time between start() and stop() counts (a fake clock: behaviour, not speed)."""
    now = [100.0]
    clock = StepClock(torch.device("cpu"), now=lambda: now[0])
    for _ in range(2):
        clock.start()
        now[0] += 0.02
        clock.stop()
    now[0] += 0.05  # between steps: not step time
    assert clock.pop() == pytest.approx(0.04)
    assert clock.pop() == 0.0


def test_step_clock_span_on_cpu_runs_from_the_first_start_to_the_last_stop():
    ticks = iter([1.0, 2.0, 3.0, 5.0])
    clock = StepClock(torch.device("cpu"), now=lambda: next(ticks))
    for _ in range(2):
        clock.start()
        clock.stop()
    assert clock.pop() == 3.0 and clock.span == (1.0, 5.0)


class _OverlappingCudaClock:
    """A CUDA StepClock's readings: 3 steps of 1 s of device work each; the host loads the next
    batch (0.5 s) while the previous step's kernels run, so only the first load is not hidden."""

    cuda = True

    def pop(self) -> float:
        return 3.0  # Σ event times

    span = (10.5, 14.0)  # host: first step start .. end of the last step's device work


def _overlap_interval(tmp_path, monkeypatch, now=None):
    monkeypatch.chdir(REPO)
    flops = FlopsCounter(args_for(tmp_path, "config=configs/entropy_debug.yaml", *TINY_ENTROPY))
    interval = IntervalMetrics(torch.device("cpu"), flops, 1e12, 1, 1, lambda: None)
    interval.clock = _OverlappingCudaClock()
    if now is not None:
        interval.timings = Timings(now=now)
    for _ in range(3):
        out = StepOutput(torch.tensor(11.0, dtype=torch.float64), 11, 11, torch.tensor(1.0))
        interval.add(out, [padded_batch()], data_time=0.5)
    return interval


def test_overlapping_host_and_device_time_is_counted_once(tmp_path, monkeypatch):
    """On CUDA, rates are over the span from the first batch's loading to the last step's end
    (3.5 + 0.5 s), not event step time + host data time (3 + 1.5 s: the overlap twice); step_time_s
    and data_time_s still mean what they say."""
    m = _overlap_interval(tmp_path, monkeypatch).compute(3, lr=0.1)
    assert m["bytes_per_s"] == pytest.approx(33 / 4.0)
    assert m["flops_per_s"] * 4.0 == pytest.approx(m["mfu"] * 1e12 * 4.0)
    assert m["step_time_s"] == 1.0 and m["data_time_s"] == 0.5


def test_eval_and_saves_inside_the_span_are_not_step_time(tmp_path, monkeypatch):
    """Measured non-step work (eval, saves) inside the span is left out, work outside it is not
    subtracted: an eval at 11.0-11.4 (inside) and a save at 9.0-9.8 (before the interval)."""
    ticks = iter([0.0, 9.0, 9.8, 11.0, 11.4, 20.0])
    interval = _overlap_interval(tmp_path, monkeypatch, now=lambda: next(ticks))
    with interval.timings.measure("checkpoint_save_s"):
        pass
    with interval.timings.measure("eval_s"):
        pass
    m = interval.compute(3, lr=0.1)
    assert m["bytes_per_s"] == pytest.approx(33 / 3.6)
    assert m["timing/eval_s"] == pytest.approx(0.4)
    assert m["timing/checkpoint_save_s"] == pytest.approx(0.8)


def test_timings_sync_the_device_before_measured_work():
    calls = []
    t = Timings(sync=lambda: calls.append("sync"))
    with t.measure("eval_s"):
        calls.append("eval")
    assert calls == ["sync", "eval"]


def test_interval_metrics_report_useful_work_and_padding(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    args = args_for(tmp_path, "config=configs/entropy_debug.yaml", *TINY_ENTROPY)
    flops = FlopsCounter(args)
    interval = IntervalMetrics(torch.device("cpu"), flops, 1e12, 1, 1, lambda: None)
    batch = padded_batch()
    monkeypatch.setattr(interval.clock, "pop", lambda: 1.5)
    out = StepOutput(torch.tensor(11.0, dtype=torch.float64), 11, 11, torch.tensor(1.0))
    interval.add(out, [batch], data_time=0.5)
    m = interval.compute(1, lr=0.1)
    assert m["bytes_per_s"] == pytest.approx(11 / 2.0)  # real tokens over step + data time
    assert m["padding_frac"] == pytest.approx(5 / 16)
    assert m["padding_flops_frac"] == pytest.approx(5 / 16)  # an LM: FLOPs scale with positions
    assert m["flops_per_s"] == pytest.approx(flops.useful(BatchSizes.of(batch)) / 2.0)
    assert m["mfu"] == pytest.approx(m["flops_per_s"] / 1e12)
    assert m["loss"] == pytest.approx(1.0) and m["step_time_s"] == 1.5 and m["lr"] == 0.1


def test_tokens_seen_is_summed_over_data_parallel_ranks_like_n_bytes(tmp_path, monkeypatch):
    """Two data-parallel ranks with the same numbers: every sum, the run total too, doubles."""
    monkeypatch.chdir(REPO)
    flops = FlopsCounter(args_for(tmp_path, "config=configs/entropy_debug.yaml", *TINY_ENTROPY))
    interval = IntervalMetrics(torch.device("cpu"), flops, None, 2, 2, lambda: None)
    monkeypatch.setattr(interval.clock, "pop", lambda: 1.0)
    monkeypatch.setattr(
        "bytelatent.trainer.interval.dist.all_reduce", lambda t, group=None: t.mul_(2)
    )
    out = StepOutput(torch.tensor(7.0, dtype=torch.float64), 7, 7, torch.tensor(1.0))
    interval.add(out, [padded_batch()], data_time=0.0)
    m = interval.compute(3, tokens_seen=21, lr=0.1)  # this rank: 21 bytes since the start
    assert m["n_bytes"] == 14 and m["tokens_seen"] == 42 and m["lr"] == 0.1


def _attended_pairs(q, k, attn_mask, is_causal) -> int:
    b, h, sq, _ = q.shape
    sk = k.shape[2]
    if attn_mask is not None:
        allowed = attn_mask if attn_mask.dtype == torch.bool else attn_mask > float("-inf")
        return int(allowed.expand(b, h, sq, sk).sum())
    if is_causal:  # top-left aligned, as torch's is_causal
        return b * h * sum(min(i + 1, sk) for i in range(sq))
    return b * h * sq * sk


def _cpu_attention_flops(q, k, v, dropout_p=0.0, is_causal=False, *_, attn_mask=None, **__):
    """q·kᵀ and p·v over the (query, key) pairs the mask allows: the model-FLOPs convention of
    model/flops.py (torch has no formula for the CPU kernel; its GPU ones count whole rectangles)."""
    return 2 * _attended_pairs(q, k, attn_mask, is_causal) * (q.shape[-1] + v.shape[-1])


def _cpu_attention_backward_flops(grad_out, q, k, v, out, lse, dropout_p=0.0, is_causal=False,
                                  *_, attn_mask=None, **__):  # fmt: skip
    """Twice the forward (gradients of q, k, v and the scores; the kernel's recompute excluded)."""
    return 2 * _cpu_attention_flops(q, k, v, dropout_p, is_causal, attn_mask=attn_mask)


_cpu_attention_flops._get_raw = True  # FlopCounterMode passes the tensors (the mask is needed)
_cpu_attention_backward_flops._get_raw = True
CPU_ATTENTION = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention_flops,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_attention_backward_flops,
}


@pytest.mark.parametrize("config", ["debug", "entropy_debug"])
def test_analytic_flops_of_a_debug_step_match_flop_counter(
    tmp_path, monkeypatch, corpus_root, config
):
    """The FLOPs the trainer reports for one step of the debug configs against torch's count of
    the same step (matmuls as torch counts them; CPU attention over the pairs its mask allows)."""
    monkeypatch.chdir(REPO)
    args = args_for(tmp_path, f"config=configs/{config}.yaml", f"data.root_dir={corpus_root}",
                    "data.load_async=false", "distributed.model_dtype=fp32")  # fmt: skip
    model = build_model(args)
    init_model_weights(model, seed=0)
    batch = next(args.data.build_from_rank(0, 1))
    with FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION) as counter:
        batch_loss_sum(model, batch, torch.device("cpu")).backward()
    counted = counter.get_flop_counts()["Global"]
    attention = (  # the CPU flash kernel, or the chunked op that runs it piece by piece
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu,
        torch.ops.bytelatent.chunked_attention,
    )
    assert sum(counted.get(op, 0) for op in attention) > 0
    analytic = FlopsCounter(args).executed(BatchSizes.of(batch))
    assert analytic == pytest.approx(counter.get_total_flops(), rel=0.10)
