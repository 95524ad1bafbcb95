"""`--help` text generated from the pydantic arg models: keys, defaults and field descriptions.

Every entry point prints its usage with `--help`; those that take a config also answer
`--help SECTION` with the keys of that section (`python -m bytelatent.train --help model`).
"""

from __future__ import annotations

import json
import typing
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from bytelatent.errors import ConfigError

HELP_FLAGS = ("-h", "--help")


def wants_help(argv: list[str]) -> bool:
    return any(a in HELP_FLAGS for a in argv)


def help_topic(argv: list[str]) -> str | None:
    """The word after `--help`/`-h` (a section name), if any."""
    for i, arg in enumerate(argv):
        if arg in HELP_FLAGS and i + 1 < len(argv) and "=" not in argv[i + 1]:
            return argv[i + 1]
    return None


def section_model(annotation: Any) -> type[BaseModel] | None:
    """The arg model of a nested section (`X`, `X | None`), None for a leaf or a list of models."""
    for member in typing.get_args(annotation) or (annotation,):
        if isinstance(member, type) and issubclass(member, BaseModel):
            return member
    return None


def sections(model: type[BaseModel]) -> dict[str, FieldInfo]:
    return {n: f for n, f in model.model_fields.items() if section_model(f.annotation) is not None}


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    if field.default_factory is not None:
        value = field.default_factory()
    else:
        value = field.default
    if value is PydanticUndefined:
        return "required"
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    try:
        return json.dumps(value)
    except TypeError:
        return str(value)


def key_lines(model: type[BaseModel], prefix: str = "") -> list[str]:
    """`  key = default   description`, one line per leaf key, nested sections flattened."""
    lines = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        nested = section_model(field.annotation)
        if nested is not None:
            note = "  (optional section, unset by default)" if _default(field) == "null" else ""
            lines.append(
                f"  {key}:{note}" + (f"  {field.description}" if field.description else "")
            )
            lines += key_lines(nested, key + ".")
            continue
        default = _default(field)
        if len(default) > 40:
            default = default[:37] + "..."
        text = f"  {key} = {default}"
        lines.append(f"{text:<48} {field.description}" if field.description else text)
    return lines


def section_help(model: type[BaseModel], topic: str, program: str) -> str:
    """The keys of section `topic` of `model` (or of every top-level key for `topic='all'`)."""
    if topic == "all":
        return "\n".join(key_lines(model)) + "\n"
    field = model.model_fields.get(topic)
    nested = section_model(field.annotation) if field is not None else None
    if nested is None:
        names = ", ".join(sections(model))
        raise ConfigError(f"--help {topic}: not a section of {program}; sections: {names}, all")
    head = f"{topic}: {field.description}" if field.description else f"{topic}:"
    return head + "\n" + "\n".join(key_lines(nested, topic + ".")) + "\n"


def top_level_lines(model: type[BaseModel]) -> list[str]:
    """Leaf keys of `model` (not sections) with their descriptions."""
    nested = sections(model)
    lines = []
    for name, field in model.model_fields.items():
        if name in nested:
            continue
        text = f"  {name} = {_default(field)}"
        lines.append(f"{text:<40} {field.description}" if field.description else text)
    return lines


def section_lines(model: type[BaseModel]) -> list[str]:
    return [
        f"  {name:<15} {field.description or ''}".rstrip()
        for name, field in sections(model).items()
    ]


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
