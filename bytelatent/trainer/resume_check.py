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

import pydantic
import torch

from bytelatent.args import TrainArgs
from bytelatent.checkpoint import fs as cfs
from bytelatent.checkpoint.manager import CheckpointManager, parse_step, train_state_name
from bytelatent.checkpoint.verify import verify_step_folder
from bytelatent.errors import CheckpointError, ConfigError
from bytelatent.model.registry import model_config_keys
from bytelatent.trainer.build import build_model
from bytelatent.trainer.loop_controls import resolve_stop_step
from bytelatent.trainer.resume_config import (  # noqa: F401 (re-exported)
    _SHOWN_CHANGES,
    ResumeCheck,
    _short,
    changes_line,
    complete_line,
    config_changes,
    config_diff,
    flatten,
    read_params,
    refuse_unresumable,
)
from bytelatent.trainer.state import TrainState


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
    saved = read_params(fs, path)
    if saved is not None:
        check.changes, check.rules = config_diff(args, saved, state.data_state)
        refuse_shape_changes(args, saved, check)
        refuse_unresumable(check)
    return check


def _saved_state(fs, path: str) -> TrainState:
    file = cfs.join(path, train_state_name(0))
    step = parse_step(path.rstrip("/").rsplit("/", 1)[-1]) or 0
    if not cfs.exists(fs, file):
        return TrainState(step=step)
    try:
        saved = json.loads(cfs.read_text(fs, file))
        if not isinstance(saved, dict):
            raise ValueError(f"a JSON {type(saved).__name__}, not an object")
        return TrainState(
            step=saved.get("step", step),
            relative_target=saved.get("relative_target"),
            data_state=saved.get("data_state"),
        )
    except (ValueError, UnicodeDecodeError) as exc:  # JSON and pydantic errors are ValueErrors
        raise CheckpointError(
            f"{file}: {_first_problem(exc)}; the checkpoint is damaged: set "
            "checkpoint.load_path to an earlier step folder, or move this one aside"
        ) from None


def _first_problem(exc: Exception) -> str:
    """One line for a JSON or validation error (pydantic's message spans several lines)."""
    if isinstance(exc, pydantic.ValidationError):
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        why = err["msg"].removeprefix("Value error, ")
        return f"{where}: {why} (got {type(err['input']).__name__})"
    return str(exc)


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
        saved_args = TrainArgs.from_saved(saved)
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
