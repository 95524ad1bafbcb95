"""`--help` text generated from the pydantic arg models: keys, defaults and field descriptions.

Every entry point prints its usage with `--help`; those that take a config also answer
`--help SECTION` with the keys of that section (`python -m bytelatent.train --help model`).
"""

from __future__ import annotations

import json
import re
import textwrap
import typing
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from bytelatent.errors import ConfigError

HELP_FLAGS = ("-h", "--help")
# Help pages wrap descriptions to this many columns (a key longer than its column puts its
# description on the lines below it).
HELP_WIDTH = 100
# `>= 0`, `(0, 1]`, `[0, 1)`: kept on one line (the space becomes a no-break space while wrapping)
_GLUED = re.compile(r"((?:^|(?<=[\s(]))(?:[<>]=?|[(\[]-?\d+(?:\.\d+)?,)) ")


def wants_help(argv: list[str]) -> bool:
    return any(a in HELP_FLAGS for a in argv)


def help_topic(argv: list[str]) -> str | None:
    """The word after `--help`/`-h` (a section name), if any."""
    for i, arg in enumerate(argv):
        if arg in HELP_FLAGS and i + 1 < len(argv) and "=" not in argv[i + 1]:
            return argv[i + 1]
    return None


def section_model(annotation: Any) -> type[BaseModel] | None:
    """The arg model of a nested section (`X`, `X | None`, or the items of `list[X]`), None for
    a leaf."""
    for member in typing.get_args(annotation) or (annotation,):
        if isinstance(member, type) and issubclass(member, BaseModel):
            return member
    return None


def _is_list(annotation: Any) -> bool:
    return typing.get_origin(annotation) is list


def _row(text: str, description: str | None, column: int) -> list[str]:
    """`text`, then `description` from `column` on, wrapped to HELP_WIDTH; the description starts
    on the next line when `text` reaches its column."""
    if not (description or "").strip():
        return [text]
    indent = " " * column
    chunks = textwrap.wrap(
        _GLUED.sub("\\1\u00a0", description),
        max(HELP_WIDTH - column, 40),
        break_long_words=False,
        break_on_hyphens=False,
    )
    chunks = [chunk.replace("\u00a0", " ") for chunk in chunks]
    if len(text) < column:
        return [f"{text:<{column}}{chunks[0]}", *(indent + c for c in chunks[1:])]
    return [text, *(indent + c for c in chunks)]


def field_section(model: type[BaseModel], name: str, field: FieldInfo) -> type[BaseModel] | None:
    """The arg model of section `name` of `model`: its annotation's, or for a section whose schema
    depends on another key (TrainArgs' `model`), what `model.config_section_class(name)` says."""
    hook = getattr(model, "config_section_class", None)
    return section_model(field.annotation) or (hook(name) if hook is not None else None)


def sections(model: type[BaseModel]) -> dict[str, FieldInfo]:
    return {n: f for n, f in model.model_fields.items() if field_section(model, n, f) is not None}


def _default_value(field: FieldInfo) -> Any:
    if field.is_required():
        return PydanticUndefined
    if field.default_factory is not None:
        return field.default_factory()
    return field.default


def _shown(value: Any) -> str:
    if value is PydanticUndefined:
        return "required"
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    try:
        return json.dumps(value)
    except TypeError:
        return str(value)


def _default(field: FieldInfo) -> str:
    return _shown(_default_value(field))


def key_lines(
    model: type[BaseModel], prefix: str = "", defaults: BaseModel | None = None
) -> list[str]:
    """`  key = default   description` per leaf key, nested sections flattened (the keys of a
    list's items as `key[i].name`); descriptions wrapped to HELP_WIDTH. `defaults`: the section's
    default value when its parent sets one (e.g. `eval.async_launch.slurm.time`), which wins over
    the field defaults of `model`."""
    lines = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        value = getattr(defaults, name) if defaults is not None else _default_value(field)
        nested = field_section(model, name, field)
        if nested is not None:
            if _is_list(field.annotation):
                note, item = f"  (a list, default {_shown(value)}; each item:)", "[i]."
            elif value is None:
                note, item = "  (optional section, unset by default)", "."
            else:
                note, item = "", "."
            lines += _row(f"  {key}:{note}", field.description, 49)
            section_defaults = value if isinstance(value, nested) else None
            lines += key_lines(nested, key + item, section_defaults)
            continue
        default = _shown(value)
        if len(default) > 40:
            default = default[:37] + "..."
        lines += _row(f"  {key} = {default}", field.description, 49)
    return lines


def section_help(model: type[BaseModel], topic: str, program: str) -> str:
    """The keys of section `topic` of `model` (or of every top-level key for `topic='all'`)."""
    if topic == "all":
        return "\n".join(key_lines(model)) + "\n"
    field = model.model_fields.get(topic)
    nested = field_section(model, topic, field) if field is not None else None
    if nested is None:
        names = ", ".join(sections(model))
        raise ConfigError(f"--help {topic}: not a section of {program}; sections: {names}, all")
    head = f"{topic}: {field.description}" if field.description else f"{topic}:"
    head = textwrap.fill(head, HELP_WIDTH, subsequent_indent="  ", break_long_words=False)
    return head + "\n" + "\n".join(key_lines(nested, topic + ".")) + "\n"


def top_level_lines(model: type[BaseModel]) -> list[str]:
    """Leaf keys of `model` (not sections) with their descriptions."""
    nested = sections(model)
    lines = []
    for name, field in model.model_fields.items():
        if name in nested:
            continue
        lines += _row(f"  {name} = {_default(field)}", field.description, 41)
    return lines


def section_lines(model: type[BaseModel]) -> list[str]:
    lines = []
    for name, field in sections(model).items():
        lines += _row(f"  {name}", field.description, 18)
    return lines


def entry_help(argv: list[str], *, usage: str, model: type[BaseModel], doc: str = "") -> str | None:
    """The `--help` page of an entry point when `argv` asks for one (`--help SECTION`: that
    section's keys), else None. Raises ConfigError for an unknown section."""
    if not wants_help(argv):
        return None
    program = usage.split("python -m ", 1)[-1].split(" ", 1)[0]
    topic = help_topic(argv)
    if topic is not None:
        return section_help(model, topic, program)
    parts = [usage, ""]
    if doc.strip():
        parts += [doc.strip(), ""]
    parts += ["Keys (key = default):", *top_level_lines(model)]
    if sections(model):
        parts += ["", "Sections (`--help SECTION` lists a section's keys; `--help all` every key):"]
        parts += section_lines(model)
    return "\n".join(parts) + "\n"
