"""Retention keeps a checkpoint whose async eval is owed (failed or never ran) until it has results."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from bytelatent.checkpoint.args import CheckpointArgs
from bytelatent.checkpoint.manager import CheckpointManager
from bytelatent.eval.args import AsyncLaunchArgs
from bytelatent.launch.async_eval import AsyncEvalLauncher, results_file


def _names(path) -> list[str]:
    return sorted(p.name for p in path.iterdir())


def test_a_checkpoint_whose_eval_failed_is_kept_until_its_eval_has_results(tmp_path):
    ckpts = tmp_path / "checkpoints"
    manager = CheckpointManager(CheckpointArgs(path=str(ckpts), eval={"every": 1, "keep": 1}))
    args = SimpleNamespace(
        eval=SimpleNamespace(async_launch=AsyncLaunchArgs(mode="local")),
        dump_dir=str(tmp_path),
        name="t",
    )
    launcher = AsyncEvalLauncher.for_training(args, 0, manager)  # wires the hooks as training does
    manager.on_complete = None  # launch nothing here: step 1's eval "failed", step 2's succeeded
    model = torch.nn.Linear(2, 2)
    for step in (1, 2, 3):
        manager.save(step, model, None, train_state={}, kind="eval")
        if step == 2:
            results_file(tmp_path, 2).parent.mkdir(parents=True)
            results_file(tmp_path, 2).write_text("{}")
    assert _names(ckpts) == [f"{1:010d}", f"{3:010d}"]  # 1 is owed its eval; 2 is done with
    assert "eval is owed" in launcher.retention_hold(1, str(ckpts / f"{1:010d}"), ["eval"])
    results_file(tmp_path, 1).parent.mkdir(parents=True)
    results_file(tmp_path, 1).write_text("{}")  # e.g. relaunched by launch_owed on a restart
    manager.retain()
    assert _names(ckpts) == [f"{3:010d}"]
