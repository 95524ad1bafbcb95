"""One device trains through the FSDP2 path as N devices do (`distributed.single_device_fsdp`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from bytelatent.distributed.args import DistributedArgs
from bytelatent.distributed.mesh import build_mesh
from tests.limits import hang_limit

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def test_default_is_fsdp_on_cuda_only():
    args = DistributedArgs()
    assert args.use_single_device_fsdp("cuda") and not args.use_single_device_fsdp("cpu")
    assert DistributedArgs(single_device_fsdp=True).use_single_device_fsdp("cpu")
    assert not DistributedArgs(single_device_fsdp=False).use_single_device_fsdp("cuda")


def test_no_process_group_no_mesh():
    """A tool that built no process group still gets the plain model (no crash)."""
    assert build_mesh(DistributedArgs(single_device_fsdp=True), 1, "cpu") is None


def run_single(*dtypes: str) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{HERE}", "OMP_NUM_THREADS": "1",
           "CUDA_VISIBLE_DEVICES": ""}  # fmt: skip
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    res = subprocess.run([sys.executable, str(HERE / "_single_device.py"), *dtypes], cwd=HERE,
                         env=env, capture_output=True, text=True, timeout=hang_limit(240))  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_one_device_fsdp_matches_the_single_process_reference_in_fp32():
    from _parity import setup_model, train

    expected = train(setup_model("lm", None, DistributedArgs(model_dtype="fp32")), "lm")
    got = run_single("fp32")["fp32"]
    np.testing.assert_allclose(got["losses"], expected["losses"], rtol=0, atol=1e-5)


@pytest.mark.slow
def test_one_device_bf16_matches_two_ranks_bf16():
    """1 and 2 ranks share the numerics (bf16 gathered params, fp32 reduce): the first forward is
    bitwise the same; later steps differ by how bf16 gradients are summed (1 vs 2 partial sums)."""
    from test_multirank import run_torchrun

    got = run_single("bf16")["bf16"]["losses"]
    with tempfile.TemporaryDirectory() as tmp:
        two = run_torchrun(2, "two", Path(tmp))["fsdp_bf16"]["losses"]
    assert got[0] == two[0]
    np.testing.assert_allclose(got, two, rtol=0, atol=1e-2)
