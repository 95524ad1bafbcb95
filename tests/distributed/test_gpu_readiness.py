"""CUDA-only defects fixed on CPU (issue 18 item 9, item 4's switch): each test fails on e1a7c89."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from torch import nn

from bytelatent.archs.blt import hashing
from bytelatent.archs.blt.model import ByteLatentTransformer
from bytelatent.distributed import parallelize
from bytelatent.distributed.args import DistributedArgs
from bytelatent.distributed.env import _set_numerics, host_to_device
from bytelatent.errors import ConfigError
from bytelatent.launch.async_eval import check_eval_devices
from tests.distributed._parity import BLT_ARGS


def test_fp16_is_refused_without_a_grad_scaler():
    with pytest.raises(ValueError, match="gradient scaler"):
        DistributedArgs(model_dtype="fp16")


def test_cuda_copies_come_from_pinned_memory(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: calls.append("pin") or self)
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **k: calls.append(("to", k)) or self)
    host_to_device(np.zeros((2, 3), dtype=np.int64), torch.device("cuda", 1))
    assert calls == ["pin", ("to", {"non_blocking": True})]
    calls.clear()
    host_to_device(np.zeros((2, 3), dtype=np.int64), torch.device("cpu"))
    assert calls == [("to", {})]  # no pinning, no non_blocking from pageable memory


def test_lookup_tables_are_not_resharded_after_forward(monkeypatch):
    seen = {}

    def fake_fully_shard(module, mesh, mp_policy, reshard_after_forward=True):
        seen[module] = reshard_after_forward

    monkeypatch.setattr(parallelize, "fully_shard", fake_fully_shard)
    args = BLT_ARGS.model_copy(update={"encoder_hash_byte_group_size": [3, 4],
                                       "encoder_hash_byte_group_vocab": 64})  # fmt: skip
    with torch.device("meta"):
        model = ByteLatentTransformer(args)
    parallelize.apply_fsdp(model, None, DistributedArgs())
    tables = [m for m in model.fsdp_units() if isinstance(m, nn.Embedding)]
    assert len(tables) >= 2
    assert all(seen[t] is False for t in tables)
    layers = [m for m in model.fsdp_units() if not isinstance(m, nn.Embedding)]
    assert all(seen[m] is True for m in layers[:-1]) and seen[layers[-1]] is False


def test_hash_grad_rows_to_zero_stay_bounded_with_zero_grad_to_zeros():
    weight = nn.Parameter(torch.zeros(10, 4))
    ids, rows = torch.tensor([1, 3, 3]), torch.ones(3, 4)
    hashing._accumulate_rows(weight, ids, rows)
    state = hashing._grad_buffers[weight]
    for _ in range(50):  # optimizer.zero_grad(set_to_none=False) between backwards
        weight.grad.zero_()
        hashing._accumulate_rows(weight, ids, rows)
    assert state.dirty is None or sum(t.numel() for t in state.dirty) <= weight.shape[0]
    weight.grad = None  # set_to_none=True again: the next backward reuses the buffer
    hashing._accumulate_rows(weight, torch.tensor([0]), torch.ones(1, 4))
    expected = torch.zeros(10, 4)
    expected[0] = 1
    assert torch.equal(weight.grad, expected)


def test_async_eval_devices_must_not_be_training_gpus():
    environ = {"CUDA_VISIBLE_DEVICES": "4,5,6,7", "LOCAL_WORLD_SIZE": "2"}
    with pytest.raises(ConfigError, match="GPU\\(s\\) 5 that training uses"):
        check_eval_devices("5,6", environ, used=["4", "5"])
    check_eval_devices("6,7", environ, used=["4", "5"])
    check_eval_devices("0", {}, used=None if torch.cuda.is_available() else [])


def test_deterministic_switch(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    try:
        _set_numerics(DistributedArgs(deterministic=True))
        assert torch.are_deterministic_algorithms_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        assert torch.backends.cudnn.deterministic
    finally:
        _set_numerics(DistributedArgs())
    assert not torch.are_deterministic_algorithms_enabled()


def test_peer_failures_are_told_apart_from_other_errors():
    from bytelatent.distributed.faults import describe_peer_failure, is_peer_failure

    gloo = RuntimeError(
        "[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:5"
    )
    assert is_peer_failure(gloo)
    assert is_peer_failure(RuntimeError("Timed out waiting 3000ms for recv operation to complete"))
    assert not is_peer_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_peer_failure(ValueError("timed out"))
    assert describe_peer_failure(gloo, rank=0, world_size=1, step="3") is None  # no peers
