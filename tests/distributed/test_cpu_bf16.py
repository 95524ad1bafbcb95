"""A bf16 run on a CPU without bf16 matmul instructions says so in one line, once, in the run's log
(stdout and train.log), never on stderr, where a failing run prints its one error line."""

from __future__ import annotations

import torch

from bytelatent.distributed import env as env_module
from bytelatent.train import main
from tests.conftest import TINY_ENTROPY
from tests.trainer.test_cli import REPO

WARNING = "distributed.model_dtype=bf16 on a CPU without bf16 matmul"


def _train_bf16(monkeypatch, tmp_path, corpus_root, native: bool):
    monkeypatch.setattr(env_module, "cpu_has_bf16_matmul", lambda: native)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_JOB_ID", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(REPO)
    dump = tmp_path / "run"
    argv = [
        "config=configs/entropy_debug.yaml",
        *TINY_ENTROPY,
        "steps=1",
        f"dump_dir={dump}",
        f"data.root_dir={corpus_root}",
        "distributed.model_dtype=bf16",
        "checkpoint.dump.every=0",
    ]
    assert main(argv) == 0
    return dump


def test_the_warning_goes_to_the_run_log_not_stderr(monkeypatch, tmp_path, corpus_root, capsys):
    dump = _train_bf16(monkeypatch, tmp_path, corpus_root, native=False)
    out = capsys.readouterr()
    assert WARNING not in out.err
    assert sum(WARNING in line for line in out.out.splitlines()) == 1
    log = (dump / "train.log").read_text().splitlines()
    lines = [line for line in log if WARNING in line]
    assert len(lines) == 1 and "distributed.model_dtype=fp32" in lines[0]


def test_no_warning_where_the_cpu_has_bf16(monkeypatch, tmp_path, corpus_root, capsys):
    dump = _train_bf16(monkeypatch, tmp_path, corpus_root, native=True)
    out = capsys.readouterr()
    assert WARNING not in out.out + out.err
    assert WARNING not in (dump / "train.log").read_text()


def test_no_warning_for_fp32_or_cuda(monkeypatch):
    monkeypatch.setattr(env_module, "cpu_has_bf16_matmul", lambda: False)
    assert env_module.cpu_bf16_warning(torch.device("cpu"), "fp32") is None
    assert env_module.cpu_bf16_warning(torch.device("cuda", 0), "bf16") is None
    assert env_module.cpu_bf16_warning(torch.device("cpu"), "bf16") is not None
