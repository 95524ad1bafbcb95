"""The profiler window: off means no object; on, it traces exactly its steps and always writes."""

from __future__ import annotations

import json

import torch

from bytelatent.trainer.args import ProfilerArgs
from bytelatent.trainer.profiling import build_profiler


def test_off_builds_nothing(tmp_path):
    off = build_profiler(ProfilerArgs(), str(tmp_path), 0, torch.device("cpu"))
    for _ in range(10):  # past the default window (steps 3-4)
        off.step_done()
    off.close()
    assert not (tmp_path / "profiling").exists()


def _trace_names(path) -> set[str]:
    return {e.get("name") for e in json.loads(path.read_text())["traceEvents"]}


def test_window_traces_its_steps_and_a_short_run_still_writes(tmp_path):
    model = torch.nn.Linear(8, 8)
    args = ProfilerArgs(run=True, start_step=2, active_steps=2)
    prof = build_profiler(args, str(tmp_path), 3, torch.device("cpu"))

    def step(op, profiler=prof) -> None:
        op(model(torch.randn(4, 8))).sum().backward()
        profiler.step_done()

    step(torch.sigmoid)  # step 1: warm-up, outside the window
    step(torch.tanh)  # steps 2 and 3: traced
    assert not prof.trace_path.exists()
    step(torch.tanh)
    assert prof.trace_path == tmp_path / "profiling" / "trace_steps2-3.rank3.json"
    names = _trace_names(prof.trace_path)
    assert {"aten::addmm", "aten::tanh"} <= names and "aten::sigmoid" not in names
    step(torch.relu)  # after the window: not traced, the file is not rewritten
    assert "aten::relu" not in _trace_names(prof.trace_path)

    short = build_profiler(args, str(tmp_path / "short"), 0, torch.device("cpu"))
    step(torch.sigmoid, short)
    step(torch.tanh, short)  # the run ends inside the window
    short.close()
    assert "aten::tanh" in _trace_names(short.trace_path)
