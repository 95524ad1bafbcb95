"""Config trees from YAML files + CLI dotlist, validated into pydantic arg models.

Precedence (later wins): included files (deepest first, in list order), the including file, the
CLI dotlist. Dicts merge recursively, lists and scalars replace, `null` replaces a dict, and
`data.sources` is always taken whole from the last layer that defines it (merging two source
mixtures would silently train on both). A `???` marks a value as mandatory: it never erases a
value set by an earlier layer, and any `???` left after merging is an error naming the key.
`${...}` interpolations (including `${oc.env:VAR}`) are resolved by OmegaConf after merging.
"""

from __future__ import annotations

import copy
import difflib
import re
import sys
import types
import typing
from collections import abc
from pathlib import Path
from typing import Any

import pydantic
import yaml

from bytelatent.errors import ConfigError

MISSING = "???"
INCLUDE_KEY = "config"
# Dotted keys whose value is replaced wholesale instead of merged.
ATOMIC_KEYS = frozenset({"data.sources"})

ModelT = typing.TypeVar("ModelT", bound=pydantic.BaseModel)


class ConfigValidationError(ConfigError):
    """A validation failure; `str()` is one line, `details` holds every error for logging."""

    def __init__(self, message: str, details: list[str]):
        super().__init__(message)
        self.details = details


# ---------------------------------------------------------------------------------------------
# YAML loading


# Nesting levels a config may have: real ones stay below 10; a document nested deeper than
# Python's recursion limit (`[[[[...`) would end in a RecursionError thousands of lines long.
MAX_NESTING = 100


class _TooDeep(Exception):
    def __init__(self, line: int, column: int):
        super().__init__(line, column)
        self.line, self.column = line, column


class _Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 floats (`1e-3` is a float), no timestamps, no duplicate keys,
    at most MAX_NESTING levels of nesting."""

    _depth = 0

    def compose_node(self, parent, index):  # recursive: one call per level of nesting
        self._depth += 1
        try:
            if self._depth > MAX_NESTING:
                mark = self.peek_event().start_mark
                raise _TooDeep(mark.line + 1, mark.column + 1)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


_Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if not tag.endswith((":float", ":timestamp"))]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_FLOAT_RE = re.compile(
    r"""^(?:[-+]?[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+
        |[-+]?\.[0-9][0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
    re.VERBOSE,
)
_Loader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_RE, list("-+0123456789."))


def _construct_mapping_no_duplicates(loader: _Loader, node: yaml.MappingNode) -> dict:
    loader.flatten_mapping(node)
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"duplicate key {key!r} (first at line {seen[key] + 1})",
                key_node.start_mark,
            )
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=True)


_Loader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping_no_duplicates
)


# Values that aliases (`*name`) may add to a document: a config that reuses a block a few times
# stays far below; an alias bomb (each level repeating the one below) is refused before it grows.
MAX_ALIAS_EXPANSION = 100_000


def _expanded_size(node: yaml.Node, sizes: dict[int, int]) -> int:
    """Values in `node` once every alias is expanded (each distinct node counted once, memoised)."""
    if id(node) in sizes:
        return sizes[id(node)]
    sizes[id(node)] = 1  # a recursive alias refers back to itself: count it once
    if isinstance(node, yaml.SequenceNode):
        children = node.value
    elif isinstance(node, yaml.MappingNode):
        children = [child for pair in node.value for child in pair]
    else:
        children = []
    sizes[id(node)] = 1 + sum(_expanded_size(child, sizes) for child in children)
    return sizes[id(node)]


def _parse_yaml_text(text: str, where: str) -> Any:
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        sizes: dict[int, int] = {}
        extra = _expanded_size(node, sizes) - len(sizes)
        if extra > MAX_ALIAS_EXPANSION:
            raise ConfigError(
                f"{where}: YAML aliases expand to {extra} more values (at most "
                f"{MAX_ALIAS_EXPANSION}); write the values out or reuse fewer"
            )
        return loader.construct_document(node)
    except _TooDeep as deep:
        raise ConfigError(
            f"{where}: YAML nested more than {MAX_NESTING} levels deep (at line {deep.line}, "
            f"column {deep.column}); flatten the structure"
        ) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        pos = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{where}: invalid YAML{pos}: {problem}") from None
    finally:
        loader.dispose()


def load_yaml_file(path: str | Path) -> dict:
    """Read one YAML config file; its top level must be a mapping (empty file -> {})."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config file ({exc.strerror})") from None
    data = _parse_yaml_text(text, str(path))
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path}: top level must be a mapping of keys, got a {type(data).__name__}"
        )
    return data


# ---------------------------------------------------------------------------------------------
# CLI dotlist


def parse_dotlist(argv: list[str]) -> dict:
    """`a.b=1 x=null l=[1,2]` -> nested dict with YAML-typed values (later args win)."""
    tree: dict = {}
    includes: list[str] = []
    for arg in argv:
        key, sep, raw = arg.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(
                f"argument {arg!r}: expected key=value (e.g. model.dim=64) or config=path.yaml"
            )
        parts = key.split(".")
        if any(not p for p in parts):
            raise ConfigError(f"argument {arg!r}: empty component in key {key!r}")
        if len(parts) > MAX_NESTING:
            raise ConfigError(
                f"argument {arg[:60]!r}...: key nested more than {MAX_NESTING} levels deep"
            )
        value = "" if raw == "" else _parse_yaml_text(raw, f"argument {arg!r}")
        if key == INCLUDE_KEY:
            includes.extend(_include_list(value, "command line"))
            continue
        node = tree
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[parts[-1]] = value
    if includes:
        tree[INCLUDE_KEY] = includes
    return tree


def _include_list(value: Any, where: str) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    raise ConfigError(f"{where}: 'config' must be a path or a list of paths, got {value!r}")


# ---------------------------------------------------------------------------------------------
# Includes and merging


def _resolve_include(name: str, including_dir: Path | None) -> Path:
    """Relative includes are tried against the including file's directory, then the CWD."""
    path = Path(name).expanduser()
    if path.is_absolute():
        return path
    if including_dir is not None and (including_dir / path).exists():
        return including_dir / path
    return Path.cwd() / path


def _expand_file(path: Path, stack: list[Path]) -> list[dict]:
    """Layers of `path` in merge order: its includes (deepest first), then the file itself."""
    real = path.resolve()
    if real in stack:
        chain = " -> ".join(str(p) for p in [*stack, real])
        raise ConfigError(f"{path}: include cycle: {chain}")
    data = load_yaml_file(path)
    layers: list[dict] = []
    if INCLUDE_KEY in data:
        for name in _include_list(data.pop(INCLUDE_KEY), str(path)):
            layers += _expand_file(_resolve_include(name, path.parent), [*stack, real])
    layers.append(data)
    return layers


def merge_config_trees(*trees: dict) -> dict:
    """Merge plain config dicts, later wins (see module docstring for the rules)."""
    merged: dict = {}
    for tree in trees:
        _merge_into(merged, tree, "")
    return merged


def _merge_into(dst: dict, src: dict, prefix: str) -> None:
    for key, value in src.items():
        full = f"{prefix}{key}"
        if full in ATOMIC_KEYS:
            dst[key] = copy.deepcopy(value)
        elif value == MISSING and key in dst:
            continue  # `???` only marks a key as required; it never erases an earlier value
        elif isinstance(value, dict) and isinstance(dst.get(key), dict):
            _merge_into(dst[key], value, f"{full}.")
        else:
            dst[key] = copy.deepcopy(value)


def _find_missing(node: Any, prefix: str) -> list[str]:
    """Full keys of every `???` left in the tree (depth first, file order)."""
    if isinstance(node, dict):
        children = [(f"{prefix}.{k}" if prefix else str(k), v) for k, v in node.items()]
    elif isinstance(node, list):
        children = [(f"{prefix}[{i}]", v) for i, v in enumerate(node)]
    else:
        return []
    found: list[str] = []
    for key, value in children:
        if isinstance(value, str) and value == MISSING:
            found.append(key)
        else:
            found += _find_missing(value, key)
    return found


def missing_values_error(missing: list[str]) -> ConfigError:
    """One line for every unset `???` at once (not one per run)."""
    hints = " ".join(f"{key.split('[')[0]}=..." for key in missing)
    if len(missing) == 1:
        return ConfigError(f"{missing[0]}: mandatory value ({MISSING}) not set; pass {hints}")
    return ConfigError(
        f"{', '.join(missing)}: {len(missing)} mandatory values ({MISSING}) not set; pass {hints}"
    )


def _has_interpolation(node: Any) -> bool:
    if isinstance(node, dict):
        return any(_has_interpolation(v) for v in node.values())
    if isinstance(node, list):
        return any(_has_interpolation(v) for v in node)
    return isinstance(node, str) and "${" in node


def _resolve_interpolations(tree: dict) -> dict:
    if not _has_interpolation(tree):
        return tree  # plain data: no need to round-trip through OmegaConf
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        return OmegaConf.to_container(OmegaConf.create(tree), resolve=True)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "(config)"
        msg = str(exc).splitlines()[0]
        raise ConfigError(f"{key}: cannot resolve interpolation: {msg}") from None


def _drop_missing(node: dict) -> None:
    """Remove the `???` leaves of `node` (in place): the model's defaults apply to them."""
    for key in [k for k, v in node.items() if isinstance(v, str) and v == MISSING]:
        del node[key]
    for value in node.values():
        if isinstance(value, dict):
            _drop_missing(value)


def _one_name(names: tuple[str, ...], layers: list[dict]) -> list[dict]:
    """`layers` with the top-level keys `names` (one key under several names) renamed to the name
    of the last layer that sets one, so messages name it as the user last did. A null is
    dropped; a layer that sets two of them keeps both, for the model to reconcile."""
    used = [n for layer in layers for n in names if layer.get(n) is not None]
    if not used:
        return layers
    name, out = used[-1], []
    for layer in layers:
        set_here = [n for n in names if layer.get(n) is not None]
        if len(set_here) != 1 or set_here == [name]:
            out.append(layer)
            continue
        renamed = {k: v for k, v in layer.items() if k not in names}
        out.append({**renamed, name: layer[set_here[0]]})
    return out


def load_config_tree(argv: list[str], cls: type | None = None) -> dict:
    """Build the merged, resolved config dict from `config=...` files and dotlist overrides.

    A `cls.config_key_aliases(tree) -> tuple[str, ...]` classmethod (if `cls` has one) names
    top-level keys that are one key under several names (TrainArgs: `model` and its old name);
    each file and the command line is renamed before merging, so a later `entropy_model.dim=`
    overrides an earlier `model: {dim: ...}` as it would the same name.

    A `cls.config_unneeded_sections(tree) -> tuple[str, ...]` classmethod (if `cls` has one) names
    top-level sections this run does not use (TrainArgs: `data` for a dry run); their unset `???`
    keys take the model's defaults instead of being an error."""
    cli = parse_dotlist(argv)
    layers: list[dict] = []
    for name in cli.pop(INCLUDE_KEY, []):
        layers += _expand_file(_resolve_include(name, None), [])
    tree = merge_config_trees(*layers, cli)
    aliases = getattr(cls, "config_key_aliases", None)
    names = aliases(tree) if aliases is not None else ()
    if names:  # each file and the command line, renamed before merging: the later one wins
        tree = merge_config_trees(*_one_name(names, [*layers, cli]))
    unneeded = getattr(cls, "config_unneeded_sections", None)
    for section in unneeded(tree) if unneeded is not None else ():
        if isinstance(tree.get(section), dict):
            _drop_missing(tree[section])
    missing = _find_missing(tree, "")
    if missing:
        raise missing_values_error(missing)
    return _resolve_interpolations(tree)


# ---------------------------------------------------------------------------------------------
# Validation into pydantic models, with one-line errors


def parse_args(cls: type[ModelT], argv: list[str] | None = None) -> ModelT:
    """Parse argv (default sys.argv[1:]) into `cls`; any problem raises a one-line ConfigError.

    On a failure, a `cls.config_format_hint(tree, path) -> str | None` classmethod (if `cls` has
    one) is asked about each `config=` file, then the merged tree; its line replaces the error
    (TrainArgs names the converter for a reference-format file this way).
    """
    argv = sys.argv[1:] if argv is None else argv
    try:
        tree = load_config_tree(argv, cls)
    except ConfigError:
        _raise_format_hint(cls, argv)  # e.g. a reference file's `???` paths: name the converter
        raise
    try:
        return cls.model_validate(tree)
    except pydantic.ValidationError as exc:
        _raise_format_hint(cls, argv, tree)
        raise validation_error_to_config_error(exc, cls, tree) from None


def _raise_format_hint(cls: type, argv: list[str], tree: dict | None = None) -> None:
    hint = getattr(cls, "config_format_hint", None)
    if hint is None:
        return
    for arg in argv:
        key, _, value = arg.partition("=")
        if key.strip() != INCLUDE_KEY:
            continue
        for name in _include_list(_parse_yaml_text(value, arg), "command line"):
            try:
                data = load_yaml_file(_resolve_include(name, None))
            except ConfigError:
                continue
            message = hint(data, name)
            if message:
                raise ConfigError(message) from None
    message = hint(tree, None) if tree is not None else None
    if message:
        raise ConfigError(message) from None


def dump_yaml(model: pydantic.BaseModel) -> str:
    """YAML of `model` in field order; loading it back with parse_args gives an equal model."""
    return yaml.safe_dump(model.model_dump(mode="json"), sort_keys=False, allow_unicode=True)


def validation_error_to_config_error(
    exc: pydantic.ValidationError, cls: type[pydantic.BaseModel], tree: Any
) -> ConfigValidationError:
    """One line for the first failing key (+N more); every error kept in `.details`."""
    by_key: dict[str, list[tuple[dict, list[str], list[str]]]] = {}
    for err in exc.errors():
        key_parts, tags, siblings = _clean_loc(cls, err["loc"], tree, err["type"])
        key = _join_key(key_parts)
        by_key.setdefault(key, []).append((err, tags, siblings))
    lines = [_describe(key, group) for key, group in by_key.items()]
    first = lines[0]
    if len(lines) > 1:
        first += f" (+{len(lines) - 1} more)"
    return ConfigValidationError(first, lines)


def _join_key(parts: list) -> str:
    """("a", "b", 0, "c") -> "a.b[0].c", the spelling used in every message."""
    key = ""
    for part in parts:
        if isinstance(part, int):
            key += f"[{part}]"
        else:
            key += f".{part}" if key else str(part)
    return key


def _describe(key: str, group: list[tuple[dict, list[str], list[str]]]) -> str:
    err, _, siblings = group[0]
    kinds = {e["type"] for e, _, _ in group}
    if len(group) > 1 and len(kinds) > 1:
        # A union where every member failed differently: list what would have been accepted.
        allowed = ", ".join(dict.fromkeys(t[-1] for _, t, _ in group if t)) or "any allowed type"
        body = f"{_short(err.get('input'))} matches none of the allowed types ({allowed})"
    else:
        body = _message(err)
    if err["type"] == "extra_forbidden":
        parent, _, leaf = key.rpartition(".")
        match = difflib.get_close_matches(leaf, siblings, n=1, cutoff=0.6)
        if match:
            body += f" (did you mean {parent + '.' if parent else ''}{match[0]}?)"
    return f"{key}: {body}" if key else body


_EXPECTED = {
    "int": "an integer",
    "float": "a number",
    "bool": "true or false",
    "string": "a string",
    "list": "a list",
    "dict": "a mapping",
    "model": "a mapping",
    "tuple": "a list",
    "set": "a list",
}


def _message(err: dict) -> str:
    kind: str = err["type"]
    got = _short(err.get("input"))
    if kind == "extra_forbidden":
        return "unknown key"
    if kind == "missing":
        return "required key missing"
    if kind == "literal_error":
        return f"expected {err.get('ctx', {}).get('expected', 'an allowed value')}, got {got}"
    if kind in ("value_error", "assertion_error"):
        msg = err["msg"]
        for prefix in ("Value error, ", "Assertion failed, "):
            msg = msg.removeprefix(prefix)
        return msg
    if kind == "int_from_float":
        return f"expected an integer, got {got}"
    base = kind.split("_")[0]
    if base in _EXPECTED and kind.endswith(("_type", "_parsing")):
        return f"expected {_EXPECTED[base]}, got {got}"
    return f"{err['msg'][:1].lower()}{err['msg'][1:]} (got {got})"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _clean_loc(
    cls: type[pydantic.BaseModel], loc: tuple, tree: Any, err_type: str
) -> tuple[list, list[str], list[str]]:
    """Split a pydantic loc into real keys and union tags; also return sibling field names.

    pydantic inserts union member tags into `loc` (`A`, `int`, `function-after[...]`, or the
    discriminator value). A part is a real key if it is a field of a candidate model, a key of
    the input at that point, a list index, or the last part of a `missing` error.
    """
    candidates: list[Any] = [cls]
    node: Any = tree
    keys: list = []
    tags: list[str] = []
    siblings: list[str] = []
    for i, part in enumerate(loc):
        flat = _flatten(candidates)
        models = [c for c in flat if _is_model(c)]
        fields = {n for m in models for n in _field_names(m)}
        real = (
            part in fields
            or (isinstance(node, dict) and part in node)
            or (isinstance(part, int) and isinstance(node, list))
            or (i == len(loc) - 1 and err_type == "missing")
        )
        if not real:
            tags.append(str(part))
            named = [c for c in flat if getattr(c, "__name__", None) == part]
            candidates = named or flat
            continue
        siblings = sorted(fields)
        keys.append(part)
        candidates = _child_types(flat, part)
        node = node[part] if _indexable(node, part) else None
    return keys, tags, siblings


def _indexable(node: Any, part: Any) -> bool:
    if isinstance(node, dict):
        return part in node
    return isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node)


def _is_model(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, pydantic.BaseModel)


def _field_names(model: type[pydantic.BaseModel]) -> list[str]:
    names = []
    for name, info in model.model_fields.items():
        names.append(name)
        if isinstance(info.alias, str):
            names.append(info.alias)
    return names


def _flatten(tps: list[Any]) -> list[Any]:
    """Unwrap Annotated/Optional/Union into their member types."""
    out: list[Any] = []
    for tp in tps:
        origin = typing.get_origin(tp)
        if origin is typing.Annotated:
            out += _flatten([typing.get_args(tp)[0]])
        elif origin in (typing.Union, types.UnionType):
            out += _flatten(list(typing.get_args(tp)))
        else:
            out.append(tp)
    return out


def _child_types(flat: list[Any], part: Any) -> list[Any]:
    children: list[Any] = []
    for tp in flat:
        if _is_model(tp):
            for name, info in tp.model_fields.items():
                if part in (name, info.alias):
                    children.append(info.annotation)
            continue
        origin, args = typing.get_origin(tp), typing.get_args(tp)
        if not isinstance(origin, type):
            continue
        if issubclass(origin, abc.Mapping):
            children.append(args[1] if len(args) == 2 else Any)
        elif issubclass(origin, (abc.Sequence, abc.Set)) and args:
            children.append(args[0])
    return children
