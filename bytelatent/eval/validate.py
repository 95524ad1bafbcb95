"""Validation bits-per-byte (the `bpb` task) and the `Validator` the training loop calls.

    if validator.should_run(step): metrics = validator.run(model, step)

Batches: each validation source is one unshuffled pass (`DataArgs.build_validation`, patched as
in training) read as a single global stream; data-parallel rank r computes batches r, r+W, ...
of it. So the result does not depend on the number of ranks (the in-loop eval of an 8-GPU run
and a 1-process standalone eval see the same batches), at the cost of every rank tokenizing the
whole (small) validation set. With an FSDP model every rank runs the same number of forwards (a
rank short of batches runs a fully masked one). Loss sums and byte counts are reduced in float64.

Results, one format everywhere: one JSON line per evaluation in `dump_dir/metrics.eval.jsonl`
with `global_step`, `val/bpb`, `val/loss`, `val/n_bytes`, `val/<source>/bpb` (and `/loss`,
`/n_bytes`), `eval_time_s` and `eval_mode` (before_training | loop | standalone | async), plus
whatever other tasks return. `val/bpb` is over all sources together (byte-weighted).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from itertools import islice
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from bytelatent.data.args import DataArgs
from bytelatent.data.batch import Batch
from bytelatent.distributed.args import DistributedArgs
from bytelatent.distributed.env import host_to_device
from bytelatent.distributed.parallelize import forward_context
from bytelatent.errors import DataError
from bytelatent.eval.args import EvalArgs
from bytelatent.eval.tasks import EvalContext, get_task, register_task, task_args
from bytelatent.eval.val_sources import resolve_validation_sources
from bytelatent.model.loss import forward_logits, masked_cross_entropy_sum
from bytelatent.progress import Progress
from bytelatent.trainer.metrics import LN2
from bytelatent.trainer.run_files import append_shared_line

logger = logging.getLogger("bytelatent")

EVAL_METRICS_FILE = "metrics.eval.jsonl"
_GLOB_CHARS = re.compile(r"[*?\[]")


def _masked(batch: Batch) -> Batch:
    """The same shapes with nothing to score: keeps an FSDP rank in step when it has no batch."""
    return Batch(batch.x, batch.y, np.zeros_like(batch.mask), batch.patch_lengths)


def rank_batches(
    data: DataArgs, files: list[str], dp_rank: int, dp_size: int, max_batches: int | None,
    batch_size: int | None, fsdp: bool,
) -> Iterator[Batch]:  # fmt: skip
    """This rank's share (r, r+W, ...) of the global validation stream of `files`."""
    stream = data.build_validation(files, 0, 1, batch_size)
    if max_batches is not None:
        stream = islice(stream, max_batches)
    while group := list(islice(stream, dp_size)):
        if dp_rank < len(group):
            yield group[dp_rank]
        elif fsdp:
            yield _masked(group[0])


# ------------------------------------------------------------------------------ the bpb task
def _eval_data_args(ctx: EvalContext) -> DataArgs:
    seq_len = ctx.eval_args.validation.seq_len
    return (
        ctx.data_args if seq_len is None else ctx.data_args.model_copy(update={"seq_len": seq_len})
    )


def _progress(ctx: EvalContext, iterable: Any, source: str) -> Any:
    if ctx.dp_rank != 0:
        return iterable
    if not ctx.progress:  # in-loop and async evals: a line a minute, never minutes of silence
        return _progress_lines(iterable, f"val {source}")
    try:
        from tqdm import tqdm
    except ImportError:  # an optional nicety: `pip install tqdm` (in the test extra)
        logger.warning("eval.progress: tqdm is not installed; no progress bars")
        ctx.progress = False
        return iterable
    total = ctx.eval_args.validation.max_batches
    total = None if total is None else math.ceil(total / ctx.dp_size)
    return tqdm(iterable, desc=f"val {source}", unit="batch", total=total, leave=False)


def _progress_lines(iterable: Any, what: str) -> Any:
    with Progress(what, unit="batch", mode="lines") as progress:
        for item in iterable:
            yield item
            progress.update()


def validation_bpb(ctx: EvalContext) -> dict[str, float]:
    """bpb = Σ CE (nats) / ln 2 / Σ bytes the targets stand for, per source and overall.

    Host syncs: one device-to-host read per call (the sums, at the end) besides the model's own
    forward's (an H-Net's `padded_width` per stage); batches go to the device by pinned,
    non-blocking copies and the byte counts come from the host batch
    (tests/generation/test_device_syncs.py)."""
    data = _eval_data_args(ctx)
    val = ctx.eval_args.validation
    names = sorted(ctx.validation_sources)
    sums = torch.zeros((len(names), 3), dtype=torch.float64, device=ctx.device)
    for i, name in enumerate(names):
        batches = rank_batches(
            data, ctx.validation_sources[name], ctx.dp_rank, ctx.dp_size, val.max_batches,
            val.batch_size, ctx.fsdp,
        )  # fmt: skip
        n_targets = n_bytes = 0
        for batch in _progress(ctx, batches, name):
            # pinned, non-blocking copies as training's: the step never waits for the device
            y, mask = (
                host_to_device(batch.y, ctx.device),
                host_to_device(batch.target_mask, ctx.device),
            )
            loss_sum = masked_cross_entropy_sum(ctx.forward(batch), y, mask)
            sums[i, 0] += loss_sum.double()
            n_targets += int(batch.target_mask.sum())
            n_bytes += ctx.tokenizer.n_bytes(batch.y, batch.target_mask)
        sums[i, 1] += n_targets
        sums[i, 2] += n_bytes
    if ctx.dp_group is not None or (ctx.dp_size > 1 and dist.is_initialized()):
        dist.all_reduce(sums, group=ctx.dp_group)
    rows = sums.cpu().tolist()
    metrics: dict[str, float] = {}
    for name, (loss_sum, n_targets, n_bytes) in zip(names, rows):
        metrics.update(_bpb_metrics(f"val/{name}", loss_sum, n_targets, n_bytes))
    total = [sum(col) for col in zip(*rows)] if rows else [0.0, 0.0, 0.0]
    return {**_bpb_metrics("val", *total), **metrics}


def _bpb_metrics(prefix: str, loss_sum: float, n_targets: float, n_bytes: float) -> dict:
    if n_targets == 0:
        raise DataError(
            f"eval.validation: {prefix}: no target bytes in the validation data "
            "(empty files, or rows longer than the data?)"
        )
    return {
        f"{prefix}/bpb": loss_sum / LN2 / n_bytes,
        f"{prefix}/loss": loss_sum / n_targets,
        f"{prefix}/n_bytes": int(n_bytes),
    }


register_task("bpb", validation_bpb)


# ------------------------------------------------------------------------------ Validator
def model_forward(
    model: torch.nn.Module, mesh: Any, distributed: DistributedArgs, device: torch.device
) -> Any:
    """Batch -> logits, exactly as the training forward runs it (autocast, patch lengths)."""

    def forward(batch: Batch) -> torch.Tensor:
        with forward_context(mesh, distributed, device.type):
            return forward_logits(model, batch, device)

    return forward


def append_jsonl(path: str | os.PathLike, record: dict) -> None:
    """One whole line: concurrent writers (trainer, async eval jobs) never interleave, and a full
    disk leaves no part of it (a DiskError line instead; bytelatent/trainer/run_files.py)."""
    line = json.dumps({"created_at": datetime.now(timezone.utc).isoformat(), **record}) + "\n"
    append_shared_line(path, line)


def summary_line(metrics: dict) -> str:
    sources = [
        f"{k.split('/')[1]} {v:.4f}"
        for k, v in metrics.items()
        if k.startswith("val/") and k.endswith("/bpb") and k.count("/") == 2
    ]
    text = f"eval step {metrics.get('global_step')}: val/bpb {metrics.get('val/bpb', float('nan')):.4f}"
    if len(sources) > 1:
        text += " (" + ", ".join(sources) + ")"
    return text + f", {metrics.get('val/n_bytes', 0):,} bytes in {metrics['eval_time_s']:.1f}s"


class Validator:
    """Runs `eval.tasks` on a model and records the results; built once, called by the loop."""

    def __init__(
        self, args: EvalArgs, data: DataArgs, *, distributed: DistributedArgs,
        device: torch.device, mesh: Any = None, dp_rank: int = 0, dp_size: int = 1,
        dp_group: Any = None, metrics_file: str | None = None, progress: bool = False,
        resolve: bool = True,
    ) -> None:  # fmt: skip
        self.args, self.data = args, data
        self.distributed, self.device, self.mesh = distributed, device, mesh
        self.dp_rank, self.dp_size, self.dp_group = dp_rank, dp_size, dp_group
        self.metrics_file = metrics_file
        self.progress = progress
        self.tasks = [get_task(name) for name in args.tasks]
        self.task_args = {t.name: task_args(t, args.task_args.get(t.name, {})) for t in self.tasks}
        self.sources = resolve_validation_sources(args, data) if resolve else {}
        self.tokenizer = data.tokenizer_args.build()

    @classmethod
    def for_training(cls, args: Any, env: Any, mesh: Any, dp_rank: int, dp_size: int) -> Validator:
        """From `TrainArgs`; checks the validation data exists when anything will evaluate."""
        from bytelatent.distributed.mesh import dp_group

        return cls(
            args.eval, args.data, distributed=args.distributed,
            device=env.device, mesh=mesh, dp_rank=dp_rank, dp_size=dp_size,
            dp_group=dp_group(mesh),
            metrics_file=os.path.join(args.dump_dir, EVAL_METRICS_FILE) if env.rank == 0 else None,
            resolve=args.eval.enabled,
        )  # fmt: skip

    def should_run(self, step: int) -> bool:
        return self.args.every > 0 and step > 0 and step % self.args.every == 0

    def should_run_before_training(self, step: int) -> bool:
        # A resumed run whose step was already evaluated in the loop does not log it twice.
        return self.args.before_training and not self.should_run(step)

    def run(self, model: torch.nn.Module, step: int | None, mode: str = "loop") -> dict:
        """Evaluate `model` (every rank calls this); returns the results, recorded on rank 0."""
        t0 = time.perf_counter()
        was_training = model.training
        model.eval()
        metrics: dict[str, Any] = {"global_step": step}
        try:
            ctx = EvalContext(
                model=model,
                forward=model_forward(model, self.mesh, self.distributed, self.device),
                step=step, eval_args=self.args, data_args=self.data, tokenizer=self.tokenizer,
                validation_sources=self.sources, device=self.device, dp_rank=self.dp_rank,
                dp_size=self.dp_size, dp_group=self.dp_group, fsdp=self.mesh is not None,
                progress=self.progress,
            )  # fmt: skip
            with torch.no_grad():
                for task in self.tasks:
                    if mode in ("loop", "before_training") and not task.in_loop:
                        continue
                    ctx.task_args = self.task_args[task.name]
                    metrics.update(task.run(ctx))
        finally:
            model.train(was_training)
        metrics["eval_time_s"] = time.perf_counter() - t0
        metrics["eval_mode"] = mode
        if self.metrics_file is not None:
            append_jsonl(self.metrics_file, metrics)
        if self.dp_rank == 0 and mode != "standalone":
            logger.info(summary_line(metrics))
        return metrics
