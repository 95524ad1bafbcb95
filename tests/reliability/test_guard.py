"""Non-finite guard: skipped updates are exact no-ops, good ones are bitwise unchanged, and the
nonfinite_stop action ends a diverging run without saving non-finite weights."""

from __future__ import annotations

import copy

import pytest
import torch

from bytelatent.trainer.actions import (
    NONFINITE_EXIT_CODE,
    Actions,
    NonFiniteStop,
    NonFiniteStopArgs,
    with_nonfinite_stop,
)
from bytelatent.trainer.guard import NonFiniteGuard


def _model_and_optimizer(fused: bool):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=1e-2, weight_decay=0.1, fused=fused, foreach=None if fused else True
    )
    return model, optimizer


def _backward(model, x, poison: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    loss = model(x).square().sum()
    if poison is not None:
        loss = loss * poison
    loss.backward()
    norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    return loss.detach().double(), norm


def _snapshot(model, optimizer):
    return copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())


def _equal_states(a, b) -> bool:
    (ma, oa), (mb, ob) = a, b
    if any(not torch.equal(ma[k], mb[k]) for k in ma):
        return False
    for key, state in oa["state"].items():
        for name, value in state.items():
            if not torch.equal(torch.as_tensor(value), torch.as_tensor(ob["state"][key][name])):
                return False
    return True


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_good_steps_bitwise_and_bad_steps_are_noops(fused: bool) -> None:
    plain, plain_opt = _model_and_optimizer(fused)
    guarded, guarded_opt = _model_and_optimizer(fused)
    guard = NonFiniteGuard(guarded_opt, torch.device("cpu"))
    xs = [torch.randn(4, 6, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    for i, x in enumerate(xs):
        _backward(plain, x)
        plain_opt.step()
        plain_opt.zero_grad()
        guard.step(*_backward(guarded, x))
        guarded_opt.zero_grad()
        if i == 1:  # a poisoned step in the guarded run only: skipped without a trace
            before = _snapshot(guarded, guarded_opt)
            guard.step(*_backward(guarded, x, poison=float("nan")))
            guarded_opt.zero_grad()
            assert _equal_states(before, _snapshot(guarded, guarded_opt))
            assert guard.read() == {
                "skipped_steps": 1,
                "skipped_streak": 1,
                "nonfinite": "loss and grad_norm",
            }
    assert _equal_states(_snapshot(plain, plain_opt), _snapshot(guarded, guarded_opt))
    assert guard.read() == {"skipped_steps": 0, "skipped_streak": 0}


def test_streak_counts_consecutive_skips_and_names_the_culprit() -> None:
    model, optimizer = _model_and_optimizer(False)
    guard = NonFiniteGuard(optimizer, torch.device("cpu"))
    finite_norm = torch.tensor(1.0)
    for _ in range(3):
        guard.step(torch.tensor(float("inf"), dtype=torch.float64), finite_norm)
    assert guard.read() == {"skipped_steps": 3, "skipped_streak": 3, "nonfinite": "loss"}
    guard.step(torch.tensor(1.0, dtype=torch.float64), torch.tensor(float("nan")))
    assert guard.read()["nonfinite"] == "grad_norm"
    assert not guard.safe_to_save(model, step=4)
    loss, norm = _backward(model, torch.randn(2, 6))
    guard.step(loss, norm)
    assert guard.read() == {"skipped_steps": 0, "skipped_streak": 0}
    assert guard.safe_to_save(model, step=5)
    with torch.no_grad():
        model[0].weight[0, 0] = float("nan")
    assert not guard.safe_to_save(model, step=6)


def test_nonfinite_stop_action() -> None:
    action = NonFiniteStop(NonFiniteStopArgs(max_skipped_steps=3))
    assert action.run(10, {"skipped_streak": 2, "nonfinite": "loss"}) is None
    stop = action.run(12, {"skipped_streak": 3, "nonfinite": "loss and grad_norm"})
    assert stop is not None and not stop.save and stop.exit_code == NONFINITE_EXIT_CODE
    assert "step 12" in stop.reason and "steps 10-12" in stop.reason
    assert "loss and grad_norm were non-finite" in stop.reason


def test_nonfinite_right_after_a_resume_points_at_the_checkpoint() -> None:
    actions = Actions.build(with_nonfinite_stop([], 3))
    actions.note_resume("ck/0000000100", 100)
    stop = actions.run(103, {"skipped_streak": 3, "nonfinite": "loss"})  # steps 101-103
    assert "resuming from ck/0000000100" in stop.reason and "may be damaged" in stop.reason
    assert "python -m bytelatent.checkpoint verify ck/0000000100" in stop.reason
    later = actions.run(110, {"skipped_streak": 3, "nonfinite": "loss"})  # steps 108-110
    assert "may be damaged" not in later.reason and "lower optim.lr" in later.reason


def test_action_is_added_from_max_skipped_steps_once() -> None:
    assert [a.kind for a in with_nonfinite_stop([], 5)] == ["nonfinite_stop"]
    assert with_nonfinite_stop([], 0) == []
    configured = [NonFiniteStopArgs(max_skipped_steps=2)]
    assert with_nonfinite_stop(configured, 5) == configured
    actions = Actions.build(with_nonfinite_stop([], 4))
    assert actions.run(8, {"skipped_streak": 4, "nonfinite": "loss"}).exit_code == 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (fused AdamW found_inf path)")
def test_cuda_guard_step_never_syncs_with_the_host() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    guard = NonFiniteGuard(optimizer, torch.device("cuda"))
    for poison in (None, float("nan"), None):
        loss, norm = _backward(model, torch.randn(4, 16, device="cuda"), poison)
        before = [p.detach().clone() for p in model.parameters()]
        torch.cuda.set_sync_debug_mode("error")  # any host sync inside raises
        try:
            guard.step(loss, norm)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        optimizer.zero_grad()
        unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        assert unchanged == (poison is not None)
    assert guard.read() == {"skipped_steps": 1, "skipped_streak": 0}
