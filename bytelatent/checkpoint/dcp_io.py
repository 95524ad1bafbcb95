"""Reading DCP folders without running code from them: `.metadata` through a restricted unpickler.

torch's DCP readers load `.metadata` with plain `pickle.load`, so a planted payload (a global
whose `__reduce__` runs a command) would execute on whoever loads the folder. Checkpoints are
shared between people and clusters; every DCP read in bytelatent goes through `SafeFsspecReader`,
whose unpickler admits only what DCP metadata is made of:

- the metadata dataclasses and enums defined in `torch.distributed.checkpoint` (Metadata,
  TensorStorageMetadata, ChunkStorageMetadata, _StorageInfo, ...);
- `torch.Size`, torch's dtype / layout / memory-format constants (and `_get_layout`, which
  layouts pickle through);
- inert containers (`collections.OrderedDict`, set, frozenset) and `pathlib` paths.

Anything else is refused with one line naming the file (`CheckpointError`).

The non-tensor items of a checkpoint (the optimizer's `param_groups`: lr, betas, flags, names)
are stored by DCP as pickled bytes, which torch's `DefaultLoadPlanner.load_bytes` reads with
`torch.load` with `weights_only=False`: a pickle appended to a shard, with `.metadata` pointing an
item at it, would run on resume. Our planners (`SafeLoadPlanner`,
`SafeEmptyStateDictLoadPlanner`) read every byte item through torch's weights-only unpickler
(plain containers, numbers, strings, tensors), and `SafeFsspecReader` refuses to read data for
any other planner, so no byte of a checkpoint reaches the full unpickler.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import enum
import io
import pathlib
import pickle
import re
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    _EmptyStateDictLoadPlanner,
)

from bytelatent.checkpoint import fs as cfs
from bytelatent.checkpoint.safe_paths import check_storage_paths
from bytelatent.errors import CheckpointError

METADATA_FILE = ".metadata"
# DCP reports failures as CheckpointException, a BaseException (not an Exception) subclass.
DCP_ERRORS = (Exception, CheckpointException)

_DCP_PACKAGE = "torch.distributed.checkpoint"
_TORCH_CONSTANTS = (torch.dtype, torch.layout, torch.memory_format)
_INERT = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("pathlib", "PosixPath"): pathlib.PosixPath,
    ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
    ("pathlib", "WindowsPath"): pathlib.WindowsPath,
    ("pathlib", "PureWindowsPath"): pathlib.PureWindowsPath,
    ("pathlib", "Path"): pathlib.Path,
    ("torch", "Size"): torch.Size,
    # torch.layout pickles as _get_layout("torch.strided"): a lookup in torch's own layout table
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
}


def _is_dcp_metadata_type(obj: Any, module: str) -> bool:
    """A dataclass or enum defined inside torch.distributed.checkpoint (pure data)."""
    return (
        isinstance(obj, type)
        and obj.__module__ == module
        and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum))
    )


class _MetadataUnpickler(pickle.Unpickler):
    """Admits only the globals DCP metadata is made of; anything else is refused."""

    def __init__(self, data: bytes, where: str) -> None:
        super().__init__(io.BytesIO(data))
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _INERT:
            return _INERT[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), _TORCH_CONSTANTS):
            return getattr(torch, name)
        if module == _DCP_PACKAGE or module.startswith(_DCP_PACKAGE + "."):
            loaded = sys.modules.get(module)
            obj = getattr(loaded, name, None) if loaded is not None else None
            if _is_dcp_metadata_type(obj, module):
                return obj
        raise CheckpointError(
            f"{self.where}: refusing to load {module}.{name}: not part of DCP checkpoint metadata "
            "(the file may have been tampered with); do not use this checkpoint"
        )


def load_metadata_bytes(data: bytes, where: str) -> Any:
    """Unpickle DCP metadata restricted to its own classes; CheckpointError on anything else."""
    try:
        metadata = _MetadataUnpickler(data, where).load()
    except CheckpointError:
        raise
    except Exception as e:  # truncated or garbled file
        raise CheckpointError(
            f"{where}: not readable DCP metadata ({type(e).__name__}: {e})"
        ) from None
    if type(metadata).__name__ != "Metadata" or not hasattr(metadata, "state_dict_metadata"):
        raise CheckpointError(f"{where}: not DCP metadata (a {type(metadata).__name__})")
    check_storage_paths(metadata, where)  # storage file names stay inside the folder
    return metadata


_TAMPERED = "the file may have been tampered with; do not use this checkpoint"


def _weights_only_reason(error: BaseException) -> str:
    """The one informative line of torch's weights-only refusal (its message is a page)."""
    text = " ".join(str(error).split())
    found = re.search(r"WeightsUnpickler error: (.*?)(?: Please use| Check the|$)", text)
    return found.group(1).strip() if found else f"{type(error).__name__}: {text[:200]}"


def load_byte_item(value: io.BytesIO | bytes, where: str) -> Any:
    """A DCP byte item through torch's weights-only unpickler; one CheckpointError line if refused."""
    stream = io.BytesIO(value) if isinstance(value, bytes) else value
    try:
        with warnings.catch_warnings():  # "Detected pickle protocol 4": what DCP writes
            warnings.simplefilter("ignore", UserWarning)
            return torch.load(stream, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:  # a global or opcode outside plain data
        raise CheckpointError(
            f"{where}: refusing to load a non-tensor item ({_weights_only_reason(e)}); {_TAMPERED}"
        ) from None
    except Exception as e:  # truncated or garbled
        raise CheckpointError(f"{where}: not a readable item ({first_line(e)[:200]})") from None


class _RestrictedBytes:
    """Planner mixin: byte items through `load_byte_item`, never the unrestricted `torch.load`.

    What DefaultLoadPlanner.load_bytes does with the loaded object, without its unpickling.
    """

    def __init__(self, *args: Any, where: str = "checkpoint", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.where = where

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        item = load_byte_item(value, f"{self.where}: {fqn}")
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], item)
        else:
            self.state_dict[fqn] = item


class SafeLoadPlanner(_RestrictedBytes, DefaultLoadPlanner):
    """dcp.load's default planner, with byte items through the weights-only unpickler."""


class SafeEmptyStateDictLoadPlanner(_RestrictedBytes, _EmptyStateDictLoadPlanner):
    """The planner of a load into an empty state dict (consolidate), likewise restricted."""


class SafeFsspecReader(FsspecReader):
    """FsspecReader whose `.metadata` goes through the restricted unpickler, and whose data only
    goes to a planner that reads byte items restricted (see the module docstring)."""

    def read_data(self, plan: Any, planner: Any) -> Any:
        if not isinstance(planner, _RestrictedBytes):
            raise CheckpointError(
                f"{self.path}: internal error: a checkpoint read with {type(planner).__name__}, "
                "which unpickles byte items unrestricted; use dcp_io.SafeLoadPlanner"
            )
        return super().read_data(plan, planner)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        rank = kwargs.get("rank")
        if hasattr(self, "_get_metadata_path"):
            path = self._get_metadata_path(rank)
        else:  # older torch
            path = self.fs.concat_path(self.path, METADATA_FILE)
        with self.fs.create_stream(path, "rb") as f:
            data = f.read()
        metadata = load_metadata_bytes(data, str(path))
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def read_metadata(path: str, s3_profile: str | None = None) -> Any:
    """The DCP metadata of step folder `path` (restricted unpickling)."""
    return SafeFsspecReader(path, **cfs.storage_options(path, s3_profile)).read_metadata()


def check_metadata(fs: Any, folder: str) -> str | None:
    """Why `folder/.metadata` must not be loaded (one line), or None if it is plain DCP metadata."""
    return _folder_problem(fs, folder, byte_items=False)


def check_byte_items(fs: Any, folder: str) -> str | None:
    """Why a non-tensor item of `folder` must not be loaded (one line), or None.

    Each byte item is read through the weights-only unpickler. Loading is restricted anyway
    (`SafeLoadPlanner`); this makes `verify` fail a folder whose items were replaced, with its
    manifests rewritten or without manifests. Items stored through a stream transform
    (compression) are left to the load, which reads them restricted after the transform.
    """
    return _folder_problem(fs, folder, byte_items=True)


def _folder_problem(fs: Any, folder: str, byte_items: bool) -> str | None:
    where = cfs.join(folder, METADATA_FILE)
    try:
        with fs.open(where, "rb") as f:
            metadata = load_metadata_bytes(f.read(), where)
        if byte_items:
            _load_byte_items(fs, folder, metadata)
    except CheckpointError as e:
        return str(e)
    except OSError as e:
        return f"{where}: cannot read ({e})"
    return None


def _load_byte_items(fs: Any, folder: str, metadata: Any) -> None:
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    byte_items = {
        fqn for fqn, md in metadata.state_dict_metadata.items()
        if isinstance(md, BytesStorageMetadata)
    }  # fmt: skip
    for index, info in (metadata.storage_data or {}).items():
        if index.fqn not in byte_items or getattr(info, "transform_descriptors", None):
            continue
        where = f"{cfs.join(folder, info.relative_path)}: {index.fqn}"
        with fs.open(cfs.join(folder, info.relative_path), "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
        if len(data) != info.length:
            raise CheckpointError(f"{where}: truncated ({len(data)} of {info.length} bytes)")
        load_byte_item(data, where)


def dcp_load(
    state: dict[str, Any],
    path: str,
    failure: str,
    storage_options: dict[str, Any] | None = None,
    process_group: Any = None,
) -> None:
    """DCP-load `state` in place from `path`; a failure is one CheckpointError line."""
    try:
        with quiet_single_process():
            dcp.load(
                state,
                storage_reader=SafeFsspecReader(path, **(storage_options or {})),
                planner=SafeLoadPlanner(where=path),
                process_group=process_group,
            )
    except CheckpointError:
        raise
    except DCP_ERRORS as e:
        cause = refusal(e)
        if cause is not None:
            raise cause from None
        raise CheckpointError(f"{path}: {failure} ({first_line(e)})") from e


def refusal(error: BaseException) -> CheckpointError | None:
    """The metadata refusal inside DCP's wrapped multi-rank errors, if that is what failed."""
    if isinstance(error, CheckpointError):
        return error
    if isinstance(error, CheckpointException):
        for cause, _trace in error.failures.values():
            if isinstance(cause, CheckpointError):
                return cause
    cause = error.__cause__ or error.__context__
    return refusal(cause) if cause is not None and cause is not error else None


_SINGLE_PROCESS_WARNING = r"torch\.distributed is disabled, unavailable or uninitialized"


@contextlib.contextmanager
def quiet_single_process() -> Iterator[None]:
    """Silence DCP's "assuming a single process" warning: without a process group that is the intent.

    A filter for the whole process, not `catch_warnings`: an async save warns from its upload
    thread, after this block has ended (and catch_warnings is not thread-safe). Adding the same
    filter again replaces it, so the list does not grow.
    """
    warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING, category=UserWarning)
    yield


def first_line(error: BaseException) -> str:
    """`Type: message` of the root cause, unwrapping DCP's multi-rank CheckpointException."""
    if isinstance(error, CheckpointException) and error.failures:
        rank, (cause, _trace) = min(error.failures.items(), key=lambda item: item[0])
        return f"rank {rank}: {first_line(cause)}"
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"
