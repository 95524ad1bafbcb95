"""Train states keep this rank's CUDA RNG only, so a resume with fewer visible GPUs works."""

import logging

import pytest
import torch

from bytelatent.trainer import state as state_mod


class FakeCuda:
    """torch.cuda on a host with `count` GPUs, this process on `current`; *_all are forbidden."""

    def __init__(self, count: int, current: int):
        self.count, self.current = count, current
        self.states = {i: torch.full((16,), i, dtype=torch.uint8) for i in range(count)}

    def is_available(self):
        return True

    def current_device(self):
        return self.current

    def get_rng_state(self, device=None):
        return self.states[self.current if device is None else device].clone()

    def set_rng_state(self, new_state, device=None):
        index = self.current if device is None else device
        assert index < self.count, f"cuda:{index} is not visible"
        self.states[index] = new_state.clone()

    def get_rng_state_all(self):
        raise AssertionError("saved every visible GPU's RNG")

    def set_rng_state_all(self, states):
        if len(states) > self.count:
            raise RuntimeError("invalid device ordinal")  # what torch does with fewer GPUs
        raise AssertionError("restored every GPU's RNG")


@pytest.fixture
def fake_cuda(monkeypatch):
    def install(count, current):
        fake = FakeCuda(count, current)
        monkeypatch.setattr(state_mod.torch, "cuda", fake)
        return fake

    yield install


def test_capture_saves_this_ranks_device_only(fake_cuda):
    fake = fake_cuda(count=8, current=3)
    saved = state_mod.capture_rng_state()
    assert "torch_cuda" not in saved
    assert torch.equal(state_mod._b64_to_tensor(saved["torch_cuda_device"]), fake.states[3])


def test_restore_on_a_host_with_fewer_gpus(fake_cuda):
    fake = fake_cuda(count=8, current=1)
    fake.states[1] = torch.full((16,), 42, dtype=torch.uint8)
    saved = state_mod.capture_rng_state()
    resumed = fake_cuda(count=2, current=1)  # the resume sees 2 GPUs
    state_mod.restore_rng_state(saved)
    assert torch.equal(resumed.states[1], torch.full((16,), 42, dtype=torch.uint8))


def test_old_states_with_every_gpu_still_load(fake_cuda, caplog):
    fake = fake_cuda(count=2, current=1)
    saved = state_mod.capture_rng_state()
    del saved["torch_cuda_device"]
    saved["torch_cuda"] = [
        state_mod._tensor_to_b64(torch.full((16,), i + 10, dtype=torch.uint8)) for i in range(4)
    ]  # written on a host with 4 GPUs
    state_mod.restore_rng_state(saved)
    assert torch.equal(fake.states[1], torch.full((16,), 11, dtype=torch.uint8))
    far = fake_cuda(count=8, current=6)  # this rank's device had no entry then
    with caplog.at_level(logging.WARNING, logger="bytelatent"):
        state_mod.restore_rng_state(saved)
    assert "none for cuda:6" in caplog.text
    assert torch.equal(far.states[6], torch.full((16,), 6, dtype=torch.uint8))
