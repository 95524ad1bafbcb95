"""Checkpoint manifests: what each rank wrote (sizes and CRC32s), checked before a checkpoint is used.

In a step folder, before the `.complete` marker:

    manifest_{rank:05d}.json   written by each rank right after its DCP shards (`__{rank}_*.distcp`)
    manifest.json              written by rank 0 last: the small files (.metadata, params.json,
                               train_state_*.json, the rank manifests) and how many ranks saved

`verify_step_folder` checks the marker, sizes always and CRC32s when asked, that `.metadata`
holds nothing but DCP metadata and that every non-tensor item is plain data (`dcp_io`); a folder without `manifest.json` was saved before
manifests existed (or by another tool) and is reported as unverified, not as broken.
`python -m bytelatent.checkpoint verify DIR` runs it over one step folder or a whole folder;
`require_loadable` is the check every reader (eval, generate, consolidate, warm start) runs first.
"""

from __future__ import annotations

import json
import logging
import re
import zlib
from dataclasses import dataclass, field
from typing import Any

from fsspec import AbstractFileSystem
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

from bytelatent.checkpoint import fs as cfs
from bytelatent.checkpoint.dcp_io import METADATA_FILE, check_byte_items, check_metadata
from bytelatent.checkpoint.layout import MARKER_FILE, marker_problem
from bytelatent.errors import CheckpointError

logger = logging.getLogger(__name__)

MANIFEST_FILE = "manifest.json"
_CHUNK = 8 << 20


def rank_manifest_name(rank: int) -> str:
    return f"manifest_{rank:05d}.json"


def file_digest(fs: AbstractFileSystem, path: str) -> dict[str, Any]:
    """{"size", "crc32"} of `path`, read in chunks (CRC32: a corruption check, not a signature)."""
    crc, size = 0, 0
    with fs.open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return {"size": size, "crc32": f"{crc:08x}"}


def write_manifest(
    fs: AbstractFileSystem, folder: str, name: str, files: list[str], **extra
) -> None:
    entries = {f: file_digest(fs, cfs.join(folder, f)) for f in sorted(set(files))}
    text = json.dumps({**extra, "files": entries}, indent=1)
    cfs.write_text_atomic(fs, cfs.join(folder, name), text)


class ManifestWriter(FsspecWriter):
    """DCP writer that records this rank's shard files in `manifest_{rank}.json` once written.

    Runs inside DCP's write phase (also in the background thread of an async save), so every
    rank's manifest exists before rank 0 writes `.metadata` and, later, the marker.
    """

    def __init__(self, path: str, rank: int, manifest_fs: AbstractFileSystem, **options) -> None:
        super().__init__(path, **options)
        self.folder = str(path)
        self.rank = rank
        self.manifest_fs = manifest_fs

    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)
        results = future.wait()
        files = [r.storage_data.relative_path for r in results]
        prefix = getattr(plan.storage_data, "prefix", "")
        match = re.fullmatch(r"__(\d+)_", prefix or "")
        rank = int(match.group(1)) if match else self.rank
        write_manifest(self.manifest_fs, self.folder, rank_manifest_name(rank), files, rank=rank)
        return future


def write_folder_manifest(fs: AbstractFileSystem, folder: str, world_size: int) -> None:
    """Rank 0, after every rank's data and `.metadata` are written, before the marker."""
    names = cfs.listdir(fs, folder)
    expected = [rank_manifest_name(r) for r in range(world_size)]
    small = [
        n
        for n in names
        if n in (".metadata", "params.json") or re.fullmatch(r"train_state_\d+\.json", n)
    ]
    write_manifest(
        fs, folder, MANIFEST_FILE, small + [n for n in expected if n in names],
        world_size=world_size, rank_manifests=expected,
    )  # fmt: skip


@dataclass
class VerifyReport:
    folder: str
    problems: list[str] = field(default_factory=list)
    verified: bool = True  # False: no manifest (older save), nothing could be checked
    n_files: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems


def _read_manifest(fs: AbstractFileSystem, path: str) -> dict[str, Any] | str:
    try:
        data = json.loads(cfs.read_text(fs, path))
    except FileNotFoundError:
        return "missing"
    except (json.JSONDecodeError, UnicodeDecodeError):
        return "not valid JSON"
    if not isinstance(data, dict) or not isinstance(data.get("files"), dict):
        return "has no 'files' table"
    return data


def _check_files(
    fs: AbstractFileSystem, folder: str, files: dict[str, Any], checksum: bool
) -> list[str]:
    problems = []
    for name, want in sorted(files.items()):
        path = cfs.join(folder, name)
        try:
            size = fs.size(path)
        except FileNotFoundError:
            problems.append(f"{name}: missing")
            continue
        if size != want.get("size"):
            problems.append(f"{name}: {size} bytes, the manifest says {want.get('size')}")
        elif checksum and file_digest(fs, path)["crc32"] != want.get("crc32"):
            problems.append(f"{name}: CRC32 differs from the manifest (corrupted)")
    return problems


def verify_step_folder(
    folder: str,
    checksum: bool = False,
    fs: AbstractFileSystem | None = None,
    shard: tuple[int, int] = (0, 1),
) -> VerifyReport:
    """Check `folder` against its manifests; `shard=(i, n)` checks only rank manifests i, i+n, ...

    (so n ranks can split the work; shard 0 also checks the top-level manifest's files).
    """
    fs = fs or cfs.get_fs(folder)
    folder = str(folder).rstrip("/")
    report = VerifyReport(folder)
    index, count = shard
    marker = marker_problem(fs, folder)
    if marker is not None:
        report.problems.append(marker)
    if index == 0 and cfs.exists(fs, cfs.join(folder, METADATA_FILE)):
        unsafe = check_metadata(fs, folder)
        if unsafe is not None:
            report.problems.append(unsafe)
    top = _read_manifest(fs, cfs.join(folder, MANIFEST_FILE))
    if top == "missing":
        report.verified = False
        return _check_byte_items(fs, report, index)
    if isinstance(top, str):
        report.problems.append(f"{MANIFEST_FILE}: {top}")
        return report
    if index == 0:
        report.problems += _check_files(fs, folder, top["files"], checksum)
        report.n_files += len(top["files"])
    for i, name in enumerate(top.get("rank_manifests", [])):
        if i % count != index:
            continue
        manifest = _read_manifest(fs, cfs.join(folder, name))
        if isinstance(manifest, str):
            report.problems.append(f"{name}: {manifest}")
            continue
        report.problems += _check_files(fs, folder, manifest["files"], checksum)
        report.n_files += len(manifest["files"])
    return _check_byte_items(fs, report, index)


def _check_byte_items(fs: AbstractFileSystem, report: VerifyReport, index: int) -> VerifyReport:
    """Last, on a folder that passed the other checks: its non-tensor items are plain data."""
    if index == 0 and report.ok and cfs.exists(fs, cfs.join(report.folder, METADATA_FILE)):
        problem = check_byte_items(fs, report.folder)
        if problem is not None:
            report.problems.append(problem)
    return report


def require_loadable(
    folder: str, s3_profile: str | None = None, checksum: bool = False
) -> VerifyReport:
    """What a reader runs before loading a DCP step folder: one CheckpointError line if it is broken.

    A folder our trainer wrote must be complete (`.complete`) and match its manifests; one with
    neither marker nor manifests (another tool's, or older) loads unverified, with a warning.
    `.metadata` must be plain DCP metadata either way.
    """
    fs = cfs.get_fs(folder, s3_profile)
    folder = str(folder).rstrip("/")
    report = verify_step_folder(folder, checksum=checksum, fs=fs)
    problems = list(report.problems)
    names = cfs.listdir(fs, folder)
    rank_manifests = any(re.fullmatch(r"manifest_\d+\.json", n) for n in names)
    if not report.verified and MARKER_FILE not in names and not rank_manifests:
        # Not written by our trainer (or before markers existed): nothing to check it against.
        problems = [p for p in problems if "partial save" not in p]
        if not problems:
            logger.warning(
                "%s: no %s nor %s; loading it unverified", folder, MARKER_FILE, MANIFEST_FILE
            )
            return report
    if problems:
        more = f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""
        raise CheckpointError(
            f"{folder}: not loadable: {'; '.join(problems[:3])}{more}; pick another checkpoint "
            "(python -m bytelatent.checkpoint verify DIR lists them)"
        )
    return report


def _is_step_folder(fs: AbstractFileSystem, path: str) -> bool:
    names = set(cfs.listdir(fs, path))
    return bool(names & {".metadata", MARKER_FILE, MANIFEST_FILE})


def verify_tree(path: str, checksum: bool = True, s3_profile: str | None = None) -> int:
    """CLI body: verify `path` (a step folder, or a folder of them); print a table; exit code."""
    fs = cfs.get_fs(path, s3_profile)
    path = str(path).rstrip("/")
    if not cfs.isdir(fs, path):
        raise CheckpointError(f"{path}: not a folder")
    single = _is_step_folder(fs, path)
    names = [path.rsplit("/", 1)[-1]] if single else cfs.listdir(fs, path)
    folders = [path] if single else [cfs.join(path, n) for n in names if _is_step_name(n)]
    if not folders:
        raise CheckpointError(f"{path}: no step folders (0000001000/...) and not a step folder")
    what = "sizes + CRC32s" if checksum else "sizes"
    failed = 0
    for folder in folders:
        report = verify_step_folder(folder, checksum=checksum, fs=fs)
        name = folder.rsplit("/", 1)[-1]
        partial = any("partial save" in p for p in report.problems)
        if partial and not single and len(report.problems) == 1:
            print(f"{name}  partial     no {MARKER_FILE}: an interrupted save, never resumed from")
        elif not report.ok:
            failed += 1
            print(f"{name}  FAILED      {'; '.join(report.problems)}")
        elif not report.verified:
            print(f"{name}  unverified  no {MANIFEST_FILE} (saved before manifests existed)")
        else:
            print(f"{name}  ok          {report.n_files} files ({what})")
    print(f"{len(folders)} checkpoint(s), {failed} failed")
    return 1 if failed else 0


def _is_step_name(name: str) -> bool:
    return len(name) == 10 and name.isdigit()
