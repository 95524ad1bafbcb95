"""Realtime entropy patching runs each rank's model on that rank's GPU (LOCAL_RANK), not GPU 0."""

from __future__ import annotations

import pytest
import torch

from bytelatent.checkpoint import pretrained as pretrained_module
from bytelatent.data.entropy import resolve_device
from bytelatent.data.patcher import Patcher, PatcherArgs


@pytest.fixture
def two_gpus(monkeypatch):
    """A (mocked) host with 2 GPUs, in the process of local rank 1."""
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    current = []
    monkeypatch.setattr(
        torch.cuda, "set_device", lambda device: current.append(torch.device(device))
    )
    return current


def test_auto_and_bare_cuda_resolve_to_the_local_rank(two_gpus):
    assert resolve_device("auto") == torch.device("cuda", 1)
    assert resolve_device("cuda") == torch.device("cuda", 1)
    assert resolve_device(torch.device("cuda")) == torch.device("cuda", 1)
    assert resolve_device("cuda:0") == torch.device("cuda", 0)  # an explicit index is kept
    assert resolve_device("cpu") == torch.device("cpu")


def test_local_rank_wraps_around_the_visible_gpus(two_gpus, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert resolve_device("auto") == torch.device("cuda", 1)


def test_realtime_patcher_builds_its_model_on_the_local_rank_gpu(two_gpus, monkeypatch):
    loaded = []

    def fake_load(checkpoint_dir, device):
        loaded.append((checkpoint_dir, torch.device(device)))
        return torch.nn.Linear(1, 1)

    monkeypatch.setattr(pretrained_module, "load_entropy_model", fake_load)  # imported at the call
    args = PatcherArgs(realtime_patching=True, entropy_model_checkpoint_dir="em")
    patcher = Patcher(args)  # what the data worker does (it never calls setup_distributed)
    assert loaded == [("em", torch.device("cuda", 1))]
    assert two_gpus == [torch.device("cuda", 1)]  # the worker's current device is its rank's
    assert isinstance(patcher.entropy_model, torch.nn.Linear)
