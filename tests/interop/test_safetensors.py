"""`consolidate --format safetensors` and loading it back with load_pretrained / load_any_checkpoint."""

import contextlib
import io

import pytest
import torch

pytest.importorskip("safetensors", reason="pip install 'bytelatent[hf]'")
from safetensors.torch import load_file  # noqa: E402

from bytelatent.checkpoint.__main__ import main  # noqa: E402
from bytelatent.checkpoint.pretrained import load_any_checkpoint, load_pretrained  # noqa: E402


def _cli(*args: str) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(list(args))
    return code, err.getvalue()


def test_consolidate_safetensors_loads_back_identically(tiny_blt_run, tmp_path):
    step = tiny_blt_run / "checkpoints" / "0000000020"
    out = tmp_path / "st"
    code, err = _cli("consolidate", str(step), "--out", str(out), "--format", "safetensors")
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir()) == ["consolidated.safetensors", "params.json"]
    from_dcp, _, _ = load_any_checkpoint(str(step))
    loaded, _ = load_pretrained(str(out))
    want = from_dcp.state_dict()
    got = loaded.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert load_file(out / "consolidated.safetensors").keys() == want.keys()


def test_safetensors_format_errors_are_one_line(tiny_blt_run, tmp_path):
    step = tiny_blt_run / "checkpoints" / "0000000020"
    code, err = _cli(
        "consolidate",
        str(step),
        "--out",
        str(tmp_path / "a"),
        "--format",
        "safetensors",
        "--with-optim",
    )
    assert code == 2 and err.strip().splitlines() == [
        "checkpoint error: --with-optim needs --format pth: safetensors holds flat tensors, not optimizer state"
    ]
    code, err = _cli("consolidate", str(step), "--out", str(tmp_path / "b"), "--format", "npz")
    assert code == 2 and "expected one of pth, safetensors" in err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_truncated_safetensors_is_a_checkpoint_error(tiny_blt_run, tmp_path):
    step = tiny_blt_run / "checkpoints" / "0000000020"
    out = tmp_path / "st"
    assert _cli("consolidate", str(step), "--out", str(out), "--format", "safetensors")[0] == 0
    data = (out / "consolidated.safetensors").read_bytes()
    (out / "consolidated.safetensors").write_bytes(data[: len(data) // 2])
    from bytelatent.errors import CheckpointError

    with pytest.raises(CheckpointError, match="cannot read safetensors"):
        load_pretrained(str(out))
