"""The config side of a resume, torch-free: what changed since the checkpoint's `params.json`,
what the resume does with each change (`resume_rules.RULES`), and the one-line refusal of a
change it cannot apply. `resume_check.py` adds the checkpoint's step and the model's shapes;
`bytelatent/preflight.py` runs this part before torch is imported."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from typing import Any

import pydantic

from bytelatent.args import TrainArgs
from bytelatent.checkpoint import fs as cfs
from bytelatent.checkpoint.layout import PARAMS_FILE
from bytelatent.config.redact import redacted_dump
from bytelatent.errors import ConfigError
from bytelatent.trainer.resume_rules import Rule, Saved, decide, sampling_sources

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
        if old.get(k) != new.get(k) and not _same_interpreter(k, old.get(k), new.get(k))
    ]


def _same_interpreter(key: str, old: Any, new: Any) -> bool:
    """`python3` and `python` (or a relative and an absolute path) of one venv: no change.
    Same folder as found on PATH (the venv's bin/) and same binary once links are resolved."""
    if key.rsplit(".", 1)[-1] != "python" or not (isinstance(old, str) and isinstance(new, str)):
        return False
    found = [os.path.abspath(shutil.which(v) or v) for v in (old, new)]
    return os.path.dirname(found[0]) == os.path.dirname(found[1]) and os.path.realpath(
        found[0]
    ) == os.path.realpath(found[1])


def read_params(fs, path: str) -> dict | None:
    """The checkpoint's `params.json` (the config it was saved with); None if it has none."""
    params_file = cfs.join(path, PARAMS_FILE)
    if not cfs.exists(fs, params_file):
        return None
    return json.loads(cfs.read_text(fs, params_file))


def config_diff(
    args: TrainArgs, saved: dict, data_state: dict | None
) -> tuple[list[tuple[str, Any, Any]], dict[str, Rule]]:
    """Every key that differs from `saved`, and the rule a resume applies to each."""
    current = redacted_dump(args)
    normalized = _with_defaults(saved)
    changes = config_changes(normalized or saved, current)
    saved_holds = Saved(data_sources=None if data_state is None else sampling_sources(data_state))
    keys_now = flatten(current)
    rules = {
        # a params.json this version validates has only keys of this version
        k: decide(k, old, new, normalized is not None or k in keys_now, saved_holds)
        for k, old, new in changes
    }
    return _as_written(args, changes, rules)


def _as_written(args: TrainArgs, changes: list, rules: dict) -> tuple[list, dict]:
    """The keys of the `model` section named as the config did (`entropy_model.dim` in a config
    that still uses the section's old name), so a message names the key the user wrote."""
    key = args._model_key
    if key == "model":
        return changes, rules

    def named(k: str) -> str:
        return key + k[len("model") :] if k == "model" or k.startswith("model.") else k

    return [(named(k), o, n) for k, o, n in changes], {named(k): r for k, r in rules.items()}


def _with_defaults(saved: dict) -> dict | None:
    """`params.json` with the defaults of keys it lacks (a checkpoint of an older version), so
    that only keys really set otherwise count as changes; None if it no longer validates."""
    try:
        return redacted_dump(TrainArgs.from_saved(saved))
    except pydantic.ValidationError:
        return None


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
