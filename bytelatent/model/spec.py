"""What the framework asks of an architecture: `ArchSpec` (torch-free; no registry here).

An architecture's folder (`bytelatent/archs/<name>/spec.py`, or one module of a plugin) builds
one `ArchSpec` of objects: its args class, a function returning its model class, and hooks grouped
by who asks (`Forward`: the trainer's call; `Sizes`: MFU and memory estimates; `Adapters`:
weights and configs from elsewhere). Hooks are plain callables; a spec module stays torch-free by
importing heavy modules inside them. The registry (`bytelatent/model/registry.py`) finds specs by
name; nothing outside an architecture's folder names it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class AuxLoss:
    """An auxiliary loss term: the model's forward returns its value (a scalar, the mean over the
    micro-batch) under `name`; the trainer adds `weight * value` to the objective and logs the
    unweighted value as `aux/<name>` (`bpb` and `loss` stay the LM loss only)."""

    name: str
    weight: float = 1.0


@dataclass(frozen=True)
class Forward:
    """How the trainer calls the model and reads its output.

    forward: `model(x, **{name: batch.<name> for name in batch_inputs}, host=batch if
    host_batch)` -> logits `[B, L, V]`, or `(logits, {aux name: scalar})` when `aux_losses` (the
    dict may also hold metrics-only entries whose names start with an `aux_metrics` prefix,
    logged as `aux/<name>`, never added to the objective). `patched`: batches carry
    `patch_lengths`, a row is `data.max_encoder_seq_length` bytes in `data.seq_len` patches (else
    `data.seq_len` bytes), and generation needs a patcher.
    """

    patched: bool = False
    batch_inputs: tuple[str, ...] = ()
    host_batch: bool = False
    aux_losses: tuple[AuxLoss, ...] = ()
    aux_metrics: tuple[str, ...] = ()


@dataclass(frozen=True)
class Sizes:
    """Estimates (each optional; absent: the report says so).

    - `flops`: `(model_args, data_args) -> (tokens, patches) -> training FLOPs` (MFU).
    - `measured_flops`: `(model_args, data_args, aux) -> counter like flops's, or None`: the
      counter at what the forward measured (`aux`: the log interval's `aux_metrics` means); it
      gets the interval's summed sizes, so it must be linear in them.
    - `activation_bytes`: `(model, train_args, tp) -> bytes` autograd keeps (model-info.txt).
    - `lower_bound`: `(args) -> (values, blocks)` without building (`require_model_fits`).
    """

    flops: Callable | None = None
    measured_flops: Callable | None = None
    activation_bytes: Callable | None = None
    lower_bound: Callable | None = None


@dataclass(frozen=True)
class Adapters:
    """Weights and configs from and to elsewhere (each optional).

    - `read_params`: `(params dict, where) -> (args, ignored reference fields)`, for either
      params.json layout (ours or a reference's); default: the `model` section (or
      `legacy_section`) through `args_class`.
    - `patcher_settings`: `(params dict) -> {PatcherArgs field: value}` a params.json keeps
      outside `data.patcher_args` (a reference layout's model section); generation reads them.
    - `config_format_hint`: `(config tree, path) -> one line | None`: a training config in
      another project's format (the parser shows the line instead of its first unknown key).
    - `reference_state_dict`: `(state, args) -> (state, notes)`: a reference's weights layout.
    - `warm_start`: `(model, model_args) -> bool`: weights from elsewhere for a fresh run.
    - `hf_export`: `(ckpt, out, entropy_model, allow_window_mismatch) -> notes`;
      `hf_import`: `(hf_dir, out) -> out`; `hf_model_types`: the config.json `model_type`s
      `hf_import` reads (`python -m bytelatent.checkpoint import-hf` picks the spec by them).
    """

    read_params: Callable | None = None
    patcher_settings: Callable | None = None
    config_format_hint: Callable | None = None
    reference_state_dict: Callable | None = None
    warm_start: Callable | None = None
    hf_export: Callable | None = None
    hf_import: Callable | None = None
    hf_model_types: tuple[str, ...] = ()


@dataclass(frozen=True)
class ArchSpec:
    """Everything the framework asks of an architecture.

    - `args_class`: a torch-free pydantic model (extra="forbid"), the schema of TrainArgs'
      `model` section when `arch` names this spec. `legacy_section`: the name that section had
      in configs and params.json files saved before one `model` section (`arch_args` for any
      architecture outside bytelatent), still read as a compatibility name.
    - `model`: `() -> model class`; `model()(args)` is called under `torch.device("meta")`, then
      the init contract (`to_empty`, `init_weights`); the module may define `fsdp_units()`,
      `ac_units()` and `tp_plan(tp_size)` (its parallel units, `bytelatent/distributed`).
    - `check_run`: `(train_args) -> None`, raises ValueError on a cross-section conflict.
    - `generation_engine`: `() -> class` with `for_engine(model, patcher_args, entropy_model,
      batch, capacity)`, `prefill_last(row, tokens)`, `step(tokens, active)`,
      `patch_lengths(row, n)`.
    - `actions`: `(train_args, rank) -> list[Action]` the trainer runs at every log step next to
      the configured ones (`trainer/actions.py`; H-Net: the router collapse warning).
    """

    name: str
    args_class: type
    model: Callable[[], type] | None
    forward: Forward = field(default_factory=Forward)
    sizes: Sizes = field(default_factory=Sizes)
    adapters: Adapters = field(default_factory=Adapters)
    check_run: Callable[[Any], None] | None = None
    generation_engine: Callable[[], type] | None = None
    actions: Callable[[Any, int], list] | None = None
    aliases: tuple[str, ...] = ()
    description: str = ""
    legacy_section: str = "arch_args"

    # the forward contract, read often enough to be spelled short
    @property
    def patched(self) -> bool:
        return self.forward.patched

    @property
    def batch_inputs(self) -> tuple[str, ...]:
        return self.forward.batch_inputs

    @property
    def host_batch(self) -> bool:
        return self.forward.host_batch

    @property
    def aux_losses(self) -> tuple[AuxLoss, ...]:
        return self.forward.aux_losses

    @property
    def aux_metrics(self) -> tuple[str, ...]:
        return self.forward.aux_metrics

    def logits(self, out: Any) -> Any:
        """The logits `[B, L, V]` of the model's forward output (`(logits, aux)` when the spec
        has `aux_losses`): for callers that score or generate (eval, harness, generation)."""
        return out[0] if self.aux_losses else out

    def build(self, args: Any) -> Any:
        """The model for `args` on the current device (the caller uses `torch.device("meta")`)."""
        return self.model()(args)

    def model_class(self) -> type | None:
        """The class `model` returns (for `arch_of`), None when unset."""
        cls = self.model() if self.model is not None else None
        return cls if isinstance(cls, type) else None

    def row_length(self, data_args: Any) -> int:
        """Bytes in one row of a batch."""
        return data_args.max_encoder_seq_length if self.patched else data_args.seq_len
