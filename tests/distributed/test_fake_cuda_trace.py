"""The training step traced on fake CUDA tensors, on a CPU-only torch (no GPU needed).

A ~60-line C++ shim (fake_cuda/fake_cuda_shim.cpp, built once per test run with g++ against the
installed torch: the `fake_cuda_shim` fixture of tests/conftest.py) registers a no-op CUDA device
guard and CUDA hooks; fake_cuda/trace_step.py loads it before torch in a subprocess (one per file, forking a process per
trace), builds the model as the trainer does (meta, then
`to_empty(device="cuda")` under FakeTensorMode) and runs `Trainer.train_step` itself. Every op
checks devices, so a CPU tensor meeting CUDA ones fails, and a host read of device data (a sync on
a GPU) raises; either failure names the file and line. The planted bugs show that it does.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.limits import hang_limit
from tests.tiny import TINY_BLT_MODEL, TINY_ENTROPY_MODEL

pytestmark = pytest.mark.slow  # a subprocess per trace (and one g++ build per session)

HERE = Path(__file__).resolve().parent / "fake_cuda"
REPO = HERE.parents[2]

BLT = ["config=configs/debug.yaml", *TINY_BLT_MODEL, "data.seq_len=48", "data.batch_size=2"]
ENTROPY = ["config=configs/entropy_debug.yaml", *TINY_ENTROPY_MODEL, "data.seq_len=128",
           "data.batch_size=2"]  # fmt: skip
FLEX_BLT = [*BLT, "model.attn_impl=flex_attention"]
HNET = [
    "config=configs/hnet_debug.yaml",
    "arch_args.max_seqlen=64",
    "data.seq_len=64",
    "data.batch_size=2",
    "arch_args.dim=64",
    "arch_args.n_layers=1",
    "arch_args.multiple_of=32",
]
HNET_TWO_STAGES = (
    "arch_args.stages=[{dim: 64, n_heads: 4, n_layers_encoder: 1, "
    "n_layers_decoder: 1, sliding_window: 64, target_ratio: 2.0}, {dim: 64, "
    "n_heads: 4, n_layers_encoder: 1, n_layers_decoder: 1, sliding_window: 32, "
    "target_ratio: 2.0}]"
)
# H-Net's one documented host sync per stage and forward (docs/hnet.md, "Host syncs")
PADDED_WIDTH = "bytelatent.archs.hnet.dc.chunking:padded_width"
WINDOWS = ["model.cross_attn_window_encoder=2", "model.cross_attn_window_decoder=2"]

# (id, config dotlist, overrides): every model the trainer builds, with each attention backend
# that can trace here (sdpa, flex; xformers needs its CUDA kernels). A new architecture adds its
# tiny config here (H-Net: HNET_CASES, which also count its documented host syncs).
CASES = [
    ("blt-sdpa-fp32", BLT, ["distributed.model_dtype=fp32"]),
    ("blt-sdpa-bf16", BLT, ["distributed.model_dtype=bf16"]),
    ("blt-sdpa-windows", BLT, WINDOWS),
    ("blt-flex-fp32", FLEX_BLT, ["distributed.model_dtype=fp32"]),
    ("blt-flex-bf16-windows", FLEX_BLT, ["distributed.model_dtype=bf16", *WINDOWS]),
    ("blt-selective-ac", BLT, ["distributed.activation_checkpointing=selective"]),
    ("blt-full-ac", BLT, ["distributed.activation_checkpointing=full"]),
    ("entropy-sdpa-bf16", ENTROPY, ["distributed.model_dtype=bf16"]),
    ("entropy-flex", ENTROPY, ["entropy_model.attn_impl=flex_attention"]),
    ("entropy-selective-ac", ENTROPY, ["distributed.activation_checkpointing=selective"]),
]


# (id, config dotlist, stages): H-Net's training step; its only host read is `padded_width`,
# once per stage and micro-batch (2 micro-batches; activation checkpointing recomputes blocks only)
HNET_CASES = [
    ("hnet-1stage-bf16", [*HNET, "distributed.model_dtype=bf16"], 1),
    ("hnet-2stage-selective-ac", [*HNET, HNET_TWO_STAGES,
                                  "distributed.activation_checkpointing=selective"], 2),
]  # fmt: skip


class Tracer:
    """fake_cuda/trace_step.py serving this file's traces: one interpreter imports torch, the
    shim and the trainer, and forks a process per trace (each trace keeps a process of its own)."""

    def __init__(self, shim: Path, tmp: Path) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
        self.tmp, self.count, self.log = tmp, 0, tmp / "server.err"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, str(HERE / "trace_step.py"), str(shim), "--serve"], cwd=REPO,
                env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                start_new_session=True,
            )  # fmt: skip

    def run(
        self, argv: list[str], plant: str | None = None, host_syncs: tuple[str, ...] = ()
    ) -> subprocess.CompletedProcess:
        self.count += 1
        out, err = self.tmp / f"{self.count}.out", self.tmp / f"{self.count}.err"
        case = {"argv": argv, "plant": plant, "host_syncs": list(host_syncs),
                "out": str(out), "err": str(err)}  # fmt: skip
        try:
            self.proc.stdin.write(json.dumps(case) + "\n")
            self.proc.stdin.flush()
            ready, _, _ = select.select([self.proc.stdout], [], [], hang_limit(180))
            answer = self.proc.stdout.readline() if ready else ""
        except BrokenPipeError:  # the server is gone (an earlier trace hung or it failed)
            answer = ""
        if not answer:
            self.close()
            pytest.fail(f"the trace server gave no answer (exit {self.proc.returncode}): "
                        f"{self.log.read_text()[-3000:]}")  # fmt: skip
        rc = json.loads(answer)["rc"]
        return subprocess.CompletedProcess(argv, rc, out.read_text(), err.read_text())

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the server and a case it still runs
        self.proc.wait()


@pytest.fixture(scope="module")
def run_trace(fake_cuda_shim, tmp_path_factory):
    """`run_trace(argv, plant=None, host_syncs=())`: one traced training step (Tracer)."""
    tracer = Tracer(fake_cuda_shim, tmp_path_factory.mktemp("fake_cuda_traces"))
    yield tracer.run
    tracer.close()


def verdict(res: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("TRACE ")]
    return lines[-1] if lines else f"no verdict (exit {res.returncode}): {res.stderr[-3000:]}"


@pytest.mark.parametrize(("config", "overrides"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_the_training_step_traces_clean_on_fake_cuda(run_trace, config, overrides):
    res = run_trace([*config, *overrides])
    assert res.returncode == 0 and verdict(res).startswith("TRACE OK"), (
        verdict(res) + "\n" + res.stderr[-3000:]
    )


@pytest.mark.parametrize(("config", "stages"), [c[1:] for c in HNET_CASES],
                         ids=[c[0] for c in HNET_CASES])  # fmt: skip
def test_hnet_step_has_exactly_its_documented_host_syncs(run_trace, config, stages):
    res = run_trace(config, host_syncs=(PADDED_WIDTH,))
    line = verdict(res)
    assert res.returncode == 0 and line.startswith("TRACE OK HNet"), line + res.stderr[-3000:]
    assert line.endswith(f"host syncs {PADDED_WIDTH} x{2 * stages}"), line


def test_hnet_step_without_the_allowance_fails_at_the_sync(run_trace):
    """The allowance is what lets the H-Net trace pass: without it the sync is the failure."""
    res = run_trace(HNET)
    line = verdict(res)
    assert res.returncode == 1 and "bytelatent/archs/hnet/dc/chunking.py" in line, line
    assert "HostReadError" in line, line


def _planted_line(name: str) -> str:
    text = (HERE / "plants.py").read_text().splitlines()
    line = next(i for i, t in enumerate(text, 1) if t.endswith(f"# plant: {name}"))
    return f"tests/distributed/fake_cuda/plants.py:{line}"


@pytest.mark.parametrize(
    ("plant", "what"),
    [
        ("cpu_arange", "two devices"),  # a CPU arange in forward
        ("item", "HostReadError"),  # `.item()` in forward: a device sync
        ("cpu_tensor", "two devices"),  # a 1-element CPU tensor meets CUDA activations
    ],
)
def test_a_planted_device_bug_fails_naming_its_line(run_trace, plant, what):
    res = run_trace([*BLT, "distributed.model_dtype=bf16"], plant=plant)
    line = verdict(res)
    assert res.returncode == 1, line
    assert line.startswith(f"TRACE FAILED at {_planted_line(plant)}:") and what in line, line
