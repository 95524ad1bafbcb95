"""What a resume does with each config key that differs from the checkpoint's `params.json`.

A resume restores more than weights: the optimizer (its hyperparameters included), the lr
scheduler, the data iterators (their own copy of the data config: files, sequence length, patcher,
mixture) and the RNG. A key whose new value those restored states would silently override is
either *applied* on top of them or *refused* before anything is loaded (one config error line,
exit 2). `harmless` keys are read afresh at every start (logging, eval, checkpoint cadence, ...).

`RULES` maps key prefixes to a decision; the longest prefix that matches a dotted key wins.
Two keys are decided by what the checkpoint holds (`decide`): `data.sources` (new weights are
applied to the resumed streams; a source the data state lacks is refused) and `optim.groups`
(new lr scales, weight decays and freeze steps apply; another list of groups is refused).

A key of the current config that no rule covers is refused: nobody decided whether a resume
honours it, and a run that silently ignores a changed key is what this module exists to prevent
(`tests/trainer/test_resume_check.py` checks every key of TrainArgs has a rule). A key only the
checkpoint's `params.json` has (a key an older version had, that this one no longer reads) is
reported and ignored: refusing it would make every checkpoint of that version unresumable, and
there is nothing here that could apply it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from bytelatent.errors import ConfigError

Decision = Literal["applied", "refused", "harmless", "ignored", "no effect on a resume"]


@dataclass(frozen=True)
class Rule:
    decision: Decision
    why: str  # applied: what takes the new value; refused: why the resume cannot


_DATA_STATE = Rule("refused", "the checkpoint's data state fixes it")
_SCHEDULE = Rule("applied", "the lr schedule")
_ADAMW = Rule("applied", "AdamW hyperparameters")
_READ_AT_START = Rule("applied", "read at every start")
_HARMLESS = Rule("harmless", "")
# Keys read only when the weights are initialised (a fresh start): a resume loads the weights.
_INIT_ONLY = Rule("no effect on a resume", "it sets the initial weights; a resume loads them")
_INIT_KEYS = ("seed", "init_base_std", "init_std_factor", "global_init")

RULES: dict[str, Rule] = {
    # top level
    "name": _HARMLESS,
    "dump_dir": _HARMLESS,
    "seed": Rule("refused", "the checkpoint's RNG state continues the run"),
    "debug_dynamo": _HARMLESS,
    "grad_acc_steps": Rule("applied", "the global batch is checked against the data state"),
    "gc_collect_freq": _HARMLESS,
    "steps": Rule("applied", "the stop step and the lr schedule's horizon"),
    "max_steps": Rule("applied", "the stop step"),
    "relative_steps": Rule("applied", "the stop step"),
    "probe_freq": _HARMLESS,
    "num_threads": _HARMLESS,
    "dry_run": _HARMLESS,
    # the model is built from the config at every start; shape changes are refused before this
    # table is read (resume_check.refuse_shape_changes)
    # (a saved config's old section names, entropy_model and arch_args, are read as `model`)
    "arch": Rule("applied", "the model is built from the config"),
    "train_entropy_model": Rule("applied", "the model is built from the config"),
    "model": Rule("applied", "the model is built from the config"),
    # a config that still names it entropy_model or arch_args has its keys named so
    "entropy_model": Rule("applied", "the model is built from the config"),
    "arch_args": Rule("applied", "the model is built from the config"),
    **{
        f"{section}.{key}": _INIT_ONLY
        for section in ("model", "entropy_model", "arch_args")
        for key in _INIT_KEYS
    },
    "distributed": Rule("applied", "the mesh is built at every start; data re-shards"),
    "env": _READ_AT_START,
    "checkpoint": _HARMLESS,
    "logging": _HARMLESS,
    "profiling": _HARMLESS,
    "run_lock": _HARMLESS,
    "eval": _HARMLESS,
    "actions": Rule("applied", "actions are built from the config"),
    "distill": Rule("applied", "the teacher and its loss term are built from the config"),
    # optimizer: the config's values are set after the optimizer and scheduler states load
    "optim": _ADAMW,
    "optim.lr": _SCHEDULE,
    "optim.scheduler": _SCHEDULE,
    "optim.warmup": _SCHEDULE,
    "optim.lr_min_ratio": _SCHEDULE,
    "optim.cycle_length": _SCHEDULE,
    "optim.cosine_theta": _SCHEDULE,
    "optim.decay_fraction": _SCHEDULE,
    "optim.exp_factor": _SCHEDULE,
    "optim.clip": _READ_AT_START,
    "optim.fused": _READ_AT_START,
    "optim.max_skipped_steps": _READ_AT_START,
    "optim.groups": Rule("applied", "group lr scales, weight decays and freezing"),  # see decide
    # data: the saved iterator state carries its own files, shapes, tokenizer and patcher
    "data": _DATA_STATE,
    "data.sources": Rule("applied", "the mixture weights of the resumed streams"),  # see decide
    "data.batch_size": Rule("applied", "the global batch is checked against the data state"),
    "data.load_async": _READ_AT_START,
    "data.prefetch_size": _READ_AT_START,
    "data.async_persist_type": _HARMLESS,  # accepted for reference configs, read by nothing
    "data.virtual_streams": Rule("refused", "the data streams are fixed at the run's first start"),
    # the one-line error for a bad row says to set it: it changes which rows are skipped from now
    # on, not what was read (apply_skip_bad_records sets it in the resumed data state)
    "data.skip_bad_records": Rule("applied", "whether a bad record is skipped from now on"),
}

_UNRULED = Rule(
    "refused", "no rule says whether a resume applies it (bytelatent/trainer/resume_rules.py)"
)
_ONLY_SAVED = Rule("ignored", "not a key of this version")


def rule_of(key: str) -> Rule | None:
    """The rule of the longest prefix of `key` in RULES (None: no rule)."""
    parts = key.split(".")
    for n in range(len(parts), 0, -1):
        rule = RULES.get(".".join(parts[:n]))
        if rule is not None:
            return rule
    return None


@dataclass
class Saved:
    """What a checkpoint holds besides params.json that decides a key."""

    data_sources: set[str] | None  # the sources of the saved data state; None: no data state


def decide(key: str, old: Any, new: Any, in_config: bool, saved: Saved) -> Rule:
    """The rule for one changed key (`in_config`: the current config has the key)."""
    if not in_config:
        return _ONLY_SAVED
    if key.split(".", 1)[0] == "data" and saved.data_sources is None:
        return Rule("applied", "the checkpoint has no data state: data starts afresh")
    if key.startswith("data.sources.") or key == "data.sources":
        return _decide_source(key, new, saved.data_sources)
    if key == "optim.groups":
        return _decide_groups(old or [], new or [])
    return rule_of(key) or _UNRULED


def _decide_source(key: str, new: Any, saved_sources: set[str]) -> Rule:
    name = key.split(".", 2)[2] if key.count(".") >= 2 else None
    positive = isinstance(new, int | float) and new > 0
    if name is not None and positive and name not in saved_sources:
        return Rule(
            "refused",
            f"the checkpoint's data state has no position in source {name!r} "
            f"(it reads {sorted(saved_sources)})",
        )
    return RULES["data.sources"]


def _decide_groups(old: list, new: list) -> Rule:
    globs_old = [g.get("params") for g in old if isinstance(g, dict)]
    globs_new = [g.get("params") for g in new if isinstance(g, dict)]
    if globs_old == globs_new:
        return RULES["optim.groups"]
    added = [g for g in globs_new if g not in globs_old]
    removed = [g for g in globs_old if g not in globs_new]
    what = []
    if added:
        what.append("adds " + ", ".join(f"params={g!r}" for g in added))
    if removed:
        what.append("removes " + ", ".join(f"params={g!r}" for g in removed))
    if not what:
        what.append(f"reorders the groups {globs_old} -> {globs_new}")
    return Rule(
        "refused",
        f"{' and '.join(what)}: the checkpoint's optimizer state has the groups {globs_old} "
        "(a group's AdamW state cannot move to another group)",
    )


def apply_source_weights(state: Any, weights: dict[str, float]) -> tuple[Any, bool]:
    """`state` (a data state, as JSON) with every sampling iterator's weights set to `weights`
    (a source the config leaves out gets weight 0 and keeps its position); True if any changed.

    ConfigError for a source with weight > 0 that the state has no position in."""
    changed = False

    def visit(node: Any) -> Any:
        nonlocal changed
        if isinstance(node, list):
            return [visit(v) for v in node]
        if not isinstance(node, dict):
            return node
        out = {k: visit(v) for k, v in node.items()}
        if out.get("type") == "sampling" and isinstance(out.get("weights"), dict):
            missing = sorted(n for n, w in weights.items() if w > 0 and n not in out["weights"])
            if missing:
                raise ConfigError(
                    f"data.sources.{missing[0]}: the checkpoint's data state has no position in "
                    f"source {missing[0]!r} (it reads {sorted(out['weights'])}); a resume cannot "
                    "add a source; restore data.sources or use another dump_dir"
                )
            new = {name: float(weights.get(name, 0.0)) for name in out["weights"]}
            if new != out["weights"]:
                changed = True
                out["weights"] = new
        return out

    return visit(state), changed


def apply_skip_bad_records(state: Any, skip: bool) -> Any:
    """`state` (a data state, as JSON) with every iterator's `skip_bad_records` set to `skip`
    (the file readers and the preprocessing copy the config's value into their state)."""
    if isinstance(state, list):
        return [apply_skip_bad_records(v, skip) for v in state]
    if not isinstance(state, dict):
        return state
    out = {k: apply_skip_bad_records(v, skip) for k, v in state.items()}
    if "skip_bad_records" in out:
        out["skip_bad_records"] = skip
    return out


def sampling_sources(state: Any) -> set[str]:
    """The source names of every sampling iterator in a data state (JSON)."""
    found: set[str] = set()

    def visit(node: Any) -> None:
        if isinstance(node, list):
            for v in node:
                visit(v)
        elif isinstance(node, dict):
            if node.get("type") == "sampling" and isinstance(node.get("weights"), dict):
                found.update(node["weights"])
            for v in node.values():
                visit(v)

    visit(state)
    return found
