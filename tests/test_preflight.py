"""`python -m bytelatent.train` finds the mistakes of a run's first seconds before it imports
torch (bytelatent/preflight.py): each exits 2 with one line and writes nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bytelatent.args import TrainArgs
from bytelatent.config import parse_args
from bytelatent.config.redact import redacted_dump
from bytelatent.data.elastic import fresh_streams
from tests.limits import hang_limit

REPO = Path(__file__).resolve().parents[1]

# Runs every command in one interpreter (as `python -m bytelatent.train`), one JSON line each:
# exit code, stderr lines, whether torch got imported.
SCRIPT = """
import contextlib, io, json, os, runpy, sys
for argv, env in COMMANDS:
    os.environ.update(env)
    sys.argv = ["bytelatent.train", *argv]
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            runpy.run_module("bytelatent.train", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exit_:
            code = exit_.code
    for key in env:
        del os.environ[key]
    print(json.dumps({"code": code, "err": err.getvalue().splitlines(),
                      "torch": "torch" in sys.modules}))
"""


def saved_run(dump: Path, args: TrainArgs) -> None:
    """A checkpoint's JSON files as a 1-rank run of `args` saved them (no weights)."""
    folder = dump / "checkpoints" / f"{10:010d}"
    folder.mkdir(parents=True)
    (folder / ".complete").write_text(json.dumps({"step": 10, "kinds": ["dump"], "dp_size": 1}))
    state = fresh_streams(args.data, 0, 1, args.grad_acc_steps).model_dump(mode="json")
    (folder / "train_state_00000.json").write_text(json.dumps({"step": 10, "data_state": state}))
    (folder / "params.json").write_text(json.dumps(redacted_dump(args)))


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")}


@pytest.mark.slow
def test_each_early_mistake_is_one_line_exit_2_without_torch_or_files(
    tmp_path, corpus_root, monkeypatch
):
    monkeypatch.chdir(REPO)
    base = ["config=configs/debug.yaml", f"data.root_dir={corpus_root}", "steps=20"]
    resumed = tmp_path / "resumed"
    saved_run(resumed, parse_args(TrainArgs, [*base, f"dump_dir={resumed}"]))
    before = snapshot(resumed)
    no_llama = tmp_path / "no_llama"
    no_llama.mkdir()
    mistakes = {  # name: (argv, env, what the line says)
        "root_dir": ([f"data.root_dir={tmp_path}/nowhere"], {},
                     f"data.root_dir {tmp_path}/nowhere does not exist"),
        "source": (["data.sources={stdlb: 1.0}"], {}, "did you mean 'stdlib'?"),
        "validation": (["eval.every=10", "eval.validation.sources=[held_out.jsonl]"], {},
                       "data error: eval.validation: data source 'held_out.jsonl'"),
        "mesh": (["distributed.dp_shard=2"], {},
                 "= 2 but this is one process (no torchrun or srun variables); launch 2 with"),
        "mesh_torchrun": (["distributed.dp_shard=4"],
                          {"WORLD_SIZE": "2", "LOCAL_RANK": "0", "RANK": "0"},
                          "= 4 but WORLD_SIZE is 2"),
        "global_init": ([f"model.global_init.path={tmp_path}/llama"], {},
                        f"model.global_init.path {tmp_path}/llama: no such folder"),
        "global_init_no_config": ([f"model.global_init.path={no_llama}"], {},
                                  f"{no_llama}/config.json: missing"),
        "tokenizer_patching": (["data.patcher_args.patching_mode=tokenizer",
                                f"data.patcher_args.tokenizer_path={no_llama}"], {},
                               f"tokenizer_path={no_llama}: no tokenizer.json there"),
        "tokenizer_generation": (["data.patcher_args.patching_mode=tokenizer",
                                  f"data.patcher_args.tokenizer_path={no_llama}",
                                  "eval.tasks=[bpb,generation]"], {},
                                 "patching_mode=tokenizer cannot generate or score"),
    }  # fmt: skip
    commands = [
        ([*base, f"dump_dir={tmp_path}/{name}", *argv], env)
        for name, (argv, env, _) in mistakes.items()
    ]
    commands.append((["config=configs/blt_from_llama.yaml"], {}))  # every ??? in one line
    commands.append(([*base, f"dump_dir={resumed}", "data.batch_size=8"], {}))
    script = f"COMMANDS = {commands!r}\n{SCRIPT}"
    res = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                         text=True, timeout=hang_limit(120))  # fmt: skip
    results = [json.loads(line) for line in res.stdout.splitlines()]
    assert len(results) == len(commands), res.stdout + res.stderr[-2000:]
    expected = [said for _, _, said in mistakes.values()]
    expected.append(
        "config error: dump_dir, data.root_dir, data.sources, data.preprocess_dir: 4 mandatory "
        "values (???) not set; pass dump_dir=... data.root_dir=... data.sources=... "
        "data.preprocess_dir=..."
    )
    expected.append("global batch: the checkpoint's data stream has 4 rows per step, this run")
    for (argv, _), result, said in zip(commands, results, expected):
        assert result["code"] == 2, (argv, result)
        assert len(result["err"]) == 1 and said in result["err"][0], (said, result["err"])
        assert not result["torch"], argv
    for name in mistakes:
        assert not (tmp_path / name).exists(), name  # no dump_dir, no train.log
    assert snapshot(resumed) == before


def test_a_config_that_fits_passes_the_preflight(tmp_path, corpus_root, monkeypatch):
    from bytelatent.preflight import preflight

    monkeypatch.chdir(REPO)
    args = parse_args(
        TrainArgs,
        ["config=configs/debug.yaml", f"data.root_dir={corpus_root}", f"dump_dir={tmp_path}",
         "eval.every=10"],
    )  # fmt: skip
    preflight(args)
    assert list(tmp_path.iterdir()) == []
