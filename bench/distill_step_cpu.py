"""What the distillation term adds to a training micro-batch: forward + backward of the byteify
stage-1 BLT (configs/byteify_distill_stage1.yaml) with and without `aux/distill` (teacher
re-tokenization, teacher forward, targets, KL), on the same batches.

    OMP_NUM_THREADS=1 python bench/distill_step_cpu.py --repeats 7

Needs the recipe's teacher (hf/stdlib-teacher) and data (data/stdlib): docs/byteify.md. Process
CPU-seconds per micro-batch at 1 thread, the variants interleaved after a warm-up, medians; the
load (`uptime`) is printed with the table. Results: bench/RESULTS_byteify_distill_cpu.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

from bytelatent.args import TrainArgs
from bytelatent.config import parse_args
from bytelatent.distributed.env import detect_env
from bytelatent.trainer.trainer import Trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--batches", type=int, default=4, help="micro-batches per measurement")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as dump:
        train_args = parse_args(
            TrainArgs,
            [
                "config=configs/byteify_distill_stage1.yaml", f"dump_dir={dump}",
                "data.load_async=false", "eval.every=0", "num_threads=1",
            ],
        )  # fmt: skip
        trainer = Trainer(train_args, detect_env())
        try:
            run(trainer, args)
        finally:
            trainer.close()


def run(trainer: Trainer, args: argparse.Namespace) -> None:
    batches = [next(trainer.data) for _ in range(args.batches)]
    terms, aux = trainer.logit_terms, trainer.aux_terms
    variants = {"CE only": ([], ()), "CE + distill": (terms, aux)}

    def measure(name: str) -> float:
        trainer.logit_terms, trainer.aux_terms = variants[name]
        start = time.process_time()
        for batch in batches:
            trainer.forward_backward(batch, 1.0 / batch.target_mask.sum())
        trainer.optimizer.zero_grad(set_to_none=True)
        return (time.process_time() - start) / len(batches)

    for name in variants:
        measure(name)  # warm-up
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name in variants:  # interleaved
            times[name].append(measure(name))
    n_bytes = batches[0].x.size
    print(f"micro-batch: {batches[0].x.shape[0]} rows x {batches[0].x.shape[1]} bytes")
    print("| variant | median CPU ms / micro-batch | min | max |")
    print("|---|---|---|---|")
    for name, values in times.items():
        med = statistics.median(values)
        print(f"| {name} | {med * 1e3:.0f} | {min(values) * 1e3:.0f} | {max(values) * 1e3:.0f} |")
    ratio = statistics.median(times["CE + distill"]) / statistics.median(times["CE only"])
    print(f"ratio: {ratio:.2f}x ({n_bytes} bytes per micro-batch)")
    print("load:", os.popen("uptime").read().strip())


if __name__ == "__main__":
    main()
