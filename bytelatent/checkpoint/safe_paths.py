"""File names read from a checkpoint's own index files stay inside the checkpoint folder.

Two indexes name the files to read: DCP's `.metadata` (each storage item's
`_StorageInfo.relative_path`) and a Hugging Face shard index (`model.safetensors.index.json`,
its `weight_map` values). Both come with the folder, so whoever shipped the folder chose them. A
name that is absolute, has a `..` component, or (local folders) resolves through a symlink to
somewhere outside the folder is refused in one line naming the index file and the name.

One exception, for symlinks only: a Hugging Face hub cache snapshot
(`.../snapshots/<revision>/`) links its files to `../../blobs/<hash>`, so there the repository's
`blobs/` folder counts as inside.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Any

from bytelatent.errors import CheckpointError


def _is_local(folder: str) -> bool:
    return "://" not in folder or folder.startswith("file://")


def _local_path(folder: str) -> str:
    return folder[len("file://") :] if folder.startswith("file://") else folder


def _allowed_roots(folder: str) -> list[str]:
    real = os.path.realpath(folder)
    roots = [real]
    parent = os.path.dirname(os.path.abspath(folder))
    if os.path.basename(parent) == "snapshots":  # HF hub cache: snapshots/<rev>/x -> ../../blobs/
        roots.append(os.path.realpath(os.path.join(os.path.dirname(parent), "blobs")))
    return roots


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def outside_reason(name: Any, folder: str) -> str | None:
    """Why the file `name`, relative to `folder`, is not inside it; None when it is."""
    if not isinstance(name, str) or not name:
        return f"not a file name (a {type(name).__name__})"
    if "\x00" in name:
        return "has a NUL character"
    if name.startswith(("/", "\\")) or "://" in name or (len(name) > 1 and name[1] == ":"):
        return "an absolute path"
    if ".." in name.replace("\\", "/").split("/"):
        return "has a '..' component"
    if _is_local(folder):
        local = _local_path(folder)
        target = os.path.realpath(os.path.join(local, name))
        if not any(_inside(target, root) for root in _allowed_roots(local)):
            return f"a symlink to {target}"
    return None


def require_inside(names: Iterable[Any], folder: str, where: str, what: str) -> None:
    """CheckpointError (one line) for the first of `names` that points outside `folder`."""
    for name in names:
        reason = outside_reason(name, folder)
        if reason is not None:
            raise CheckpointError(
                f"{where}: refusing {what} {name!r}: it points outside {folder} ({reason}); "
                "the file may have been tampered with, do not use this checkpoint"
            )


def check_storage_paths(metadata: Any, where: str) -> None:
    """Every `relative_path` in DCP metadata's `storage_data` names a file inside the folder of
    `where` (the `.metadata` file)."""
    storage = getattr(metadata, "storage_data", None)
    if storage is None:
        return
    if not isinstance(storage, dict):
        raise CheckpointError(f"{where}: storage_data is a {type(storage).__name__}, not a mapping")
    folder = where.rsplit("/", 1)[0] if "/" in where else "."
    names = {getattr(info, "relative_path", None) for info in storage.values()}
    require_inside(sorted(names, key=repr), folder, where, "storage file")


def read_shard_index(fs: Any, folder: str, index_file: str) -> list[str]:
    """The distinct shard file names of a safetensors index (`weight_map` values), each checked
    to stay inside `folder`; one CheckpointError line for an unreadable or hostile index."""
    where = folder.rstrip("/") + "/" + index_file
    try:
        with fs.open(where, "r") as f:
            index = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{where}: not valid JSON ({err})") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{where}: no 'weight_map' mapping tensor names to shard files")
    names = set(weight_map.values())
    require_inside(sorted(names, key=repr), folder, where, "shard file")
    return sorted(names)
