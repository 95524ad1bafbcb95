"""Generation and validation wait for the device only where their design needs a value.

tests/generation/device_syncs/scenarios.py runs, on a CPU-only torch with the fake-CUDA shim,
generation (a BLT's cached steps with entropy and with space patching, speculative rounds greedy
and sampled, an H-Net's cached steps, a byte LM's) with the batch's prefill, and the validation
step, on tensors tagged as ``cuda:0`` (real values, every op run), recording every host sync
(device-to-host read, blocking or pageable host-to-device copy, data-dependent shape, host tensor
meeting device tensors) at its file, line and function. Each phase must have exactly the reads
its engine's docstring documents, per byte, per round and per prefill; anything else fails,
naming file:line. Planted bugs on the per-byte path (a blocking copy, a pageable non-blocking
copy, an ``.item()``) must fail the same check at their line.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.limits import hang_limit

pytestmark = pytest.mark.slow  # two subprocesses (each ~10 s of CPU), the shim's g++ build

HERE = Path(__file__).resolve().parent / "device_syncs"
REPO = HERE.parents[2]
PLANTS = ("blocking_copy", "pageable_copy", "item")

GEN = "bytelatent/eval/generation/"
BLT = "bytelatent/archs/blt/generation.py"
HNET = "bytelatent/archs/hnet/generation.py"
SAMPLED_BYTE = (GEN + "sampling.py", "sample_rows")  # the sampled bytes, one read per step
STEP_ENTROPY = (BLT, "IncrementalBLT.step")  # entropies that decide patch starts
APPEND_ENTROPY = (BLT, "IncrementalBLT._decide_new_starts")  # the same, per append
VERIFY = (GEN + "speculative.py", "SpeculativeEngine._read_checks")  # true logits of a round
DRAFT_SAMPLE = (GEN + "speculative.py", "SpeculativeEngine._draft")  # sampled drafts' logits
BOUNDARY = (HNET, "IncrementalHNet._dechunk")  # H-Net's boundary flags, per stage
VAL_SUMS = ("bytelatent/eval/validate.py", "validation_bpb")  # the sums, once per validation


def documented(scenario: str, units: dict) -> dict[str, dict[tuple[str, str], int]]:
    """Per phase: {(file, function): reads} as the engines' docstrings state them."""
    steps = units.get("steps")
    if scenario == "blt-entropy":  # IncrementalBLT: per byte the sampled byte and the entropies
        return {"prefill": {APPEND_ENTROPY: 1}, "steps": {SAMPLED_BYTE: steps,
                                                           STEP_ENTROPY: steps}}  # fmt: skip
    if scenario in ("blt-space", "lm") or scenario.startswith("plant:"):
        return {"prefill": {}, "steps": {SAMPLED_BYTE: steps}}
    if scenario == "speculative":  # per round: each draft byte, the appends' entropies, the check
        return {"generate": {SAMPLED_BYTE: 1 + units["draft_steps"],
                             APPEND_ENTROPY: units["extends"], VERIFY: units["rounds"]}}  # fmt: skip
    if scenario == "speculative-sampled":
        return {"generate": {SAMPLED_BYTE: 1, DRAFT_SAMPLE: units["draft_steps"],
                             APPEND_ENTROPY: units["extends"], VERIFY: units["rounds"]}}  # fmt: skip
    if scenario == "hnet":  # IncrementalHNet: per byte the sampled byte, the flags of each stage
        return {"prefill": {BOUNDARY: units["prefill_stage_runs"]},
                "steps": {SAMPLED_BYTE: steps, BOUNDARY: units["stage_runs"]}}  # fmt: skip
    if scenario == "validation":
        return {"validate": {VAL_SUMS: 1}}
    raise AssertionError(f"no documented syncs for {scenario}")


def undocumented(events: list, allowed: dict[tuple[str, str], int]) -> list[str]:
    """The syncs of a phase beyond ``allowed``, one line each (file:line, what, how often), and
    any documented read that happened another number of times."""
    seen: collections.Counter = collections.Counter()
    problems = []
    for kind, file, line, function, count in events:
        if (file, function) in allowed:
            seen[(file, function)] += count
        else:
            problems.append(f"{file}:{line} ({function}): {kind} x{count}")
    for (file, function), expected in allowed.items():
        if seen[(file, function)] != expected:
            problems.append(
                f"{file} ({function}): {seen[(file, function)]} reads, documented {expected}"
            )
    return problems


def run_scenarios(shim: Path, case: dict) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    res = subprocess.run(
        [sys.executable, str(HERE / "scenarios.py"), str(shim), json.dumps(case)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=hang_limit(120),
    )  # fmt: skip
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("SYNCS ")]
    assert res.returncode == 0 and lines, f"exit {res.returncode}: {res.stderr[-3000:]}"
    return json.loads(lines[-1][len("SYNCS ") :])


@pytest.fixture(scope="module")
def traced(fake_cuda_shim) -> dict:
    return run_scenarios(fake_cuda_shim, {})


@pytest.fixture(scope="module")
def planted(fake_cuda_shim) -> dict:
    return run_scenarios(fake_cuda_shim, {"scenarios": [], "plants": list(PLANTS)})


SCENARIOS = ["blt-entropy", "blt-space", "speculative", "speculative-sampled", "hnet", "lm",
             "validation"]  # fmt: skip


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_only_the_documented_syncs(traced, scenario):
    result = traced[scenario]
    expected = documented(scenario, result["units"])
    assert set(result["phases"]) == set(expected)
    for phase, events in result["phases"].items():
        problems = undocumented(events, expected[phase])
        assert not problems, f"{scenario} {phase}: syncs beyond the documented ones:\n" + (
            "\n".join(problems)
        )


def test_the_scenarios_exercise_what_they_count(traced):
    """The counts are not vacuous: patches close and speculative rounds draft and verify."""
    spec = traced["speculative"]["units"]
    assert spec["rounds"] >= 2 and spec["draft_steps"] >= spec["rounds"], spec
    assert spec["plain_steps"] == 0, spec  # every speculative step is a draft
    hnet = traced["hnet"]["units"]
    assert hnet["steps"] < hnet["stage_runs"] <= hnet["steps"] * hnet["stages"], hnet


def _plant_line(name: str) -> str:
    text = (HERE / "plants.py").read_text().splitlines()
    line = next(i for i, t in enumerate(text, 1) if t.endswith(f"# plant: {name}"))
    return f"tests/generation/device_syncs/plants.py:{line}"


@pytest.mark.parametrize(
    ("plant", "what"),
    [
        ("blocking_copy", "blocking host-to-device copy"),
        ("pageable_copy", "from pageable memory"),
        ("item", "host read of device data"),
    ],
)
def test_a_planted_sync_fails_the_check_at_its_line(planted, plant, what):
    result = planted[f"plant:{plant}"]
    expected = documented(f"plant:{plant}", result["units"])
    problems = undocumented(result["phases"]["steps"], expected["steps"])
    at_plant = [p for p in problems if p.startswith(_plant_line(plant) + " ")]
    assert len(at_plant) == 1 and what in at_plant[0], problems
    assert at_plant[0].endswith(f"x{result['units']['steps']}"), at_plant  # once per byte
    assert problems == at_plant, problems  # nothing else: the plant is what fails
