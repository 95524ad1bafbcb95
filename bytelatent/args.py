"""`TrainArgs`: every section of a training run, composed from the arg classes of each component.

Each component defines (and validates) its own arguments next to the code that reads them; this
module only composes them and checks the few rules that span sections, before anything is built.
"""

from __future__ import annotations

import difflib
import os
import re
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    model_validator,
)

from bytelatent.checkpoint.args import CheckpointArgs
from bytelatent.data.args import DataArgs
from bytelatent.distributed.args import DistributedArgs
from bytelatent.eval.args import EvalArgs
from bytelatent.launch.args import EnvVars
from bytelatent.model.registry import (
    LEGACY_SECTIONS,
    MODEL_SECTION,
    arch_name_from_config,
    get_arch,
    registered_archs,
)
from bytelatent.trainer.actions import ActionArgs
from bytelatent.trainer.args import LoggingArgs, OptimArgs, ProfilerArgs
from bytelatent.trainer.distill_args import DistillArgs
from bytelatent.trainer.run_lock import RunLockArgs

# Exported before the process group is created; NCCL settings are harmless on CPU.
DEFAULT_ENV = {
    "TORCH_NCCL_AVOID_RECORD_STREAMS": "1",
    "NCCL_IB_TIMEOUT": "22",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
}


def _model_errors(exc: ValidationError, arch: str, args_class: type, name: str) -> str:
    """One line per problem, named like every other key (`model.dim: ...`); a key the
    architecture does not read says so (it would change nothing), with the parser's did-you-mean."""

    def line(e: dict) -> str:
        key = ".".join([name, *(str(p) for p in e["loc"])])
        if e["type"] != "extra_forbidden":
            return f"{key}: {e['msg'].removeprefix('Value error, ')} (arch {arch})"
        leaf = str(e["loc"][-1])
        close = difflib.get_close_matches(leaf, list(args_class.model_fields), n=1, cutoff=0.6)
        hint = (
            f" (did you mean {key[: -len(leaf)]}{close[0]}?)"
            if close and len(e["loc"]) == 1
            else ""
        )
        return f"{key}: unknown key{hint}; arch={arch} does not read it ({args_class.__name__})"

    return "; ".join(line(e) for e in exc.errors())


def _is_unwritten_blt_section(value: Any) -> bool:
    """Whether `value`, found next to an old-named section (`entropy_model`, `arch_args`), is
    what old configs and params.json files held under `model` for every architecture: null, or
    every key of the args whose old section name is `model` at its default (a dump of the
    defaults, written by no user; a partial section is a user's keys)."""
    if value is None or value == {}:
        return True
    for spec in registered_archs().values():
        if spec.legacy_section != MODEL_SECTION:
            continue
        if isinstance(value, BaseModel):
            if type(value) is spec.args_class and not value.model_dump(exclude_defaults=True):
                return True
            continue
        if not isinstance(value, dict) or value.keys() != spec.args_class.model_fields.keys():
            continue  # a partial section: keys a user wrote
        try:
            args = spec.args_class.model_validate(value)
        except ValidationError:
            continue
        if not args.model_dump(exclude_defaults=True):
            return True
    return False


def _merge_old_section(model: Any, old: Any, key: str, arch: str) -> Any:
    """`model` and `key` (its old name) in a user's config hold one section: keys from both, a
    key in both with different values refused (a dotlist `model.x=` over an old `arch_args:`).
    Old configs had the BLT's section under `model` next to entropy_model: its keys are now
    refused by the chosen architecture's args class, naming each."""
    if isinstance(model, BaseModel) or isinstance(old, BaseModel):
        raise ValueError(
            f"model and {key}: both set for arch={arch}; {key} is the old name of model, keep model"
        )
    if not isinstance(model, dict) or not isinstance(old, dict):
        return old if not isinstance(old, dict) else model
    for name in sorted(model.keys() & old.keys()):
        if model[name] != old[name]:
            raise ValueError(
                f"model.{name} and {key}.{name}: both set for arch={arch} ({key} is the old name "
                "of model); set it once, under model"
            )
    return {**old, **model}


_MODEL_KEY = re.compile(r"(?<![\w.])model\.")


def _as_named(message: str, name: str) -> str:
    """`message` with its `model.` keys named `name.` (what the config called the section)."""
    return message if name == MODEL_SECTION else _MODEL_KEY.sub(name + ".", message)


# Validation context key: False when the config was not written by this run's user.
ALLOW_ARCH_IMPORT = "allow_arch_import"


class TrainArgs(BaseModel):
    """A training run. Field names follow the reference BLT `TrainArgs` where they exist."""

    model_config = ConfigDict(extra="forbid")
    # the name the config gave the `model` section (an old one: entropy_model, arch_args)
    _model_key: str = PrivateAttr(MODEL_SECTION)

    name: str = Field("bytelatent", description="run name (wandb, SLURM job name)")
    dump_dir: str = Field(
        ..., description="where config.yaml, metrics.jsonl, train.log and checkpoints go"
    )
    seed: int = Field(
        42, description="torch's global RNG seed (dropout); weight init uses model.seed"
    )
    debug_dynamo: bool = Field(False, description="verbose torch.compile (dynamo) logging")
    grad_acc_steps: int = Field(1, ge=1, description="micro-batches per optimizer step")
    gc_collect_freq: int = Field(1000, ge=0, description="0 leaves Python's GC automatic")
    steps: int = Field(1000, ge=1, description="LR-schedule horizon and loop end")
    max_steps: int | None = Field(
        None, ge=1, description="stop early at this step (schedule keeps `steps`)"
    )
    relative_steps: int | None = Field(
        None,
        ge=1,
        description="train this many more steps from the resumed step (trainer/loop_controls.py)",
    )
    probe_freq: int | None = Field(
        None,
        ge=1,
        description="module output stats and grad norms every N steps to dump_dir/probe/",
    )
    arch: str = Field(
        "blt",
        description="architecture: a built-in one (the list: bytelatent/archs/__init__.py) or "
        "'package.module:name' for one a module registers (docs/extending.md); its args are "
        "the `model` section",
    )
    train_entropy_model: bool = Field(
        False,
        description="same as arch=entropy (kept for configs and checkpoints from before `arch`)",
    )
    num_threads: int | None = Field(
        None,
        ge=1,
        description="torch intra-op threads on CPU (default: $OMP_NUM_THREADS if set, else this "
        "rank's share of the cores less one for the async data worker)",
    )
    dry_run: bool = Field(
        False,
        description="build the model on meta, write model-info.txt, print its size; no training",
    )

    data: DataArgs = Field(
        default_factory=DataArgs,
        description="corpus, sources and mixture weights, tokenizer, patcher, batch and sequence sizes",
    )
    optim: OptimArgs = Field(
        default_factory=OptimArgs,
        description="AdamW, gradient clipping, learning-rate schedule and warmup",
    )
    model: Any = Field(
        None,
        description="the architecture's args, schema from `arch` (--help model: the default "
        "arch's keys); old configs' entropy_model and arch_args sections are read as this one",
    )
    distributed: DistributedArgs = Field(
        default_factory=DistributedArgs,
        description="mesh (dp_replicate x dp_shard x tp), FSDP, dtypes, activation checkpointing",
    )
    env: EnvVars = Field(
        default_factory=lambda: dict(DEFAULT_ENV),
        description="environment variables exported before the process group starts",
    )
    checkpoint: CheckpointArgs = Field(
        default_factory=CheckpointArgs,
        description="where and how often to save, retention, resume and warm start",
    )
    logging: LoggingArgs = Field(
        default_factory=LoggingArgs, description="log frequency, console line, peak FLOP/s for MFU"
    )
    profiling: ProfilerArgs = Field(
        default_factory=ProfilerArgs,
        description="torch.profiler trace window (start step, active steps, CUDA memory snapshot)",
    )
    run_lock: RunLockArgs = Field(
        default_factory=RunLockArgs,
        description="one run per dump_dir: the lock's heartbeat and when a dead holder's lock is stale",
    )
    eval: EvalArgs = Field(
        default_factory=EvalArgs,
        description="validation bpb in the loop / before training, eval tasks, async eval jobs",
    )
    actions: list[ActionArgs] = Field(
        default_factory=list,
        description="run after each log step and evaluation: {kind: early_stop, metric, mode, "
        "patience, min_delta} or {kind: nonfinite_stop, max_skipped_steps}",
    )
    distill: DistillArgs | None = Field(
        None,
        description="a frozen token-level teacher to distill from (byteify, docs/byteify.md): "
        "{teacher: HF folder, weight, temperature}",
    )

    @model_validator(mode="wrap")
    @classmethod
    def _one_model_section(
        cls, data: Any, handler: ModelWrapValidatorHandler, info: ValidationInfo
    ) -> TrainArgs:
        """Fold the old section names into `model` (`_fold_old_sections`); messages about the
        section's keys (resume checks) name it as the config did."""
        data, key = _fold_old_sections(data, info)
        args = handler(data)
        args._model_key = key  # (the after validators run outside this one: they see it)
        return args

    @model_validator(mode="after")
    def _arch_section(self, info: ValidationInfo) -> TrainArgs:
        spec = _spec_for(self.arch, info)
        if ":" not in self.arch:
            self.arch = spec.name  # an alias (lm) is saved as the name it stands for
        if spec.legacy_section == "entropy_model":
            self.train_entropy_model = True  # old readers of config.yaml / params.json
        if not isinstance(self.model, spec.args_class):
            value = self.model
            if isinstance(value, BaseModel):  # another architecture's args object
                value = value.model_dump(exclude_unset=True)
            try:
                self.model = spec.args_class.model_validate(value or {})
            except ValidationError as exc:
                raise ValueError(
                    _model_errors(exc, self.arch, spec.args_class, self._model_key)
                ) from None
        return self

    @model_validator(mode="after")
    def _cross_section_rules(self) -> TrainArgs:
        if not self.dump_dir:
            raise ValueError("dump_dir: must be set (e.g. dump_dir=runs/debug)")
        if self.max_steps is not None and self.max_steps > self.steps:
            raise ValueError(f"max_steps ({self.max_steps}) exceeds steps ({self.steps})")
        if self.max_steps is not None and self.relative_steps is not None:
            raise ValueError("max_steps and relative_steps: set at most one of them")
        if self.checkpoint.path is None:
            self.checkpoint.path = os.path.join(self.dump_dir, "checkpoints")
        if self.eval.async_launch.mode != "none" and self.checkpoint.eval.every == 0:
            raise ValueError(
                f"eval.async_launch.mode={self.eval.async_launch.mode}: evaluates checkpoint.eval "
                "saves, but checkpoint.eval.every=0; set it > 0"
            )
        check_run = get_arch(self.arch).check_run
        if check_run is not None:
            try:
                check_run(self)
            except ValueError as exc:
                raise ValueError(_as_named(str(exc), self._model_key)) from None
        return self

    @classmethod
    def from_saved(cls, saved: Any) -> TrainArgs:
        """The config a checkpoint's params.json holds: an arch `"pkg.module:name"` whose module
        this process has not imported is a validation error, never an import."""
        return cls.model_validate(saved, context={ALLOW_ARCH_IMPORT: False})

    @classmethod
    def config_format_hint(cls, tree: dict, path: str | None) -> str | None:
        """Parser hook (config/parser.py): a config in another project's format (the reference
        BLT's) gets the one line an architecture's adapter gives, e.g. naming its converter."""
        for spec in registered_archs().values():
            hint = spec.adapters.config_format_hint
            line = hint(tree, path) if hint is not None else None
            if line:
                return line
        return None

    @classmethod
    def config_key_aliases(cls, tree: dict) -> tuple[str, ...]:
        """Parser hook (config/parser.py): `model` and the old name this config's arch gave it
        (`entropy_model`, `arch_args`) are one key: each file and dotlist is renamed before they
        merge, so the later one wins whichever name it uses."""
        try:
            spec = get_arch(arch_name_from_config(tree), allow_import=True)
        except ValueError:
            return ()  # validation names the arch's problem
        old = spec.legacy_section
        return () if old == MODEL_SECTION else (MODEL_SECTION, old)

    @classmethod
    def config_unneeded_sections(cls, tree: dict) -> tuple[str, ...]:
        """Parser hook (config/parser.py): a dry run reads no data, so `data.root_dir: ???` and
        the like need not be set for it."""
        return ("data",) if tree.get("dry_run") is True else ()

    @property
    def model_key(self) -> str:
        """What the config called the `model` section (`entropy_model`, `arch_args` in configs
        that still use an old name), for messages that name its keys as the user wrote them."""
        return self._model_key

    def active_model_args(self) -> BaseModel:
        """The args of the run's architecture (the `model` section)."""
        return self.model

    @classmethod
    def config_section_class(cls, name: str) -> type | None:
        """Help hook (config/help.py): the args class `--help model` lists (the default arch's)."""
        if name != MODEL_SECTION:
            return None
        return get_arch(cls.model_fields["arch"].default).args_class


def _fold_old_sections(data: Any, info: ValidationInfo) -> tuple[Any, str]:
    """(`data` with its old-named sections folded into `model`, the name the config gave the
    section). The chosen spec's `legacy_section` (`entropy_model`, `arch_args`) holds its args in
    old files; another old-named section must be null (old files wrote `entropy_model: null`):
    a set one is read by nothing."""
    if not isinstance(data, dict):
        return data, MODEL_SECTION
    data = _entropy_flag(data)
    old = {k: data[k] for k in LEGACY_SECTIONS if k != MODEL_SECTION and k in data}
    if not old:
        return data, MODEL_SECTION
    data = {k: v for k, v in data.items() if k not in old}
    spec = _spec_for(arch_name_from_config(data), info)
    named = MODEL_SECTION
    for key, value in old.items():
        if value is None:
            continue
        if key != spec.legacy_section:
            if not _users_config(info):
                continue  # a saved file from before one section: that section was read by nothing
            raise ValueError(
                f"{key}: arch={spec.name} does not read it (its args are the `model` section); "
                f"remove the {key} section"
            )
        model = data.get(MODEL_SECTION)
        if _is_unwritten_blt_section(model) or not _users_config(info):
            # a saved file from before one section: its `model` was the BLT's, read by nothing
            named, data[MODEL_SECTION] = key, value
            continue
        data[MODEL_SECTION] = _merge_old_section(model, value, key, spec.name)
    return data, named


def _entropy_flag(data: dict) -> dict:
    """`train_entropy_model: true` (configs and params.json from before `arch`) means
    arch=entropy; the two keys must not disagree."""
    if not data.get("train_entropy_model"):
        return data
    arch = data.get("arch")
    if arch in (None, "entropy", "lm"):
        return {**data, "arch": arch or arch_name_from_config(data)}
    raise ValueError(
        f"train_entropy_model=true and arch={arch}: train_entropy_model=true means "
        "arch=entropy; remove train_entropy_model"
    )


def _users_config(info: ValidationInfo) -> bool:
    """Whether the config was written by this run's user (else a file read back: `from_saved`)."""
    return (info.context or {}).get(ALLOW_ARCH_IMPORT, True)


def _spec_for(arch: str, info: ValidationInfo) -> Any:
    """The spec `arch` names. The user's own config may name a plugin module (importing it is
    their choice); a config read back from a checkpoint (`from_saved`) may not import anything."""
    try:
        return get_arch(arch, allow_import=_users_config(info))
    except ValueError as exc:
        raise ValueError(f"arch: {exc}") from None
