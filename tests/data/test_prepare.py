import json
import os

from bytelatent.data.args import DataArgs
from bytelatent.data.corpus import split_documents, stdlib_documents
from bytelatent.data.prepare import is_complete, main


def test_prepare_writes_deterministic_shards_once(tmp_path, capsys):
    out = tmp_path / "data" / "stdlib"
    assert main(["--out", str(out), "--chunks", "3", "--max-mb", "0.6"]) == 0
    assert "wrote 4 files" in capsys.readouterr().out
    names = sorted(p.name for p in out.iterdir())
    assert names == [f"stdlib.chunk.0{i}.jsonl" for i in range(3)] + [
        "stdlib.complete",
        "stdlib.val.jsonl",
    ]
    mtimes = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    records = [
        json.loads(line) for line in (out / "stdlib.chunk.00.jsonl").read_text().splitlines()
    ]
    assert records and all(r["sample_id"].endswith(".py") and r["text"] for r in records)
    val_ids = {
        json.loads(line)["sample_id"]
        for line in (out / "stdlib.val.jsonl").read_text().splitlines()
    }
    train_ids = {
        json.loads(line)["sample_id"]
        for i in range(3)
        for line in (out / f"stdlib.chunk.0{i}.jsonl").read_text().splitlines()
    }
    assert val_ids and not val_ids & train_ids

    assert main(["--out", str(out), "--chunks", "3", "--max-mb", "0.6"]) == 0  # idempotent
    assert "already prepared" in capsys.readouterr().out
    assert mtimes == {p.name: p.stat().st_mtime_ns for p in out.iterdir()}

    other = tmp_path / "again"
    main(["--out", str(other), "--chunks", "3", "--max-mb", "0.6"])
    for name in names:
        assert (other / name).read_bytes() == (out / name).read_bytes()  # deterministic

    # a damaged output is rebuilt
    os.truncate(out / "stdlib.chunk.01.jsonl", 10)
    assert not is_complete(out, "stdlib")
    main(["--out", str(out), "--chunks", "3", "--max-mb", "0.6"])
    assert (out / "stdlib.chunk.01.jsonl").read_bytes() == (
        other / "stdlib.chunk.01.jsonl"
    ).read_bytes()

    # the reference layout is what DataArgs reads (validation file excluded)
    args = DataArgs(
        root_dir=str(tmp_path / "data"),
        sources={"stdlib": 1.0},
        load_async=False,
        seq_len=64,
        patcher_args={"patching_mode": "byte"},
    )
    assert [p.rsplit("/", 1)[1] for p in args.files_of("stdlib")] == names[:3]
    assert next(args.build_from_rank(0, 1)).mask.all()


def test_corpus_selection_is_sorted_and_within_budget():
    docs = stdlib_documents(max_bytes=300_000)
    assert docs == sorted(docs, key=lambda d: d.sample_id)
    assert sum(len(d.text.encode()) for d in docs) <= 300_000
    train, val = split_documents(docs, 0.2)
    assert len(train) + len(val) == len(docs) and val
