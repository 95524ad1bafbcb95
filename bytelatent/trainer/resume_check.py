"""Before a run starts: is there anything left to do, and does the config still fit the checkpoint?

Read-only and cheap (no model weights, no process-group collectives), so a run that would do
nothing, or could not load its checkpoint, leaves `dump_dir` exactly as it found it:

* the newest complete checkpoint already reached the stop step: one line, exit 0;
* the config differs from the checkpoint's `params.json`: the differing keys are logged in one
  line, each applied one saying what takes its new value; a change of the model's parameter
  shapes (which the checkpoint could never load), or of a key the restored states would silently
  override (data.seq_len, the patcher, ...: `resume_rules.RULES`), is a `ConfigError` naming the
  keys.

The trainer keeps its own check (`Trainer.train`) for the rare case where this look-ahead and the
real resume disagree (a newest checkpoint that fails verification).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import pydantic
import torch

from bytelatent.args import TrainArgs
from bytelatent.checkpoint import fs as cfs
from bytelatent.checkpoint.consolidate import PARAMS_FILE
from bytelatent.checkpoint.manager import CheckpointManager, parse_step, train_state_name
from bytelatent.checkpoint.verify import verify_step_folder
from bytelatent.config.redact import redacted_dump
from bytelatent.errors import ConfigError
from bytelatent.model.registry import model_config_keys
from bytelatent.trainer.build import build_model
from bytelatent.trainer.loop_controls import resolve_stop_step
from bytelatent.trainer.resume_rules import Rule, Saved, decide, sampling_sources
from bytelatent.trainer.state import TrainState

_SHOWN_CHANGES = 3  # keys named in the one-line refusal


@dataclass
class ResumeCheck:
    path: str | None  # the checkpoint a resume would load; None: a fresh start
    step: int = 0
    stop_step: int = 0
    changes: list[tuple[str, Any, Any]] = field(default_factory=list)  # (key, saved, now)
    rules: dict[str, Rule] = field(default_factory=dict)  # key -> what the resume does with it

    @property
    def complete(self) -> bool:
        return self.path is not None and self.step >= self.stop_step


def complete_line(args: TrainArgs, step: int) -> str:
    """`runs/debug is complete at step 200 (steps=200); raise steps or use another dump_dir`."""
    bound = f"max_steps={args.max_steps}" if args.max_steps is not None else f"steps={args.steps}"
    raise_what = "max_steps" if args.max_steps is not None else "steps"
    return (
        f"{args.dump_dir} is complete at step {step} ({bound}); "
        f"raise {raise_what} or use another dump_dir"
    )


def changes_line(check: ResumeCheck) -> str:
    """One line: every changed key, and for those a resume applies on top of the restored
    states, what applies it (`optim.lr 0.003 -> 0.005 (applied: the lr schedule)`)."""
    shown = ", ".join(
        f"{k} {_short(old)} -> {_short(new)}{_note(check.rules.get(k))}"
        for k, old, new in check.changes
    )
    return f"config differs from {check.path}/{PARAMS_FILE}: {shown}"


def _note(rule: Rule | None) -> str:
    if rule is None or rule.decision == "harmless":
        return ""
    return f" ({rule.decision}: {rule.why})" if rule.why else f" ({rule.decision})"


def _short(value: Any, limit: int = 60) -> str:
    text = json.dumps(value) if not isinstance(value, str) else value
    return text if len(text) <= limit else text[: limit - 3] + "..."


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """{dotted key: leaf}; lists are leaves (compared whole)."""
    if not isinstance(tree, dict) or (prefix and not tree):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def config_changes(saved: dict, current: dict) -> list[tuple[str, Any, Any]]:
    """(key, saved value, current value) for every key that differs; absent keys read as None."""
    old, new = flatten(saved), flatten(current)
    return [
        (k, old.get(k), new.get(k))
        for k in sorted(old.keys() | new.keys())
        if old.get(k) != new.get(k)
    ]


def check_resume(args: TrainArgs) -> ResumeCheck:
    """Where this run would resume, whether it is complete, and what changed since the save."""
    ckpt = args.checkpoint
    manager = CheckpointManager(
        ckpt.model_copy(update={"async_save": False}), dump_dir=args.dump_dir
    )
    path = ckpt.load_path or manager.latest_complete()
    if path is None:
        return ResumeCheck(path=None)  # fresh, or a warm start (init_ckpt_path): nothing to compare
    fs = cfs.get_fs(path, ckpt.s3_profile)
    state = _saved_state(fs, path)
    check = ResumeCheck(path=path, step=state.step, stop_step=resolve_stop_step(args, state))
    if check.complete and not ckpt.load_path:
        # "Nothing to do" only for a checkpoint that verifies: a damaged newest one is set aside
        # by the trainer's resume, which then continues from the previous one.
        report = verify_step_folder(path, ckpt.verify == "checksum", fs=fs)
        if not report.ok:
            return ResumeCheck(path=None)
    params_file = cfs.join(path, PARAMS_FILE)
    if cfs.exists(fs, params_file):
        saved = json.loads(cfs.read_text(fs, params_file))
        current = redacted_dump(args)
        normalized = _with_defaults(saved)
        check.changes = config_changes(normalized or saved, current)
        refuse_shape_changes(args, saved, check)
        saved_holds = Saved(
            data_sources=None if state.data_state is None else sampling_sources(state.data_state)
        )
        keys_now = flatten(current)
        check.rules = {
            # a params.json this version validates has only keys of this version
            k: decide(k, old, new, normalized is not None or k in keys_now, saved_holds)
            for k, old, new in check.changes
        }
        refuse_unresumable(check)
    return check


def _with_defaults(saved: dict) -> dict | None:
    """`params.json` with the defaults of keys it lacks (a checkpoint of an older version), so
    that only keys really set otherwise count as changes; None if it no longer validates."""
    try:
        return redacted_dump(TrainArgs.model_validate(saved))
    except pydantic.ValidationError:
        return None


def _saved_state(fs, path: str) -> TrainState:
    file = cfs.join(path, train_state_name(0))
    step = parse_step(path.rstrip("/").rsplit("/", 1)[-1]) or 0
    if not cfs.exists(fs, file):
        return TrainState(step=step)
    saved = json.loads(cfs.read_text(fs, file))
    return TrainState(
        step=saved.get("step", step),
        relative_target=saved.get("relative_target"),
        data_state=saved.get("data_state"),
    )


def refuse_unresumable(check: ResumeCheck) -> None:
    """ConfigError naming the changed keys that the resumed states would silently override."""
    refused = [(k, o, n) for k, o, n in check.changes if check.rules[k].decision == "refused"]
    if not refused:
        return
    named = ", ".join(
        f"{k}={_short(new)} (checkpoint: {_short(old)})" for k, old, new in refused[:_SHOWN_CHANGES]
    )
    more = f" and {len(refused) - _SHOWN_CHANGES} more" if len(refused) > _SHOWN_CHANGES else ""
    why = check.rules[refused[0][0]].why
    raise ConfigError(
        f"{named}{more}: a resume cannot apply it ({why}), so {check.path} would train with the "
        "checkpoint's value; restore the value or use another dump_dir"
    )


def _parameter_shapes(args: TrainArgs) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        model = build_model(args)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def refuse_shape_changes(args: TrainArgs, saved: dict, check: ResumeCheck) -> None:
    """ConfigError when the model the config builds has other parameters than the checkpoint's."""
    model_keys = [k for k, _, _ in check.changes if k.split(".", 1)[0] in model_config_keys()]
    if not model_keys:
        return
    try:
        saved_args = TrainArgs.model_validate(saved)
    except pydantic.ValidationError:
        return  # a config of another version: the checkpoint load reports what does not fit
    if _parameter_shapes(saved_args) == _parameter_shapes(args):
        return
    old = dict((k, o) for k, o, _ in check.changes)
    new = dict((k, n) for k, _, n in check.changes)
    named = ", ".join(
        f"{k}={_short(new[k])} (checkpoint: {_short(old[k])})" for k in model_keys[:_SHOWN_CHANGES]
    )
    more = (
        f" and {len(model_keys) - _SHOWN_CHANGES} more" if len(model_keys) > _SHOWN_CHANGES else ""
    )
    raise ConfigError(
        f"{named}{more}: changes the model's parameter shapes, so {check.path} cannot be "
        "resumed; restore the value or use another dump_dir"
    )
