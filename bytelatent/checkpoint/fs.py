"""fsspec helpers shared by checkpoint saving, loading and consolidation (local paths and s3://)."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from typing import IO, Any

import fsspec
from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem

# s3fs/botocore retry policy (the reference uses 10 attempts in "standard" mode).
S3_RETRIES = {"max_attempts": 10, "mode": "standard"}


def is_s3(path: str) -> bool:
    return str(path).startswith("s3://")


def storage_options(path: str, s3_profile: str | None = None) -> dict[str, Any]:
    """Keyword arguments for `fsspec.url_to_fs(path, **options)` (also given to DCP's Fsspec readers/writers)."""
    if not is_s3(path):
        return {}
    options: dict[str, Any] = {"config_kwargs": {"retries": dict(S3_RETRIES)}}
    if s3_profile:
        options["profile"] = s3_profile
    # botocore reads AWS_ENDPOINT_URL itself on recent versions; passing it explicitly keeps older
    # botocore builds (and aiobotocore wrappers) pointed at the same endpoint. No region_name here:
    # it makes bucket creation send a LocationConstraint that some S3 servers reject.
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        options["client_kwargs"] = {"endpoint_url": endpoint}
    return options


def get_fs(path: str, s3_profile: str | None = None) -> AbstractFileSystem:
    """The filesystem that serves `path` (local or s3://; credentials come from the usual AWS env/profile)."""
    fs, _ = fsspec.core.url_to_fs(str(path), **storage_options(str(path), s3_profile))
    return fs


def join(base: str, *names: str) -> str:
    """Join path parts with "/" keeping the protocol (os.path.join would be wrong for s3:// on Windows)."""
    out = str(base).rstrip("/")
    for name in names:
        out = f"{out}/{name.strip('/')}"
    return out


def _refresh(fs: AbstractFileSystem, path: str) -> None:
    # s3fs caches listings; files written by other ranks/processes are invisible until invalidated.
    fs.invalidate_cache(path)
    fs.invalidate_cache(str(path).rstrip("/").rsplit("/", 1)[0])


def exists(fs: AbstractFileSystem, path: str) -> bool:
    _refresh(fs, path)
    return fs.exists(path)


def listdir(fs: AbstractFileSystem, path: str) -> list[str]:
    """Base names of the entries directly under `path` ([] if it does not exist)."""
    _refresh(fs, path)
    try:
        entries = fs.ls(path, detail=False)
    except FileNotFoundError:
        return []
    return sorted({str(entry).rstrip("/").rsplit("/", 1)[-1] for entry in entries} - {""})


def isdir(fs: AbstractFileSystem, path: str) -> bool:
    _refresh(fs, path)
    return fs.isdir(path)


def makedirs(fs: AbstractFileSystem, path: str) -> None:
    # On object stores directories are implicit; makedirs is a no-op below the bucket.
    fs.makedirs(path, exist_ok=True)


def read_text(fs: AbstractFileSystem, path: str) -> str:
    with fs.open(path, "r") as f:
        return f.read()


@contextlib.contextmanager
def open_atomic_write(fs: AbstractFileSystem, path: str) -> Iterator[IO[bytes]]:
    """Binary writer for `path` such that readers see either nothing or the whole file.

    Local: write a temporary sibling, fsync, then rename (atomic on POSIX). Object stores: an
    upload becomes visible only when it completes, so write directly (a rename there is a copy).
    A failure removes the partial temporary file / aborts the upload.
    """
    if not isinstance(fs, LocalFileSystem):
        f = fs.open(path, "wb")
        try:
            yield f
        except BaseException:
            # Closing would commit the partial upload; discard aborts it (fsspec buffered files).
            if hasattr(f, "discard"):
                f.discard()
            raise
        f.close()
        _refresh(fs, path)
        return
    local_path = fs._strip_protocol(path)
    tmp = f"{local_path}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, local_path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_bytes_atomic(fs: AbstractFileSystem, path: str, data: bytes) -> None:
    with open_atomic_write(fs, path) as f:
        f.write(data)


def write_text_atomic(fs: AbstractFileSystem, path: str, text: str) -> None:
    write_bytes_atomic(fs, path, text.encode("utf-8"))


def rm(fs: AbstractFileSystem, path: str, recursive: bool = True) -> None:
    """Remove a file or folder; a path that is already gone is not an error."""
    try:
        fs.rm(path, recursive=recursive)
    except FileNotFoundError:
        pass
    _refresh(fs, path)
