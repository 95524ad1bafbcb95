"""Device bugs planted on the BLT's per-byte path (scenarios.py ``plant``): the sync check must
report each at its line here (the tests find the line by its ``# plant:`` marker)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path

import torch


def _blocking_copy(self) -> None:
    torch.tensor(self.length).to(self.device)  # plant: blocking_copy


def _pageable_copy(self) -> None:
    torch.tensor(self.length).to(self.device, non_blocking=True)  # plant: pageable_copy


def _item(self) -> None:
    if self.tokens.sum().item() < 0:  # plant: item
        raise AssertionError("unreachable")


BUGS = {"blocking_copy": _blocking_copy, "pageable_copy": _pageable_copy, "item": _item}


def engine_module(arch: str):
    """The module of an architecture's generation engine: ``bytelatent.archs.<arch>.generation``,
    or before the issue-37 layout ``bytelatent.eval.generation.<arch>`` (bench/generation_syncs.py
    traces older revisions with these scenarios)."""
    import bytelatent

    # by file, not by trying the import: an editable install may resolve a missing submodule
    # from another checkout
    root = Path(bytelatent.__file__).parent
    if (root / "archs" / arch / "generation.py").exists():
        return importlib.import_module(f"bytelatent.archs.{arch}.generation")
    return importlib.import_module(f"bytelatent.eval.generation.{arch}")


def plant(name: str) -> Callable[[], None]:
    """``IncrementalBLT.step`` runs the bug ``name`` before each step; returns the undo."""
    IncrementalBLT = engine_module("blt").IncrementalBLT  # noqa: N806

    step, bug = IncrementalBLT.step, BUGS[name]

    def planted(self, *args, **kwargs):
        bug(self)
        return step(self, *args, **kwargs)

    IncrementalBLT.step = planted

    def undo() -> None:
        IncrementalBLT.step = step

    return undo
