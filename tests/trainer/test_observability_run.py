"""One tiny run with the profiler, the probe, checkpoint.steps and the timing metrics on."""

from __future__ import annotations

import json
import re

import pytest

from tests.trainer.test_cli import TINY_ENTROPY, metrics, run_cli


def complete_steps(dump) -> list[int]:
    folders = (dump / "checkpoints").iterdir()
    return sorted(int(f.name) for f in folders if (f / ".complete").exists())


@pytest.mark.slow
def test_profiler_probe_checkpoint_steps_and_timings(tmp_path, corpus_root):
    dump = tmp_path / "run"
    argv = [
        *TINY_ENTROPY,
        f"dump_dir={dump}",
        f"data.root_dir={corpus_root}",
        "steps=8",
        "logging.freq=2",
        "profiling.run=true",
        "profiling.start_step=3",
        "profiling.active_steps=2",
        "probe_freq=4",
        "checkpoint.steps=[3]",
        "checkpoint.dump.every=4",
        "checkpoint.dump.keep=1",
    ]
    res = run_cli("bytelatent.train", argv)
    assert res.returncode == 0, res.stderr[-3000:]

    trace = json.loads((dump / "profiling" / "trace_steps3-4.rank0.json").read_text())
    names = {event.get("name") for event in trace["traceEvents"]}
    assert {"aten::mm", "aten::embedding"} <= names, sorted(n for n in names if n)[:50]

    probe = [
        json.loads(line) for line in (dump / "probe" / "probe.0.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in probe] == [4, 8]
    assert {"model", "tok_embeddings", "layers.0.attention.wq", "output"} <= set(
        probe[0]["modules"]
    )
    assert "tok_embeddings.weight" in probe[0]["grad_norm"]
    assert all(v > 0 for v in probe[0]["grad_norm"].values())

    # Step 3 was asked for explicitly and survives retention (dump.keep=1 retired step 4).
    assert complete_steps(dump) == [3, 8]
    marker = json.loads((dump / "checkpoints" / f"{3:010d}" / ".complete").read_text())
    assert marker["kinds"] == ["step"]

    rows = metrics(dump)
    assert [r["global_step"] for r in rows] == [2, 4, 6, 8]
    assert rows[0]["timing/init_or_restore_s"] > 0 and rows[0]["timing/first_step_s"] > 0
    assert "timing/init_or_restore_s" not in rows[1]  # reported once
    assert rows[1]["timing/checkpoint_save_s"] > 0  # the step-3 save, reported at step 4
    assert all(r["timing/steps_per_s"] > 0 for r in rows)

    # Saves are logged with their time, and the run ends with one summary line (issue 33).
    log = (dump / "train.log").read_text()
    for step in (3, 4, 8):
        assert f"saved checkpoint {dump / 'checkpoints' / f'{step:010d}'} (" in log, log[-2000:]
    assert re.search(r"saved checkpoint \S+ \(step\) in \d+\.\d s", log), log[-2000:]
    last = log.strip().splitlines()[-1]
    final = rows[-1]
    assert last.endswith(
        f"done: 8 steps (8 in this process), loss {final['loss']:.4f}, bpb {final['bpb']:.4f}; "
        f"checkpoint {dump / 'checkpoints' / f'{8:010d}'}"
    ), last
    # Each start-up phase says what it does as it starts (issue 33): no silent phase.
    assert log.index("building the entropy model ...") < log.index("starting the data loader ...")
