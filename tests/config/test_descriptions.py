"""Every config field has a description, and `--help SECTION` prints it (issue 28 item 5).

A new field without `Field(..., description=...)` fails here, named by its class and key. The walk
follows nested arg models through `X | None`, `list[X]`, `dict[str, X]` and discriminated unions,
from the model of every command that takes key=value arguments.
"""

from __future__ import annotations

import importlib
import typing

import pytest
from pydantic import BaseModel

from bytelatent.args import TrainArgs
from bytelatent.config.help import HELP_WIDTH, _row, entry_help, section_help
from bytelatent.model.registry import registered_archs

# command (or config section read by its own model) -> the arg model it validates
COMMAND_MODELS = {
    "bytelatent.train / print_config / data.check": "bytelatent.args:TrainArgs",
    "bytelatent.eval": "bytelatent.eval.__main__:StandaloneEvalArgs",
    "bytelatent.eval.harness": "bytelatent.eval.harness:HarnessArgs",
    "eval.task_args.harness": "bytelatent.eval.harness:HarnessTaskArgs",
    "bytelatent.generate": "bytelatent.generate:GenerateArgs",
    "bytelatent.launch.slurm": "bytelatent.launch.args:SlurmArgs",
}

DESCRIPTION_COLUMN = 49  # key_lines' description column


def _load(ref: str) -> type[BaseModel]:
    module, name = ref.split(":")
    return getattr(importlib.import_module(module), name)


def _models_in(annotation: typing.Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    found = []
    for arg in typing.get_args(annotation):  # X | None, list[X], dict[K, X], Annotated[...]
        found += _models_in(arg)
    return found


def reachable_fields(root: type[BaseModel]) -> list[tuple[type[BaseModel], str]]:
    """(model, field name) of every field of `root` and of every model nested in it."""
    seen: set[type[BaseModel]] = set()
    fields = []
    todo = [root]
    while todo:
        model = todo.pop()
        if model in seen:
            continue
        seen.add(model)
        for name, field in model.model_fields.items():
            fields.append((model, name))
            todo += _models_in(field.annotation)
    return fields


def _arch_args_classes() -> list[type[BaseModel]]:
    """The schemas of TrainArgs' `model` section: one per registered architecture."""
    return [spec.args_class for spec in registered_archs().values()]


def test_the_walk_reaches_nested_list_and_union_models():
    roots = [TrainArgs, *_arch_args_classes()]
    models = {model.__name__ for root in roots for model, _ in reachable_fields(root)}
    assert {
        "DataArgs",
        "PatcherArgs",
        "TokenizerArgs",
        "ByteLatentTransformerArgs",
        "RopeScalingArgs",
        "GlobalInitArgs",
        "LMTransformerArgs",
        "ParamGroupArgs",  # list[ParamGroupArgs]
        "EarlyStopArgs",  # list[Annotated[EarlyStopArgs | NonFiniteStopArgs, ...]]
        "NonFiniteStopArgs",
        "WandbArgs",
        "SlurmArgs",  # eval.async_launch.slurm
        "SaveEvery",
    } <= models


@pytest.mark.parametrize("command", [*COMMAND_MODELS, "model (every arch's args)"])
def test_every_field_has_a_description(command):
    roots = [_load(COMMAND_MODELS[command])] if command in COMMAND_MODELS else _arch_args_classes()
    missing = [
        f"{model.__module__}.{model.__qualname__}.{name}"
        for root in roots
        for model, name in reachable_fields(root)
        if not (model.model_fields[name].description or "").strip()
    ]
    assert not missing, (
        f"{command}: {len(missing)} config field(s) without a description; give each one "
        "Field(..., description='what it does, unit, valid values'):\n  " + "\n  ".join(missing)
    )


def _entries(page: str, column: int) -> dict[str, str]:
    """{key: its text with the wrapped description, whitespace-normalised} of a help page."""
    entries: dict[str, str] = {}
    key = None
    for line in page.splitlines():
        if line.startswith(" " * column) and key is not None:
            entries[key] += " " + line
        elif line.startswith("  ") and not line.startswith("   "):
            key = line.split()[0].rstrip(":")
            entries[key] = line
    return {k: " ".join(v.split()) for k, v in entries.items()}


def _expected(model: type[BaseModel], prefix: str) -> dict[str, str]:
    """{key: description} of every key `key_lines` shows for `model` under `prefix`."""
    out = {}
    for name, field in model.model_fields.items():
        key = prefix + name
        out[key] = " ".join((field.description or "").split())
        nested = _models_in(field.annotation)
        if len(nested) == 1:  # a section (X, X | None) or a list of X: its keys follow
            is_list = typing.get_origin(field.annotation) is list
            out.update(_expected(nested[0], key + ("[i]." if is_list else ".")))
    return out


@pytest.mark.parametrize("section", ["model", "data", "optim", "distributed", "eval"])
def test_help_section_prints_every_key_with_its_description(section):
    page = section_help(TrainArgs, section, "bytelatent.train")
    # `model`'s schema is the chosen arch's args class: --help shows the default arch's
    nested = (
        TrainArgs.config_section_class(section)
        or _models_in(TrainArgs.model_fields[section].annotation)[0]
    )
    shown = _entries(page, DESCRIPTION_COLUMN)
    for key, description in _expected(nested, section + ".").items():
        assert key in shown, f"--help {section}: no line for {key}"
        assert description in shown[key], f"--help {section}: {key}: {description!r} not shown"
    for line in page.splitlines()[1:]:
        if line.startswith(" " * DESCRIPTION_COLUMN):  # wrapped description lines
            assert len(line) <= HELP_WIDTH or " " not in line.strip(), line


def test_standalone_eval_help_section_and_generate_keys_show_descriptions():
    from bytelatent.eval.__main__ import StandaloneEvalArgs
    from bytelatent.generate import GenerateArgs

    page = section_help(StandaloneEvalArgs, "eval", "bytelatent.eval")
    shown = _entries(page, DESCRIPTION_COLUMN)
    for key, description in _expected(StandaloneEvalArgs.model_fields["eval"].annotation,
                                      "eval.").items():  # fmt: skip
        assert description in shown[key], key
    page = entry_help(["--help"], usage="usage: python -m bytelatent.generate", model=GenerateArgs)
    shown = _entries(page, 41)  # top-level keys: description column 41
    for name, field in GenerateArgs.model_fields.items():
        assert " ".join(field.description.split()) in shown[name], name


def test_descriptions_wrap_under_their_column_and_keep_ranges_whole():
    lines = _row(
        "  optim.decay_fraction = 0.1",
        "wsd: fraction of each cycle spent decaying, in (0, 1], never more than >= 0 of it",
        49,
    )
    assert all(len(line) <= HELP_WIDTH for line in lines)
    assert all(line.startswith(" " * 49) for line in lines[1:])
    assert any("(0, 1]" in line for line in lines) and any(">= 0" in line for line in lines)
    long_key = "  data.patcher_args.entropy_model_checkpoint_dir = null"
    assert _row(long_key, "a folder", 49) == [long_key, " " * 49 + "a folder"]
    assert _row("  key = 1", None, 49) == ["  key = 1"]
