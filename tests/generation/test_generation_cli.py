"""Generation on real checkpoints: released-layout fixtures, the trained tiny BLT (DCP), the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bytelatent.data.patcher import Patcher
from bytelatent.errors import DataError
from bytelatent.eval.generation import GenerationArgs, load_generator
from bytelatent.generate import main
from tests.limits import hang_limit
from tests.paths import CONFORMANCE

REPO = Path(__file__).resolve().parents[2]
needs_fixtures = pytest.mark.conformance("blt/params.json")


@needs_fixtures
def test_released_layout_cached_equals_recompute() -> None:
    gen = load_generator(str(CONFORMANCE / "blt"))  # finds the sibling entropy_model/
    assert gen.patcher_args.patching_mode.value == "entropy"
    cases = torch.load(CONFORMANCE / "cases.pt", weights_only=True)
    assert gen.patcher_args.threshold == pytest.approx(cases[0]["threshold"])
    prompts = [case["text"][:24] for case in cases]
    args = dict(max_new_bytes=24, stop_at_eos=False)
    cached = gen.generate(prompts, GenerationArgs(**args))
    oracle = gen.generate(prompts, GenerationArgs(**args, use_cache=False))
    patcher = Patcher(gen.patcher_args, entropy_model=gen.entropy_model)
    for a, b in zip(cached, oracle):
        assert a.tokens == b.tokens and a.patch_lengths == b.patch_lengths
        lengths, _ = patcher.patch(torch.tensor([a.prompt_tokens + a.tokens]))
        assert a.patch_lengths == lengths[0].tolist()


@needs_fixtures
def test_bad_prompts_are_data_errors() -> None:
    gen = load_generator(str(CONFORMANCE / "blt"))
    with pytest.raises(DataError, match="empty"):
        gen.generate([""])
    with pytest.raises(DataError, match="at most"):
        gen.generate(["x" * gen.max_tokens])


def _cli(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "bytelatent.generate", *argv],
        cwd=REPO,
        env=env,
        capture_output=True,
        timeout=hang_limit(300),
    )


@pytest.mark.slow
def test_cli_on_trained_dcp_checkpoint(tiny_blt_run, tmp_path, capsys) -> None:
    ckpt = tiny_blt_run / "checkpoints" / "0000000020"
    prompts = tmp_path / "in.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["def f(x):", "import os"]))
    out = tmp_path / "out.jsonl"
    code = main(
        [
            f"ckpt={ckpt}",
            f"prompts_file={prompts}",
            f"output={out}",
            "max_new_bytes=20",
            "batch_size=1",
            "progress=true",
        ]
    )
    assert code == 0
    assert "2/2" in capsys.readouterr().err  # the tqdm bar, asked for with progress=true
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == ["def f(x):", "import os"]
    assert all(r["n_bytes"] <= 20 and r["finish_reason"] in ("eos", "length") for r in rows)
    # the same continuation through the subprocess CLI (stdout, UTF-8) without caches
    proc = _cli(f"ckpt={ckpt}", "prompt=def f(x):", "max_new_bytes=20", "use_cache=false")
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stdout.decode("utf-8") == rows[0]["continuation"] + "\n"


@needs_fixtures
def test_cli_ends_with_bytes_per_s_threads_and_speculative_acceptance(capsys, monkeypatch) -> None:
    from bytelatent.distributed import threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(threads, "available_cores", lambda: 3)
    before = torch.get_num_threads()
    try:
        # the released-layout fixture is slow per byte on CPU: a few bytes say it all
        argv = [f"ckpt={CONFORMANCE / 'blt'}", "prompt=The cat", "max_new_bytes=3"]
        assert main([*argv, "stop_at_eos=false"]) == 0
        out, err = capsys.readouterr()
        assert torch.get_num_threads() == 2  # the cores less one, as the trainer chooses
        last = err.strip().splitlines()[-1]
        assert last.startswith("generated ") and last.endswith(" bytes/s (2 threads)"), last
        n_bytes, seconds = int(last.split()[1]), float(last.split()[4])
        rate = float(last.split(": ")[1].split()[0])
        assert 0 < n_bytes <= 3
        # the line rounds seconds to 0.01 s and the rate to 0.1: the rate is n / s within that
        assert n_bytes / (seconds + 0.005) - 0.05 <= rate
        assert seconds <= 0.005 or rate <= n_bytes / (seconds - 0.005) + 0.05
        assert main([*argv, "stop_at_eos=false", "speculative_k=2", "num_threads=1"]) == 0
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert torch.get_num_threads() == 1 and "(1 thread); speculative acceptance " in last
        accepted, drafted = last.split("(")[-1].split()[0].split("/")
        assert 0 <= int(accepted) <= int(drafted) and int(drafted) > 0
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["ckpt=/does/not/exist", "prompt=hi"], "checkpoint error: /does/not/exist"),
        (["ckpt=/does/not/exist", "prompt="], "data error: prompt 0 is empty"),
        (["ckpt=x"], "config error: give exactly one of prompt"),
        (["ckpt=x", "prompt=a", "temprature=1"], "config error: temprature"),
    ],
)
def test_cli_bad_input_one_line(argv, message, capsys) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(message), err


@needs_fixtures
def test_cli_prompt_too_long_one_line(capsys) -> None:
    assert main([f"ckpt={CONFORMANCE / 'blt'}", "prompt=" + "a" * 600]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("data error: prompt 0 has 600 bytes"), err


@pytest.mark.slow
def test_cli_consolidated_folder_and_entropy_lm(tiny_blt_run, tiny_entropy_run, tmp_path, capsys):
    from bytelatent.checkpoint.consolidate import consolidate

    step = tiny_blt_run / "checkpoints" / "0000000020"
    consolidated = consolidate(str(step), str(tmp_path / "cons"))
    outputs = []
    for ckpt in (step, consolidated):
        assert main([f"ckpt={ckpt}", "prompt=import os", "max_new_bytes=12"]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] and outputs[0].endswith("\n")
    lm_step = tiny_entropy_run / "checkpoints" / "0000000020"
    for cache in ("true", "false"):
        argv = [f"ckpt={lm_step}", "prompt=def main():", "max_new_bytes=16", f"use_cache={cache}"]
        assert main(argv) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[2] == outputs[3] and len(outputs[2]) > 1
