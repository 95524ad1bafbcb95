"""Optional extras that test modules use without importing them at collection.

`import transformers` alone costs ~2 s of CPU and `from transformers import BltForCausalLM` ~7 s;
every pytest-xdist worker collects every test module, so a module-level import is paid once per
worker even when no test of that module runs there. `lazy_extra("transformers", reason)` skips
the calling module at collection when the package is missing (as `pytest.importorskip` does) and
otherwise returns a stand-in that imports the module on first attribute access.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

import pytest


class LazyModule:
    """`importlib.import_module(name)`, done on first attribute access."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str):
        if attr.startswith("_") or attr == "pytestmark":  # what collection probes on module
            raise AttributeError(attr)  # globals (__test__, _pytestfixturefunction, ...)
        module: ModuleType = importlib.import_module(self._name)
        return getattr(module, attr)


def lazy_extra(name: str, reason: str) -> LazyModule:
    """`name` (dotted), imported when first used; the calling test module is skipped when its
    top-level package is not installed (checked without importing it)."""
    if importlib.util.find_spec(name.split(".")[0]) is None:
        pytest.skip(reason, allow_module_level=True)
    return LazyModule(name)
