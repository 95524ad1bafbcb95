"""Validation sources: which files `eval.validation.sources` names (torch-free, so that
`python -m bytelatent.train` finds a missing one before it imports torch: `bytelatent/preflight.py`)."""

from __future__ import annotations

import os
import re

from bytelatent.data.args import DATASET_FILES_SOURCE, DataArgs
from bytelatent.data.sources import source_files
from bytelatent.errors import ConfigError, DataError
from bytelatent.eval.args import EvalArgs

_GLOB_CHARS = re.compile(r"[*?\[]")


def _source_name(entry: str) -> str:
    name = entry.rstrip("/").rsplit("/", 1)[-1]
    for suffix in (".val.jsonl", ".jsonl", ".json", ".arrow"):
        if name.endswith(suffix) and not _GLOB_CHARS.search(name):
            return name[: -len(suffix)]
    return name


def _val_files_beside(source: str, data: DataArgs) -> list[str]:
    """The `*.val.jsonl` files in a training source's directory (the reference layout)."""
    return source_files(
        f"{source.rstrip('/')}/*.val.jsonl",
        root_dir=data.root_dir,
        file_format=data.file_format,
        storage_options=data.fsspec_options(),
    )


def resolve_validation_sources(eval_args: EvalArgs, data: DataArgs) -> dict[str, list[str]]:
    """{source name: files}; a missing source is a DataError now, not at the first evaluation."""
    entries = eval_args.validation.sources
    if entries is None:
        if data.dataset_files is not None:
            raise ConfigError(
                "eval.validation.sources: no default with data.dataset_files; list the "
                "validation files (e.g. eval.validation.sources=[/data/held_out.jsonl])"
            )
        entries = sorted(data.source_weights())
    resolved: dict[str, list[str]] = {}
    for entry in entries:
        name = entry if entry in data.sources else _source_name(entry)
        if name in resolved or name == DATASET_FILES_SOURCE:
            raise ConfigError(f"eval.validation.sources: two entries are named '{name}'")
        try:
            if entry in data.sources:
                files = _val_files_beside(entry, data)
            else:
                files = source_files(
                    entry,
                    root_dir=data.root_dir,
                    file_format=data.file_format,
                    storage_options=data.fsspec_options(),
                )
        except DataError as e:
            raise DataError(f"eval.validation: {e}") from None
        # absolute: evaluation re-resolves these against data.root_dir (and async jobs run elsewhere)
        resolved[name] = [f if "://" in f else os.path.abspath(f) for f in files]
    _check_no_training_overlap(resolved, data)
    return resolved


def _file_keys(path: str) -> tuple[str, str]:
    """(the file itself, its name without a preprocessing `.arrow` suffix) for comparisons."""
    full = path if "://" in path else os.path.realpath(path)
    return full, full.rsplit("/", 1)[-1].removesuffix(".arrow")


def _check_no_training_overlap(resolved: dict[str, list[str]], data: DataArgs) -> None:
    """A validation file that is also training data (or its preprocessed copy) is an error."""
    training: dict[str, tuple[str, str]] = {}
    for source in data.source_weights():
        try:
            files = data.files_of(source)
        except DataError:  # the training data reports its own problems
            continue
        for path in files:
            for key in _file_keys(path):
                training[key] = (source, path)
    for name, files in resolved.items():
        for path in files:
            hit = next((training[k] for k in _file_keys(path) if k in training), None)
            if hit:
                raise DataError(
                    f"eval.validation.sources: {path} (source '{name}') is also training data "
                    f"of source '{hit[0]}' ({hit[1]}); keep validation files out of the training "
                    "sources (e.g. preprocess them into an --output-dir of their own)"
                )
