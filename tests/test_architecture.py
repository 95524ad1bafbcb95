"""The `bytelatent` import graph: no import circle, and no layer imports a layer above it.

The graph is read statically (ast) from `bytelatent/` and `apps/`: module-level imports,
imports inside functions and `if TYPE_CHECKING:` imports all count, since each is a dependency
a reader has to follow. Imports by name at run time (`importlib`, the eval task registry) are
not seen.

`LAYERS` (bottom first) is the table of docs/architecture.md: a module belongs to the layer of
its longest matching prefix, and may import modules of its own layer or of a layer below.
`python tests/test_architecture.py` prints the graph's numbers.
"""

from __future__ import annotations

import ast
import functools
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOTS = ("bytelatent", "apps")

# Bottom first. A module may import its own layer and the layers listed before it.
LAYERS: dict[str, tuple[str, ...]] = {
    # one-line errors, progress bars, the generic config parser, sbatch resources: no torch
    "base": (
        "bytelatent.errors",
        "bytelatent.exit_hooks",
        "bytelatent.compat",
        "bytelatent.progress",
        "bytelatent.config",
        "bytelatent.launch.args",
    ),
    # rank/world/device, mesh, FSDP/TP wrapping (through the model's `fsdp_units()`), signals
    "distributed": ("bytelatent.distributed",),
    "tokenizers": ("bytelatent.tokenizers",),
    "model": ("bytelatent.model",),
    # DCP save/load, verification, released and HF weights: knows models, not data
    "checkpoint": ("bytelatent.checkpoint",),
    # readers, iterators, patcher (realtime patching loads its entropy model through checkpoint)
    "data": ("bytelatent.data",),
    # trainer parts that TrainArgs composes and eval reuses (metrics, optim, actions, ...)
    "trainer parts": ("bytelatent.trainer",),
    "eval": ("bytelatent.eval",),
    # one folder per architecture (model, args, spec, estimates, generation engine, adapters)
    "archs": ("bytelatent.archs",),
    # TrainArgs composes every section's arg class
    "args": ("bytelatent.args",),
    "launch": ("bytelatent.launch",),
    # what takes a TrainArgs and runs it
    "training": (
        "bytelatent.trainer.trainer",
        "bytelatent.trainer.build",
        "bytelatent.trainer.loop_controls",
        "bytelatent.trainer.model_info",
        "bytelatent.trainer.memory_advice",
        "bytelatent.trainer.resume_check",
        "bytelatent.trainer.resume_config",
        "bytelatent.preflight",
    ),
    "entry points": (
        "bytelatent",
        "bytelatent.train",
        "bytelatent.generate",
        "bytelatent.print_config",
        "bytelatent.data.check",
        "bytelatent.data.patch_size",
        "bytelatent.archs.blt.from_reference",
        "apps",
    ),
}

# Edges (importer, imported) both checks ignore while other branches cut them; empty it once
# they are merged (a test below fails when an entry is no longer needed).
# (importer, imported), each with a reason.
KNOWN_EXCEPTIONS: set[tuple[str, str]] = set()


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    where: str  # path:line
    in_function: bool


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every .py under ROOTS (a package is its __init__)."""
    modules = {}
    for root in ROOTS:
        for path in sorted((REPO / root).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """`bytelatent.config.parse_args` -> `bytelatent.config` (the longest module prefix)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _targets(node: ast.Import | ast.ImportFrom, package: str) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:  # relative import
        parts = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join([*parts, base] if base else parts)
    return [f"{base}.{alias.name}" for alias in node.names]


def _walk(node: ast.AST, in_function: bool) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child, in_function
        functions = ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda
        inner = in_function or isinstance(child, functions)
        yield from _walk(child, inner)


@functools.cache
def import_graph() -> tuple[Import, ...]:
    """Every import of one of our modules by one of our modules (one entry per statement)."""
    modules = module_files()
    found = []
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(), filename=str(path))
        for node, in_function in _walk(tree, False):
            targets = {_resolve(t, modules) for t in _targets(node, package)}
            where = f"{path.relative_to(REPO)}:{node.lineno}"
            found += [Import(name, t, where, in_function) for t in sorted(targets - {None, name})]
    return tuple(found)


def layer_of(module: str) -> str | None:
    """The layer of the longest prefix of `module` in LAYERS (`bytelatent` alone is no prefix)."""
    best, best_len = None, -1
    for layer, prefixes in LAYERS.items():
        for prefix in prefixes:
            matches = module == prefix or (
                prefix != "bytelatent" and module.startswith(prefix + ".")
            )
            if matches and len(prefix) > best_len:
                best, best_len = layer, len(prefix)
    return best


def circles(edges: list[Import]) -> list[list[str]]:
    """One import cycle (a list of modules, first repeated last) per strongly connected component."""
    graph: dict[str, set[str]] = {}
    for edge in edges:
        graph.setdefault(edge.importer, set()).add(edge.imported)
    found = []
    for component in _components(graph):
        found.append(_cycle_through(min(component), graph, component))
    return found


def _components(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's strongly connected components with more than one module (iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    result = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    result.append(component)
    return result


def _cycle_through(start: str, graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """Shortest path start -> ... -> start inside the component (breadth first)."""
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for child in sorted(graph.get(node, set()) & component):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [*reversed(path), start]
                if child not in previous:
                    previous[child] = node
                    nxt.append(child)
        frontier = nxt
    raise AssertionError(f"no cycle through {start}")  # a component always has one


def _checked_edges() -> list[Import]:
    return [e for e in import_graph() if (e.importer, e.imported) not in KNOWN_EXCEPTIONS]


def _describe_cycle(cycle: list[str], edges: list[Import]) -> str:
    where = {(e.importer, e.imported): e.where for e in edges}
    steps = [f"{a} -> {b} ({where[a, b]})" for a, b in zip(cycle, cycle[1:])]
    return "import circle: " + "; ".join(steps)


def test_no_import_circle():
    edges = _checked_edges()
    problems = [_describe_cycle(cycle, edges) for cycle in circles(edges)]
    assert not problems, "\n".join(problems)


def test_every_module_has_a_layer():
    unplaced = sorted(m for m in module_files() if layer_of(m) is None)
    assert not unplaced, f"add these modules to LAYERS in {Path(__file__).name}: {unplaced}"


def test_no_layer_imports_a_higher_layer():
    order = {layer: i for i, layer in enumerate(LAYERS)}
    problems = []
    for edge in _checked_edges():
        low, high = layer_of(edge.importer), layer_of(edge.imported)
        if low is not None and high is not None and order[high] > order[low]:
            problems.append(
                f"{edge.where}: {edge.importer} (layer '{low}') imports {edge.imported} "
                f"(layer '{high}', above it)"
            )
    assert not problems, "\n".join(problems)


def test_known_exceptions_are_still_needed():
    edges = {(e.importer, e.imported) for e in import_graph()}
    stale = sorted(KNOWN_EXCEPTIONS - edges)
    assert not stale, f"these imports are gone; remove them from KNOWN_EXCEPTIONS: {stale}"


def test_the_checks_catch_a_circle_and_an_upward_import():
    """The checks themselves: a made-up circle and a made-up upward edge are reported."""
    made_up = [
        Import("bytelatent.model.layers", "bytelatent.trainer.trainer", "x.py:1", False),
        Import("bytelatent.trainer.trainer", "bytelatent.model.layers", "y.py:2", False),
    ]
    assert circles(made_up) == [
        ["bytelatent.model.layers", "bytelatent.trainer.trainer", "bytelatent.model.layers"]
    ]
    assert layer_of("bytelatent.model.layers") == "model"
    assert layer_of("bytelatent.trainer.trainer") == "training"
    assert layer_of("bytelatent.trainer.metrics") == "trainer parts"
    assert layer_of("bytelatent.archs.blt.from_reference") == "entry points"
    assert layer_of("bytelatent") == "entry points" and layer_of("bytelatent.nowhere") is None


def summary() -> dict[str, int]:
    """The numbers reported for the import graph (all edges, exceptions included)."""
    edges = import_graph()
    in_function = [e for e in edges if e.in_function]
    return {
        "modules": len(module_files()),
        "import edges": len({(e.importer, e.imported) for e in edges}),
        "function-level bytelatent imports (statements)": len({e.where for e in in_function}),
        "files with function-level bytelatent imports": len(
            {e.where.split(":")[0] for e in in_function}
        ),
        "import circles": len(circles(edges)),
    }


if __name__ == "__main__":
    for key, value in summary().items():
        print(f"{key}: {value}")
    for edge in (e for e in import_graph() if e.in_function):
        print(f"  {edge.where}: {edge.importer} -> {edge.imported}", file=sys.stderr)


# ---------------------------------------------------------------------------------------------
# One folder per architecture (issue 37): `bytelatent/archs/<name>/` is reached from outside only
# through the built-in list (`bytelatent.archs`) and the registry; the framework asks the spec.

ARCHS = "bytelatent.archs"
# (importer, imported folder) allowed besides the built-in list, each with its reason
FOLDER_IMPORTS_ALLOWED: dict[tuple[str, str], str] = {
    ("bytelatent.archs.blt", "bytelatent.archs.lm"): "the BLT's entropy model is the byte LM",
    ("bytelatent.archs.lm", "bytelatent.archs.blt"): "the byte LM's HF export is the BLT's "
    "BltPatcher format (archs/lm/spec.py)",
}
# Code (not docstrings) that compares something with an architecture's name, outside its folder:
# old configs' and params.json's compatibility rules, the compare recipe that picks by name, and
# the tokenizers (whose own name 'blt' is not the architecture).
NAME_CHECKS_ALLOWED = {
    "bytelatent.args",
    "bytelatent.model.registry",
    "bytelatent.tokenizers",
    "apps.compare",
}
ARCH_NAMES = {"blt": "blt", "hnet": "hnet", "entropy": "lm", "lm": "lm"}


def _folder(module: str) -> str | None:
    parts = module.split(".")
    return ".".join(parts[:3]) if module.startswith(ARCHS + ".") else None


def _importer_key(importer: str) -> str:
    return _folder(importer) or importer


def test_arch_folders_are_reached_only_through_the_builtin_list():
    problems = []
    for edge in import_graph():
        folder = _folder(edge.imported)
        if folder is None or edge.importer == ARCHS or _folder(edge.importer) == folder:
            continue
        if (_importer_key(edge.importer), folder) not in FOLDER_IMPORTS_ALLOWED:
            problems.append(f"{edge.where}: {edge.importer} imports {edge.imported} (ask the spec)")
    assert not problems, "\n".join(problems)


def test_folder_import_allowances_are_still_needed():
    used = {
        (_importer_key(e.importer), _folder(e.imported))
        for e in import_graph()
        if _folder(e.imported)
    }
    stale = sorted(set(FOLDER_IMPORTS_ALLOWED) - used)
    assert not stale, f"remove these from FOLDER_IMPORTS_ALLOWED: {stale}"


def _name_comparisons(path: Path) -> Iterator[tuple[int, str]]:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            for sub in ast.walk(node):
                if isinstance(sub, ast.Constant) and sub.value in ARCH_NAMES:
                    yield node.lineno, str(sub.value)


def test_no_framework_code_branches_on_an_architecture_name():
    """`if args.arch == "hnet"` outside archs/hnet/ is what the spec replaces."""
    problems = []
    for module, path in module_files().items():
        if any(module == m or module.startswith(m + ".") for m in NAME_CHECKS_ALLOWED):
            continue
        for line, name in _name_comparisons(path):
            if _folder(module) != f"{ARCHS}.{ARCH_NAMES[name]}":
                problems.append(f"{path.relative_to(REPO)}:{line}: compares with {name!r}")
    # 'entropy' is also a patching mode: compared inside the BLT's folder and the patcher's args
    problems = [p for p in problems if not p.endswith("'entropy'")]
    assert not problems, "\n".join(problems)


def test_hnet_is_named_only_in_its_folder():
    """The H-Net's name (unambiguous, unlike 'blt' or 'entropy', which are also a tokenizer and a
    patching mode) appears in no string outside archs/hnet/, the compare recipe aside."""
    problems = []
    for module, path in module_files().items():
        if module.startswith(f"{ARCHS}.hnet") or module.startswith("apps.compare"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value == "hnet":
                problems.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not problems, "'hnet' named outside archs/hnet/: " + ", ".join(problems)


def test_builtin_specs_are_torch_free_and_listed_once():
    """Importing the built-in list (every spec) imports no torch: config validation and --help
    stay light."""
    code = (
        "import sys; import bytelatent.archs as a; "
        "assert 'torch' not in sys.modules, 'torch imported'; "
        "print(sorted(s.name for s in a.BUILTINS))"
    )
    import subprocess

    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "['blt', 'entropy', 'hnet']"
