"""Worker processes for the checkpoint tests (run as a script, one process per rank).

    python ckpt_worker.py SCENARIO CKPT_PATH OUT_DIR [--async] [--steps N] [--big]

Rank/world come from RANK / WORLD_SIZE (MASTER_ADDR/PORT for gloo); WORLD_SIZE=1 runs without a
process group and without FSDP. Every assertion failure exits non-zero; the test reads OUT_DIR.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
)

from bytelatent.checkpoint.args import CheckpointArgs
from bytelatent.checkpoint.manager import CheckpointManager

DIM, VOCAB, GLOBAL_BATCH = 16, 32, 4


class TinyNet(nn.Module):
    def __init__(self, dim: int = DIM, n_layers: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(n_layers))
        self.out = nn.Linear(dim, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        for layer in self.layers:
            h = h + torch.tanh(layer(h))
        return self.out(h)


def build(
    world: int, seed: int = 0, dim: int = DIM, tp: bool = False
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Same full init on every rank (CPU DTensor init would repeat shards), then FSDP2 (or TP) if world > 1."""
    torch.manual_seed(seed)
    model = TinyNet(dim)
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        if tp:
            from torch.distributed.tensor import Replicate
            from torch.distributed.tensor.parallel import (
                ColwiseParallel,
                parallelize_module,
            )

            mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
            plan = ColwiseParallel(output_layouts=Replicate())
            for layer in model.layers:
                parallelize_module(layer, mesh, plan)
            parallelize_module(model.out, mesh, plan)
        else:
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
            for layer in model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
    # foreach=False: TP mixes DTensor and plain parameters, which foreach kernels reject.
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=not tp)
    return model, optimizer


def layout(args: argparse.Namespace, rank: int, world: int) -> tuple[int, int, bool]:
    """(dp_rank, dp_size, is_tp_rank0): with --tp every rank is one TP group sharing the data."""
    return (0, 1, rank == 0) if args.tp else (rank, world, True)


def train_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, step: int, rank: int, world: int
) -> None:
    """One step on this rank's slice of a global batch that depends only on `step`."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, 8), generator=g)
    local = tokens.chunk(world)[rank]
    logits = model(local[:, :-1])
    loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), local[:, 1:].reshape(-1))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def touch(path: str) -> None:
    with open(path, "w"):
        pass


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {k: v.clone() for k, v in get_model_state_dict(model, options=options).items()}


def assert_equal(got: dict, want: dict, atol: float, what: str) -> None:
    """Compare full weights; only rank 0 holds them (full_weights offloads to rank 0's CPU)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        _assert_close(got, want, atol, what)


def _assert_close(got: dict, want: dict, atol: float, what: str) -> None:
    assert got.keys() == want.keys(), f"{what}: keys differ"
    for key, value in want.items():
        diff = (got[key].float() - value.float()).abs().max().item()
        assert diff <= atol, f"{what}: {key} differs by {diff}"


def scenario_save(args: argparse.Namespace, rank: int, world: int) -> None:
    """Train 2 steps, save step 2 (maybe async), then record the weights after step 3."""
    model, optimizer = build(world, tp=args.tp)
    dp_rank, dp_size, is_tp_rank0 = layout(args, rank, world)
    ckpt_args = CheckpointArgs(path=args.ckpt_path, async_save=args.async_save)
    manager = CheckpointManager(
        ckpt_args, dp_rank=dp_rank, dp_size=dp_size, is_tp_rank0=is_tp_rank0
    )
    for step in (1, 2):
        train_step(model, optimizer, step, dp_rank, dp_size)
    step2 = full_weights(model)
    manager.save(2, model, optimizer, {"step": 2, "dp_rank": dp_rank}, {"run": "test"})
    # With --async, training continues (collectives on the default group) during the save.
    train_step(model, optimizer, 3, dp_rank, dp_size)
    manager.wait()
    step3 = full_weights(model)  # a collective under FSDP/TP: every rank calls it
    if rank == 0:
        expected = {"step2": step2, "step3": step3}
        torch.save(expected, os.path.join(args.out_dir, "expected.pt"))
    manager.close()


def scenario_load(args: argparse.Namespace, rank: int, world: int) -> None:
    """Load the newest checkpoint (any saved world size), check weights, step once, compare."""
    expected = torch.load(os.path.join(args.out_dir, "expected.pt"))
    # A different init: everything must come from the checkpoint.
    model, optimizer = build(world, seed=123, tp=args.tp)
    dp_rank, dp_size, is_tp_rank0 = layout(args, rank, world)
    manager = CheckpointManager(
        CheckpointArgs(path=args.ckpt_path),
        dp_rank=dp_rank,
        dp_size=dp_size,
        is_tp_rank0=is_tp_rank0,
    )
    train_state = manager.load(model, optimizer)
    assert train_state["step"] == 2, train_state
    info = manager.last_load
    result = {
        "train_state": train_state,
        "dp_size_changed": info.dp_size_changed,
        "saved_dp_size": info.saved_dp_size,
    }
    assert_equal(full_weights(model), expected["step2"], 0.0, "weights after load")
    train_step(model, optimizer, 3, dp_rank, dp_size)
    # Different world sizes reduce gradients in a different order: allow float rounding only.
    assert_equal(full_weights(model), expected["step3"], 1e-6, "weights one step after load")
    if args.init_from:
        fresh, _ = build(world, seed=321, tp=args.tp)
        report = manager.load_init(fresh, args.init_from)
        assert not report.missing and not report.unexpected, report
        assert_equal(
            full_weights(fresh),
            expected["step2"],
            0.0,
            f"load_init from {args.init_from}",
        )
        result["init_format"] = report.format
    if rank == 0:
        with open(os.path.join(args.out_dir, f"load_world{world}.json"), "w") as f:
            json.dump(result, f)


def scenario_kill(args: argparse.Namespace, rank: int, world: int) -> None:
    """Save step 1, then start saving step 2 and hang at the kill point named by --kill-at."""
    from bytelatent.checkpoint import saver as saver_module

    model, optimizer = build(world, dim=args.dim)
    manager = CheckpointManager(CheckpointArgs(path=args.ckpt_path), dp_rank=rank, dp_size=world)
    train_step(model, optimizer, 1, rank, world)
    manager.save(1, model, optimizer, {"step": 1}, kind="dump")
    torch.save(full_weights(model), os.path.join(args.out_dir, "step1.pt"))
    train_step(model, optimizer, 2, rank, world)

    def hang(*_a: object, **_k: object) -> None:
        touch(os.path.join(args.out_dir, "ready"))
        time.sleep(600)

    if args.kill_at == "before_marker":
        saver_module.Saver._write_marker = hang  # DCP data and .metadata are written
    elif args.kill_at == "before_metadata":
        writer_cls = saver_module.ManifestWriter  # the writer the saver saves with
        original = writer_cls.finish

        def finish_then_hang(self: object, *a: object, **k: object) -> None:
            hang()
            original(self, *a, **k)

        writer_cls.finish = finish_then_hang  # data files are written, .metadata is not
    else:
        touch(os.path.join(args.out_dir, "ready"))  # the test kills us at a random point
    manager.save(2, model, optimizer, {"step": 2}, kind="dump")
    touch(os.path.join(args.out_dir, "saved2"))


SCENARIOS = {"save": scenario_save, "load": scenario_load, "kill": scenario_kill}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=sorted(SCENARIOS))
    parser.add_argument("ckpt_path")
    parser.add_argument("out_dir")
    parser.add_argument("--async", dest="async_save", action="store_true")
    parser.add_argument("--tp", action="store_true", help="tensor parallel instead of FSDP")
    parser.add_argument("--init-from", default=None)
    parser.add_argument("--kill-at", default="random")
    parser.add_argument("--dim", type=int, default=DIM)
    args = parser.parse_args()
    rank, world = (
        int(os.environ.get("RANK", "0")),
        int(os.environ.get("WORLD_SIZE", "1")),
    )
    if world > 1:
        dist.init_process_group("gloo")
    code = 0
    try:
        SCENARIOS[args.scenario](args, rank, world)
    except Exception:  # noqa: BLE001 - report any failure, then still reach os._exit
        traceback.print_exc()
        code = 1
    if world > 1:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    # os._exit: gloo runloop threads kept alive by DeviceMesh can abort a normal interpreter exit.
    os._exit(code)


if __name__ == "__main__":
    main()
