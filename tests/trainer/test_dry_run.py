"""dry_run=true and model-info.txt; the CLI's --help and no-argument usage hint."""

from __future__ import annotations

import os
import re
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bytelatent.args import TrainArgs
from bytelatent.config import parse_args
from bytelatent.config.help import sections as config_sections
from bytelatent.errors import ConfigError
from bytelatent.train import main
from bytelatent.trainer.build import build_parallel_model
from bytelatent.trainer.model_info import (
    MODEL_INFO,
    estimate_memory,
    parameter_table,
    write_model_info,
)
from tests.limits import hang_limit

REPO = Path(__file__).resolve().parents[2]
BLT_1B_PARAMS = 4_533_879_808
BLT_1B = ["config=configs/blt_1b.yaml", "dry_run=true"]  # no data.*: a dry run reads no data


def env() -> dict[str, str]:
    drop = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_JOB_ID")
    out = {k: v for k, v in os.environ.items() if k not in drop}
    return out | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def info_rows(path: Path) -> list[tuple[str, int, int, list[int], list[int]]]:
    """(name, count, local count, shape, local shape) of each parameter line of model-info.txt."""
    rows = []
    pattern = re.compile(r"^  (\S+)\s+\[([\d, ]*)\]\s+\S+\s+([\d,]+)\s+\[([\d, ]*)\]\s+([\d,]+)\s+")
    for line in path.read_text().splitlines():
        m = pattern.match(line)
        if m:
            shape = [int(s) for s in m.group(2).split(",") if s.strip()]
            local = [int(s) for s in m.group(4).split(",") if s.strip()]
            count, local_count = int(m.group(3).replace(",", "")), int(m.group(5).replace(",", ""))
            rows.append((m.group(1), count, local_count, shape, local))
    return rows


def _children_peak_rss_gib() -> float:
    """The largest peak RSS of any child process this test process has waited for (GiB)."""
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20


# 4.5e9 parameters materialised would take 17 GiB in fp32; a dry run keeps them on meta.
DRY_RUN_PEAK_GIB = 4


def test_dry_run_blt_1b_single_process(tmp_path):
    res = subprocess.run(
        [sys.executable, "-m", "bytelatent.train", *BLT_1B, f"dump_dir={tmp_path}"],
        cwd=REPO, env=env(), capture_output=True, text=True, timeout=hang_limit(120),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    assert _children_peak_rss_gib() < DRY_RUN_PEAK_GIB  # nothing allocated
    assert f"parameters: {BLT_1B_PARAMS:,}" in res.stdout, res.stdout
    assert "estimated memory per rank" in res.stdout
    # 107.5 GiB on one rank: over 85% of an H100's 80 GiB (the CPU default): knobs are named
    assert "(the CPU default: an 80 GiB H100; set distributed.device_memory_gib)" in res.stdout
    assert "  distributed.activation_checkpointing=full: " in res.stdout
    assert "  together: " in res.stdout and "(fits)" in res.stdout
    rows = info_rows(tmp_path / MODEL_INFO)
    assert sum(r[1] for r in rows) == BLT_1B_PARAMS
    assert all(r[1] == r[2] for r in rows)  # one process holds every parameter whole
    assert any(r[0] == "global_transformer.layers.24.feed_forward.w2.weight" for r in rows)
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "metrics.jsonl").exists()
    assert "leaked semaphore" not in res.stderr and "Traceback" not in res.stderr


@pytest.mark.slow
def test_dry_run_blt_1b_two_ranks_fsdp(tmp_path):
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        "-m", "bytelatent.train", *BLT_1B, f"dump_dir={tmp_path}", "distributed.dp_shard=2",
    ]  # fmt: skip
    res = subprocess.run(
        cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=hang_limit(180)
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert _children_peak_rss_gib() < DRY_RUN_PEAK_GIB  # torchrun waited for both ranks
    assert "dry run (2 ranks)" in res.stdout and f"parameters: {BLT_1B_PARAMS:,}" in res.stdout
    text = (tmp_path / MODEL_INFO).read_text()
    rows = info_rows(tmp_path / MODEL_INFO)
    assert sum(r[1] for r in rows) == BLT_1B_PARAMS
    # rank 0's FSDP shard: dim 0 split in two (rounded up), every parameter sharded
    assert all(
        local[0] == -(-shape[0] // 2) and local[1:] == shape[1:] for *_, shape, local in rows
    )
    assert "dp_shard=2:S(0)" in text and "fsdp gathered" in text
    for noise in ("leaked semaphore", "Traceback", "Error"):
        assert noise not in res.stderr, res.stderr[-3000:]


def test_dry_run_needs_no_data_keys_a_real_run_does(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    base = ["config=configs/blt_1b.yaml", f"dump_dir={tmp_path}"]
    args = parse_args(TrainArgs, [*base, "dry_run=true"])
    assert args.data.root_dir is None and args.data.preprocess_dir is None
    given = parse_args(TrainArgs, [*base, "dry_run=true", "data.root_dir=d"])
    assert given.data.root_dir == "d"  # a value that is set is kept
    with pytest.raises(ConfigError, match=r"^data\.root_dir, data\.sources, .*mandatory values"):
        parse_args(TrainArgs, base)
    with pytest.raises(ConfigError, match=r"^dump_dir: mandatory value"):
        parse_args(TrainArgs, ["config=configs/blt_1b.yaml", "dry_run=true"])  # not data: still


def tiny(tmp_path, *extra: str) -> TrainArgs:
    base = [] if any(e.startswith("config=") for e in extra) else ["config=configs/debug.yaml"]
    return parse_args(TrainArgs, [*base, f"dump_dir={tmp_path}", *extra])


def test_memory_estimate_follows_the_layout(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    args = tiny(tmp_path)
    model = build_parallel_model(args, None)
    rows = parameter_table(model)
    n = sum(r.numel for r in rows)
    assert n == sum(p.numel() for p in model.parameters())
    mem = estimate_memory(model, rows, args)
    assert mem.params == mem.grads == 4 * n and mem.optimizer == 8 * n and mem.gathered_params == 0
    acts = {}
    for mode in ("none", "selective", "full"):
        a = tiny(tmp_path, f"distributed.activation_checkpointing={mode}")
        acts[mode] = estimate_memory(build_parallel_model(a, None), rows, a).activations
    assert acts["full"] < acts["selective"] < acts["none"]
    bigger = tiny(tmp_path, "data.batch_size=8")
    assert estimate_memory(model, rows, bigger).activations == 2 * mem.activations


def test_model_info_lists_every_parameter_and_component(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    args = tiny(tmp_path, "train_entropy_model=true", "config=configs/entropy_debug.yaml")
    model = build_parallel_model(args, None)
    total, _ = write_model_info(model, args, None)
    text = (tmp_path / MODEL_INFO).read_text()
    rows = info_rows(tmp_path / MODEL_INFO)
    assert [r[0] for r in rows] == [name for name, _ in model.named_parameters()]
    assert sum(r[1] for r in rows) == total == sum(p.numel() for p in model.parameters())
    assert "allocator's peak on GPU, the process's peak RSS on CPU" in text  # what `mem` is
    for component in ("tok_embeddings", "layers", "norm", "output"):
        assert re.search(rf"^  {component}\s+[\d,]+", text, re.M), component


def test_help_lists_every_config_section(capsys):
    for flag in ("--help", "-h"):
        assert main([flag]) == 0
        out = capsys.readouterr().out
        assert out.startswith("usage: python -m bytelatent.train")
        assert "Examples:" in out and "dry_run" in out
        sections = list(config_sections(TrainArgs))
        assert {"data", "model", "optim", "distributed", "checkpoint", "eval"} <= set(sections)
        for name in sections:  # each with the description of its field (maybe wrapped)
            description = TrainArgs.model_fields[name].description
            words = r"\s+".join(map(re.escape, description.split()))
            assert description and re.search(rf"^  {name}\s+{words}", out, re.M), name
        top_level = out.split("Top-level keys")[1].split("Config sections")[0]
        for name in set(TrainArgs.model_fields) - set(sections):
            assert re.search(rf"^  {name} = ", top_level, re.M), name


def test_help_section_lists_its_keys_with_defaults(capsys):
    assert main(["--help", "model"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("model: the architecture's args")  # the default arch's: the BLT's
    assert re.search(r"^  model\.dim = 512\b", out, re.M), out[:2000]
    assert re.search(r"^  model\.cross_attn_k = ", out, re.M)
    assert main(["--help", "optim"]) == 0
    assert re.search(r"^  optim\.lr = [\d.e-]+", capsys.readouterr().out, re.M)
    assert main(["--help", "modle"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("config error: --help modle: not a section") and "model" in err


def test_no_arguments_prints_a_usage_hint(capsys):
    assert main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: python -m bytelatent.train") and "--help" in err
    assert "dump_dir" not in err and len(err.splitlines()) <= 3


def test_meta_model_is_not_materialised(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    model = build_parallel_model(tiny(tmp_path), None)
    assert all(p.device == torch.device("meta") for p in model.parameters())


@pytest.mark.parametrize("config", ["debug", "entropy_debug"])
def test_activation_estimate_is_close_to_what_autograd_saves(
    tmp_path, monkeypatch, corpus_root, config
):
    from bytelatent.distributed.parallelize import init_model_weights
    from bytelatent.trainer.model_info import measured_activation_bytes

    monkeypatch.chdir(REPO)
    small = (
        ["data.batch_size=2", "data.seq_len=64"]
        if config == "entropy_debug"
        else ["data.batch_size=2"]
    )
    args = tiny(
        tmp_path,
        f"config=configs/{config}.yaml",
        "distributed.model_dtype=fp32",
        f"data.root_dir={corpus_root}",
        "data.load_async=false",
        *small,
    )
    model = build_parallel_model(args, None)
    estimate = estimate_memory(model, parameter_table(model), args).activations
    model.to_empty(device="cpu")
    init_model_weights(model, seed=0)
    measured = measured_activation_bytes(model, args, next(args.data.build_from_rank(0, 1)))
    assert 0.7 < estimate / measured < 1.2, (estimate, measured)
