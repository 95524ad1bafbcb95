"""A train state with thousands of data files stays small (issue 22, minor): the data state's file
lists are written compact (with `indent=2` two thirds of the file was indentation), and states
written by older versions (indented) load the same."""

from __future__ import annotations

import json

import torch

from bytelatent.checkpoint.args import CheckpointArgs
from bytelatent.checkpoint.manager import CheckpointManager, train_state_name
from bytelatent.data.args import DataArgs
from bytelatent.data.elastic import build_train_data


def _data_state(root, n_files: int) -> dict:
    source = root / "web"
    source.mkdir(parents=True)
    for i in range(n_files):
        (source / f"web.chunk.{i:05d}.jsonl").write_text(
            json.dumps({"text": f"doc {i} " * 8}) + "\n"
        )
    args = DataArgs(root_dir=str(root), sources={"web": 1.0}, batch_size=4, seq_len=32,
                    load_async=False, patcher_args={"patching_mode": "byte"})  # fmt: skip
    data = build_train_data(args, 0, 1, 1, None)
    next(data)
    return data.get_state().model_dump(mode="json")


def test_train_state_with_many_files_is_compact_and_loads_back(tmp_path):
    train_state = {"step": 1, "tokens_seen": 128, "data_state": _data_state(tmp_path, 2000)}
    manager = CheckpointManager(CheckpointArgs(path=str(tmp_path / "ck")))
    model = torch.nn.Linear(2, 2)
    folder = manager.save(1, model, None, train_state)
    text = (tmp_path / "ck" / "0000000001" / train_state_name(0)).read_text()
    indented = json.dumps(train_state, indent=2)
    assert len(text) < 0.45 * len(indented), (len(text), len(indented))
    assert text.splitlines()[1] == '  "step": 1,'  # the top level stays readable
    assert manager.load(model, None, folder) == train_state
    # an older, indented state loads the same
    (tmp_path / "ck" / "0000000001" / train_state_name(0)).write_text(indented)
    assert (
        CheckpointManager(CheckpointArgs(path=str(tmp_path / "ck")))._read_train_state(folder)[0]
        == train_state
    )
