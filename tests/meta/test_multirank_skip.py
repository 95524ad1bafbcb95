"""Multi-rank test files skip on a CUDA host with fewer than two GPUs, and run everywhere else."""

from pathlib import Path

from tests.conftest import MULTIRANK_FILES, multirank_skip_reason

TESTS = Path(__file__).resolve().parents[1]


def test_multirank_files_skip_only_on_a_host_with_one_gpu():
    assert multirank_skip_reason("test_multirank.py", 1) == (
        "starts 2 ranks: needs 2 GPUs on a CUDA host (1 visible)"
    )
    assert multirank_skip_reason("test_multirank.py", 0) is not None
    assert multirank_skip_reason("test_multirank.py", 2) is None  # 2 GPUs: one per rank
    assert multirank_skip_reason("test_multirank.py", None) is None  # CPU host: gloo
    assert multirank_skip_reason("test_attention.py", 1) is None  # single-process tests run


def test_every_listed_file_exists_and_every_torchrun_test_is_listed():
    files = {p.name: p for p in TESTS.rglob("test_*.py")}
    assert MULTIRANK_FILES <= set(files), sorted(MULTIRANK_FILES - set(files))
    launching = {
        name
        for name, path in files.items()
        if path != Path(__file__).resolve()
        if "--nproc-per-node" in path.read_text() or "nproc_per_node" in path.read_text()
    }
    assert launching <= MULTIRANK_FILES, sorted(launching - MULTIRANK_FILES)
