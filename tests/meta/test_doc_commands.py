"""The docs' shell commands as scripts/run_doc_commands.py sees them (CI runs them all)."""

import importlib.util
import sys
from collections import Counter

from tests.paths import REPO

spec = importlib.util.spec_from_file_location(
    "run_doc_commands", REPO / "scripts" / "run_doc_commands.py"
)
docs = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = docs  # dataclasses look their module up
spec.loader.exec_module(docs)


def runnable() -> list:
    out = []
    for command in docs.collect():
        text = docs.rewrite(command.text)
        if docs.skip_reason(text) is None:
            out.append(docs.Command(command.where, docs.shorten(text)))
    return out


def test_every_command_runs_or_names_why_not():
    commands = docs.collect()
    assert len(commands) > 30 and commands[0].where.startswith("README.md")
    assert any("bytelatent.data.prepare" in c.text for c in runnable())
    for command in runnable():
        assert "DIR" not in command.text.split() and "hf-weights/" not in command.text, command


def test_each_training_example_has_its_own_dump_dir():
    """Two examples on one dump_dir: the second resumes a finished run and trains nothing."""
    dirs = Counter(
        str(docs.config_dump_dir(c.text, REPO)) for c in runnable() if docs.is_training(c.text)
    )
    assert [d for d, n in dirs.items() if n > 1] == []


def test_training_is_shortened():
    text = docs.shorten(
        "python -m bytelatent.train config=configs/debug.yaml eval.every=50 probe_freq=50 "
        '"checkpoint.steps=[150,175]" relative_steps=50 x=runs/debug/checkpoints/0000000200'
    )
    assert "steps=20 " in text and "eval.every=5 " in text and "probe_freq=5 " in text
    assert "checkpoint.steps=[15,17]" in text and "relative_steps=5 " in text
    assert text.endswith("checkpoints/0000000020")
    assert docs.shorten("python -m bytelatent.train --help") == "python -m bytelatent.train --help"


def test_comparison_recipe_quick_runs_as_written_and_the_cpu_preset_is_skipped():
    quick = "python -m apps.compare config=configs/compare_quick.yaml"
    assert docs.shorten(quick) == quick and docs.skip_reason(quick) is None
    assert "test_compare.py" in docs.skip_reason(
        "python -m apps.compare config=configs/compare_cpu.yaml"
    )
