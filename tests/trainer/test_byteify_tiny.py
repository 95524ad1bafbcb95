"""docs/byteify.md "Byteify at CPU size", run as written: scripts/tiny_llama.py saves a random
128d x 2 Llama, the debug BLT trains 20 steps from it on the stdlib corpus; without the doc's
overrides the run stops before the first step naming both mismatches."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest

from tests.extras import lazy_extra
from tests.limits import hang_limit
from tests.trainer.test_cli import REPO, metrics

lazy_extra(
    "transformers", reason="scripts/tiny_llama.py needs transformers: pip install 'bytelatent[hf]'"
)
pytest.importorskip("safetensors")

SECTION = "## Byteify at CPU size"


def doc_commands() -> list[str]:
    """The commands of the section's bash block (continuations joined, comments dropped)."""
    text = (REPO / "docs" / "byteify.md").read_text().split(SECTION, 1)[1]
    block = text.split("```bash\n", 1)[1].split("```", 1)[0]
    joined = re.sub(r"\\\n\s*", "", block)
    return [
        line.strip() for line in joined.splitlines() if line.strip() and not line.startswith("#")
    ]


def run(command: str, cwd) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    command = re.sub(r"^python ", shlex.quote(sys.executable) + " ", command)
    return subprocess.run(
        ["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True,
        timeout=hang_limit(120),
    )  # fmt: skip


@pytest.mark.slow
def test_doc_tiny_byteify_runs_as_written(tmp_path, corpus_root):
    prepare, save, train = doc_commands()
    assert prepare == "python -m bytelatent.data.prepare --out data/stdlib"
    (tmp_path / "data").symlink_to(corpus_root)  # the prepared corpus (1 MB of it)
    for name in ("configs", "scripts"):
        (tmp_path / name).symlink_to(REPO / name)

    res = run(save, tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert (tmp_path / "hf" / "tiny-llama" / "config.json").is_file()

    res = run(train, tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "global transformer: 18 tensors from hf/tiny-llama" in res.stderr + res.stdout
    rows = metrics(tmp_path / "runs" / "byteify_tiny")
    assert [r["global_step"] for r in rows] == [10, 20]  # logging.freq 10
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.3, [r["loss"] for r in rows]

    overrides = ("model.n_kv_heads_global=2", "model.multiple_of=128")
    assert all(o in train for o in overrides)
    bare = train.replace(overrides[0], "").replace(overrides[1], "")
    bare = bare.replace("runs/byteify_tiny", "runs/byteify_bare")
    res = run(bare, tmp_path)
    assert res.returncode == 2, res.stderr[-3000:]
    assert (
        "model.n_kv_heads_global=4 but num_key_value_heads=2; model.ffn_dim_multiplier/multiple_of"
        " (FFN width)=512 but intermediate_size=384" in res.stderr + res.stdout
    )
