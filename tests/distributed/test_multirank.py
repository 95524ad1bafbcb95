"""Parity under torchrun on gloo: 1 process vs FSDP, HSDP (1×2, 2×1), no_shard, TP, TP×FSDP
(LMTransformer; BLT: FSDP and TP; H-Net: TP).

Every layout must start from the single-process weights (same seed) and give the same losses
and grad norms for 5 AdamW steps in fp32. One torchrun launch runs all 2-rank scenarios; the
workers run under a timeout in their own process group so a hang cannot outlive the test.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from _parity import full_params, setup_model, train

from bytelatent.distributed.args import DistributedArgs
from tests.limits import hang_limit

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
TIMEOUT_S = hang_limit(240)


def run_torchrun(nproc: int, group: str, out: Path) -> dict:
    env = {
        **os.environ,
        "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",
    }
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(HERE / "_dist_worker.py"),
        str(out),
        group,
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=HERE,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        log, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its workers share this session
        log, _ = proc.communicate()
        pytest.fail(f"torchrun {group} timed out after {TIMEOUT_S}s:\n{log[-4000:]}")
    assert proc.returncode == 0, log[-4000:]
    return json.loads((out / "results.json").read_text())


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("two_ranks")
    return run_torchrun(2, "two", out), out


@pytest.fixture(scope="module")
def reference() -> dict[str, tuple[dict, dict]]:
    """Single-process runs on the full batch: {kind: (losses/norms, initial weights)}."""
    refs = {}
    for kind in ("lm", "blt", "hnet"):
        model = setup_model(kind, None, DistributedArgs(model_dtype="fp32"))
        init = full_params(model)
        refs[kind] = (train(model, kind), init)
    return refs


def check_parity(result: dict, init_path: Path, ref: tuple[dict, dict], atol: float) -> None:
    assert "error" not in result, result.get("error")
    expected, expected_init = ref
    init = torch.load(init_path)
    assert init.keys() == expected_init.keys()
    for name, value in expected_init.items():
        torch.testing.assert_close(init[name], value, rtol=0, atol=0, msg=name)
    np.testing.assert_allclose(result["losses"], expected["losses"], rtol=0, atol=atol)
    np.testing.assert_allclose(result["grad_norms"], expected["grad_norms"], rtol=atol * 10)


SCENARIOS = {
    # name: (model kind, per-rank [dp_rank, dp_size, tp_rank, tp_size])
    "fsdp": ("lm", [[0, 2, 0, 1], [1, 2, 0, 1]]),
    "fsdp_accum": ("lm", [[0, 2, 0, 1], [1, 2, 0, 1]]),
    "fsdp_ac_full": ("lm", [[0, 2, 0, 1], [1, 2, 0, 1]]),
    "fsdp_ac_selective": ("lm", [[0, 2, 0, 1], [1, 2, 0, 1]]),
    "hsdp_1x2": ("lm", [[0, 2, 0, 1], [1, 2, 0, 1]]),
    "hsdp_2x1": ("lm", [[0, 2, 0, 1], [1, 2, 0, 1]]),
    "no_shard": ("lm", [[0, 2, 0, 1], [1, 2, 0, 1]]),
    "tp": ("lm", [[0, 1, 0, 2], [0, 1, 1, 2]]),
    "blt_fsdp": ("blt", [[0, 2, 0, 1], [1, 2, 0, 1]]),
    "blt_tp": ("blt", [[0, 1, 0, 2], [0, 1, 1, 2]]),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_two_rank_parity(name: str, two_ranks, reference):
    results, out = two_ranks
    kind, ranks = SCENARIOS[name]
    assert results[name].get("ranks") == ranks, results[name]
    check_parity(results[name], out / f"{name}.pt", reference[kind], atol=1e-5)
    if name == "fsdp_accum":  # reduce-scatter waited for the last micro-batch
        assert results[name]["grads_before_sync"] == [False] * 5


@pytest.mark.slow
def test_bf16_params_fp32_reduce_close_to_fp32(two_ranks, reference):
    results, _ = two_ranks
    result = results["fsdp_bf16"]
    assert "error" not in result, result.get("error")
    expected = reference["lm"][0]["losses"]
    np.testing.assert_allclose(result["losses"], expected, rtol=0, atol=2e-2)
    assert not np.allclose(result["losses"], expected, rtol=0, atol=1e-6)  # bf16 was used


@pytest.mark.slow
def test_clip_mixed_dtensor_and_tensor_grads(two_ranks):
    results, _ = two_ranks
    got = results["clip_mixed"]
    gen = torch.Generator().manual_seed(7)  # the worker's gradients, as plain tensors
    params = []
    for i in range(5):
        p = torch.nn.Parameter(torch.zeros(6, 4))
        p.grad = torch.randn(6, 4, generator=gen) * (i + 1)
        params.append(p)
    expected = torch.nn.utils.clip_grad_norm_(params, max_norm=1.0)
    assert got["norm"] == pytest.approx(expected.item(), rel=1e-6)
    for clipped, p in zip(got["clipped"], params, strict=True):
        torch.testing.assert_close(torch.tensor(clipped), p.grad, rtol=1e-6, atol=1e-7)
    assert got["after"] == pytest.approx(1.0, rel=1e-5)


@pytest.mark.slow
def test_four_rank_tp_with_fsdp_and_hsdp(tmp_path: Path, reference):
    """2×2 (dp_shard × tp) and 2×1×2 (dp_replicate × dp_shard × tp) on 4 gloo processes."""
    results = run_torchrun(4, "four", tmp_path)
    layouts = {
        "tp_fsdp_2x2": [[0, 2, 0, 2], [0, 2, 1, 2], [1, 2, 0, 2], [1, 2, 1, 2]],
        "hsdp_tp_2x1x2": [[0, 2, 0, 2], [0, 2, 1, 2], [1, 2, 0, 2], [1, 2, 1, 2]],
    }
    for name, ranks in layouts.items():
        assert results[name].get("ranks") == ranks, results[name]
        check_parity(results[name], tmp_path / f"{name}.pt", reference["lm"], atol=1e-5)


@pytest.mark.slow
def test_hnet_tensor_parallel(tmp_path: Path, reference):
    """H-Net with every block split over 2 TP ranks (`HNet.tp_plan`; routing, chunking and the
    EMA replicated): the single-process losses (ratio loss included) and grad norms."""
    results = run_torchrun(2, "hnet_two", tmp_path)
    assert results["hnet_tp"].get("ranks") == [[0, 1, 0, 2], [0, 1, 1, 2]], results["hnet_tp"]
    check_parity(results["hnet_tp"], tmp_path / "hnet_tp.pt", reference["hnet"], atol=1e-5)
