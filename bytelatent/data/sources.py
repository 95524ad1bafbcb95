"""Find the files of a data source (local paths or URLs such as s3://bucket/prefix).

A source name `S` (a key of data.sources) resolves, in this order, to:
1. `{preprocess_dir}/{S}/{entropy_model_name}/*.arrow` when preprocess_dir is set (the reference
   entropy-preprocessing layout); only shards with a `<shard>.complete` marker are used;
2. the files matching `S` when it is a glob (relative to root_dir unless absolute or a URL);
3. the file `S` itself;
4. a directory `S`: the files of the first registered format (`bytelatent/data/readers`, in
   `listing_rank` order) that it holds: `*.arrow` (`.arrows`, `.ipc`, `.feather`), else
   `*.parquet` / `*.pq` (FineWeb), else `*.jsonl.zst` / `*.jsonl.gz` (DCLM), else `*.jsonl`;
   never `*.val.jsonl*` (validation files live beside the training chunks). Within that kind,
   if some files have a `<file>.complete` marker only the marked ones are used (entropy
   preprocessing writes them), and `*.chunk.NN.*` files (the reference layout
   `{root}/{S}/{S}.chunk.NN.jsonl`) are preferred when present.
   `data.file_format` (a format name, or `jsonl`) picks one kind when a folder holds several.
Files are sorted naturally (`shard_2` before `shard_10`). Anything missing is a DataError that
names the path.
"""

from __future__ import annotations

import difflib
import logging
import os
import re

from bytelatent.data.readers import forced_format, formats, open_fs
from bytelatent.errors import DataError

DEFAULT_CORPUS = (
    "stdlib"  # written by `python -m bytelatent.data.prepare` (bytelatent/data/corpus.py)
)

logger = logging.getLogger(__name__)

_GLOB_CHARS = re.compile(r"[*?\[]")
_CHUNK = re.compile(r"\.chunk\.\d+$")  # before the suffix: the reference layout {S}.chunk.NN.jsonl
COMPLETE_SUFFIX = ".complete"


def natural_key(path: str) -> list:
    """Sort key that orders embedded numbers numerically."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path)]


def _join(root: str | None, name: str) -> str:
    if root is None or "://" in name or name.startswith("/"):
        return name
    return root.rstrip("/") + "/" + name


def _full(fs, path: str, like: str) -> str:
    """A path returned by fs.glob/ls, with the protocol back when `like` is a URL."""
    return fs.unstrip_protocol(path) if "://" in like else path


def _glob(pattern: str, storage_options: dict | None) -> list[str]:
    fs, fs_pattern = open_fs(pattern, storage_options)
    return [_full(fs, p, pattern) for p in fs.glob(fs_pattern)]


def _complete(
    paths: list[str], all_paths: set[str], where: str, require_markers: bool
) -> list[str]:
    """`paths`, or only those with a `.complete` marker when some have one (or markers are
    required)."""
    has_markers = any(p + COMPLETE_SUFFIX in all_paths for p in paths)
    if not (require_markers or has_markers):
        return paths
    complete = [p for p in paths if p + COMPLETE_SUFFIX in all_paths]
    if len(complete) < len(paths):
        logger.warning(
            "%s: ignoring %d shard(s) without a .complete marker", where, len(paths) - len(complete)
        )
    return complete


def _without_suffix(path: str, suffixes: list[str]) -> str:
    suffix = max((s for s in suffixes if path.lower().endswith(s)), key=len)
    return path[: len(path) - len(suffix)]


def _directory_files(directory: str, storage_options: dict | None, file_format: str) -> list[str]:
    """The files of the first format (by listing rank) that `directory` holds."""
    fs, fs_dir = open_fs(directory, storage_options)
    names = [_full(fs, p, directory) for p in fs.ls(fs_dir, detail=False)]
    everything = set(names)
    names = [p for p in names if ".val.jsonl" not in p]
    forced = "json" if file_format == "jsonl" else file_format
    ranks: dict[int, list[str]] = {}
    for fmt in formats():
        if forced == "auto" or fmt.name == forced:
            ranks.setdefault(fmt.listing_rank, []).extend(s.lower() for s in fmt.suffixes)
    for suffixes in (ranks[rank] for rank in sorted(ranks)):
        found = [p for p in names if p.lower().endswith(tuple(suffixes))]
        found = _complete(found, everything, directory, require_markers=False)
        chunks = [p for p in found if _CHUNK.search(_without_suffix(p, suffixes))]
        if found or forced != "auto":
            return chunks or found
    return []


def _raise_if_unreadable(source: str, location: str) -> None:
    """A local path that exists but cannot be read (a symlink loop, no permission): say so."""
    if "://" in location or not os.path.lexists(location):
        return
    try:
        os.stat(location)
    except OSError as exc:
        raise DataError(
            f"data source '{source}': {location}: cannot open ({exc.strerror or exc})"
        ) from None


def _missing_source_hint(source: str, root_dir: str | None, storage_options: dict | None) -> str:
    """What to check when `{root_dir}/{source}` does not exist: the root itself, or a close name."""
    if root_dir is None or "/" in source.strip("/"):
        return "check data.root_dir and data.sources"
    try:
        fs, fs_root = open_fs(root_dir, storage_options)
        if not fs.isdir(fs_root):
            return f"data.root_dir {root_dir} does not exist"
        names = sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(fs_root, detail=False))
    except OSError:
        return "check data.root_dir and data.sources"
    close = difflib.get_close_matches(source, names, n=1, cutoff=0.6)
    if close:
        return f"did you mean '{close[0]}'? check data.sources"
    shown = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
    return f"data.root_dir {root_dir} holds: {shown or 'nothing'}"


def source_files(
    source: str,
    *,
    root_dir: str | None,
    preprocess_dir: str | None = None,
    entropy_model_name: str | None = None,
    file_format: str = "auto",
    storage_options: dict | None = None,
    option: str | None = None,
) -> list[str]:
    """The sorted files of `source` (resolution rules in the module docstring). `option`: the
    command-line option that named it, for a tool outside training (`--entropies`)."""
    if preprocess_dir is not None:
        directory = _join(_join(preprocess_dir, source), entropy_model_name or "")
        fs, fs_dir = open_fs(directory, storage_options)
        if not fs.isdir(fs_dir):
            raise DataError(
                f"data source '{source}': preprocessed directory {directory} does not exist "
                "(check data.preprocess_dir / data.entropy_model_name, or run apps/preprocess_entropies)"
            )
        names = [_full(fs, p, directory) for p in fs.ls(fs_dir, detail=False)]
        arrows = [p for p in names if p.endswith(".arrow")]
        files = _complete(arrows, set(names), directory, require_markers=True)
        if not files:
            raise DataError(
                f"data source '{source}': no complete .arrow shards (with .complete markers) in {directory}"
            )
        return sorted(files, key=natural_key)
    location = _join(root_dir, source)
    if _GLOB_CHARS.search(location):
        files = _glob(location, storage_options)
        if not files:
            raise DataError(f"data source '{source}': no files match {location}")
        return sorted(files, key=natural_key)
    fs, fs_path = open_fs(location, storage_options)
    if fs.isfile(fs_path):
        return [location]
    if not fs.isdir(fs_path):
        _raise_if_unreadable(source, location)
        if option is not None:  # a tool's own option, not a training config
            raise DataError(f"{option} {location}: does not exist")
        hint = _missing_source_hint(source, root_dir, storage_options)
        if source == DEFAULT_CORPUS:
            build = (
                f"build the default corpus with: python -m bytelatent.data.prepare --out {location}"
            )
            hint = f"{hint}; or {build}" if hint.endswith("does not exist") else build
        raise DataError(f"data source '{source}': {location} does not exist ({hint})")
    files = _directory_files(location, storage_options, file_format)
    if not files:
        suffixes = ", ".join(s for fmt in formats() for s in fmt.suffixes)
        raise DataError(f"data source '{source}': no {suffixes} files in {location}")
    return sorted(files, key=natural_key)


def file_formats(paths: list[str], file_format: str) -> list[str]:
    """Format of each file: forced by data.file_format (a format name, `jsonl` for JSONL: its
    compressed forms still follow the extension), else from the suffix (the readers' registry)."""
    return [forced_format(p, file_format) for p in paths]
