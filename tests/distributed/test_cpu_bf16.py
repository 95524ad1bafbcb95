"""A bf16 run on a CPU without bf16 matmul instructions says so in one line, once."""

from __future__ import annotations

import logging

import pytest
import torch

from bytelatent.distributed import env as env_module
from bytelatent.distributed.args import DistributedArgs


@pytest.mark.parametrize("native", [False, True])
def test_setup_warns_about_bf16_only_where_the_cpu_lacks_it(monkeypatch, caplog, native):
    monkeypatch.setattr(env_module, "cpu_has_bf16_matmul", lambda: native)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_JOB_ID", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(env_module.mp, "set_start_method", lambda *a, **k: None)
    with caplog.at_level(logging.WARNING, logger=env_module.__name__):
        env = env_module.setup_distributed(DistributedArgs(model_dtype="bf16"))
    assert env.device.type == "cpu" and env.backend is None
    lines = [r.getMessage() for r in caplog.records if "model_dtype=bf16" in r.getMessage()]
    if native:
        assert lines == []
    else:
        assert len(lines) == 1 and "\n" not in lines[0]
        assert "distributed.model_dtype=fp32" in lines[0]


def test_no_warning_for_fp32_or_cuda(monkeypatch):
    monkeypatch.setattr(env_module, "cpu_has_bf16_matmul", lambda: False)
    assert env_module.cpu_bf16_warning(torch.device("cpu"), "fp32") is None
    assert env_module.cpu_bf16_warning(torch.device("cuda", 0), "bf16") is None
    assert env_module.cpu_bf16_warning(torch.device("cpu"), "bf16") is not None
