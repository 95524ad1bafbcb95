"""Convert a reference (facebookresearch/blt) training YAML into a bytelatent config, with a report.

`python -m bytelatent.archs.blt.from_reference REF.yaml [-o OUT.yaml]` writes the converted config
(to stdout without -o) and prints a report on stderr that lists every field of the input exactly
once: mapped (old -> new), dropped (with the reason), or needing the user (`???` values).

The model sections go through `bytelatent.archs.blt.reference_compat` (the same mapping that loads
released `params.json` files), so a converted config builds the model the reference would have
built. Where the reference ignores a field (verified no-ops, patcher settings in the model
section that only matter with patch_in_forward, the top-level dim/n_layers/n_heads of a BLT),
the report says so instead of carrying it over.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pydantic
import yaml

from bytelatent.archs.blt.reference_compat import (
    REFERENCE_PATCHER_FIELDS,
    blt_args_from_reference,
    lm_args_from_reference,
)
from bytelatent.archs.blt.reference_format import CONVERTER
from bytelatent.args import TrainArgs  # torch-free, as every module here: `--help` needs no torch
from bytelatent.config.parser import MISSING, load_yaml_file, validation_error_to_config_error
from bytelatent.errors import ConfigError, UserError

# Reference TrainArgs schema (facebookresearch/blt bytelatent/args.py and the arg classes it
# composes, BLT_REFERENCE_FACTS.md §2): section -> its fields. Leaves only; dict-valued fields
# (data.sources, tokenizer init_kwargs) are kept whole.
_SAME_TOP = (
    "name",
    "dump_dir",
    "seed",
    "debug_dynamo",
    "grad_acc_steps",
    "gc_collect_freq",
    "steps",
    "max_steps",
    "train_entropy_model",
)
_DROPPED_TOP = {
    "probe_freq": "the activation probe is not part of bytelatent",
    "async_eval_gpus": "evaluation runs are launched separately here",
    "eval": "evaluation is configured separately here (bytelatent.eval)",
    "eval_on_gpus": "evaluation runs are launched separately here",
}
_SECTIONS_SAME = {
    "optim": (
        "lr",
        "weight_decay",
        "epsilon",
        "beta1",
        "beta2",
        "clip",
        "scheduler",
        "warmup",
        "lr_min_ratio",
        "cycle_length",
        "cosine_theta",
        "decay_fraction",
        "exp_factor",
    ),
    "distributed": (
        "dp_shard",
        "tp_size",
        "selective_activation_checkpointing",
        "compile",
        "fsdp_type",
        "model_dtype",
        "float8_recipe",
        "float8_filter",
        "matmul_allow_tf32",
        "allow_bf16_reduced_precision_reduction",
        "detect_anomaly",
        "compile_cache_size_limit",
        "spawn_method",
    ),
    "checkpoint": ("path", "init_ckpt_path", "continue_training_from_init", "s3_profile"),
    "logging": ("freq",),
    "data": (
        "root_dir",
        "sources",
        "batch_size",
        "seq_len",
        "seed",
        "add_bos",
        "add_eos",
        "load_async",
        "async_persist_type",
        "prefetch_size",
        "preprocess_dir",
        "dataset_files",
        "entropy_model_name",
        "arrow_batch_size",
        "buffer_size",
        "file_format",
        "pad_to_max_length",
        "max_encoder_seq_length",
        "enable_byte_ngrams",
        "add_patches",
        "s3_profile",
    ),
}
_DROPPED_IN_SECTION = {
    "optim.annealing_step": "never read by the reference",
    "distributed.dp_replicate": "the reference recomputes it as world/dp_shard/tp_size",
    "logging.acc_freq": "metrics are logged per optimizer step here",
    "logging.wandb": "no wandb section in bytelatent's logging args",
}
_PATCHER_FIELDS = (
    "patching_mode",
    "patching_device",
    "entropy_model_checkpoint_dir",
    "realtime_patching",
    "threshold",
    "threshold_add",
    "max_patch_length",
    "patch_size",
    "patching_batch_size",
    "device",
    "monotonicity",
    "log_time",
)
_SAVE_EVERY = ("every", "keep")


@dataclass
class Report:
    """One line per input field: mapped, dropped (why) or needs the user."""

    mapped: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    needs_user: list[str] = field(default_factory=list)
    fields: list[str] = field(default_factory=list)  # every input key, in report order
    notes: list[str] = field(
        default_factory=list
    )  # reference defaults that matter (not input keys)

    def map(self, old: str, new: str, value: Any, note: str = "") -> None:
        self.fields.append(old)
        suffix = f"  ({note})" if note else ""
        self.mapped.append(f"{old} -> {new} = {_short(value)}{suffix}")

    def drop(self, old: str, value: Any, reason: str) -> None:
        self.fields.append(old)
        self.dropped.append(f"{old} = {_short(value)}: {reason}")

    def need(self, old: str, new: str) -> None:
        self.fields.append(old)
        self.needs_user.append(f"{old} -> {new} = ???: set it ({new}=...)")

    def render(self) -> str:
        lines = [f"mapped ({len(self.mapped)}):", *(f"  {x}" for x in self.mapped)]
        lines += [f"dropped ({len(self.dropped)}):", *(f"  {x}" for x in self.dropped)]
        lines += [f"needs you ({len(self.needs_user)}):", *(f"  {x}" for x in self.needs_user)]
        if self.notes:
            lines += [f"notes ({len(self.notes)}):", *(f"  {x}" for x in self.notes)]
        return "\n".join(lines)


def _short(value: Any) -> str:
    text = repr(value) if not isinstance(value, str) else value
    return text if len(text) <= 60 else text[:57] + "..."


def _set(tree: dict, dotted: str, value: Any) -> None:
    node = tree
    *parents, leaf = dotted.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value


# ---------------------------------------------------------------------------------------------
# conversion


def convert(tree: dict) -> tuple[dict, Report]:
    """(bytelatent config tree, report) for a reference TrainArgs tree; unknown keys are errors."""
    out: dict = {}
    report = Report()
    # ours has one model section: the reference's `model` (the BLT) or, with
    # `train_entropy_model: true`, its `entropy_model` (written as `arch: entropy` + `model:`)
    entropy_trains = bool(tree.get("train_entropy_model"))
    for key, value in tree.items():
        if key == "train_entropy_model":
            if entropy_trains:
                report.map(key, "arch", "entropy", "one model section: the entropy model's")
                out["arch"] = "entropy"
            else:
                report.drop(key, value, "the BLT trains (the default arch)")
        elif key in _SAME_TOP:
            _leaf(report, out, key, key, value)
        elif key in _DROPPED_TOP:
            report.drop(key, value, "null: no effect" if value is None else _DROPPED_TOP[key])
        elif key == "profiling":
            _drop_section(
                report,
                "profiling",
                value,
                "the profiler is not configured through the training config here",
            )
        elif key == "env":
            _env(report, out, value)
        elif key == "checkpoint":
            _checkpoint(report, out, value)
        elif key in _SECTIONS_SAME:
            _section(report, out, key, value)
        elif key == "model" and entropy_trains:
            _drop_section(
                report,
                "model",
                value,
                "train_entropy_model: the reference trains "
                "the entropy model and ignores the BLT's section",
            )
        elif key == "model":
            _model(report, out, value)
        elif key == "entropy_model" and not entropy_trains:
            _drop_section(
                report,
                "entropy_model",
                value,
                "read only with train_entropy_model: "
                "true (the BLT's patcher loads its entropy model from "
                "data.patcher_args.entropy_model_checkpoint_dir)",
            )
        elif key == "entropy_model":
            _entropy_model(report, out, value)
        elif key == "config":
            raise ConfigError(
                "config: includes are not followed by the converter; convert each file"
            )
        else:
            raise ConfigError(
                f"{key}: neither a bytelatent nor a reference (facebookresearch/blt) config key"
            )
    return out, report


def _leaf(report: Report, out: dict, old: str, new: str, value: Any, note: str = "") -> None:
    if isinstance(value, str) and value == MISSING:
        report.need(old, new)
    else:
        report.map(old, new, value, note)
    _set(out, new, value)


def _mapping(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected a mapping, got {_short(value)}")
    return value


def _drop_section(report: Report, prefix: str, value: Any, reason: str) -> None:
    if not isinstance(value, dict):
        report.drop(prefix, value, reason)
        return
    for key, sub in value.items():
        report.drop(f"{prefix}.{key}", sub, reason)


def _env(report: Report, out: dict, value: Any) -> None:
    env = _mapping(value, "env")
    out["env"] = {}
    for key, sub in env.items():
        _leaf(
            report, out, f"env.{key}", f"env.{key}", str(sub), "exported before the process group"
        )


def _section(report: Report, out: dict, section: str, value: Any) -> None:
    if value is None:
        report.drop(section, value, "null: the reference would fail on it; defaults used")
        return
    for key, sub in _mapping(value, section).items():
        dotted = f"{section}.{key}"
        if key in _SECTIONS_SAME.get(section, ()):
            _leaf(report, out, dotted, dotted, sub)
        elif dotted in _DROPPED_IN_SECTION:
            report.drop(dotted, sub, _DROPPED_IN_SECTION[dotted])
        elif dotted == "data.tokenizer_args":
            _tokenizer(report, out, sub)
        elif dotted == "data.patcher_args":
            _patcher(report, out, sub)
        else:
            raise ConfigError(f"{dotted}: neither a bytelatent nor a reference config key")


def _tokenizer(report: Report, out: dict, value: Any) -> None:
    for key, sub in _mapping(value, "data.tokenizer_args").items():
        dotted = f"data.tokenizer_args.{key}"
        if key == "name":
            _leaf(report, out, dotted, dotted, sub)
        elif key == "init_kwargs" and sub is None:
            _leaf(report, out, dotted, dotted, sub)
        elif key == "init_kwargs":
            kwargs = _mapping(sub, dotted)
            bpe_delim = bool(kwargs.get("bpe_delim", False))
            for name, arg in kwargs.items():
                inner = f"{dotted}.{name}"
                if name == "bpe_tokenizer_path" and not bpe_delim:
                    report.drop(
                        inner,
                        arg,
                        "never loaded unless bpe_delim=true (bytes are encoded directly)",
                    )
                else:
                    _leaf(report, out, inner, inner, arg)
        else:
            raise ConfigError(f"{dotted}: not a reference TokenizerArgs field")


def _patcher(report: Report, out: dict, value: Any) -> None:
    for key, sub in _mapping(value, "data.patcher_args").items():
        dotted = f"data.patcher_args.{key}"
        if key not in _PATCHER_FIELDS:
            # the reference's PatcherArgs has no extra="forbid": unknown keys were silently ignored
            report.drop(dotted, sub, "not a PatcherArgs field: the reference silently ignored it")
        elif key in ("patching_device", "device") and sub == "cuda":
            _leaf(report, out, dotted, dotted, "auto", "auto: CUDA when available, else CPU")
        else:
            _leaf(report, out, dotted, dotted, sub)


def _checkpoint(report: Report, out: dict, value: Any) -> None:
    for key, sub in _mapping(value, "checkpoint").items():
        dotted = f"checkpoint.{key}"
        if key in ("dump", "eval") and isinstance(sub, dict):
            for name, every in sub.items():
                if name not in _SAVE_EVERY:
                    raise ConfigError(f"{dotted}.{name}: not a reference SaveEvery field")
                _leaf(report, out, f"{dotted}.{name}", f"{dotted}.{name}", every)
        elif key in _SECTIONS_SAME["checkpoint"]:
            _leaf(report, out, dotted, dotted, sub)
        else:
            raise ConfigError(f"{dotted}: neither a bytelatent nor a reference config key")


_GLOBAL_ALIASES = {"dim_global": "dim", "n_layers_global": "n_layers", "n_heads_global": "n_heads"}
_PATCHER_REASON = (
    "the reference reads the model's patcher settings only with patch_in_forward=true; the "
    "training data's patches come from data.patcher_args"
)


def _field_name(entry: str) -> str:
    name = ""
    for char in entry:
        if not (char.isalnum() or char == "_"):
            break
        name += char
    return name


def _reason(entry: str) -> str:
    """'name=v (why)' / 'name (why)' -> 'why' (the reason part of a reference_compat note)."""
    rest = entry[len(_field_name(entry)) :].strip()
    if rest.startswith("="):
        rest = rest.partition(" ")[2].strip()
    if rest.startswith("(") and rest.endswith(")"):
        rest = rest[1:-1]
    return rest.lstrip(": ") or entry


def _model(report: Report, out: dict, value: Any) -> None:
    if value is None:
        report.map("model", "model", None)
        out["model"] = None
        return
    section = _mapping(value, "model")
    missing = [k for k, v in section.items() if isinstance(v, str) and v == MISSING]
    if missing:
        raise ConfigError(f"model.{missing[0]}: ??? in the model section; set it before converting")
    args, ignored = blt_args_from_reference(section)
    converted = args.model_dump(mode="json", include=set(args.model_fields_set))
    reasons = {_field_name(entry): entry for entry in ignored}
    patcher_only = set(REFERENCE_PATCHER_FIELDS) | {"patch_size"}
    for key, sub in section.items():
        old = f"model.{key}"
        if key in patcher_only and key not in converted:
            report.drop(old, sub, _PATCHER_REASON)
        elif key in ("dim", "n_layers", "n_heads"):
            report.drop(old, sub, _reason(reasons.get(key, "x (the reference ignores it for BLT)")))
        elif key in _GLOBAL_ALIASES:
            report.map(old, f"model.{_GLOBAL_ALIASES[key]}", converted.get(_GLOBAL_ALIASES[key]))
        elif key in converted:
            report.map(old, old, converted[key], _reason(reasons[key]) if key in reasons else "")
        elif key in reasons:
            report.drop(old, sub, _reason(reasons[key]))
        else:
            report.drop(old, sub, "equals the default here")
    for name, entry in reasons.items():
        if name not in section:
            report.notes.append(f"model.{name}: {entry}")
    sources = set(section) | {_GLOBAL_ALIASES[k] for k in section if k in _GLOBAL_ALIASES}
    for name in converted:
        if name not in sources:
            report.notes.append(
                f"model.{name} = {_short(converted[name])}: the reference's default"
            )
    out["model"] = converted


def _entropy_model(report: Report, out: dict, value: Any) -> None:
    """The entropy model that trains (`train_entropy_model: true`): our `model:` section."""
    if value is None:
        report.map("entropy_model", "model", None, "the entropy model's defaults")
        out["model"] = {}
        return
    section = _mapping(value, "entropy_model")
    args, ignored = lm_args_from_reference(section)
    converted = args.model_dump(mode="json", include=set(args.model_fields_set))
    reasons = {_field_name(entry): entry for entry in ignored}
    for key in section:
        note = reasons.get(key, "")
        report.map(
            f"entropy_model.{key}",
            f"model.{key}",
            converted.get(key),
            _reason(note) if note else "",
        )
    for name, entry in reasons.items():
        if name not in section:
            report.notes.append(f"model.{name}: {entry}")
    out["model"] = converted


def _reconcile(tree: dict, report: Report) -> None:
    """Rules our TrainArgs checks across sections and the reference did not (noted in the report)."""
    data = tree.setdefault("data", {}) if isinstance(tree.get("data", {}), dict) else {}
    model = tree.get("model")
    if tree.get("arch") == "entropy":
        patcher = data.setdefault("patcher_args", {})
        if patcher.get("patching_mode") != "byte":
            report.notes.append(
                f"data.patcher_args.patching_mode = byte (was {patcher.get('patching_mode', 'entropy')}): "
                "the entropy model trains on bytes; byte mode packs rows the same way"
            )
            patcher["patching_mode"] = "byte"
    elif isinstance(model, dict):
        data_len = data.get("max_encoder_seq_length", 12288)
        if model.get("max_encoder_seq_length", 12288) != data_len:
            report.notes.append(
                f"model.max_encoder_seq_length = {data_len} (was {model.get('max_encoder_seq_length')}): "
                "set to data.max_encoder_seq_length, which our TrainArgs requires; it only sizes "
                "the local RoPE tables (not saved weights)"
            )
            model["max_encoder_seq_length"] = data_len


def _check_converted(tree: dict) -> None:
    """The output must validate as our TrainArgs once its ??? values are filled in."""

    def fill(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: fill(v) for k, v in node.items()}
        return "/set/by/user" if isinstance(node, str) and node == MISSING else node

    filled = fill(tree)
    filled.setdefault("dump_dir", "/set/by/user")
    try:
        TrainArgs.from_saved(filled)  # a file we were handed: it imports nothing
    except pydantic.ValidationError as exc:
        err = validation_error_to_config_error(exc, TrainArgs, filled)
        raise ConfigError(f"the converted config does not validate: {err}") from None


def convert_file(path: str) -> tuple[str, Report]:
    """(YAML text of the converted config, report) for a reference YAML file."""
    tree = load_yaml_file(path)
    converted, report = convert(tree)
    patcher = (converted.get("data") or {}).get("patcher_args") or {}
    if (
        converted.get("arch") != "entropy"
        and converted.get("model") is not None
        and "patching_mode" not in patcher
    ):
        report.notes.append(
            "data.patcher_args.patching_mode not set: the reference default (entropy) reads "
            "precomputed entropies from the data (data.preprocess_dir); set it to train otherwise"
        )
    _reconcile(converted, report)
    _check_converted(converted)
    header = f"# converted from {path} by {CONVERTER}\n"
    return header + yaml.safe_dump(converted, sort_keys=False, allow_unicode=True), report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=CONVERTER, description=__doc__.splitlines()[0])
    parser.add_argument(
        "ref_yaml", help="a reference training YAML (e.g. bytelatent/configs/debug.yaml)"
    )
    parser.add_argument(
        "-o", "--out", default=None, help="write the converted YAML here (default: stdout)"
    )
    args = parser.parse_args(argv)
    try:
        text, report = convert_file(args.ref_yaml)
    except UserError as e:
        print(e.one_line(), file=sys.stderr)
        return 2
    if args.out:
        Path(args.out).write_text(text)
    else:
        sys.stdout.write(text)
    print(report.render(), file=sys.stderr)
    if args.out:
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
