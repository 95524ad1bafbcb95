"""Build the model a `TrainArgs` describes (on whatever device is current), through its
architecture's spec (`bytelatent/model/registry.py`)."""

from __future__ import annotations

import logging

import torch
from torch.distributed.device_mesh import DeviceMesh

from bytelatent.args import TrainArgs
from bytelatent.distributed.parallelize import parallelize_model
from bytelatent.model import cpu_bf16
from bytelatent.model.registry import get_arch


def build_model(args: TrainArgs) -> torch.nn.Module:
    return get_arch(args.arch).build(args.active_model_args())


def build_parallel_model(args: TrainArgs, mesh: DeviceMesh | None) -> torch.nn.Module:
    """The model on the meta device with the parallelism plan for `mesh` applied (no memory
    used yet): the trainer then materialises it, the dry run only describes it."""
    with torch.device("meta"):
        model = build_model(args)
    n_params = sum(p.numel() for p in model.parameters())
    logging.getLogger("bytelatent").info(
        "model: %s (arch %s) with %s parameters", type(model).__name__, args.arch, f"{n_params:,}"
    )
    cpu_bf16.resolve()  # the CPU bf16 kernel choice, read before compiled blocks trace a linear
    return parallelize_model(model, mesh, args.distributed)


def warm_start_from_spec(model: torch.nn.Module, args: TrainArgs) -> bool:
    """The architecture's own warm start (`ArchSpec.warm_start`; the BLT's `model.global_init`
    copies a Llama's layers into its global transformer) into the materialised, maybe sharded
    model; False when it has none or the config asks for none. Fresh runs only: a resumed run's
    weights come from its own checkpoint."""
    warm_start = get_arch(args.arch).adapters.warm_start
    return bool(warm_start is not None and warm_start(model, args.active_model_args()))


init_global_from_pretrained = warm_start_from_spec  # the name callers knew
