"""Every entry point answers `--help` with its usage and exit 0 (in-process: no torch start-up per
module). Config-taking ones also answer `--help SECTION`."""

from __future__ import annotations

import importlib

import pytest

from tests.limits import hang_limit

ENTRY_POINTS = {
    "bytelatent.train": "usage: python -m bytelatent.train",
    "bytelatent.generate": "usage: python -m bytelatent.generate",
    "bytelatent.eval.__main__": "usage: python -m bytelatent.eval",
    "bytelatent.eval.harness": "usage: python -m bytelatent.eval.harness",
    "bytelatent.print_config": "usage: python -m bytelatent.print_config",
    "bytelatent.data.check": "usage: python -m bytelatent.data.check config=",
    "bytelatent.data.prepare": "usage:",
    "bytelatent.checkpoint.__main__": "usage: python -m bytelatent.checkpoint",
    "bytelatent.launch.slurm": "usage:",
    "bytelatent.archs.blt.from_reference": "usage:",
    "apps.plot": "usage:",
    "apps.preprocess_entropies": "usage:",
    "apps.compare.__main__": "usage: python -m apps.compare",
}


def call_main(module: str, argv: list[str]) -> int:
    main = importlib.import_module(module).main
    try:
        return main(argv)
    except SystemExit as exit_:  # argparse's --help
        return int(exit_.code or 0)


@pytest.mark.parametrize("module", list(ENTRY_POINTS))
def test_help_prints_usage_and_exits_0(module, capsys):
    assert call_main(module, ["--help"]) == 0
    out = capsys.readouterr()
    assert out.out.lower().startswith(ENTRY_POINTS[module].lower()), out.out[:300] + out.err[-300:]


@pytest.mark.parametrize(
    "module, section, key",
    [
        ("bytelatent.train", "model", "model.dim = "),
        ("bytelatent.print_config", "optim", "optim.lr = "),
        ("bytelatent.eval.__main__", "eval", "eval.every = "),
        ("bytelatent.eval.__main__", "data", "data.seq_len = "),
    ],
)
def test_help_section_lists_keys_with_defaults(module, section, key, capsys):
    assert call_main(module, ["--help", section]) == 0
    assert f"\n  {key}" in capsys.readouterr().out


NO_TORCH_SCRIPT = """
import contextlib, io, runpy, sys
for module, argv, expected in COMMANDS:
    sys.argv = [module, *argv]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exit_:
            code = exit_.code
    if code != expected or "torch" in sys.modules:
        print(module, argv, "exit", code, "torch loaded:", "torch" in sys.modules)
        break
else:
    print("ok")
"""


def test_help_usage_config_errors_and_print_config_never_load_torch():
    """They answer from the config alone (~0.7 CPU-s, not ~4): every arg class is torch-free, and
    `python -m bytelatent.train` validates before it imports torch or starts the data loader."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    commands = [
        ("bytelatent.train", ["--help"], 0),
        ("bytelatent.train", [], 2),
        ("bytelatent.train", ["config=configs/debug.yaml", "model.cross_atn_k=2"], 2),
        ("bytelatent.train", ["config=configs/entropy_debug.yaml", "optim.lr=fast"], 2),
        ("bytelatent.print_config", ["config=configs/debug.yaml", "model.dim=64"], 0),
        ("bytelatent.print_config", ["--help", "model"], 0),
        ("bytelatent.archs.blt.from_reference", ["--help"], 0),
    ]
    script = f"COMMANDS = {commands!r}\n{NO_TORCH_SCRIPT}"
    res = subprocess.run([sys.executable, "-c", script], cwd=repo, capture_output=True,
                         text=True, timeout=hang_limit(120))  # fmt: skip
    assert res.stdout.strip() == "ok", res.stdout + res.stderr[-2000:]
