import math

import pytest
import torch

from bytelatent.trainer.args import OptimArgs
from bytelatent.trainer.optim import build_optimizer, lr_factor_fn


def factors(scheduler: str, n_steps: int = 100, **kw) -> list[float]:
    fn = lr_factor_fn(OptimArgs(scheduler=scheduler, **kw), n_steps)
    return [fn(i) for i in range(n_steps)]


@pytest.mark.parametrize("scheduler", ["constant", "linear", "inv_sqrt", "cosine", "wsd"])
def test_warmup_is_linear_and_first_step_is_not_zero(scheduler):
    f = factors(scheduler, warmup=10)
    assert f[0] == pytest.approx(0.1)
    assert f[4] == pytest.approx(0.5)
    assert f[9] == pytest.approx(1.0)


def test_cosine_ends_at_min_ratio():
    f = factors("cosine", warmup=10, lr_min_ratio=0.1)
    assert f[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(f[10:], f[11:]))  # monotone decay after warmup
    mid = 10 + (100 - 10) // 2
    assert f[mid - 1] == pytest.approx(0.1 + 0.45 * (math.cos(math.pi * 0.5) + 1), abs=0.02)


def test_linear_and_wsd_shapes():
    lin = factors("linear", warmup=0, lr_min_ratio=0.0)
    assert lin[-1] == pytest.approx(0.0, abs=1e-9)
    assert lin[49] == pytest.approx(0.5)
    wsd = factors("wsd", warmup=10, decay_fraction=0.2, lr_min_ratio=0.1)
    assert wsd[20:79] == [1.0] * 59  # stable phase
    assert wsd[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(wsd[79:], wsd[80:]))


def test_inv_sqrt_floor():
    f = factors("inv_sqrt", n_steps=10_000, warmup=100, lr_min_ratio=0.2)
    assert f[399] == pytest.approx((100 / 400) ** 0.5)
    assert min(f) == pytest.approx(0.01)  # warmup start; after warmup the floor holds
    assert min(f[100:]) >= 0.2


def test_bad_args_are_rejected():
    with pytest.raises(ValueError, match="lr_min_ratio"):
        OptimArgs(lr_min_ratio=2.0)
    with pytest.raises(ValueError):
        OptimArgs(scheduler="exponential")


def test_build_optimizer_applies_schedule():
    model = torch.nn.Linear(4, 4)
    opt, sched = build_optimizer(
        model, OptimArgs(lr=1.0, warmup=4, scheduler="constant"), 10, "cpu"
    )
    seen = []
    for _ in range(5):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0])


def test_build_optimizer_uses_fused_adamw_on_cpu_by_default():
    model = torch.nn.Linear(4, 4)
    fused, _ = build_optimizer(model, OptimArgs(), 10, "cpu")
    assert fused.param_groups[0]["fused"] and not fused.param_groups[0]["foreach"]
    foreach, _ = build_optimizer(model, OptimArgs(fused=False), 10, "cpu")
    assert not foreach.param_groups[0]["fused"] and foreach.param_groups[0]["foreach"]
    # the same update up to rounding: fused is a faster kernel, not a different optimizer
    grads = [torch.randn_like(p) for p in model.parameters()]
    results = []
    for opt in (fused, foreach):
        clone = torch.nn.Linear(4, 4)
        clone.load_state_dict(model.state_dict())
        opt.param_groups[0]["params"] = list(clone.parameters())
        for p, g in zip(clone.parameters(), grads):
            p.grad = g.clone()
        opt.step()
        results.append([p.detach().clone() for p in clone.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
