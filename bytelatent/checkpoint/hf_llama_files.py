"""The files of a Hugging Face `LlamaForCausalLM` folder (`model.global_init`): its config and
its safetensors files, each checked to exist. Torch-free, so that `python -m bytelatent.train`
checks `model.global_init.path` before it imports torch (`bytelatent/preflight.py`); reading the
weights is `hf_llama.py`'s."""

from __future__ import annotations

import json
from typing import Any

from bytelatent.checkpoint.fs import get_fs, join
from bytelatent.checkpoint.safe_paths import read_shard_index, require_inside
from bytelatent.errors import CheckpointError

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def read_hf_config(path: str) -> dict[str, Any]:
    fs = get_fs(path)
    file = join(path, CONFIG_FILE)
    if not fs.exists(file):
        raise CheckpointError(f"{file}: missing; model.global_init.path must be a HF model folder")
    try:
        with fs.open(file, "r") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{file}: not valid JSON ({err})") from None


def weight_files(path: str) -> list[str]:
    """The safetensors files of the folder (from the shard index), each checked to exist."""
    fs = get_fs(path)
    index = join(path, INDEX_FILE)
    if fs.exists(index):
        names = read_shard_index(fs, path, INDEX_FILE)  # names stay inside the folder
    elif fs.exists(join(path, SINGLE_FILE)):
        names = [SINGLE_FILE]
        require_inside(names, path, join(path, SINGLE_FILE), "weights file")
    else:
        raise CheckpointError(
            f"{path}: neither {INDEX_FILE} nor {SINGLE_FILE}; not a HF safetensors folder"
        )
    files = [join(path, name) for name in names]
    for file in files:
        if not fs.exists(file):
            raise CheckpointError(f"{file}: missing (listed in {INDEX_FILE})")
    return files
