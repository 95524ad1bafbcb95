"""Issue 38 item 1: an arch `"pkg.module:name"` that a checkpoint's params.json names is never
imported by generate, eval, export-hf, consolidate or a resume, unless the run opts in
(`allow_arch_import=true`, `--allow-arch-import`); the user's own config naming a plugin still
imports it.

Each planted module writes a marker file when imported: one in the working directory, one next
to the checkpoint and one inside the step folder (both reachable as namespace packages from the
working directory, as when a downloaded folder is used from the folder above it).
"""

from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path

import pytest
import torch

from bytelatent.archs.lm.model import LMTransformer
from bytelatent.args import TrainArgs
from bytelatent.checkpoint.__main__ import main as checkpoint_cli
from bytelatent.checkpoint.args import CheckpointArgs
from bytelatent.checkpoint.manager import CheckpointManager
from bytelatent.checkpoint.pretrained import load_any_checkpoint
from bytelatent.config import parse_args
from bytelatent.config.redact import redacted_dump
from bytelatent.errors import CheckpointError
from bytelatent.eval.__main__ import main as eval_cli
from bytelatent.generate import main as generate_cli
from bytelatent.model.args import LMTransformerArgs
from bytelatent.model.registry import unregister_arch
from bytelatent.trainer.resume_check import check_resume
from tests.conftest import TINY_ENTROPY
from tests.tiny import ENTROPY_CONFIG

ARGS = {"dim": 32, "n_layers": 1, "n_heads": 2, "max_seqlen": 128, "sliding_window": 64}
PLUGIN = """
import dataclasses, pathlib
pathlib.Path({marker!r}).write_text("imported")
from bytelatent.model.registry import get_arch, register_arch
register_arch(dataclasses.replace(get_arch("entropy"), name={arch!r}, aliases=()))
"""


def _config(tmp_path: Path, corpus_root: Path, *extra: str) -> TrainArgs:
    argv = [f"config={ENTROPY_CONFIG}", *TINY_ENTROPY, f"dump_dir={tmp_path / 'run'}",
            f"data.root_dir={corpus_root}", "eval.validation.max_batches=1", *extra]  # fmt: skip
    return parse_args(TrainArgs, argv)


def _plant(where: Path, module: str, marker: Path) -> str:
    """A module file in `where` that writes `marker` and registers arch `module`; its arch ref."""
    where.mkdir(parents=True, exist_ok=True)
    leaf = module.rsplit(".", 1)[-1]
    (where / f"{leaf}.py").write_text(PLUGIN.format(marker=str(marker), arch=leaf))
    return f"{module}:{leaf}"


def _save(folder_root: Path, params: dict) -> str:
    torch.manual_seed(0)
    model = LMTransformer(LMTransformerArgs(**ARGS))
    model.init_weights()
    manager = CheckpointManager(CheckpointArgs(path=str(folder_root)))
    return manager.save(1, model, torch.optim.AdamW(model.parameters()), {"step": 1}, params)


@pytest.fixture
def cwd(tmp_path, monkeypatch):
    """The working directory of a `python -m ...` run: on sys.path, so its modules import."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    added = set()
    yield tmp_path, added
    for name in [m for m in sys.modules if m.split(".")[0] in added]:
        del sys.modules[name]


def _params_naming(arch: str, args: TrainArgs) -> dict:
    params = redacted_dump(args)
    params.update(arch=arch, train_entropy_model=False)
    return params


@pytest.mark.parametrize("place", ["cwd", "next_to_checkpoint", "inside_checkpoint"])
def test_a_checkpoint_naming_a_module_never_imports_it(cwd, corpus_root, capsys, place):
    root, added = cwd
    tag = uuid.uuid4().hex[:8]
    marker = root / f"imported_{place}"
    step_folder = root / "ck" / "0000000001"  # CheckpointManager's name for step 1
    module = {"cwd": f"evil_{tag}", "next_to_checkpoint": f"ck.evil_{tag}",
              "inside_checkpoint": f"ck.0000000001.evil_{tag}"}[place]  # fmt: skip
    added.add(module.split(".")[0])
    args = _config(root, corpus_root)
    folder = _save(root / "ck", _params_naming(f"{module}:evil_{tag}", args))
    assert folder == str(step_folder)
    arch = _plant({"cwd": root, "next_to_checkpoint": root / "ck"}.get(place, step_folder),
                  module, marker)  # fmt: skip
    hint = "allow_arch_import=true"

    readers = {
        "generate": lambda: generate_cli([f"ckpt={folder}", "prompt=hi", "max_new_bytes=2"]),
        "eval": lambda: eval_cli([f"ckpt={folder}", f"dump_dir={root / 'eval'}"]),
        "export-hf": lambda: checkpoint_cli(["export-hf", folder, str(root / "hf")]),
    }
    for name, read in readers.items():
        assert read() == 2, name
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("checkpoint error:"), (name, err)
        assert arch in err[0] and hint in err[0], (name, err)
        assert not marker.exists(), f"{name} imported {module}"
    with pytest.raises(CheckpointError, match="would import module"):
        load_any_checkpoint(folder)
    assert checkpoint_cli(["consolidate", folder, "--out", str(root / "cons")]) == 0
    capsys.readouterr()
    check = check_resume(_config(root, corpus_root, f"checkpoint.load_path={folder}"))
    assert ("arch", arch, "entropy") in check.changes  # reported, never imported
    assert not marker.exists() and module not in sys.modules


def test_the_users_own_choice_imports_the_plugin(cwd, corpus_root, capsys):
    root, added = cwd
    tag = uuid.uuid4().hex[:8]
    module = f"plugin_{tag}"
    added.add(module)
    marker = root / "imported"
    arch = _plant(root, module, marker)
    folder = _save(root / "ck", _params_naming(arch, _config(root, corpus_root)))
    try:
        assert generate_cli([f"ckpt={folder}", "prompt=hi", "max_new_bytes=2"]) == 2
        assert not marker.exists()
        capsys.readouterr()
        # opting in on the command line: the module is imported, the model generates
        argv = [f"ckpt={folder}", "prompt=hi", "max_new_bytes=2", "allow_arch_import=true"]
        assert generate_cli(argv) == 0, capsys.readouterr().err
        assert marker.exists()
        marker.unlink()
        del sys.modules[module]
        unregister_arch(f"plugin_{tag}")
        # the user's own config naming the plugin imports it, and resumes its own checkpoint
        args = _config(root, corpus_root, f"arch={arch}", "train_entropy_model=false",
                       f"checkpoint.load_path={folder}")  # fmt: skip
        assert marker.exists() and args.arch == arch
        check = check_resume(args)
        assert check.path == folder and not [k for k, _, _ in check.changes if k == "arch"]
        assert isinstance(load_any_checkpoint(folder)[0], LMTransformer)  # now registered
    finally:
        unregister_arch(f"plugin_{tag}")


def test_a_saved_config_is_validated_without_importing(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    tag = uuid.uuid4().hex[:8]
    marker = tmp_path / "imported"
    arch = _plant(tmp_path, f"saved_{tag}", marker)
    saved = {"dump_dir": "d", "arch": arch, "model": None, "entropy_model": ARGS,
             "data": {"seq_len": 64, "patcher_args": {"patching_mode": "byte"}}}  # fmt: skip
    with pytest.raises(ValueError, match="would import module"):
        TrainArgs.from_saved(saved)
    assert not marker.exists()
    params_json = json.dumps(saved)  # what TrainArgs(**...) in the user's own code does: imports
    try:
        assert TrainArgs.model_validate(json.loads(params_json)).arch == arch
        assert marker.exists()
    finally:
        unregister_arch(f"saved_{tag}")
        sys.modules.pop(f"saved_{tag}", None)
