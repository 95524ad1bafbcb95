"""The Validator's pieces in process: data resolution, rank shares, the bpb sum, tasks, leases."""

from __future__ import annotations

import json
import math
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from bytelatent.args import TrainArgs
from bytelatent.checkpoint.args import CheckpointArgs
from bytelatent.checkpoint.manager import CheckpointManager
from bytelatent.config import parse_args
from bytelatent.distributed.args import DistributedArgs
from bytelatent.errors import ConfigError, DataError
from bytelatent.eval.args import EvalArgs
from bytelatent.eval.tasks import EvalContext, known_tasks, register_task
from bytelatent.eval.validate import Validator, rank_batches, resolve_validation_sources
from bytelatent.trainer.build import build_model
from tests.trainer.test_cli import TINY_BLT


@pytest.fixture(scope="module")
def train_args(corpus_root, tmp_path_factory) -> TrainArgs:
    dump = tmp_path_factory.mktemp("validate")
    return parse_args(TrainArgs, [*TINY_BLT, f"dump_dir={dump}", f"data.root_dir={corpus_root}"])


@pytest.fixture(scope="module")
def model(train_args) -> torch.nn.Module:
    torch.manual_seed(0)
    m = build_model(train_args)
    m.init_weights()
    return m.eval()


def test_default_validation_data_is_the_val_file_beside_each_source(train_args, corpus_root):
    sources = resolve_validation_sources(EvalArgs(), train_args.data)
    assert sources == {"stdlib": [str(corpus_root / "stdlib" / "stdlib.val.jsonl")]}


def test_a_missing_validation_source_is_a_data_error(train_args, tmp_path):
    args = EvalArgs(validation={"sources": [str(tmp_path / "nope.jsonl")]})
    with pytest.raises(DataError, match="eval.validation: .*nope.jsonl"):
        resolve_validation_sources(args, train_args.data)
    data = train_args.data.model_copy(update={"root_dir": str(tmp_path)})  # no stdlib/*.val.jsonl
    with pytest.raises(DataError, match="stdlib"):
        resolve_validation_sources(EvalArgs(), data)


def test_validation_files_that_are_training_data_are_refused(
    train_args, corpus_root, tmp_path, monkeypatch
):
    train_file = "stdlib/stdlib.chunk.00.jsonl"
    with pytest.raises(DataError, match="also training data of source 'stdlib'"):
        resolve_validation_sources(EvalArgs(validation={"sources": [train_file]}), train_args.data)
    # the validation file preprocessed into the training folder (stdlib.val.jsonl.arrow there)
    root = tmp_path / "root"
    (root / "stdlib").mkdir(parents=True)
    for name in ("stdlib.chunk.00.jsonl", "stdlib.val.jsonl"):
        (root / "stdlib" / name).write_bytes((corpus_root / "stdlib" / name).read_bytes())
    (root / "stdlib" / "stdlib.val.jsonl.arrow").write_bytes(b"")
    data = train_args.data.model_copy(update={"root_dir": str(root)})
    shards = [str(root / "stdlib" / n) for n in ("stdlib.chunk.00.jsonl", "stdlib.val.jsonl.arrow")]
    monkeypatch.setattr(
        type(data), "files_of", lambda self, source: shards
    )  # as listed for training
    with pytest.raises(DataError, match="stdlib.val.jsonl.arrow"):
        resolve_validation_sources(EvalArgs(), data)


def test_relative_validation_file_is_joined_onto_root_dir_once(
    train_args, corpus_root, monkeypatch
):
    monkeypatch.chdir(corpus_root.parent)
    data = train_args.data.model_copy(update={"root_dir": corpus_root.name})
    args = EvalArgs(validation={"sources": ["stdlib/stdlib.val.jsonl"]})
    files = resolve_validation_sources(args, data)["stdlib"]
    assert files == [str(corpus_root / "stdlib" / "stdlib.val.jsonl")]
    assert next(rank_batches(data, files, 0, 1, 1, None, fsdp=False)).x.shape[0] > 0


@pytest.mark.parametrize("world", [2, 3])
def test_rank_shares_partition_the_global_stream(train_args, corpus_root, world):
    files = [str(corpus_root / "stdlib" / "stdlib.val.jsonl")]
    data = train_args.data
    whole = [b.x for b in rank_batches(data, files, 0, 1, 7, None, fsdp=False)]
    assert len(whole) == 7
    shares = [list(rank_batches(data, files, r, world, 7, None, fsdp=True)) for r in range(world)]
    assert len({len(s) for s in shares}) == 1  # FSDP: every rank runs the same number of forwards
    real = [
        (i * world + r, b) for r, s in enumerate(shares) for i, b in enumerate(s) if b.mask.any()
    ]
    assert sorted(i for i, _ in real) == list(range(7))
    for i, batch in real:
        np.testing.assert_array_equal(batch.x, whole[i])


def test_bpb_is_the_ce_sum_over_the_bytes_of_the_targets(train_args, model, corpus_root):
    args = EvalArgs(validation={"max_batches": 3})
    validator = Validator(args, train_args.data, distributed=DistributedArgs(model_dtype="fp32"),
                          device=torch.device("cpu"))  # fmt: skip
    metrics = validator.run(model, 7, mode="loop")
    loss_sum, n_bytes = 0.0, 0
    files = validator.sources["stdlib"]
    for b in rank_batches(train_args.data, files, 0, 1, 3, None, fsdp=False):
        with torch.no_grad():
            logits = model(torch.from_numpy(b.x), patch_lengths=torch.from_numpy(b.patch_lengths))
        ce = F.cross_entropy(
            logits.flatten(0, 1), torch.from_numpy(b.y).flatten(), reduction="none"
        )
        loss_sum += float((ce * torch.from_numpy(b.mask).flatten()).sum())
        n_bytes += int(b.mask.sum())  # byte tokenizer: one byte per target
    assert metrics["global_step"] == 7 and metrics["val/n_bytes"] == n_bytes
    assert metrics["val/bpb"] == pytest.approx(loss_sum / math.log(2) / n_bytes, rel=1e-6)
    assert not model.training


class _TopArgs(__import__("pydantic").BaseModel):
    model_config = {"extra": "forbid"}
    k: int = 1


def _top_k_accuracy(ctx: EvalContext) -> dict[str, float]:
    """A second task, as another module would register one: top-k next-byte accuracy."""
    hits = total = 0
    for files in ctx.validation_sources.values():
        for b in rank_batches(ctx.data_args, files, ctx.dp_rank, ctx.dp_size, 2, None, ctx.fsdp):
            top = ctx.forward(b).topk(ctx.task_args.k, dim=-1).indices
            hit = (top == torch.from_numpy(b.y)[..., None]).any(-1) & torch.from_numpy(b.mask)
            hits, total = hits + int(hit.sum()), total + int(b.mask.sum())
    return {f"top{ctx.task_args.k}/acc": hits / total}


def test_a_registered_task_runs_beside_bpb_with_its_options(train_args, model):
    register_task("test_topk", _top_k_accuracy, args_model=_TopArgs)
    assert "test_topk" in known_tasks() and {"bpb", "harness", "generation"} <= known_tasks()
    args = EvalArgs(tasks=["bpb", "test_topk"], task_args={"test_topk": {"k": 260}},
                    validation={"max_batches": 1})  # fmt: skip
    validator = Validator(args, train_args.data, distributed=DistributedArgs(),
                          device=torch.device("cpu"))  # fmt: skip
    metrics = validator.run(model, 0)
    assert metrics["top260/acc"] == 1.0 and "val/bpb" in metrics  # every byte is in the top 260
    bad = EvalArgs(tasks=["test_topk"], task_args={"test_topk": {"kk": 2}})
    with pytest.raises(ConfigError, match="eval.task_args.test_topk.kk"):
        Validator(bad, train_args.data, distributed=DistributedArgs(),
                  device=torch.device("cpu"))  # fmt: skip


def test_a_task_whose_module_is_missing_is_a_config_error(train_args, monkeypatch):
    from bytelatent.eval import tasks

    monkeypatch.setitem(tasks.PROVIDERS, "nowhere", "bytelatent.eval.not_a_module")
    with pytest.raises(ConfigError, match="task 'nowhere' is not available"):
        Validator(EvalArgs(tasks=["nowhere"]), train_args.data, distributed=DistributedArgs(),
                  device=torch.device("cpu"))  # fmt: skip


def test_retention_keeps_a_leased_checkpoint_until_its_reader_is_done(tmp_path):
    model = torch.nn.Linear(2, 2)
    manager = CheckpointManager(CheckpointArgs(path=str(tmp_path), eval={"every": 1, "keep": 1}))
    saved = []
    manager.on_complete = lambda step, folder, kinds: saved.append((step, kinds))
    manager.save(1, model, None, train_state={}, kind="eval")
    (tmp_path / f"{1:010d}" / ".lease.eval").write_text("{}")
    manager.save(2, model, None, train_state={}, kind="eval")
    manager.save(3, model, None, train_state={}, kind="eval")
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{1:010d}", f"{3:010d}"]
    assert saved == [(1, ["eval"]), (2, ["eval"]), (3, ["eval"])]
    (tmp_path / f"{1:010d}" / ".lease.eval").unlink()
    manager.retain()
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{3:010d}"]


def test_with_async_save_the_hook_fires_once_the_save_is_complete(tmp_path):
    model = torch.nn.Linear(2, 2)
    manager = CheckpointManager(CheckpointArgs(path=str(tmp_path), async_save=True))
    seen = []

    def hook(step, folder, kinds):  # the marker is there when an eval job is launched
        seen.append((step, (tmp_path / f"{step:010d}" / ".complete").exists()))

    manager.on_complete = hook
    manager.save(1, model, None, train_state={}, kind="eval")
    manager.save(2, model, None, train_state={}, kind=["dump", "eval"])
    assert seen[0] == (1, True)
    manager.close()
    assert seen == [(1, True), (2, True)]


def test_validation_data_on_s3_gives_the_local_batches(train_args, corpus_root, s3_env):
    s3fs = pytest.importorskip("s3fs")
    fs = s3fs.S3FileSystem()
    if not fs.exists("evalbucket"):
        fs.mkdir("evalbucket")
    fs.put_file(
        str(corpus_root / "stdlib" / "stdlib.val.jsonl"), "evalbucket/stdlib/stdlib.val.jsonl"
    )
    data = train_args.data.model_copy(update={"root_dir": "s3://evalbucket"})
    sources = resolve_validation_sources(EvalArgs(), data)  # the default: *.val.jsonl beside stdlib
    assert sources == {"stdlib": ["s3://evalbucket/stdlib/stdlib.val.jsonl"]}
    local = resolve_validation_sources(EvalArgs(), train_args.data)["stdlib"]
    remote = list(rank_batches(data, sources["stdlib"], 0, 1, 3, None, fsdp=False))
    for a, b in zip(rank_batches(train_args.data, local, 0, 1, 3, None, fsdp=False), remote):
        np.testing.assert_array_equal(a.x, b.x)
    assert len(remote) == 3


def test_resume_releases_stale_leases_and_skips_finished_evals(tmp_path):
    from bytelatent.eval.args import AsyncLaunchArgs
    from bytelatent.launch.async_eval import AsyncEvalLauncher, results_file

    manager = CheckpointManager(CheckpointArgs(path=str(tmp_path / "checkpoints")))
    manager.save(10, torch.nn.Linear(2, 2), None, train_state={}, kind="eval")
    lease = tmp_path / "checkpoints" / f"{10:010d}" / ".lease.eval"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that is certainly not a running eval
    lease.write_text(json.dumps({"pid": dead.pid, "job_id": None, "host": socket.gethostname()}))
    results_file(tmp_path, 10).parent.mkdir(parents=True)
    results_file(tmp_path, 10).write_text("{}")
    launcher = AsyncEvalLauncher(AsyncLaunchArgs(mode="local"), str(tmp_path), "t", True, manager)
    launcher.launch_owed()
    assert not lease.exists() and launcher.jobs == {}  # released, and nothing relaunched
