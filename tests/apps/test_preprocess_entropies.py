"""apps.preprocess_entropies end to end with a tiny entropy model in the released layout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest
import torch

import apps.preprocess_entropies as prep
from bytelatent.archs.lm.model import LMTransformer
from bytelatent.data.entropy import entropy
from bytelatent.model.args import LMTransformerArgs
from bytelatent.tokenizers.blt import BltTokenizer
from tests.limits import hang_limit

REPO = Path(__file__).resolve().parents[2]
MAX_SEQLEN = 32

DOCS_0 = [
    {"id": "a", "text": "hello world"},
    {"url": "http://x/b", "text": "Ünïcödé ☃ and a line\nthat is long enough " * 3},
    {"content": ""},  # empty text: BOS and EOS only, id falls back to name:line
]
DOCS_1 = [{"sample_id": 7, "text": "x" * 70}, {"title": "t", "text": "short"}]


def make_model_dir(path: Path) -> LMTransformer:
    args = LMTransformerArgs(
        dim=32,
        n_layers=1,
        n_heads=2,
        max_seqlen=MAX_SEQLEN,
        attn_impl="xformers",  # as the released params.json says; falls back on CPU
        attn_bias_type="local_block_causal",
        sliding_window=16,
    )
    torch.manual_seed(0)
    model = LMTransformer(args)
    model.init_weights()
    with torch.no_grad():
        model.output.weight.mul_(6.0)  # peaky predictions so entropies spread
    path.mkdir(parents=True)
    params = {"name": "tiny", "train_entropy_model": True, "model": None}
    params["entropy_model"] = args.model_dump(mode="json")
    (path / "params.json").write_text(json.dumps(params))
    torch.save({"model": model.state_dict()}, path / "consolidated.pth")
    return model.eval()


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


@pytest.fixture
def setup(tmp_path: Path) -> dict:
    model = make_model_dir(tmp_path / "em")
    write_jsonl(tmp_path / "raw" / "ds.chunk.00.jsonl", DOCS_0)
    write_jsonl(tmp_path / "raw" / "ds.chunk.01.jsonl", DOCS_1)
    out = tmp_path / "out"
    shards = [out / "ds" / "tiny" / f"ds.chunk.0{i}.jsonl.arrow" for i in (0, 1)]
    argv = [
        "--input",
        str(tmp_path / "raw"),
        "--output-dir",
        str(out),
        "--entropy-model",
        str(tmp_path / "em"),
        "--entropy-model-name",
        "tiny",
        "--device",
        "cpu",
        "--batch-size",
        "3",
        "--docs-per-chunk",
        "2",
        "--no-progress",
    ]
    return {"model": model, "argv": argv, "shards": shards, "tmp": tmp_path}


def read_shard(path: Path) -> pa.Table:
    with pa.memory_map(str(path)) as source:
        return pa.ipc.open_file(source).read_all()


@torch.no_grad()
def expected_entropies(model: LMTransformer, texts: list[str]) -> list[torch.Tensor]:
    """Each document alone through the model, in windows of MAX_SEQLEN with fresh context."""
    tokenizer = BltTokenizer(add_bos=True, add_eos=True)
    out = []
    for text in texts:
        tokens = torch.tensor([tokenizer.encode(text)])
        windows = tokens.split(MAX_SEQLEN, dim=1)
        out.append(torch.cat([entropy(model(window))[0] for window in windows]))
    return out


def test_end_to_end_schema_and_values(setup: dict) -> None:
    assert prep.main(setup["argv"]) == 0
    for shard, rows in zip(setup["shards"], (DOCS_0, DOCS_1), strict=True):
        assert Path(str(shard) + ".complete").exists()
        assert not Path(str(shard) + ".partial").exists()
        table = read_shard(shard)
        assert table.schema.equals(prep.SCHEMA)
        texts = [row.get("text", row.get("content")) for row in rows]
        assert table.column("text").to_pylist() == texts
        expected = expected_entropies(setup["model"], texts)
        for stored, direct, text in zip(
            table.column("entropies").to_pylist(), expected, texts, strict=True
        ):
            assert len(stored) == len(text.encode("utf-8")) + 2  # BOS + bytes + EOS
            assert torch.allclose(torch.tensor(stored), direct, atol=4e-3, rtol=1e-3)
        assert torch.cat(expected).std() > 0.1  # a real spread, not a constant
    ids = [read_shard(s).column("sample_id").to_pylist() for s in setup["shards"]]
    assert ids == [["a", "http://x/b", "ds.chunk.00.jsonl:3"], ["7", "t"]]
    # documents longer than the window were cut (the long doc spans several windows)
    assert len(DOCS_1[0]["text"]) + 2 > MAX_SEQLEN


def test_resume_skips_complete_shards(setup: dict) -> None:
    assert prep.main(setup["argv"]) == 0
    first, second = setup["shards"]
    stamps = [os.stat(s).st_mtime_ns for s in setup["shards"]]
    counts = prep.run(prep.parse_args(setup["argv"]))
    assert counts == {"written": 0, "skipped": 2, "documents": 0}
    Path(str(second) + ".complete").unlink()
    counts = prep.run(prep.parse_args(setup["argv"]))
    assert counts == {"written": 1, "skipped": 1, "documents": 2}
    assert os.stat(first).st_mtime_ns == stamps[0]
    assert Path(str(second) + ".complete").exists()
    counts = prep.run(prep.parse_args([*setup["argv"], "--overwrite"]))
    assert counts["written"] == 2


def test_interrupted_write_leaves_no_marker(setup: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"n": 0}
    real = prep.document_entropies

    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:  # the second chunk of the first shard
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(prep, "document_entropies", failing)
    with pytest.raises(KeyboardInterrupt):
        prep.main(setup["argv"])
    first = setup["shards"][0]
    assert not Path(str(first) + ".complete").exists()
    assert not first.exists() and not Path(str(first) + ".partial").exists()
    # a hard kill leaves a partial file (and maybe a final file without marker): redone
    Path(str(first) + ".partial").write_bytes(b"garbage")
    first.write_bytes(b"half")
    monkeypatch.setattr(prep, "document_entropies", real)
    assert prep.main(setup["argv"]) == 0
    assert Path(str(first) + ".complete").exists()
    assert read_shard(first).num_rows == len(DOCS_0)


def test_ranks_split_inputs(setup: dict) -> None:
    counts = prep.run(prep.parse_args([*setup["argv"], "--rank", "1", "--world-size", "2"]))
    assert counts["written"] == 1
    first, second = setup["shards"]
    assert second.exists() and not first.exists()
    counts = prep.run(prep.parse_args([*setup["argv"], "--rank", "0", "--world-size", "2"]))
    assert counts["written"] == 1 and first.exists()


def test_arrow_input_and_dataset_override(setup: dict) -> None:
    source = setup["tmp"] / "arrow_in" / "part-0.arrow"
    source.parent.mkdir()
    table = pa.table({"id": ["p", "q"], "text": ["abc", "def ghi"]})
    with pa.OSFile(str(source), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table)
    argv = list(setup["argv"])
    argv[argv.index("--input") + 1] = str(source)
    assert prep.main([*argv, "--dataset", "mydata"]) == 0
    out = setup["tmp"] / "out" / "mydata" / "tiny" / "part-0.arrow"
    result = read_shard(out)
    assert result.column("sample_id").to_pylist() == ["p", "q"]
    assert [len(e) for e in result.column("entropies").to_pylist()] == [5, 9]


def test_bad_line_names_file_and_line(setup: dict, capsys) -> None:
    bad = setup["tmp"] / "raw" / "ds.chunk.00.jsonl"
    bad.write_text('{"text": "ok"}\n\n{"text": broken}\n')
    assert prep.main(setup["argv"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("data error: ")
    assert f"{bad}:3: invalid JSON" in err
    assert not Path(str(setup["shards"][0]) + ".complete").exists()
    bad.write_text('{"text": "ok"}\n{"title": "no text"}\n')
    assert prep.main(setup["argv"]) == 2
    assert f"{bad}:2: no string 'text'" in capsys.readouterr().err


def test_user_errors(setup: dict, capsys) -> None:
    argv = list(setup["argv"])
    argv[argv.index("--input") + 1] = str(setup["tmp"] / "missing")
    assert prep.main(argv) == 2
    assert "input not found" in capsys.readouterr().err
    assert prep.main([*setup["argv"], "--rank", "2", "--world-size", "2"]) == 2
    assert "--rank=2" in capsys.readouterr().err


def test_module_entry_point(setup: dict) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, "-m", "apps.preprocess_entropies", *setup["argv"]],
        check=False,
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=hang_limit(120),
    )
    assert result.returncode == 0, result.stderr
    assert all(Path(str(s) + ".complete").exists() for s in setup["shards"])


def test_progress_bar_only_when_asked(setup: dict, capsys) -> None:
    pytest.importorskip("tqdm")
    auto = [a for a in setup["argv"] if a != "--no-progress"]
    assert prep.main(auto) == 0  # --progress auto under pytest: stderr is not a terminal
    assert "doc/s" not in capsys.readouterr().err  # tqdm's rate, only printed by a bar
    assert prep.main([*auto, "--progress", "on", "--overwrite"]) == 0
    err = capsys.readouterr().err
    assert "ds.chunk.00.jsonl" in err and "doc/s" in err, err
