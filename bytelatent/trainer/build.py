"""Build the model a `TrainArgs` describes (on whatever device is current)."""

from __future__ import annotations

import logging

import torch
from torch.distributed.device_mesh import DeviceMesh

from bytelatent.args import TrainArgs
from bytelatent.distributed.parallelize import parallelize_model
from bytelatent.model.blt import ByteLatentTransformer
from bytelatent.model.transformer import LMTransformer


def build_model(args: TrainArgs) -> torch.nn.Module:
    if args.train_entropy_model:
        return LMTransformer(args.entropy_model)
    return ByteLatentTransformer(args.model)


def build_parallel_model(args: TrainArgs, mesh: DeviceMesh | None) -> torch.nn.Module:
    """The model on the meta device with the parallelism plan for `mesh` applied (no memory
    used yet): the trainer then materialises it, the dry run only describes it."""
    with torch.device("meta"):
        model = build_model(args)
    n_params = sum(p.numel() for p in model.parameters())
    logging.getLogger("bytelatent").info(
        "model: %s with %s parameters", type(model).__name__, f"{n_params:,}"
    )
    return parallelize_model(model, mesh, args.distributed)


def init_global_from_pretrained(model: torch.nn.Module, args: TrainArgs) -> bool:
    """Copy `model.global_init`'s weights into the (materialised, maybe sharded) global
    transformer; False when the run has none. Called for fresh runs only: a resumed run's
    weights come from its own checkpoint."""
    if args.train_entropy_model or args.model is None or args.model.global_init is None:
        return False
    from bytelatent.checkpoint.hf_llama import load_hf_llama  # safetensors: the `hf` extra

    load_hf_llama(model, args.model)
    return True

