"""wandb (the real library, offline, no network) across a preemption and a resume.

The job is preempted with SIGUSR2 mid-run and started again with the same command (one process:
two torchrun runs would double the test's time; rank-0-only sinks are tested in
tests/trainer/test_metric_sinks.py, the `os._exit` path in tests/distributed/test_exit_wandb.py). wandb writes one offline folder per process start, all with the stored run id
(`wandb sync` uploads them as one run); together their history holds every step once, in order,
with the values of metrics.jsonl, and no secret-looking value is in the wandb config, config.yaml
or params.json.
"""

from __future__ import annotations

import json

import pytest
from harness import model_args, read_metrics
from test_resume import PREEMPT_AT, STEP_DELAY

from bytelatent.config.redact import REDACTED
from tests.extras import lazy_extra

lazy_extra("wandb", reason="pip install 'bytelatent[wandb]'")

SECRET = "hf_do_not_leak_0123456789"
WANDB_ENV = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", **STEP_DELAY}


@pytest.mark.slow
def test_preempted_and_resumed_run_is_one_wandb_run_with_every_step_once(runner):
    from tests.trainer.wandb_offline import offline_runs

    args = [
        *model_args("entropy", 1),
        "logging.wandb={mode: offline, tags: [ci]}",
        f"env.HF_TOKEN={SECRET}",
        f"env.MY_API_KEY={SECRET}",
    ]
    first = runner.start("run", args, env=WANDB_ENV)
    first.wait_for_step(PREEMPT_AT)
    first.signal_rank(0)
    first.wait_ok()
    stopped = read_metrics(first.dump_dir)[-1]["global_step"]
    assert PREEMPT_AT <= stopped < 20
    runner.start("run", args, env=WANDB_ENV).wait_ok()

    dump = first.dump_dir
    run_id = json.loads((dump / "wandb_run.json").read_text())["id"]
    runs = offline_runs(dump / "wandb")
    assert len(runs) == 2, [r.path for r in runs]  # one per process start
    assert {r.run_id for r in runs} == {run_id}
    assert all(r.exited for r in runs)  # wandb.finish ran on the preemption path too

    history = [row for r in runs for row in r.history]
    assert [row["_step"] for row in history] == list(range(1, 21))
    assert [row["global_step"] for row in history] == list(range(1, 21))
    expected = {m["global_step"]: m for m in read_metrics(dump)}
    for row in history:
        for key in ("loss", "bpb", "lr", "timing/steps_per_s"):
            assert row[key] == expected[row["_step"]][key], (row["_step"], key)
        for key in (k for k in expected[row["_step"]] if k.startswith("val/")):  # once eval logs
            assert row[key] == expected[row["_step"]][key], (row["_step"], key)

    for r in runs:
        assert r.config["env"]["HF_TOKEN"] == REDACTED
        assert r.config["env"]["MY_API_KEY"] == REDACTED
        assert r.config["n_params"] > 0 and r.summary["n_params"] == r.config["n_params"]
        assert SECRET not in json.dumps(r.config)
    assert SECRET not in (dump / "config.yaml").read_text()
    for params in (dump / "checkpoints").glob("*/params.json"):
        assert SECRET not in params.read_text()
