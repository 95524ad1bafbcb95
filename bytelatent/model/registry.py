"""The model registry: one `ArchSpec` per architecture, found by name.

The trainer, eval, generation and checkpoint code ask the spec of a run (`get_arch(args.arch)`)
or of a built model (`arch_of(model)`); only the spec knows the model class. This module and the
spec objects are torch-free: everything that needs torch is a lazy reference, a
`"package.module:attribute"` string resolved on first use (`ArchSpec.resolve`), so `TrainArgs`
validates (and `--help` answers) without importing torch.

Built-in architectures (`bytelatent/model/archs.py`): `blt` (ByteLatentTransformer) and `entropy`
(alias `lm`: the byte-level LMTransformer). An architecture defined outside the package registers
itself when its module is imported: the config names it `arch: "my_pkg.my_arch:my_name"`, and
`get_arch` imports `my_pkg.my_arch` (which calls `register_arch`) before looking up `my_name`
(docs/extending.md, "How to add a model").

Importing a module runs its code, so only the user's own choice imports one: `get_arch` imports
only with `allow_import=True` (the user's config, `TrainArgs`; `allow_arch_import=true` /
`--allow-arch-import` on the CLIs that read a checkpoint). A name read from a file someone
handed us (a checkpoint's params.json) finds an architecture already registered, or is refused
(docs/reliability.md, threat model).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# TrainArgs sections that may hold an architecture's args: the built-in ones and `arch_args`,
# the section of every architecture registered outside bytelatent.
ARCH_SECTIONS = ("model", "entropy_model", "arch_args")

Ref = str | Callable | None  # "module:attr" (resolved lazily), the object itself, or absent


@dataclass(frozen=True)
class AuxLoss:
    """An auxiliary loss term: the model's forward returns its value (a scalar, the mean over the
    micro-batch) under `name`; the trainer adds `weight * value` to the objective and logs the
    unweighted value as `aux/<name>` (`bpb` and `loss` stay the LM loss only)."""

    name: str
    weight: float = 1.0


@dataclass(frozen=True)
class ArchSpec:
    """Everything the framework asks of an architecture.

    Lazy references (`Ref`) are `"module:attribute"` strings, or the object itself where the
    spec's module may import torch anyway. Signatures:

    - `model`: `(args) -> nn.Module`, called under `torch.device("meta")`; the module then
      follows the init contract (`to_empty`, `init_weights`) and may define `fsdp_units()`,
      `ac_units()` and `tp_plan(tp_size)` (its parallel units, `bytelatent/distributed`).
    - forward: `model(x, **{name: batch.<name> for name in batch_inputs}, host=batch if
      host_batch)` -> logits `[B, L, V]`, or `(logits, {aux name: scalar})` when `aux_losses`
      (the dict may also hold metrics-only entries whose names start with an `aux_metrics` prefix).
    - `flops`: `(model_args, data_args) -> (tokens, patches) -> training FLOPs` (MFU).
    - `measured_flops`: `(model_args, data_args, aux) -> counter like flops's, or None`: the
      counter at what the forward measured (`aux`: the log interval's `aux_metrics` means, e.g.
      H-Net's chunk counts); it gets the interval's summed sizes, so it must be linear in them.
    - `activation_bytes`: `(model, train_args, tp) -> bytes` autograd keeps (model-info.txt).
    - `size_lower_bound`: `(args) -> (values, blocks)` without building (`require_model_fits`).
    - `check_run`: `(train_args) -> None`, raises ValueError on a cross-section conflict.
    - `read_params`: `(params dict, where) -> (args, ignored reference fields)`, for either
      params.json layout (ours or the reference's); default: the `section` through `args_class`.
    - `reference_state_dict`: `(state, args) -> (state, notes)`: the reference's weights layout.
    - `warm_start`: `(model, model_args) -> bool`: weights from elsewhere for a fresh run.
    - `hf_export` / `hf_import`: the Hugging Face adapters (`python -m bytelatent.checkpoint`).
    - `generation_engine`: a class with `for_engine(model, patcher_args, entropy_model, batch,
      capacity)`, `prefill_last(row, tokens)`, `step(tokens, active)`, `patch_lengths(row, n)`.
    - `actions`: `(train_args, rank) -> list[Action]` the trainer runs at every log step next to
      the configured ones (`trainer/actions.py`; H-Net: the router collapse warning).
    """

    name: str
    args_class: type  # a torch-free pydantic model (extra="forbid")
    section: str  # the TrainArgs section holding the args, one of ARCH_SECTIONS
    model: Ref
    # Batches carry `patch_lengths`; a row is `data.max_encoder_seq_length` bytes in
    # `data.seq_len` patches (else a row is `data.seq_len` bytes) and generation needs a patcher.
    patched: bool = False
    batch_inputs: tuple[str, ...] = ()
    host_batch: bool = False
    aux_losses: tuple[AuxLoss, ...] = ()
    # Name prefixes of metrics-only entries the forward's aux dict may carry next to its aux
    # losses (e.g. H-Net's `chunk_len_mean/stage0`): logged as `aux/<name>` (the mean over
    # micro-batches, steps and ranks), never added to the objective.
    aux_metrics: tuple[str, ...] = ()
    flops: Ref = None
    measured_flops: Ref = None
    activation_bytes: Ref = None
    size_lower_bound: Ref = None
    check_run: Ref = None
    read_params: Ref = None
    reference_state_dict: Ref = None
    warm_start: Ref = None
    hf_export: Ref = None
    hf_import: Ref = None
    generation_engine: Ref = None
    actions: Ref = None
    aliases: tuple[str, ...] = ()
    description: str = ""
    _cache: dict = field(default_factory=dict, compare=False, repr=False)

    def resolve(self, name: str) -> Any:
        """The object behind field `name` (imported on first use), or None when unset."""
        ref = getattr(self, name)
        if not isinstance(ref, str):
            return ref
        if name not in self._cache:
            self._cache[name] = resolve_ref(ref, f"{self.name}.{name}")
        return self._cache[name]

    def logits(self, out: Any) -> Any:
        """The logits `[B, L, V]` of the model's forward output (`(logits, aux)` when the spec
        has `aux_losses`): for callers that score or generate (eval, harness, generation)."""
        return out[0] if self.aux_losses else out

    def build(self, args: Any) -> Any:
        """The model for `args` on the current device (the caller uses `torch.device("meta")`)."""
        return self.resolve("model")(args)

    def model_class(self) -> type | None:
        """The class `model` builds when `model` names a class (for `arch_of`)."""
        obj = self.resolve("model")
        return obj if isinstance(obj, type) else None

    def row_length(self, data_args: Any) -> int:
        """Bytes in one row of a batch."""
        return data_args.max_encoder_seq_length if self.patched else data_args.seq_len


def resolve_ref(ref: str, what: str = "reference") -> Any:
    """`"package.module:attr.sub"` -> the object."""
    module_name, _, attr = ref.partition(":")
    if not attr:
        raise ValueError(f"{what}: {ref!r} is not 'package.module:attribute'")
    obj = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


_REGISTRY: dict[str, ArchSpec] = {}
_ALIASES: dict[str, str] = {}
_builtins_loaded = False


def register_arch(spec: ArchSpec, replace: bool = False) -> ArchSpec:
    """Add `spec` (and its aliases); a second spec under a taken name is an error unless
    `replace` (re-importing the module that registered it is fine)."""
    if spec.section not in ARCH_SECTIONS:
        raise ValueError(
            f"arch {spec.name!r}: section {spec.section!r} is not one of {ARCH_SECTIONS} "
            "(an architecture defined outside bytelatent reads its args from 'arch_args')"
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
    global _builtins_loaded
    if not _builtins_loaded:
        _builtins_loaded = True
        importlib.import_module("bytelatent.model.archs")


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
    return {"arch", "train_entropy_model", *ARCH_SECTIONS}
