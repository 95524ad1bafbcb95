"""Issue 38, item 8: one line instead of a traceback for a prompt that is not UTF-8
(`python -m bytelatent.generate`) and for a damaged `done.json` / `threshold.json` of
`python -m apps.compare` (a cached NaN or negative threshold is refused, not used)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from apps.compare.__main__ import main as compare_main
from apps.compare.args import CompareArgs
from apps.compare.runs import DONE, Job, pick_threshold
from bytelatent.archs.lm.model import LMTransformer
from bytelatent.checkpoint.args import CheckpointArgs
from bytelatent.checkpoint.manager import CheckpointManager
from bytelatent.config import parse_args
from bytelatent.errors import UserError
from bytelatent.generate import main as generate_cli
from bytelatent.model.args import LMTransformerArgs
from tests.apps.test_compare import QUICK as CONFIG
from tests.limits import hang_limit
from tests.paths import REPO

ARGS = {"dim": 16, "n_layers": 1, "n_heads": 2, "max_seqlen": 16}


@pytest.fixture
def lm_folder(tmp_path) -> str:
    torch.manual_seed(0)
    model = LMTransformer(LMTransformerArgs(**ARGS))
    model.init_weights()
    manager = CheckpointManager(CheckpointArgs(path=str(tmp_path / "ck")))
    params = {"train_entropy_model": True, "entropy_model": ARGS}
    return manager.save(1, model, torch.optim.AdamW(model.parameters()), {"step": 1}, params)


@pytest.mark.parametrize(
    ("prompt", "bad"),
    [("ab\udcffc", "byte 0xff at character 2"),  # b"ab\xffc" on the command line
     ("a\ud800", "U+D800 at character 1")],  # a lone surrogate
)  # fmt: skip
def test_a_prompt_that_is_not_utf8_is_one_line(lm_folder, capsys, prompt, bad):
    assert generate_cli([f"ckpt={lm_folder}", f"prompt={prompt}", "max_new_bytes=2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"data error: prompt 0 is not valid UTF-8 ({bad}); pass UTF-8 text"]


def test_a_prompts_file_that_is_not_utf8_is_one_line(lm_folder, tmp_path, capsys):
    bad_bytes = tmp_path / "bytes.jsonl"
    bad_bytes.write_bytes(b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n')
    surrogate = tmp_path / "surrogate.jsonl"
    surrogate.write_text('{"prompt": "ok"}\n{"prompt": "a\\udc80"}\n')
    for path, says in [(bad_bytes, f"data error: {bad_bytes}:2: invalid UTF-8 at byte 15"),
                       (surrogate, "data error: prompt 1 is not valid UTF-8 (byte 0x80 at")]:  # fmt: skip
        assert generate_cli([f"ckpt={lm_folder}", f"prompts_file={path}"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(says), err


@pytest.mark.slow
def test_generate_with_raw_bytes_on_the_command_line(lm_folder):
    """What the shell hands over: bytes that are not UTF-8 in argv (`prompt=$'\\xff'`)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    res = subprocess.run(
        [sys.executable, "-m", "bytelatent.generate", f"ckpt={lm_folder}", b"prompt=ab\xffc"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=hang_limit(120),
    )  # fmt: skip
    assert res.returncode == 2, res.stderr[-2000:]
    assert res.stderr.strip().splitlines() == [
        "data error: prompt 0 is not valid UTF-8 (byte 0xff at character 2); pass UTF-8 text"
    ]


@pytest.mark.parametrize(
    ("content", "says"),
    [("{", "unreadable"), ("[]", "damaged (no 'argv')"), ('{"argv": []}', "damaged (no 'wall_s')"),
     ('{"argv": ["x"], "wall_s": NaN}', "damaged (wall_s=nan)")],
)  # fmt: skip
def test_a_damaged_done_json_is_one_line(tmp_path, content, says):
    (tmp_path / DONE).write_text(content)
    with pytest.raises(UserError) as info:
        Job("blt", 0.001, 0, tmp_path, ["x"]).done()
    assert str(info.value).startswith(f"{tmp_path / DONE}: {says}"), str(info.value)
    assert str(info.value).endswith("; delete it to train blt lr=0.001 seed=0 again")


def _compare_args(tmp_path, corpus_root) -> CompareArgs:
    return parse_args(CompareArgs, [CONFIG, f"out_dir={tmp_path}", f"data_root={corpus_root}"])


def _cache_a_threshold(args: CompareArgs, monkeypatch) -> dict:
    """threshold.json as a first run writes it (patch_size faked: it prints threshold=1.25)."""

    def fake_patch_size(cmd, log, threads, what):
        log.write_text("threshold=1.25\n")
        return 0.0

    monkeypatch.setattr("apps.compare.runs.run_logged", fake_patch_size)
    assert pick_threshold(args, "ENT") == (1.25, True)
    assert pick_threshold(args, "ENT") == (1.25, False)  # reused
    return json.loads((Path(args.out_dir) / "threshold.json").read_text())


@pytest.mark.parametrize("threshold", ["NaN", "-1.5", "Infinity", '"high"'])
def test_a_cached_threshold_that_is_not_a_finite_non_negative_number_is_refused(
    tmp_path, corpus_root, monkeypatch, threshold
):
    args = _compare_args(tmp_path, corpus_root)
    cache = tmp_path / "threshold.json"
    command = json.dumps(_cache_a_threshold(args, monkeypatch)["command"])
    cache.write_text(f'{{"command": {command}, "threshold": {threshold}}}')
    with pytest.raises(UserError) as info:
        pick_threshold(args, "ENT")
    message = str(info.value)
    assert message.startswith(f"{cache}: threshold ") and "is not a finite number >= 0" in message
    assert message.endswith("delete it to pick the threshold again") and "\n" not in message


def test_a_damaged_threshold_json_is_one_line(tmp_path, corpus_root):
    args = _compare_args(tmp_path, corpus_root)
    cache = tmp_path / "threshold.json"
    cache.write_text('{"command": ["-m"')  # cut off by a kill mid-write
    with pytest.raises(UserError, match=r"threshold\.json: unreadable .*delete it to pick"):
        pick_threshold(args, "ENT")


def test_compare_cli_with_a_damaged_done_json_is_one_line(tmp_path, corpus_root, capsys):
    out = tmp_path / "out"
    (out / "entropy").mkdir(parents=True)
    (out / "entropy" / DONE).write_text('{"argv": ')
    argv = [CONFIG, f"out_dir={out}", f"data_root={corpus_root}"]
    assert compare_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        f"data error: {out / 'entropy' / DONE}: unreadable"
    ), err
    assert err[0].endswith("delete it to train the entropy model again")
