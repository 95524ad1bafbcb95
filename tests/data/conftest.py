"""Fixtures for the data-pipeline tests."""

import pytest
from datagen import write_arrow, write_jsonl


@pytest.fixture
def corpus(tmp_path):
    """Two sources in the reference layout: `a` (3 JSONL chunks) and `b` (2 Arrow files)."""
    return write_corpus(tmp_path / "root")


@pytest.fixture(scope="module")
def module_corpus(tmp_path_factory):
    """`corpus`, written once per test module (for tests that only read it)."""
    return write_corpus(tmp_path_factory.mktemp("corpus") / "root")


def write_corpus(root):
    for chunk in range(3):
        write_jsonl(
            root / "a" / f"a.chunk.{chunk:02d}.jsonl",
            "a",
            range(chunk * 7, chunk * 7 + 7),
        )
    write_jsonl(root / "a" / "a.val.jsonl", "aval", range(3))
    for shard in range(2):
        write_arrow(
            root / "b" / f"b.shard_{shard}.arrow",
            "b",
            range(shard * 9, shard * 9 + 9),
            seed=shard,
        )
    return root
