"""torchrun worker for the multi-rank tests: `torchrun --nproc-per-node N _dist_worker.py OUT GROUP`.

Runs every scenario of GROUP on gloo; rank 0 writes OUT/results.json and OUT/<scenario>.pt
(initial full weights). Ends through cleanup_and_exit so gloo cannot abort at shutdown.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from _parity import full_params, setup_model, train
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from bytelatent.distributed.args import DistributedArgs
from bytelatent.distributed.clip import clip_grad_norm_
from bytelatent.distributed.env import cleanup_and_exit, setup_distributed
from bytelatent.distributed.mesh import build_mesh, dp_group, dp_rank_and_size, tp_rank_and_size

# name -> (model kind, DistributedArgs overrides, options)
GROUPS = {
    "two": {
        "fsdp": ("lm", {"dp_shard": 2}, {}),
        "fsdp_accum": ("lm", {"dp_shard": 2}, {"grad_acc": 2}),
        "fsdp_ac_full": ("lm", {"dp_shard": 2, "activation_checkpointing": "full"}, {}),
        "fsdp_ac_selective": (
            "lm",
            {"dp_shard": 2, "activation_checkpointing": "selective"},
            {},
        ),
        "hsdp_1x2": ("lm", {"dp_replicate": 1, "dp_shard": 2}, {"force_2d": True}),
        "hsdp_2x1": ("lm", {"dp_replicate": 2, "dp_shard": 1}, {}),
        "no_shard": ("lm", {"fsdp_type": "no_shard"}, {}),
        "tp": ("lm", {"dp_shard": 1, "tp_size": 2}, {}),
        "fsdp_bf16": ("lm", {"dp_shard": 2, "model_dtype": "bf16"}, {}),
        "blt_fsdp": ("blt", {"dp_shard": 2}, {}),
        "blt_tp": ("blt", {"dp_shard": 1, "tp_size": 2}, {}),
    },
    # (no H-Net FSDP case here: the ratio loss multiplies batch means, so the mean of two
    # half-batch losses is not the full batch's, and parity would not hold by design)
    "hnet_two": {
        "hnet_tp": ("hnet", {"dp_shard": 1, "tp_size": 2}, {}),
    },
    "four": {
        "tp_fsdp_2x2": ("lm", {"dp_shard": 2, "tp_size": 2}, {}),
        "hsdp_tp_2x1x2": ("lm", {"dp_replicate": 2, "dp_shard": 1, "tp_size": 2}, {}),
    },
}


def run_scenario(kind: str, overrides: dict, options: dict) -> tuple[dict, dict]:
    args = DistributedArgs(**{"model_dtype": "fp32", **overrides})
    mesh = build_mesh(args, dist.get_world_size(), "cpu")
    model = setup_model(kind, mesh, args, force_2d=options.get("force_2d", False))
    init = full_params(model)
    dp_rank, dp_size = dp_rank_and_size(mesh)
    result = train(model, kind, dp_rank, dp_size, grad_acc=options.get("grad_acc", 1))
    count = torch.ones(())
    dist.all_reduce(count, group=dp_group(mesh))  # the dp group spans exactly dp_size ranks
    assert count.item() == dp_size, (count.item(), dp_size)
    ranks: list = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, [dp_rank, dp_size, *tp_rank_and_size(mesh)])
    result["ranks"] = ranks  # per global rank: dp_rank, dp_size, tp_rank, tp_size
    return result, init


def clip_mixed() -> dict:
    """Grads as plain tensors, 1-D and 2-D DTensors with several placements."""
    world = dist.get_world_size()
    mesh1 = build_mesh(DistributedArgs(dp_shard=world), world, "cpu")["dp_shard"]
    mesh2 = build_mesh(DistributedArgs(dp_replicate=1, dp_shard=world), world, "cpu")
    mesh2 = mesh2["dp_replicate", "dp_shard"]
    gen = torch.Generator().manual_seed(7)
    fulls = [torch.randn(6, 4, generator=gen) * (i + 1) for i in range(5)]
    layouts = [
        None,
        (mesh1, [Shard(0)]),
        (mesh1, [Replicate()]),
        (mesh2, [Replicate(), Shard(1)]),
        (mesh1, [Shard(1)]),
    ]
    params = []
    for full, layout in zip(fulls, layouts, strict=True):
        grad = full.clone() if layout is None else distribute_tensor(full, *layout)
        param = torch.nn.Parameter(torch.zeros_like(grad))
        param.grad = grad
        params.append(param)
    norm = clip_grad_norm_(params, max_norm=1.0)
    clipped = [
        (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).tolist()
        for p in params
    ]
    unclipped = clip_grad_norm_(params, max_norm=0.0)  # after clipping: about 1
    return {"norm": norm.item(), "clipped": clipped, "after": unclipped.item()}


def main() -> None:
    out, group = Path(sys.argv[1]), sys.argv[2]
    env = setup_distributed(DistributedArgs(model_dtype="fp32"))
    results: dict = {"world": env.world_size, "launcher": env.launcher}
    for name, (kind, overrides, options) in GROUPS[group].items():
        try:
            result, init = run_scenario(kind, overrides, options)
        except Exception as exc:  # noqa: BLE001 - report it per scenario, run the rest
            result, init = {"error": f"{type(exc).__name__}: {exc}"}, None
            traceback.print_exc()
        results[name] = result
        if env.rank == 0 and init is not None:
            torch.save(init, out / f"{name}.pt")
    if group == "two":
        results["clip_mixed"] = clip_mixed()
    if env.rank == 0:
        (out / "results.json").write_text(json.dumps(results))
    dist.barrier()


if __name__ == "__main__":
    code = 0
    try:
        main()
    except Exception:  # noqa: BLE001 - any failure must still reach cleanup_and_exit
        traceback.print_exc()
        code = 1
    cleanup_and_exit(code)
