"""`TrainArgs`: every section of a training run, composed from the arg classes of each component.

Each component defines (and validates) its own arguments next to the code that reads them; this
module only composes them and checks the few rules that span sections, before anything is built.
"""

from __future__ import annotations

import os
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    model_validator,
)

from bytelatent.archs.blt.args import ByteLatentTransformerArgs
from bytelatent.archs.blt.reference_format import looks_like_reference, reference_hint
from bytelatent.checkpoint.args import CheckpointArgs
from bytelatent.data.args import DataArgs
from bytelatent.distributed.args import DistributedArgs
from bytelatent.eval.args import EvalArgs
from bytelatent.launch.args import EnvVars
from bytelatent.model.args import LMTransformerArgs
from bytelatent.model.registry import arch_name_from_config, get_arch
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


def _arch_args_errors(exc: ValidationError, arch: str) -> str:
    """One line per problem, named like every other key (`arch_args.dim: ...`)."""
    return "; ".join(
        f"arch_args.{'.'.join(str(p) for p in e['loc'])}: {e['msg']} (arch {arch})"
        for e in exc.errors()
    )


# Validation context key: False when the config was not written by this run's user.
ALLOW_ARCH_IMPORT = "allow_arch_import"


class TrainArgs(BaseModel):
    """A training run. Field names follow the reference BLT `TrainArgs` where they exist."""

    model_config = ConfigDict(extra="forbid")

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
        description="architecture (bytelatent/model/registry.py): blt (args in `model`), entropy "
        "or lm (args in `entropy_model`), or 'package.module:name' for one a module registers "
        "(args in `arch_args`; docs/extending.md, How to add a model)",
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
    model: ByteLatentTransformerArgs | None = Field(
        default_factory=ByteLatentTransformerArgs,
        description="BLT shape: global (latent) transformer, local encoder/decoder, cross-attention, hashes",
    )
    entropy_model: LMTransformerArgs | None = Field(
        None, description="byte LM shape, used with train_entropy_model=true"
    )
    arch_args: Any = Field(
        None,
        description="args of an architecture registered outside bytelatent (validated by its "
        "spec's args class)",
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

    @model_validator(mode="before")
    @classmethod
    def _arch_compat(cls, data: Any) -> Any:
        """`train_entropy_model: true` (configs and params.json from before `arch`) means
        arch=entropy; the two keys must not disagree."""
        if not isinstance(data, dict) or not data.get("train_entropy_model"):
            return data
        arch = data.get("arch")
        if arch in (None, "entropy", "lm"):
            return {**data, "arch": arch or arch_name_from_config(data)}
        raise ValueError(
            f"train_entropy_model=true and arch={arch}: train_entropy_model=true means "
            "arch=entropy; remove train_entropy_model"
        )

    @model_validator(mode="after")
    def _arch_section(self, info: ValidationInfo) -> TrainArgs:
        # The user's own config may name a plugin module (importing it is their choice); a
        # config read back from a checkpoint (`from_saved`) may not make us import anything.
        allow_import = (info.context or {}).get(ALLOW_ARCH_IMPORT, True)
        try:
            spec = get_arch(self.arch, allow_import=allow_import)
        except ValueError as exc:
            raise ValueError(f"arch: {exc}") from None
        if ":" not in self.arch:
            self.arch = spec.name  # an alias (lm) is saved as the name it stands for
        if spec.name == "entropy":
            self.train_entropy_model = True  # old readers of config.yaml / params.json
        if spec.section == "entropy_model" and self.model is not None:
            if not self.model.model_dump(exclude_defaults=True):
                self.model = None  # the BLT's defaults, unread: as `model: null` did
        if spec.section == "arch_args":
            self._refuse_unread_sections(spec.name)
            if not isinstance(self.arch_args, spec.args_class):
                try:
                    self.arch_args = spec.args_class.model_validate(self.arch_args or {})
                except ValidationError as exc:
                    raise ValueError(_arch_args_errors(exc, self.arch)) from None
        elif self.arch_args is not None:
            raise ValueError(
                f"arch_args: only for architectures registered outside bytelatent; arch={self.arch} "
                f"reads `{spec.section}`"
            )
        return self

    def _refuse_unread_sections(self, arch: str) -> None:
        """An `arch_args` architecture reads neither `model` nor `entropy_model`: a key set there
        would change nothing, so it is a config error. A `model` section nobody wrote (the BLT's
        defaults) is dropped."""
        if self.entropy_model is not None:
            raise ValueError(
                f"entropy_model: arch={arch} does not read it (its args are `arch_args`); "
                "remove the entropy_model section"
            )
        if self.model is None:
            return
        changed = sorted(self.model.model_fields_set)
        if changed:
            keys = ", ".join(f"model.{key}" for key in changed)
            raise ValueError(
                f"{keys}: arch={arch} does not read the model section (its args are "
                "`arch_args`); remove it or set the matching arch_args key"
            )
        self.model = None

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
            check_run(self)
        return self

    @classmethod
    def from_saved(cls, saved: Any) -> TrainArgs:
        """The config a checkpoint's params.json holds: an arch `"pkg.module:name"` whose module
        this process has not imported is a validation error, never an import."""
        return cls.model_validate(saved, context={ALLOW_ARCH_IMPORT: False})

    @classmethod
    def config_format_hint(cls, tree: dict, path: str | None) -> str | None:
        """Parser hook (config/parser.py): a reference-format config gets one line naming the converter."""
        return reference_hint(path) if looks_like_reference(tree) else None

    @classmethod
    def config_unneeded_sections(cls, tree: dict) -> tuple[str, ...]:
        """Parser hook (config/parser.py): a dry run reads no data, so `data.root_dir: ???` and
        the like need not be set for it."""
        return ("data",) if tree.get("dry_run") is True else ()

    def active_model_args(self) -> BaseModel:
        """The args of the run's architecture (its spec's section)."""
        return getattr(self, get_arch(self.arch).section)
