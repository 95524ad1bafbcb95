"""Load a training checkpoint into a Trainer on this launch's world and take two steps on a fixed batch.

    [torchrun --nproc-per-node N] probe_checkpoint.py OUT.json BATCH_WORLD BATCH_SIZE key=value ...

The key=value arguments are a training config; `checkpoint.load_path` names the step folder.
The fixed global batch is what a fresh data pipeline with BATCH_WORLD data-parallel ranks of
BATCH_SIZE rows each yields first (the rows of ranks 0..BATCH_WORLD-1, concatenated), i.e. exactly
the first batch of a run that resumes this checkpoint on BATCH_WORLD ranks after a change of
data-parallel size. The rows are split evenly over this launch's ranks. OUT.json (rank 0) gets:

* loss_before: loss of the loaded weights on the batch (model state);
* loss_after: loss on the same batch after one optimizer step (optimizer + schedule state);
* lr: the learning rate that step used; step: the step the checkpoint was taken at.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch
import torch.distributed as dist


def global_batch(data_args, world: int):
    from bytelatent.data.batch import Batch

    firsts = []
    for rank in range(world):
        iterator = data_args.build_from_rank(rank, world)
        firsts.append(next(iterator))
        close = getattr(iterator, "close", None)
        if close is not None:
            close()
    patch = None
    if firsts[0].patch_lengths is not None:
        width = max(b.patch_lengths.shape[1] for b in firsts)
        patch = np.concatenate(
            [
                np.pad(b.patch_lengths, ((0, 0), (0, width - b.patch_lengths.shape[1])))
                for b in firsts
            ]
        )
    return Batch(
        x=np.concatenate([b.x for b in firsts]),
        y=np.concatenate([b.y for b in firsts]),
        mask=np.concatenate([b.mask for b in firsts]),
        patch_lengths=patch,
    )


def rows_of_rank(batch, rank: int, world: int):
    from bytelatent.data.batch import Batch

    n = batch.x.shape[0]
    assert n % world == 0, f"{n} rows do not split over {world} ranks"
    part = slice(rank * n // world, (rank + 1) * n // world)
    patch = None if batch.patch_lengths is None else batch.patch_lengths[part]
    return Batch(x=batch.x[part], y=batch.y[part], mask=batch.mask[part], patch_lengths=patch)


def global_loss(trainer, out) -> float:
    sums = torch.tensor([float(out.loss_sum), float(out.n_bytes)], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(sums)
    return float(sums[0] / sums[1])


def probe(argv: list[str]) -> int:
    from bytelatent.args import TrainArgs
    from bytelatent.config import parse_args
    from bytelatent.distributed.env import setup_distributed
    from bytelatent.trainer.trainer import Trainer

    out_path, batch_world, batch_size, overrides = argv[0], int(argv[1]), int(argv[2]), argv[3:]
    args = parse_args(TrainArgs, [*overrides, "data.load_async=false"])
    env = setup_distributed(args.distributed)
    trainer = Trainer(args, env)
    try:
        step = trainer.state.step
        batch = rows_of_rank(
            global_batch(args.data.model_copy(update={"batch_size": batch_size}), batch_world),
            trainer.dp_rank,
            trainer.dp_size,
        )
        lr = trainer.scheduler.get_last_lr()[0]
        before = global_loss(trainer, trainer.train_step([batch]))
        after = global_loss(trainer, trainer.train_step([batch]))
    finally:
        trainer.close()
    if env.rank == 0:
        with open(out_path, "w") as f:
            json.dump({"loss_before": before, "loss_after": after, "lr": lr, "step": step}, f)
    return 0


if __name__ == "__main__":
    code = probe(sys.argv[1:])
    if dist.is_initialized():
        from bytelatent.distributed.env import cleanup_and_exit

        cleanup_and_exit(code)
    sys.exit(code)
