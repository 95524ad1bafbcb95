"""`TrainState`: everything besides model and optimizer that a resume needs, as plain JSON."""

from __future__ import annotations

import base64
import io
import json
import logging
import random
from typing import Any

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, model_validator

from bytelatent.checkpoint import fs as cfs
from bytelatent.checkpoint.manager import train_state_name
from bytelatent.errors import DataError

logger = logging.getLogger("bytelatent")


def _tensor_to_b64(t: torch.Tensor) -> str:
    buf = io.BytesIO()
    torch.save(t, buf)
    return base64.b64encode(buf.getvalue()).decode()


def _b64_to_tensor(s: str) -> torch.Tensor:
    return torch.load(io.BytesIO(base64.b64decode(s)), weights_only=True)


def capture_rng_state() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": [version, list(internal), gauss],
        "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch_cpu": _tensor_to_b64(torch.get_rng_state()),
    }
    if torch.cuda.is_available():
        # this rank's device only (train states are per rank, as the data states are): a resume
        # on a host that sees fewer or other GPUs restores what this rank needs and nothing else
        device = torch.cuda.current_device()
        state["torch_cuda_device"] = _tensor_to_b64(torch.cuda.get_rng_state(device))
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_b64_to_tensor(state["torch_cpu"]))
    if torch.cuda.is_available():
        _restore_cuda_rng(state)


def _restore_cuda_rng(state: dict[str, Any]) -> None:
    """This rank's device RNG; states written before it was per rank held every visible GPU's
    (`torch_cuda`): take the entry of this rank's device, if that host had one."""
    device = torch.cuda.current_device()
    if "torch_cuda_device" in state:
        torch.cuda.set_rng_state(_b64_to_tensor(state["torch_cuda_device"]), device)
    elif "torch_cuda" in state:
        old = state["torch_cuda"]
        if device < len(old):
            torch.cuda.set_rng_state(_b64_to_tensor(old[device]), device)
        else:
            logger.warning(
                "train state holds CUDA RNG states of %d devices, none for cuda:%d; its RNG "
                "starts from the seed",
                len(old),
                device,
            )


class TrainState(BaseModel):
    """Per data-parallel rank; written as `train_state_{dp_rank:05d}.json` in each checkpoint."""

    model_config = ConfigDict(extra="forbid")

    step: int = 0  # optimizer steps taken
    data_state: dict[str, Any] | None = None  # the data iterator's state after the last batch used
    scheduler: dict[str, Any] = {}
    rng: dict[str, Any] = {}
    tokens_seen: int = 0  # target bytes consumed on this rank (metrics report the dp sum)
    actions: dict[str, Any] = {}  # each action's state (bytelatent.trainer.actions)
    # {"relative_steps": N, "stop_step": S} while a relative_steps run is under way (loop_controls)
    relative_target: dict[str, int] | None = None

    @model_validator(mode="before")
    @classmethod
    def _drop_acc_step(cls, data: Any) -> Any:
        # Older checkpoints stored `acc_step`, always 0 at a save (saves fall between steps).
        if isinstance(data, dict) and "acc_step" in data:
            data = {k: v for k, v in data.items() if k != "acc_step"}
        return data


def read_data_states(fs: Any, path: str, saved_dp_size: int) -> list[dict | None]:
    """The data state of every dp rank that wrote the checkpoint at `path` (elastic resume)."""
    states = []
    for rank in range(saved_dp_size):
        file = cfs.join(path, train_state_name(rank))
        try:
            states.append(json.loads(cfs.read_text(fs, file)).get("data_state"))
        except (OSError, ValueError) as exc:
            raise DataError(f"{file}: cannot read its data state ({exc})") from exc
    return states
