"""The dry-run estimate of the GPU configs on 1 H200, 8 H100s and 4 nodes of 8 H100s.

    PYTHONPATH=. python bench/scaling_dry_run.py [--configs blt_1b hnet_2stage_xl ...]

Each config's model is built once on the meta device (no process group: one rank) and priced with
the dry run's estimator (`bytelatent/trainer/memory_advice.py`): FSDP over N ranks divides the
parameters, gradients and AdamW state by N and adds the gathered copies of the two largest units;
activations are per micro-batch and do not change with N. A torchrun dry run on N ranks prints
the same estimate (checked for 2 ranks in docs/scaling.md). Nothing here ran on a GPU.
"""

from __future__ import annotations

import argparse

from bytelatent.args import TrainArgs
from bytelatent.config import parse_args
from bytelatent.trainer.build import build_parallel_model
from bytelatent.trainer.memory_advice import HEADROOM, MemoryPricer
from bytelatent.trainer.model_info import GIB, parameter_table

CONFIGS = ("blt_1b", "blt_7b", "hnet_1stage_l", "hnet_2stage_xl", "entropy_model")
# (label, ranks, GiB per device)
SETUPS = (("1 H200", 1, 141.0), ("8 H100", 8, 80.0), ("4x8 H100", 32, 80.0))


def row(name: str, extra: list[str]) -> str:
    args = parse_args(
        TrainArgs, [f"config=configs/{name}.yaml", "dump_dir=/tmp/x", "dry_run=true", *extra]
    )
    model = build_parallel_model(args, None)
    pricer = MemoryPricer(model, parameter_table(model), args, {})
    params = sum(p.numel() for p in model.parameters())
    cells = []
    for _, ranks, gib in SETUPS:
        total = pricer.total(args, ranks) / GIB
        cells.append(f"{total:.1f}{'' if total <= HEADROOM * gib else ' (over)'}")
    dist = args.distributed
    attn = getattr(args.active_model_args(), "attn_impl", "-")
    knobs = f"{attn}, AC {dist.activation_checkpointing}, micro-batch {args.data.batch_size}"
    return (
        f"| {name} {' '.join(extra)} | {params / 1e9:.2f} B | {knobs} | " + " | ".join(cells) + " |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="*", default=list(CONFIGS))
    parser.add_argument("overrides", nargs="*", help="key=value applied to every config")
    cli = parser.parse_args()
    header = " | ".join(f"{label} (GiB/rank)" for label, _, _ in SETUPS)
    print(f"| config | parameters | attention, AC, micro-batch | {header} |")
    print("|---|---|---|" + "---|" * len(SETUPS))
    for name in cli.configs:
        print(row(name, cli.overrides), flush=True)


if __name__ == "__main__":
    main()
