"""optim.groups: per-group lr scale and weight decay, freezing for the first N steps."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from bytelatent.errors import ConfigError
from bytelatent.trainer.args import OptimArgs
from bytelatent.trainer.optim import build_optimizer, group_label


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(4, 4)
        self.core = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.core(self.encoder(x)))


def optim_args(**kw) -> OptimArgs:
    groups = [
        {"params": "core.*", "lr_scale": 0.1, "freeze_until_step": 3},
        {"params": "head.bias", "weight_decay": 0.0},
    ]
    return OptimArgs(lr=1e-2, warmup=0, scheduler="linear", weight_decay=0.1, groups=groups, **kw)


def step(model, optimizer, scheduler) -> None:
    model(torch.randn(3, 4)).square().sum().backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)


def test_groups_scale_lr_and_weight_decay_and_the_schedule_applies_to_all():
    torch.manual_seed(0)
    model = Tiny()
    optimizer, scheduler = build_optimizer(model, optim_args(), n_steps=10, device_type="cpu")
    core, bias, default = optimizer.param_groups
    assert len(core["params"]) == 4 and len(bias["params"]) == 1 and len(default["params"]) == 3
    assert bias["weight_decay"] == 0.0 and core["weight_decay"] == default["weight_decay"] == 0.1
    lrs = [g["lr"] for g in optimizer.param_groups]
    assert lrs[0] == pytest.approx(0.1 * lrs[2]) and lrs[1] == pytest.approx(lrs[2])
    for _ in range(4):
        step(model, optimizer, scheduler)
    later = [g["lr"] for g in optimizer.param_groups]
    assert later[2] < lrs[2] and later[0] == pytest.approx(0.1 * later[2])
    assert group_label("core.1.weight", optim_args().groups) == "0:core.*"
    assert group_label("encoder.weight", optim_args().groups) == "default"


def test_frozen_group_gets_no_grads_no_state_and_no_update_until_its_step():
    torch.manual_seed(0)
    model = Tiny()
    optimizer, scheduler = build_optimizer(model, optim_args(), n_steps=10, device_type="cpu")
    core = list(model.core.parameters())
    start = [p.detach().clone() for p in core]
    for n in range(1, 4):  # steps 1..3 frozen
        assert not any(p.requires_grad for p in core)
        step(model, optimizer, scheduler)
        assert all(p.grad is None and p not in optimizer.state for p in core)
        assert all(torch.equal(p, s) for p, s in zip(core, start)), n
        assert model.encoder.weight in optimizer.state
    assert all(p.requires_grad for p in core)
    step(model, optimizer, scheduler)  # step 4 updates the group
    assert all(p in optimizer.state for p in core)
    assert not any(torch.equal(p, s) for p, s in zip(core, start))


def test_scheduler_state_restores_the_flags():
    model = Tiny()
    optimizer, scheduler = build_optimizer(model, optim_args(), n_steps=10, device_type="cpu")
    for _ in range(3):
        step(model, optimizer, scheduler)
    state = scheduler.state_dict()
    assert "freeze_until" not in state
    fresh = Tiny()
    optimizer2, scheduler2 = build_optimizer(fresh, optim_args(), n_steps=10, device_type="cpu")
    assert not fresh.core[0].weight.requires_grad
    scheduler2.prepare_resume(3)  # a checkpoint of step 3 has no state for the group yet
    assert not fresh.core[0].weight.requires_grad
    scheduler2.load_state_dict(state)
    assert fresh.core[0].weight.requires_grad
    assert scheduler2.get_last_lr() == scheduler.get_last_lr()


def test_a_group_matching_nothing_is_a_config_error():
    args = OptimArgs(groups=[{"params": "global_transformer.*"}])
    with pytest.raises(ConfigError, match=r"optim.groups\[0\].params='global_transformer.\*'"):
        build_optimizer(Tiny(), args, n_steps=10, device_type="cpu")


def test_without_groups_the_optimizer_is_one_group_as_before():
    model = Tiny()
    optimizer, _ = build_optimizer(model, OptimArgs(), n_steps=10, device_type="cpu")
    assert len(optimizer.param_groups) == 1
    assert len(optimizer.param_groups[0]["params"]) == len(list(model.parameters()))


def test_resume_takes_lr_and_weight_decay_from_the_config_not_the_checkpoint():
    model = Tiny()
    optimizer, scheduler = build_optimizer(model, optim_args(), n_steps=10, device_type="cpu")
    for _ in range(4):
        step(model, optimizer, scheduler)
    saved_optim, saved_sched = optimizer.state_dict(), scheduler.state_dict()
    same_opt, same_sched = build_optimizer(Tiny(), optim_args(), n_steps=10, device_type="cpu")
    same_opt.load_state_dict(saved_optim)
    same_sched.load_state_dict(saved_sched)
    assert [g["lr"] for g in same_opt.param_groups] == [g["lr"] for g in optimizer.param_groups]
    new_args = optim_args()
    new_args.lr, new_args.weight_decay = 2e-2, 0.05
    new_args.groups[0].lr_scale = 0.5
    fresh = Tiny()
    optimizer2, scheduler2 = build_optimizer(fresh, new_args, n_steps=10, device_type="cpu")
    optimizer2.load_state_dict(saved_optim)  # brings back the old lr and weight decay
    scheduler2.load_state_dict(saved_sched)
    factor = 1 - 5 / 10 * 0.9  # linear over 10 steps to 0.1: the factor of update 5
    core, bias, default = optimizer2.param_groups
    assert core["lr"] == pytest.approx(2e-2 * 0.5 * factor)  # the next update uses the new lr
    assert default["lr"] == pytest.approx(2e-2 * factor)
    assert (core["weight_decay"], bias["weight_decay"], default["weight_decay"]) == (
        0.05,
        0.0,
        0.05,
    )
    assert scheduler2.get_last_lr() == [g["lr"] for g in optimizer2.param_groups]


def test_a_group_that_an_earlier_group_covers_is_said_to_overlap():
    args = OptimArgs(groups=[{"params": "core.*"}, {"params": "core.0.*", "lr_scale": 0.5}])
    with pytest.raises(ConfigError) as err:
        build_optimizer(Tiny(), args, n_steps=10, device_type="cpu")
    assert str(err.value).startswith(
        "optim.groups[1].params='core.0.*' overlaps optim.groups[0].params='core.*': every "
        "parameter it matches (e.g. core.0.weight) is already in group 0"
    )


def test_logged_lr_is_the_schedules_and_each_group_is_logged_by_name():
    """`lr` is optim.lr times the schedule's factor even when the first group is scaled (it used
    to be get_last_lr()[0], the 0.1-scaled group); `lr/<group>` is each group's own."""
    torch.manual_seed(0)
    model = Tiny()
    args = optim_args()
    optimizer, scheduler = build_optimizer(model, args, n_steps=10, device_type="cpu")
    for _ in range(4):
        step(model, optimizer, scheduler)
    logged = scheduler.lr_metrics(args.lr)
    factor = 1 - 4 / 10  # linear decay to 0 over 10 steps, 4 done
    assert set(logged) == {"lr", "lr/0", "lr/1", "lr/default"}
    assert logged["lr"] == pytest.approx(args.lr * factor, rel=0.2)
    assert logged["lr"] == pytest.approx(logged["lr/default"])
    assert logged["lr/0"] == pytest.approx(0.1 * logged["lr"])  # core.*: lr_scale 0.1
    assert logged["lr/1"] == pytest.approx(logged["lr"])
    plain, plain_scheduler = build_optimizer(Tiny(), OptimArgs(lr=1e-2), 10, "cpu")
    assert set(plain_scheduler.lr_metrics(1e-2)) == {"lr"}  # no groups: one key, as before
    state = scheduler.state_dict()
    assert "group_names" not in state  # the config names the groups, not the checkpoint
