"""Debug H-Net (configs/hnet_debug.yaml) beside the debug BLT (configs/debug.yaml) on CPU at one
thread: training step time and bytes/s at similar FLOPs per byte, and the EMA scan's share of the
H-Net step.

Both models are built by the trainer itself (`bytelatent.trainer.Trainer`: registry build, init,
AdamW, clipping, the real data loader on the stdlib corpus, synchronous loading) and stepped with
`Trainer.train_step`, alternating H-Net and BLT steps round after round (same machine load for
both). Reported: medians over the timed rounds of process CPU seconds (user + system) and wall
seconds per step, bytes/s (input bytes / CPU s), and training FLOPs per byte from each
architecture's registry `flops` (`ArchSpec.sizes.flops`, what MFU uses).

EMA share: every `ema_scan` call of one H-Net step is recorded (the dechunk layer's inputs), and
the same calls (forward + backward, fresh leaves) are timed alone in the same rounds; the share is
their median CPU time over the median H-Net step's.

    OMP_NUM_THREADS=1 PYTHONPATH=. python bench/hnet_vs_blt_cpu.py --rounds 10

H-Net overrides (`--hnet-override`, default: widen the global transformer to 192d / 3 layers) size
it near the debug BLT's FLOPs per byte; both are printed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bytelatent.archs.hnet.dc import chunking  # noqa: E402
from bytelatent.args import TrainArgs  # noqa: E402
from bytelatent.config import parse_args  # noqa: E402
from bytelatent.distributed.env import detect_env  # noqa: E402
from bytelatent.model.registry import get_arch  # noqa: E402
from bytelatent.trainer.throughput import BatchSizes  # noqa: E402
from bytelatent.trainer.trainer import Trainer  # noqa: E402

COMMON = ["data.load_async=false", "num_threads=1", "logging.freq=1000", "steps=100000"]
HNET_DEFAULT = ["arch_args.dim=192", "arch_args.n_layers=3", "arch_args.n_heads=4"]


def trainer(config: str, root: str, dump: str, extra: list[str]) -> Trainer:
    argv = [f"config={config}", f"data.root_dir={root}", f"dump_dir={dump}", *COMMON, *extra]
    return Trainer(parse_args(TrainArgs, argv), detect_env())


def flops_per_byte(t: Trainer, batches) -> float:
    count = get_arch(t.args.arch).sizes.flops(t.args.active_model_args(), t.args.data)
    sizes = [BatchSizes.of(b) for b in batches]
    return sum(count(s.tokens, s.patches) for s in sizes) / sum(s.tokens for s in sizes)


def timed_step(t: Trainer) -> tuple[float, float, int]:
    batches = t.next_batches()  # data time kept out of the step
    wall, cpu = time.perf_counter(), time.process_time()
    out = t.train_step(batches)
    float(out.loss_sum)
    return time.perf_counter() - wall, time.process_time() - cpu, out.n_bytes


def record_ema_calls(t: Trainer) -> list[tuple[torch.Tensor, ...]]:
    """The (log_decay, inputs, reset, block_size) of every ema_scan call in one H-Net step."""
    calls, real = [], chunking.ema_scan

    def spy(log_decay, inputs, reset, block_size):
        calls.append((log_decay.detach().clone(), inputs.detach().clone(), reset, block_size))
        return real(log_decay, inputs, reset, block_size)

    chunking.ema_scan = spy
    try:
        timed_step(t)
    finally:
        chunking.ema_scan = real
    return calls


def timed_ema(calls) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    for log_decay, inputs, reset, block in calls:
        leaves = log_decay.requires_grad_(True), inputs.requires_grad_(True)
        chunking.ema_scan(*leaves, reset, block).sum().backward()
        for leaf in leaves:
            leaf.grad = None
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--hnet-override", nargs="*", default=HNET_DEFAULT)
    parser.add_argument("--blt-override", nargs="*", default=[])
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        root = os.path.join(tmp, "data")
        cmd = [
            sys.executable,
            "-m",
            "bytelatent.data.prepare",
            "--out",
            f"{root}/stdlib",
            "--max-mb",
            "1",
        ]
        subprocess.run(cmd, check=True, capture_output=True, cwd=REPO)
        models = {
            "hnet": trainer("configs/hnet_debug.yaml", root, f"{tmp}/hnet", args.hnet_override),
            "blt": trainer("configs/debug.yaml", root, f"{tmp}/blt", args.blt_override),
            "blt32": trainer(  # debug.yaml trains in bf16; the H-Net config in fp32
                "configs/debug.yaml", root, f"{tmp}/blt32",
                [*args.blt_override, "distributed.model_dtype=fp32"],
            ),
        }  # fmt: skip
        torch.set_num_threads(1)
        fpb = {}
        for name, t in models.items():
            probe = t.next_batches()
            fpb[name] = flops_per_byte(t, probe)
            print(
                f"{name}: {t.args.arch}, {t.n_params:,} parameters, {fpb[name] / 1e6:.2f} MFLOPs/byte"
            )
        for _ in range(args.warmup):
            for t in models.values():
                timed_step(t)
        calls = record_ema_calls(models["hnet"])
        shapes = ", ".join(f"{tuple(c[1].shape)}" for c in calls)
        print(f"ema_scan calls per H-Net step: {len(calls)} on inputs {shapes}")
        hnet = models["hnet"].args.model
        log_decay, inputs, reset, block = calls[0]
        batch, _, width = inputs.shape
        at_ratio = int(models["hnet"].args.data.seq_len / hnet.stages[0].target_ratio)
        gen = torch.Generator().manual_seed(0)
        prob = torch.rand(batch, at_ratio, generator=gen).clamp(1e-3, 1 - 1e-3)
        reset = torch.zeros(batch, at_ratio, dtype=torch.bool)
        reset[:, 0] = True
        target = [
            (torch.log1p(-prob), torch.randn(batch, at_ratio, width, generator=gen), reset, block)
        ]
        print(f"ema_scan at the target ratio: inputs {(batch, at_ratio, width)}")
        rows = {name: [] for name in [*models, "ema", "ema_target"]}
        for _ in range(args.rounds):
            for name, t in models.items():
                rows[name].append(timed_step(t))
            rows["ema"].append((*timed_ema(calls), 0))
            rows["ema_target"].append((*timed_ema(target), 0))
        med = {n: (statistics.median(r[0] for r in rs), statistics.median(r[1] for r in rs),
                   statistics.median(r[2] for r in rs)) for n, rs in rows.items()}  # fmt: skip
    print(
        f"\n{args.rounds} rounds after {args.warmup} warm-up, 1 thread, load average {os.getloadavg()}"
    )
    print(
        f"{'model':<6}{'MFLOP/B':>9}{'bytes/step':>11}{'CPU s/step':>12}{'wall s/step':>12}{'bytes/CPU-s':>12}"
    )
    for name in models:
        wall, cpu, n = med[name]
        print(f"{name:<6}{fpb[name] / 1e6:>9.2f}{n:>11}{cpu:>12.4f}{wall:>12.4f}{n / cpu:>12.0f}")
    for key, what in (("ema", "the step's calls"), ("ema_target", "at the target ratio")):
        ema_wall, ema_cpu, _ = med[key]
        print(f"ema_scan fwd+bwd alone, {what}: {ema_cpu * 1e3:.2f} CPU ms "
              f"({ema_cpu / med['hnet'][1]:.1%} of the H-Net step), {ema_wall * 1e3:.2f} wall ms "
              f"({ema_wall / med['hnet'][0]:.1%})")  # fmt: skip


if __name__ == "__main__":
    main()
