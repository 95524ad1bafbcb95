"""Activation-memory estimate of model-info.txt vs the tensors autograd really saves (CPU).

    PYTHONPATH=. python bench/model_info_activations.py --data-root data [key=value ...]

Prints, per setting, the estimate (bytelatent/trainer/model_info.py) and the measured bytes of
one forward + loss of the debug config on a real batch. Activation checkpointing is left out:
its recomputation happens in backward, where this measurement does not look.
"""

from __future__ import annotations

import argparse

from bytelatent.args import TrainArgs
from bytelatent.config import parse_args
from bytelatent.distributed.parallelize import init_model_weights
from bytelatent.trainer.build import build_parallel_model
from bytelatent.trainer.model_info import (
    GIB,
    estimate_memory,
    measured_activation_bytes,
    parameter_table,
)

SETTINGS = [
    ["config=configs/debug.yaml"],
    ["config=configs/debug.yaml", "distributed.model_dtype=fp32"],
    ["config=configs/debug.yaml", "data.batch_size=2"],
    ["config=configs/entropy_debug.yaml", "distributed.model_dtype=fp32"],
    ["config=configs/entropy_debug.yaml"],
]


def compare(argv: list[str]) -> tuple[int, int]:
    args = parse_args(TrainArgs, [*argv, "dump_dir=/tmp/model_info_bench", "data.load_async=false"])
    model = build_parallel_model(args, None)
    estimate = estimate_memory(model, parameter_table(model), args).activations
    model.to_empty(device="cpu")
    init_model_weights(model, seed=0)
    model.train()
    batch = next(args.data.build_from_rank(0, 1))
    return estimate, measured_activation_bytes(model, args, batch)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data-root", required=True)
    known, extra = parser.parse_known_args()
    print(f"{'setting':<70} {'estimate MiB':>12} {'measured MiB':>12} {'ratio':>6}")
    for setting in SETTINGS:
        est, got = compare([*setting, f"data.root_dir={known.data_root}", *extra])
        name = " ".join(setting).replace("config=configs/", "")
        print(f"{name:<70} {est * 1024 / GIB:12.1f} {got * 1024 / GIB:12.1f} {est / got:6.2f}")


if __name__ == "__main__":
    main()
