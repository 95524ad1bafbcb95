"""`python -m bytelatent.data.check`: finds every defect of a broken data folder, passes on good data."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest
import yaml

from bytelatent.data.check import main as check_main
from tests.trainer.test_cli import REPO


def _arrow(path: Path, texts: pa.Array, entropies: list | None = None) -> Path:
    columns = {"sample_id": pa.array([f"{path.stem}-{i}" for i in range(len(texts))]),
               "text": texts}  # fmt: skip
    if entropies is not None:
        columns["entropies"] = pa.array(entropies, pa.list_(pa.float32()))
    table = pa.table(columns)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=2):
            writer.write_batch(batch)
    return path


def _broken_folder(root: Path) -> dict[str, str]:
    """file name -> the problem the check must report for it (None: must pass)."""
    root.mkdir()
    (root / "good.jsonl").write_text('{"text": "fine"}\n{"text": "also fine"}\n')
    (root / "malformed.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "cut\n')
    (root / "badutf8.jsonl").write_bytes(b'{"text": "caf\xe9"}\n')
    (root / "entropies.jsonl").write_text('{"text": "abc", "entropies": [0.1, 0.2]}\n')
    (root / "empty.jsonl").write_bytes(b"")
    whole = _arrow(root / "whole.arrow", pa.array(["x" * 50] * 8), [[0.0] * 52] * 8)
    data = whole.read_bytes()
    (root / "cut.arrow").write_bytes(data[: int(len(data) * 0.6)])
    _arrow(root / "ent.arrow", pa.array(["abcd", "ef"]), [[0.0] * 6, [0.0] * 3])
    _arrow(root / "utf8.arrow", pa.array([b"ok", b"caf\xe9"], pa.binary()).view(pa.string()))
    return {
        "good.jsonl": None,
        "whole.arrow": None,
        "malformed.jsonl": "row 1: malformed JSON",
        "badutf8.jsonl": "row 0: invalid UTF-8",
        "entropies.jsonl": "'entropies' has 2 values for 5 tokens",
        "empty.jsonl": "empty file",
        "cut.arrow": "truncated Arrow IPC file",
        "ent.arrow": "row 1: 'entropies' has 3 values for 4 tokens",
        "utf8.arrow": "row 1: column 'text': invalid UTF-8 at byte 3",
    }


def _config(tmp_path: Path, root: Path, sources: list[str]) -> Path:
    tree = yaml.safe_load((REPO / "configs" / "debug.yaml").read_text())
    tree["data"]["root_dir"] = str(root)
    tree["data"]["sources"] = {name: 1.0 for name in sources}
    path = tmp_path / "check.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def test_every_defect_is_found(tmp_path, capsys):
    root = tmp_path / "broken"
    expected = _broken_folder(root)
    config = _config(tmp_path, root, sorted(expected))
    assert check_main([f"config={config}"]) == 1
    out = capsys.readouterr().out
    rows = {line.split()[1].rsplit("/", 1)[-1]: line for line in out.splitlines()[1:-1]}
    assert set(rows) == set(expected), out
    for name, problem in expected.items():
        if problem is None:
            assert rows[name].endswith("  ok"), rows[name]
        else:
            assert problem in rows[name], (name, rows[name])
    assert out.splitlines()[-1].endswith("7 file(s) with problems")


def test_default_corpus_passes_with_validation_files(corpus_root, capsys):
    assert check_main([f"config={REPO / 'configs' / 'debug.yaml'}",
                       f"data.root_dir={corpus_root}"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "stdlib.val.jsonl" in out and "no problems found" in out
    assert "val " in out and "train:stdlib" in out


def test_config_errors_are_one_line(tmp_path, capsys):
    assert check_main([f"config={tmp_path / 'missing.yaml'}"]) == 2
    assert capsys.readouterr().err.startswith("config error:")
    with pytest.raises(SystemExit):
        check_main(["--help"])
