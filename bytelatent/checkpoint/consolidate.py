"""DCP checkpoint -> released layout (`params.json` + `consolidated.pth`), and readers for both formats.

The released layout is what BLT publishes and what `load_init` / evaluation read:
`consolidated.pth` holds `{"model": state_dict}` (plus `"optim"` with `--with-optim`) with plain
CPU tensors, loadable with `torch.load` in a single process. Works for local and s3:// paths
(torch's `dcp_to_torch_save` only handles local paths, so this reads through `FsspecReader`).
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from bytelatent.checkpoint import fs as cfs
from bytelatent.checkpoint.dcp_io import (
    DCP_ERRORS,
    METADATA_FILE,
    SafeEmptyStateDictLoadPlanner,
    SafeFsspecReader,
    first_line,
    refusal,
)
from bytelatent.checkpoint.layout import PARAMS_FILE  # noqa: F401 (re-exported)
from bytelatent.checkpoint.verify import require_loadable
from bytelatent.errors import CheckpointError
from bytelatent.progress import Progress, ProgressMode

logger = logging.getLogger(__name__)

CONSOLIDATED_FILE = "consolidated.pth"
CONSOLIDATED_SAFETENSORS = "consolidated.safetensors"
FORMATS = ("pth", "safetensors")
CONSOLIDATE_FOLDER = "consolidated"


def _step_folders(fs: Any, path: str) -> list[str]:
    return [name for name in cfs.listdir(fs, path) if len(name) == 10 and name.isdigit()]


def require_dcp_dir(path: str, s3_profile: str | None = None) -> None:
    """Raise a one-line CheckpointError unless `path` holds a DCP checkpoint (a `.metadata` file)."""
    fs = cfs.get_fs(path, s3_profile)
    if cfs.exists(fs, cfs.join(path, METADATA_FILE)):
        return
    if not cfs.exists(fs, path):
        raise CheckpointError(f"{path}: does not exist")
    steps = _step_folders(fs, path)
    if steps:
        raise CheckpointError(
            f"{path}: no {METADATA_FILE} here; it holds step folders, pass one of them (e.g. {cfs.join(path, steps[-1])})"
        )
    if cfs.exists(fs, cfs.join(path, CONSOLIDATED_FILE)):
        raise CheckpointError(
            f"{path}: already a consolidated checkpoint ({CONSOLIDATED_FILE}), not a DCP folder"
        )
    raise CheckpointError(
        f"{path}: no {METADATA_FILE}; not a DCP checkpoint folder (or its save was interrupted)"
    )


class _ProgressReader(SafeFsspecReader):
    """FsspecReader that advances a progress bar by the stored size of every item it reads."""

    def __init__(self, path: str, progress: ProgressMode, **storage_options: Any) -> None:
        super().__init__(path, **storage_options)
        self._progress_mode = progress
        self._bar: Progress | None = None

    def read_data(self, plan, planner):
        total = sum(self.storage_data[item.storage_index].length for item in plan.items)
        with Progress(
            "consolidate: reading", total=total, unit="B", unit_scale=True,
            mode=self._progress_mode,
        ) as self._bar:  # fmt: skip
            return super().read_data(plan, planner)

    def _slice_file(self, file, sinfo):  # called once per read item, with its stored size
        if self._bar is not None:
            self._bar.update(sinfo.length)
        return super()._slice_file(file, sinfo)


def load_dcp_state_dict(
    path: str,
    keys: set[str] | None = None,
    s3_profile: str | None = None,
    progress: ProgressMode = "off",
) -> dict[str, Any]:
    """Read a whole DCP checkpoint (or only the top-level `keys`) into plain CPU tensors, in this process only.

    The folder is checked first (`require_loadable`: marker, manifests, safe `.metadata`); any
    failure, also while reading, is one CheckpointError line.
    """
    require_dcp_dir(path, s3_profile)
    require_loadable(path, s3_profile)
    state: dict[str, Any] = {}
    reader = _ProgressReader(path, progress, **cfs.storage_options(path, s3_profile))
    try:
        with warnings.catch_warnings():
            # no_dist=True is intended here (one process reads everything); silence DCP's reminder.
            warnings.simplefilter("ignore", UserWarning)
            _load_state_dict(
                state,
                storage_reader=reader,
                planner=SafeEmptyStateDictLoadPlanner(keys=keys, where=str(path)),
                no_dist=True,
            )
    except CheckpointError:
        raise
    except DCP_ERRORS as e:
        cause = refusal(e)  # a refused byte item, inside DCP's wrapped error
        if cause is not None:
            raise cause from None
        raise CheckpointError(f"{path}: cannot read the checkpoint ({first_line(e)})") from None
    return state


def find_consolidated_file(path: str, s3_profile: str | None = None) -> str | None:
    """The consolidated weights file for `path`: the file itself, `path/consolidated.pth` or `path/consolidated/consolidated.pth`."""
    fs = cfs.get_fs(path, s3_profile)
    candidates = [path] if path.endswith((".pth", ".pt")) else []
    candidates += [
        cfs.join(path, CONSOLIDATED_FILE),
        cfs.join(path, CONSOLIDATE_FOLDER, CONSOLIDATED_FILE),
    ]
    for candidate in candidates:
        if cfs.exists(fs, candidate) and not cfs.isdir(fs, candidate):
            return candidate
    return None


def load_consolidated_state_dict(
    path: str, s3_profile: str | None = None
) -> dict[str, torch.Tensor]:
    """Model state dict from a released/consolidated checkpoint (`{"model": sd}` or a bare state dict)."""
    file = find_consolidated_file(path, s3_profile)
    if file is None:
        raise CheckpointError(
            f"{path}: no {CONSOLIDATED_FILE} found (looked in the folder and its {CONSOLIDATE_FOLDER}/)"
        )
    fs = cfs.get_fs(file, s3_profile)
    try:
        with fs.open(file, "rb") as f:
            payload = torch.load(f, map_location="cpu", weights_only=True)
    except Exception as e:  # corrupt/truncated files surface as pickle or zip errors
        raise CheckpointError(
            f"{file}: cannot read with torch.load ({type(e).__name__}: {e})"
        ) from e
    if isinstance(payload, dict) and isinstance(payload.get("model"), dict):
        payload = payload["model"]
    if not isinstance(payload, dict) or not all(
        isinstance(v, torch.Tensor) for v in payload.values()
    ):
        raise CheckpointError(
            f"{file}: expected a state dict of tensors (or {{'model': state_dict}})"
        )
    return payload


def consolidate(
    ckpt_dir: str,
    out_dir: str | None = None,
    *,
    with_optim: bool = False,
    s3_profile: str | None = None,
    format: str = "pth",
    progress: ProgressMode = "off",
) -> str:
    """Convert the DCP checkpoint in `ckpt_dir` to `out_dir/{params.json, consolidated.pth}`; returns out_dir.

    `out_dir` defaults to `ckpt_dir/consolidated` (the reference location). params.json is copied
    when the checkpoint has one. The .pth is written atomically, so an interrupted run leaves no
    half-written file behind.
    """
    ckpt_dir = str(ckpt_dir).rstrip("/")
    out_dir = (out_dir or cfs.join(ckpt_dir, CONSOLIDATE_FOLDER)).rstrip("/")
    _check_format(format, with_optim)
    keys = {"model", "optim"} if with_optim else {"model"}
    state = load_dcp_state_dict(ckpt_dir, keys=keys, s3_profile=s3_profile, progress=progress)
    if "model" not in state:
        raise CheckpointError(
            f"{ckpt_dir}: the checkpoint has no 'model' entries (was it written by dcp.save of {{'model': ...}}?)"
        )
    if with_optim and "optim" not in state:
        raise CheckpointError(
            f"{ckpt_dir}: --with-optim given but the checkpoint has no 'optim' entries"
        )

    in_fs = cfs.get_fs(ckpt_dir, s3_profile)
    out_fs = cfs.get_fs(out_dir, s3_profile)
    cfs.makedirs(out_fs, out_dir)
    params_path = cfs.join(ckpt_dir, PARAMS_FILE)
    if cfs.exists(in_fs, params_path):
        cfs.write_text_atomic(
            out_fs, cfs.join(out_dir, PARAMS_FILE), cfs.read_text(in_fs, params_path)
        )
    else:
        logger.warning("%s: no %s; writing %s without it", ckpt_dir, PARAMS_FILE, CONSOLIDATED_FILE)
    if format == "safetensors":
        data = safetensors_bytes(state["model"])
        cfs.write_bytes_atomic(out_fs, cfs.join(out_dir, CONSOLIDATED_SAFETENSORS), data)
    else:
        payload = {key: state[key] for key in sorted(keys)}
        with cfs.open_atomic_write(out_fs, cfs.join(out_dir, CONSOLIDATED_FILE)) as f:
            torch.save(payload, f)
    n_params = sum(t.numel() for t in state["model"].values() if isinstance(t, torch.Tensor))
    logger.info(
        "consolidated %s -> %s (%d tensors, %d values)",
        ckpt_dir,
        out_dir,
        len(state["model"]),
        n_params,
    )
    return out_dir


def _check_format(format: str, with_optim: bool) -> None:
    if format not in FORMATS:
        raise CheckpointError(f"--format {format!r}: expected one of {', '.join(FORMATS)}")
    if format == "safetensors":
        if with_optim:
            raise CheckpointError(
                "--with-optim needs --format pth: safetensors holds flat tensors, not optimizer state"
            )
        try:
            import safetensors  # noqa: F401
        except ImportError:
            raise CheckpointError(
                "--format safetensors needs the safetensors package: pip install 'bytelatent[hf]'"
            ) from None


def safetensors_bytes(model_state: dict[str, Any]) -> bytes:
    """A flat model state dict as safetensors bytes (tied tensors stored as separate copies)."""
    from safetensors.torch import save

    seen: set[int] = set()
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in model_state.items():
        if not isinstance(tensor, torch.Tensor):
            raise CheckpointError(
                f"model entry {name}: not a tensor; cannot store it as safetensors"
            )
        tensor = tensor.detach().to("cpu").contiguous()
        if tensor.untyped_storage().data_ptr() in seen:
            tensor = tensor.clone()  # safetensors refuses shared storage
        seen.add(tensor.untyped_storage().data_ptr())
        tensors[name] = tensor
    return save(tensors, metadata={"format": "pt"})
