"""The model registry: one `ArchSpec` per architecture, found by name.

The trainer, eval, generation and checkpoint code ask the spec of a run (`get_arch(args.arch)`)
or of a built model (`arch_of(model)`); only the spec knows the model class. This module and the
specs (`bytelatent/model/spec.py`) are torch-free: a spec's hooks import torch when called, so
`TrainArgs` validates (and `--help` answers) without importing torch.

The built-in architectures are listed once, in `bytelatent/archs/__init__.py` (one folder each).
An architecture defined outside the package registers itself when its module is imported: the
config names it `arch: "my_pkg.my_arch:my_name"`, and `get_arch` imports `my_pkg.my_arch` (which
calls `register_arch`) before looking up `my_name` (docs/extending.md).

Importing a module runs its code, so only the user's own choice imports one: `get_arch` imports
only with `allow_import=True` (the user's config, `TrainArgs`; `allow_arch_import=true` /
`--allow-arch-import` on the CLIs that read a checkpoint). A name read from a file someone
handed us (a checkpoint's params.json) finds an architecture already registered, or is refused
(docs/reliability.md, threat model).
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

from bytelatent.model.spec import Adapters, ArchSpec, AuxLoss, Forward, Sizes

__all__ = [  # the spec's parts, for an architecture's module: `from bytelatent.model.registry import`
    "Adapters",
    "ArchSpec",
    "AuxLoss",
    "Forward",
    "Sizes",
    "arch_of",
    "get_arch",
    "register_arch",
    "registered_archs",
]

# The TrainArgs section that holds the chosen architecture's args.
MODEL_SECTION = "model"
# Its names in configs and params.json files from before one section (`ArchSpec.legacy_section`):
# the BLT's `model`, the byte LM's `entropy_model`, and `arch_args` (H-Net and every
# architecture registered outside bytelatent). Still read, never written.
LEGACY_SECTIONS = ("model", "entropy_model", "arch_args")

_REGISTRY: dict[str, ArchSpec] = {}
_ALIASES: dict[str, str] = {}
_builtins_loaded = False


def register_arch(spec: ArchSpec, replace: bool = False) -> ArchSpec:
    """Add `spec` (and its aliases); a second spec under a taken name is an error unless
    `replace` (re-importing the module that registered it is fine)."""
    if spec.legacy_section not in LEGACY_SECTIONS:
        raise ValueError(
            f"arch {spec.name!r}: legacy_section {spec.legacy_section!r} is not one of "
            f"{LEGACY_SECTIONS} (the old name of its `model` section; 'arch_args' outside "
            "bytelatent)"
        )
    old = _REGISTRY.get(spec.name)
    same_origin = old is not None and _origin(old) == _origin(spec)
    if old is not None and not (replace or same_origin):
        raise ValueError(f"arch {spec.name!r} is already registered ({_origin(old)})")
    for alias in spec.aliases:
        taken = _ALIASES.get(alias) or (alias if alias in _REGISTRY else None)
        if taken not in (None, spec.name):
            raise ValueError(f"arch {spec.name!r}: alias {alias!r} is taken by {taken!r}")
    _REGISTRY[spec.name] = spec
    _ALIASES.update(dict.fromkeys(spec.aliases, spec.name))
    return spec


def unregister_arch(name: str) -> None:
    """Remove `name` (tests)."""
    spec = _REGISTRY.pop(name, None)
    for alias in spec.aliases if spec else ():
        _ALIASES.pop(alias, None)


def _origin(spec: ArchSpec) -> str:
    return f"{spec.args_class.__module__}.{spec.args_class.__qualname__}"


def _load_builtins() -> None:
    """Register the built-in list (`bytelatent/archs/__init__.py`), imported by name: the
    architectures sit above the registry, which never imports them itself."""
    global _builtins_loaded
    if not _builtins_loaded:
        _builtins_loaded = True
        for spec in importlib.import_module("bytelatent.archs").BUILTINS:
            register_arch(spec)


def registered_archs() -> dict[str, ArchSpec]:
    _load_builtins()
    return dict(_REGISTRY)


ARCH_IMPORT_HINT = (
    "add allow_arch_import=true (generate, eval) or --allow-arch-import (checkpoint export-hf), "
    "or name the arch in your own config, if you trust it"
)


class ArchImportRefused(ValueError):
    """A `"pkg.module:name"` arch whose module is not imported, asked for without consent."""


def get_arch(name: str, *, allow_import: bool = False) -> ArchSpec:
    """The spec registered as `name` (or an alias); `"pkg.module:name"` imports `pkg.module`
    first (which registers it) when `allow_import`, else the module must already be imported
    (ArchImportRefused). ValueError with the known names otherwise."""
    _load_builtins()
    module_name, sep, short = name.partition(":")
    if sep and module_name not in sys.modules and not allow_import:
        raise ArchImportRefused(
            f"arch {name!r} would import module {module_name!r} (running its code); a name read "
            f"from a checkpoint is imported only when you opt in: {ARCH_IMPORT_HINT}"
        )
    if sep:
        try:
            importlib.import_module(module_name)
        except ImportError as exc:
            raise ValueError(
                f"cannot import {module_name!r} ({type(exc).__name__}: {exc}); arch "
                "'package.module:name' names a module on sys.path that registers 'name'"
            ) from None
        name = short
    key = _ALIASES.get(name, name)
    if key not in _REGISTRY:
        known = ", ".join(sorted(_REGISTRY) + sorted(_ALIASES))
        where = f" (module {module_name!r} registered no arch {short!r})" if sep else ""
        raise ValueError(
            f"unknown architecture {name!r}{where}; registered: {known}, or "
            "'package.module:name' for one registered outside bytelatent"
        )
    return _REGISTRY[key]


def arch_of(model: Any) -> ArchSpec | None:
    """The spec whose model class `model` is an instance of (FSDP wrapping subclasses it), or
    None for a module built outside the registry."""
    for spec in registered_archs().values():
        cls = spec.model_class()
        if cls is not None and isinstance(model, cls):
            return spec
    return None


def arch_of_args(args: Any) -> ArchSpec:
    """The spec whose args class `args` is (each architecture has its own)."""
    for spec in registered_archs().values():
        if type(args) is spec.args_class:
            return spec
    raise ValueError(f"no architecture registered for {type(args).__name__}")


def arch_name_from_config(tree: dict[str, Any]) -> str:
    """The `arch` a config dict names; a config from before the registry says
    `train_entropy_model: true` for `entropy` (the config layer's compatibility rule)."""
    arch = tree.get("arch")
    if arch:
        return str(arch)
    return "entropy" if tree.get("train_entropy_model") else "blt"


def arch_name_from_params(params: dict[str, Any]) -> str:
    """The `arch` of a checkpoint's params.json: its `arch`, else (checkpoints from before the
    registry, released weights) `entropy` when it says `train_entropy_model: true` or has no
    `model` section (the released entropy_model/params.json is a flat LM layout), else `blt`."""
    arch = params.get("arch")
    if arch:
        return str(arch)
    return "entropy" if params.get("train_entropy_model") or not params.get("model") else "blt"


def model_config_keys() -> set[str]:
    """Top-level config keys that describe the model (a change may change parameter shapes)."""
    return {"arch", "train_entropy_model", MODEL_SECTION, *LEGACY_SECTIONS}


def arch_section(tree: dict[str, Any], spec: ArchSpec) -> Any:
    """The args of `spec` in a config dict (config.yaml, params.json): its `model` section, or in
    a file from before one section, the section's old name (`spec.legacy_section`) when set."""
    old = tree.get(spec.legacy_section)
    return old if old is not None else tree.get(MODEL_SECTION)
