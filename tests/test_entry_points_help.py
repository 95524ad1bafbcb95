"""Every entry point answers `--help` with its usage and exit 0 (in-process: no torch start-up per
module). Config-taking ones also answer `--help SECTION`."""

from __future__ import annotations

import importlib

import pytest

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
    "bytelatent.config.from_reference": "usage:",
    "apps.plot": "usage:",
    "apps.preprocess_entropies": "usage:",
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
