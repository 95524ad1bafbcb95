"""bench/gpu/check.py runs on CPU (`--device cpu --quick`) so it cannot rot before a GPU is lent."""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.limits import hang_limit

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench" / "gpu"))

import check  # noqa: E402


@pytest.mark.slow
def test_quick_check_on_cpu(tmp_path):
    """The CPU run passes within its budget (the default, scaled for a busy machine like every
    limit in tests) and says what the budget was."""
    out = tmp_path / "out"
    budget = hang_limit(check.DEFAULT_QUICK_BUDGET_S)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    res = subprocess.run(
        [sys.executable, "bench/gpu/check.py", "--device", "cpu", "--quick", "--out", str(out),
         "--work", str(tmp_path / "work"), "--budget", str(budget)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=budget + hang_limit(60),
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["budget_s"] == budget
    assert f"budget {budget:.0f} s" in res.stdout
    assert sum(v for v in summary["limits_s"].values() if v is not None) <= budget
    assert sum(s.get("seconds", 0) for s in summary["steps"]) <= budget
    assert "single_device_fsdp" not in summary  # CPU: no NCCL probe, nothing changed
    statuses = {s["step"]: s["status"] for s in summary["steps"]}
    assert list(statuses) == [name for name, _, _ in check.STEPS]
    assert statuses.pop("throughput_compiled") == "skip"  # inductor runs on the GPU only
    assert set(statuses.values()) == {"ok"}, summary
    assert len(list(out.iterdir())) <= check.MAX_OUT_FILES
    attention = next(s for s in summary["steps"] if s["step"] == "attention")
    assert attention["cases"] >= 16 and attention["worst_rel_err"]["float32"] < 1e-4
    blt = next(s for s in summary["steps"] if s["step"] == "blt_1b")
    assert blt["warmup_steps"] >= 2 and blt["timed_steps"] >= 5
    assert blt["activation_checkpointing"] == "none" and blt["batch_size"] == 4  # the config's
    assert 0 < blt["mfu"] and 0 < blt["hfu"]  # two numbers, stated apart
    assert f"MFU {blt['mfu']:.2%}" in res.stdout and f"HFU {blt['hfu']:.2%}" in res.stdout
    hnet = next(s for s in summary["steps"] if s["step"] == "hnet_flex")
    assert hnet["distinct_widths"] > 1 and 1 <= hnet["flex_graphs_compiled"] <= 8


def test_a_step_that_overruns_is_recorded_as_timeout(tmp_path, monkeypatch):
    """The driver records what a killed step could not; the summary still lists every step."""
    import steps

    def sleeps(*args, **kwargs):  # the forked step (a copy of this process) overruns for sure
        time.sleep(60)

    monkeypatch.setattr(steps, "run", sleeps)
    # 0.5 s of a budget long enough that the driver's imports never spend it
    monkeypatch.setattr(check, "STEPS", [("env", 0.5 / hang_limit(60), 0.5 / hang_limit(60))])
    code = check.main(
        ["--device", "cpu", "--quick", "--out", str(tmp_path), "--work", str(tmp_path),
         "--budget", str(hang_limit(60))]
    )  # fmt: skip
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert code == 1
    assert [(s["step"], s["status"]) for s in summary["steps"]] == [("env", "timeout")]


def test_record_appends_atomically(tmp_path):
    check.record(tmp_path, {"step": "a", "status": "ok"})
    check.record(tmp_path, {"step": "b", "status": "skip", "reason": "r"})
    steps = json.loads((tmp_path / "summary.json").read_text())["steps"]
    assert [s["step"] for s in steps] == ["a", "b"]
    assert not (tmp_path / "summary.tmp").exists()


@pytest.mark.parametrize("quick", [False, True])
def test_step_limits_are_shares_of_the_budget(quick):
    """The limits (and, on a GPU, the NCCL probe's) add up to at most the budget, whatever it is;
    the default budget leaves a 10-minute device call time to spare."""
    assert check.DEFAULT_BUDGET_S <= 420
    for budget in (check.DEFAULT_BUDGET_S, check.DEFAULT_QUICK_BUDGET_S, 50.0):
        limits = check.step_limits(budget, quick)
        assert list(limits) == [name for name, _, _ in check.STEPS]
        probe = 0.0 if quick else check.PROBE_SHARE * budget
        assert sum(v for v in limits.values() if v is not None) + probe <= budget + 1e-9
        assert all(v is None or v > 0 for v in limits.values())
    assert check.step_limits(100.0, True)["throughput_compiled"] is None


def test_summary_table_names_the_budget():
    summary = {
        "device": "cuda", "quick": False, "budget_s": 400.0,
        "limits_s": {"env": 16.0}, "single_device_fsdp": {"nccl_probe": "no", "fallback": "off"},
        "steps": [{"step": "env", "status": "ok", "seconds": 3.5}],
    }  # fmt: skip
    table = check.summary_table(summary)
    assert table.splitlines()[0].startswith("budget 400 s")
    assert "single-device FSDP off: no" in table
    assert "3.5/   16 s" in table and table.splitlines()[-1].endswith("3.5/  400 s")


def _probe_failing(log, limit):
    return "1-rank NCCL group did not start (exit code 1): ncclSystemError"


def test_nccl_probe_decides_single_device_fsdp(tmp_path):
    """On CUDA a failed probe turns single-device FSDP off for every step (with the reason); a
    passing one changes nothing; on CPU (gloo) the probe is not run."""
    calls = []

    def passing(log, limit):
        calls.append(limit)

    cuda = argparse.Namespace(device="cuda")
    note = check.resolve_fsdp(cuda, None, 24.0, probe=_probe_failing)
    assert cuda.no_fsdp is True
    assert "ncclSystemError" in note["nccl_probe"]
    assert "single_device_fsdp=false" in note["fallback"]
    cuda = argparse.Namespace(device="cuda")
    assert check.resolve_fsdp(cuda, None, 24.0, probe=passing)["nccl_probe"] == "ok"
    assert cuda.no_fsdp is False and calls == [24.0]
    cpu = argparse.Namespace(device="cpu")
    assert check.resolve_fsdp(cpu, None, 24.0, probe=passing) is None
    assert cpu.no_fsdp is False and calls == [24.0]


def test_failed_probe_reaches_every_step_and_the_summary(tmp_path, monkeypatch, capsys):
    import steps

    monkeypatch.setattr(check, "probe_nccl", _probe_failing)
    monkeypatch.setattr(steps, "run", lambda name, **kw: {"no_fsdp": kw["no_fsdp"]})
    monkeypatch.setattr(check, "STEPS", [("env", 0.3, 0.3), ("train_step", 0.3, 0.3)])
    code = check.main(
        ["--device", "cuda", "--out", str(tmp_path), "--work", str(tmp_path),
         "--budget", str(hang_limit(60))]
    )  # fmt: skip
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert code == 0
    assert "fallback" in summary["single_device_fsdp"]
    assert [s["no_fsdp"] for s in summary["steps"]] == [True, True]
    assert "single-device FSDP off" in capsys.readouterr().out


def test_fsdp_fallback_rewrites_the_trainer_arguments(tmp_path):
    import steps

    argv = ["config=x.yaml", "distributed.single_device_fsdp=true", "data.batch_size=2"]
    ctx = steps.Ctx("cuda", False, tmp_path, tmp_path, no_fsdp=True)
    assert steps.fsdp_argv(ctx, argv) == [
        "config=x.yaml", "data.batch_size=2", "distributed.single_device_fsdp=false"
    ]  # fmt: skip
    assert steps.fsdp_argv(steps.Ctx("cuda", False, tmp_path, tmp_path), argv) == argv
    with pytest.raises(steps.Skip, match="NCCL"):
        steps.step_fsdp_dcp(ctx)


def test_compile_watch_fails_a_call_that_ran_uncompiled():
    """Past the recompile limit dynamo would run the function eagerly and say nothing: the watch
    raises the limit, times each compile, and lists a call that ran uncompiled."""
    import steps
    import torch

    fn = torch.compile(lambda x: x * 2 + 1, backend="eager", dynamic=False)
    with steps.CompileWatch(limit=2) as watch:
        for n in (3, 4):
            with watch.call(f"n={n}"):
                fn(torch.ones(n))
        with pytest.raises(steps.CheckFailed, match="n=5"), watch.call("n=5"):
            fn(torch.ones(5))
    assert [c["case"] for c in watch.compiles] == ["n=3", "n=4"]
    assert len(watch.uncompiled) == 1 and watch.uncompiled[0].startswith("n=5")
    with steps.CompileWatch(limit=16) as watch:
        for n in (6, 7, 8, 9):
            with watch.call(f"n={n}"):
                fn(torch.ones(n))
        with watch.call("again"):  # a cache hit: no compile, not uncompiled
            fn(torch.ones(6))
    assert len(watch.compiles) == 4 and not watch.uncompiled
    assert all(c["seconds"] >= 0 and c["frames"] == 1 for c in watch.compiles)


def test_default_timing_runs_without_the_deterministic_workspace(tmp_path, monkeypatch):
    """The deterministic step's default-mode run is timed in a child without
    CUBLAS_WORKSPACE_CONFIG (set by the deterministic runs of the same process)."""
    import steps

    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    ctx = steps.Ctx("cpu", True, tmp_path, tmp_path)
    seen = steps._in_clean_child(ctx, lambda: os.environ.get("CUBLAS_WORKSPACE_CONFIG", "unset"))
    assert seen == "unset"
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"


def test_summary_states_mfu_and_hfu_apart():
    """MFU (analytic model FLOPs) and HFU (counted FLOPs) each get a line naming the peak."""
    step = {"step": "blt_1b", "status": "ok", "seconds": 9.0, "mfu": 0.4123, "hfu": 0.4871,
            "matmul_tflops": {"n": 8192, "dtype": "bfloat16", "tflops": 700.0}}  # fmt: skip
    summary = {"device": "cuda", "quick": False, "budget_s": 400.0, "limits_s": {},
               "steps": [step]}  # fmt: skip
    lines = check.summary_table(summary).splitlines()
    mfu = next(line for line in lines if line.startswith("MFU"))
    hfu = next(line for line in lines if line.startswith("HFU"))
    assert "41.23%" in mfu and "analytic" in mfu and "700.0 TFLOP/s" in mfu
    assert "48.71%" in hfu and "FlopCounterMode" in hfu
    failed = {**summary, "steps": [{"step": "blt_1b", "status": "fail", "seconds": 1.0}]}
    assert not any(
        line.startswith(("MFU", "HFU")) for line in check.summary_table(failed).splitlines()
    )


def test_entropy_like_patch_lengths_cover_each_row():
    """Rows sum to L + 1, first patch 1, mean near the asked one, within the patch columns."""
    import numpy as np
    import steps

    from bytelatent.data.batch import Batch

    x = np.zeros((3, 400), dtype=np.int64)
    batch = Batch(x, x, np.ones_like(x, dtype=bool), np.zeros((3, 100), dtype=np.int64))
    lengths = steps.entropy_like(batch, 4.0, seed=0).patch_lengths
    assert lengths.shape == (3, 100)
    assert (lengths.sum(1) == 401).all() and (lengths[:, 0] == 1).all()
    used = lengths > 0
    assert 3.0 < lengths[used].mean() < 5.0 and len(set(lengths[used].tolist())) > 5


def test_host_syncs_names_the_op_and_the_repo_caller(monkeypatch):
    """`host_syncs` attributes a sync warning raised inside an op to that op and to the first
    frame of this repository (CPU: a Python op stands in for a CUDA kernel that syncs)."""
    import steps
    import torch

    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda mode: None)
    lib = torch.library.Library("bytelatent_test_sync", "DEF")
    lib.define("syncing(Tensor x) -> Tensor")

    def syncing(x):
        import warnings

        warnings.warn("called a synchronizing CUDA operation", stacklevel=1)
        return x.clone()

    lib.impl("syncing", syncing, "CPU")
    x = torch.ones(3)
    sites = steps.host_syncs(lambda: torch.ops.bytelatent_test_sync.syncing(x) + x.sum())
    assert len(sites) == 1 and sum(sites.values()) == 1, sites
    (site,) = sites
    assert "tests/bench/test_gpu_check.py" in site and "bytelatent_test_sync.syncing" in site
    assert steps.host_syncs(lambda: x * 2) == {}


def test_prepare_carries_every_dependency_the_device_image_lacks():
    """The lent machine's image has torch, numpy, PyYAML, pyarrow and fsspec (device KINDS.md);
    every other module of install_requires must be among prepare.sh's wheels (the first GPU
    run lost 8 of 11 steps to a missing zstandard)."""
    import re

    import bytelatent

    on_image = {"torch", "numpy", "yaml", "pyarrow", "fsspec"}
    text = (REPO / "bench" / "gpu" / "prepare.sh").read_text()
    block = re.search(r"WHEELS=\((.*?)\)", text, re.S).group(1)
    carried = {line.split("==")[0].strip().lower().replace("-", "_") for line in block.split()}
    missing = set(bytelatent.REQUIRED_MODULES) - on_image - carried
    assert not missing, f"prepare.sh does not carry {sorted(missing)}"
