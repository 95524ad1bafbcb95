"""Untrusted sizes and paths in a checkpoint folder (issue 29, item 6).

* A params.json that asks for a model larger than this machine is refused in one line before any
  weight is read or any tensor allocated (eval, generation, export, entropy-model loading).
* File names that a folder's own index gives (DCP `.metadata` storage items, a safetensors shard
  index) never lead outside the folder: absolute paths, `..` and escaping symlinks are refused.
"""

from __future__ import annotations

import json
import os
import pickle
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bytelatent.archs.blt.args import ByteLatentTransformerArgs
from bytelatent.archs.lm.model import LMTransformer
from bytelatent.checkpoint import fs as cfs
from bytelatent.checkpoint import model_size
from bytelatent.checkpoint.args import CheckpointArgs
from bytelatent.checkpoint.dcp_io import read_metadata
from bytelatent.checkpoint.manager import CheckpointManager
from bytelatent.checkpoint.pretrained import load_any_checkpoint, load_entropy_model
from bytelatent.checkpoint.safe_paths import outside_reason
from bytelatent.checkpoint.verify import write_folder_manifest
from bytelatent.errors import CheckpointError
from bytelatent.model.args import LMTransformerArgs
from tests.limits import hang_limit

REPO = Path(__file__).resolve().parents[2]
ENTROPY = {"dim": 32, "n_layers": 1, "n_heads": 2, "max_seqlen": 128}
HUGE = {"dim": 65536, "n_layers": 200, "n_heads": 512}  # ~38 TiB in fp32


def _model() -> LMTransformer:
    torch.manual_seed(0)
    model = LMTransformer(LMTransformerArgs(**ENTROPY))
    model.init_weights()
    return model


def _consolidated(folder: Path, entropy_model: dict) -> Path:
    """A consolidated entropy-model folder: real tiny weights, params.json as given."""
    folder.mkdir(parents=True, exist_ok=True)
    torch.save({"model": _model().state_dict()}, folder / "consolidated.pth")
    params = {"train_entropy_model": True, "entropy_model": entropy_model,
              "data": {"patcher_args": {"patching_mode": "byte"}}}  # fmt: skip
    (folder / "params.json").write_text(json.dumps(params))
    return folder


def _one_line(error: BaseException) -> str:
    text = str(error)
    assert "\n" not in text, text
    return text


# ---------------------------------------------------------------------------------- model size
def test_small_params_json_loads_and_huge_one_is_refused_before_allocating(tmp_path):
    small = _consolidated(tmp_path / "small", ENTROPY)
    model, _, _ = load_any_checkpoint(str(small))
    assert isinstance(model, LMTransformer)
    huge = _consolidated(tmp_path / "huge", {**ENTROPY, **HUGE})
    for load in (lambda: load_any_checkpoint(str(huge)), lambda: load_entropy_model(str(huge))):
        with pytest.raises(CheckpointError) as info:
            load()
        line = _one_line(info.value)
        assert line.startswith(f"{huge}/params.json: the model has at least "), line
        assert "GiB in float32), more than this host's available memory" in line


def test_model_just_over_the_available_memory_is_refused_with_its_exact_size(tmp_path, monkeypatch):
    """The exact count (meta build) decides when the analytic lower bound alone fits."""
    args = LMTransformerArgs(**ENTROPY)
    exact = model_size.exact_count(args)
    need = exact * 4 + model_size.BLOCK_HOST_BYTES * args.n_layers  # fp32 + module objects
    assert model_size.lower_bound(args)[0] < exact
    monkeypatch.setattr(model_size, "available_host_bytes", lambda: need - 1)
    with pytest.raises(CheckpointError) as info:
        model_size.require_model_fits(args, "cpu", "D/params.json")
    assert f"the model has {exact:,} parameters and buffers" in _one_line(info.value)
    monkeypatch.setattr(model_size, "available_host_bytes", lambda: need)
    assert model_size.require_model_fits(args, "cpu", "D/params.json") == exact
    monkeypatch.setattr(model_size, "available_host_bytes", lambda: None)  # unknown: no check
    assert model_size.require_model_fits(args, "cpu", "D/params.json") == exact


@pytest.mark.parametrize(
    "args",
    [
        LMTransformerArgs(**ENTROPY),
        LMTransformerArgs(dim=64, n_layers=3, n_heads=4, weight_tying=True),
        ByteLatentTransformerArgs(),
        ByteLatentTransformerArgs(
            dim=96, n_layers=2, n_heads=4, dim_local_encoder=32, dim_local_decoder=32,
            n_layers_local_encoder=2, n_layers_local_decoder=3, n_heads_local_encoder=2,
            n_heads_local_decoder=2, cross_attn_encoder=True, cross_attn_decoder=True,
            cross_attn_nheads=2, cross_attn_init_by_pooling=True, cross_attn_all_layers_encoder=True,
            encoder_hash_byte_group_size=[3, 4], encoder_hash_byte_group_vocab=100,
            encoder_ngram_to_size_str="2:50,3:60", use_rope=False,
        ),
    ],
    ids=["entropy", "tied", "blt-default", "blt-cross-ngram"],
)  # fmt: skip
def test_analytic_lower_bound_never_exceeds_the_built_model(args):
    bound, _ = model_size.lower_bound(args)
    assert 0.3 * model_size.exact_count(args) < bound <= model_size.exact_count(args)


@pytest.mark.slow
def test_eval_cli_refuses_a_huge_params_json_in_one_line(tmp_path):
    huge = _consolidated(tmp_path / "huge", {**ENTROPY, **HUGE})
    data = tmp_path / "data" / "tiny"
    data.mkdir(parents=True)
    rows = "".join(json.dumps({"text": f"row {i} " * 20}) + "\n" for i in range(20))
    (data / "a.chunk.00.jsonl").write_text(rows)
    (data / "a.val.jsonl").write_text(rows)

    def limit_memory() -> None:  # a regression fails here instead of swapping the machine
        resource.setrlimit(resource.RLIMIT_AS, (8 * 2**30, 8 * 2**30))

    argv = [f"dump_dir={tmp_path / 'out'}", f"data.root_dir={data.parent}",
            "data.sources={tiny: 1.0}", "data.seq_len=64", "eval.validation.max_batches=2"]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    res = subprocess.run(
        [sys.executable, "-m", "bytelatent.eval", f"ckpt={huge}", *argv], cwd=REPO, env=env,
        capture_output=True, text=True, timeout=hang_limit(300), preexec_fn=limit_memory,
    )  # fmt: skip
    assert res.returncode == 2, res.stderr[-3000:]
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("checkpoint error: "), res.stderr[-3000:]
    assert "params.json: the model has at least" in lines[0]
    assert not (tmp_path / "out" / "results.json").exists()
    small = _consolidated(tmp_path / "small", ENTROPY)  # the same command, a sane params.json
    res = subprocess.run(
        [sys.executable, "-m", "bytelatent.eval", f"ckpt={small}", *argv], cwd=REPO, env=env,
        capture_output=True, text=True, timeout=hang_limit(300), preexec_fn=limit_memory,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    assert (tmp_path / "out" / "results.json").exists()


# ---------------------------------------------------------------------------------- DCP paths
def _dcp_step(tmp_path: Path) -> str:
    manager = CheckpointManager(CheckpointArgs(path=str(tmp_path / "ck")))
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters())
    params = {"train_entropy_model": True, "entropy_model": ENTROPY}
    return manager.save(1, model, optimizer, {"step": 1}, params)


def _retarget(folder: str, rename) -> None:
    """Rewrite every storage item's relative_path in `.metadata` (and the manifest to match)."""
    metadata = read_metadata(folder)
    for info in metadata.storage_data.values():
        info.relative_path = rename(info.relative_path)
    with open(os.path.join(folder, ".metadata"), "wb") as f:
        pickle.dump(metadata, f)
    write_folder_manifest(cfs.get_fs(folder), folder, 1)


@pytest.mark.parametrize("kind", ["dotdot", "absolute"])
def test_dcp_storage_path_outside_the_folder_is_refused(tmp_path, kind):
    folder = _dcp_step(tmp_path)
    load_any_checkpoint(folder)  # loads before the tampering
    outside = tmp_path / "outside"
    outside.mkdir()
    for name in os.listdir(folder):  # the attacker's copy of the data, outside the folder
        if name.endswith(".distcp"):
            (outside / name).write_bytes(Path(folder, name).read_bytes())
    if kind == "dotdot":
        _retarget(folder, lambda name: f"../../outside/{name}")
    else:
        _retarget(folder, lambda name: str(outside / name))
    for read in (lambda: read_metadata(folder), lambda: load_any_checkpoint(folder)):
        with pytest.raises(CheckpointError) as info:
            read()
        line = _one_line(info.value)
        assert f"{folder}/.metadata: refusing storage file " in line and "points outside" in line


def test_dcp_storage_file_symlinked_outside_is_refused(tmp_path):
    folder = _dcp_step(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    for name in os.listdir(folder):
        if name.endswith(".distcp"):
            (outside / name).write_bytes(Path(folder, name).read_bytes())
            os.remove(os.path.join(folder, name))
            os.symlink(outside / name, os.path.join(folder, name))
    with pytest.raises(CheckpointError) as info:
        load_any_checkpoint(folder)
    assert "points outside" in _one_line(info.value) and "a symlink to" in str(info.value)


# ---------------------------------------------------------------------------------- HF index
def _safetensors_folder(folder: Path, shard_name: str) -> Path:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file({"model.layers.0.input_layernorm.weight": torch.ones(4)}, str(folder / "shard.st"))
    index = {"metadata": {}, "weight_map": {"model.layers.0.input_layernorm.weight": shard_name}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


@pytest.mark.parametrize(
    "name", ["../elsewhere/shard.st", "/tmp/shard.st", "sub/../../shard.st", "link.st"]
)
def test_hf_shard_index_outside_the_folder_is_refused(tmp_path, name):
    pytest.importorskip("safetensors")
    from bytelatent.archs.blt.hf import read_hf_folder
    from bytelatent.checkpoint.hf_llama import weight_files

    _safetensors_folder(tmp_path / "elsewhere", "shard.st")
    folder = _safetensors_folder(tmp_path / "model", name)
    os.symlink(tmp_path / "elsewhere" / "shard.st", folder / "link.st")
    with pytest.raises(CheckpointError) as info:
        weight_files(str(folder))
    line = _one_line(info.value)
    assert line.startswith(f"{folder}/model.safetensors.index.json: refusing shard file {name!r}")
    (folder / "config.json").write_text(json.dumps({"model_type": "blt"}))
    with pytest.raises(CheckpointError, match="points outside"):
        read_hf_folder(str(folder))


def test_hf_hub_cache_snapshot_symlinks_are_inside(tmp_path):
    pytest.importorskip("safetensors")
    from bytelatent.checkpoint.hf_llama import weight_files

    repo = tmp_path / "models--org--name"
    _safetensors_folder(repo / "blobs", "shard.st")
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    os.symlink("../../blobs/shard.st", snapshot / "shard.st")
    os.symlink(
        "../../blobs/model.safetensors.index.json", snapshot / "model.safetensors.index.json"
    )
    assert weight_files(str(snapshot)) == [f"{snapshot}/shard.st"]
    assert outside_reason("../../blobs/shard.st", str(snapshot)) == "has a '..' component"
