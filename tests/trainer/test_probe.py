"""The probe: hooks and numbers only on probed steps, one JSONL line per probed step."""

from __future__ import annotations

import json

import torch
from torch import nn

from bytelatent.trainer.probe import build_probe


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(4, 8)
        self.outer = nn.Linear(8, 2)
        self.unused = nn.Linear(2, 2)

    def forward(self, x):
        return self.outer(torch.relu(self.inner(x)))


def hook_count(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) for m in model.modules())


def test_probe_records_stats_and_grad_norms_only_on_probe_steps(tmp_path):
    torch.manual_seed(0)
    model = Tiny()
    probe = build_probe(model, freq=3, dump_dir=str(tmp_path), rank=5)
    x = torch.randn(16, 4)
    inner_out = {}
    model.inner.register_forward_hook(lambda m, i, o: inner_out.update(o=o.detach()))
    expected_grad = {}
    for step in range(1, 7):
        probe.begin(step)
        assert hook_count(model) == (1 + 4 if step % 3 == 0 else 1)  # root + 3 children, or ours
        model.zero_grad()
        model(x).square().sum().backward()
        probe.record_grads()
        if step == 6:
            expected_grad = {
                n: p.grad.norm().item() for n, p in model.named_parameters() if p.grad is not None
            }
        probe.end()
        assert hook_count(model) == 1 and not probe.active
    lines = [json.loads(x) for x in (tmp_path / "probe" / "probe.5.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [3, 6]
    last = lines[-1]
    assert set(last["modules"]) == {"model", "inner", "outer"}  # `unused` never ran
    o = inner_out["o"]
    got = last["modules"]["inner"]
    assert abs(got["mean"] - o.mean().item()) < 1e-6 and abs(got["std"] - o.std().item()) < 1e-6
    assert abs(got["abs_max"] - o.abs().max().item()) < 1e-6
    assert set(last["grad_norm"]) == set(expected_grad)
    for name, norm in expected_grad.items():
        assert abs(last["grad_norm"][name] - norm) < 1e-5, name


def test_probe_is_off_without_probe_freq(tmp_path):
    model = Tiny()
    probe = build_probe(model, None, str(tmp_path), 0)
    for step in range(1, 4):
        probe.begin(step)
        model(torch.randn(2, 4)).sum().backward()
        probe.record_grads()
        probe.end()
    assert not probe.active and not (tmp_path / "probe").exists()
    assert not any(m._forward_hooks for m in model.modules())
