"""`model.global_init` inputs and the run's result (issue 29, item 7).

* A malformed safetensors file (header length past the end, data offsets past the end, truncated)
  is one CheckpointError line naming the file, also through `python -m bytelatent.train`.
* NaN / inf weights are refused at load, naming the tensor.
* A run whose final checkpoint the non-finite guard refused ends with a non-zero exit code.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from bytelatent.archs.blt.args import ByteLatentTransformerArgs
from bytelatent.archs.blt.model import ByteLatentTransformer
from bytelatent.args import TrainArgs
from bytelatent.config import parse_args
from bytelatent.errors import CheckpointError
from bytelatent.model.args import block_head_counts
from bytelatent.model.layers import ffn_hidden_dim
from bytelatent.trainer.actions import NONFINITE_EXIT_CODE
from bytelatent.trainer.guard import NonFiniteGuard
from bytelatent.trainer.trainer import Trainer
from tests.trainer.test_cli import REPO, TINY_BLT, TINY_ENTROPY, run_cli

pytest.importorskip("safetensors")

SHARD = "model.safetensors"


def save_llama(folder: Path, args: ByteLatentTransformerArgs) -> Path:
    """A LlamaForCausalLM folder (config.json + one safetensors file) with the global shape."""
    from safetensors.torch import save_file

    block = args.global_block_args()
    head_dim, n_heads, n_kv = block_head_counts(block)
    dim, hidden = block.dim, ffn_hidden_dim(block.dim, block.multiple_of, block.ffn_dim_multiplier)
    config = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": dim,
        "num_hidden_layers": block.n_layers, "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv, "head_dim": head_dim, "intermediate_size": hidden,
        "rms_norm_eps": block.norm_eps, "rope_theta": block.rope_theta, "hidden_act": "silu",
    }  # fmt: skip
    shapes = {
        "self_attn.q_proj": (n_heads * head_dim, dim), "self_attn.k_proj": (n_kv * head_dim, dim),
        "self_attn.v_proj": (n_kv * head_dim, dim), "self_attn.o_proj": (dim, n_heads * head_dim),
        "mlp.gate_proj": (hidden, dim), "mlp.up_proj": (hidden, dim), "mlp.down_proj": (dim, hidden),
        "input_layernorm": (dim,), "post_attention_layernorm": (dim,),
    }  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    tensors = {
        f"model.layers.{i}.{name}.weight": torch.randn(shape, generator=generator) * 0.05
        for i in range(block.n_layers)
        for name, shape in shapes.items()
    }
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / SHARD))
    return folder


def _header(data: bytes) -> tuple[int, dict]:
    n = struct.unpack("<Q", data[:8])[0]
    return n, json.loads(data[8 : 8 + n])


def damage(file: Path, how: str) -> None:
    data = file.read_bytes()
    n, header = _header(data)
    if how == "header_length":  # the 8-byte length says 1 TiB
        file.write_bytes(struct.pack("<Q", 2**40) + data[8:])
    elif how == "truncated":
        file.write_bytes(data[: len(data) - 100])
    elif how == "offsets":  # one tensor's data runs 1 MB past the end of the file
        name = next(k for k in header if k != "__metadata__")
        start, end = header[name]["data_offsets"]
        header[name]["data_offsets"] = [start, end + 2**20]
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        file.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])


def small_args(path: Path) -> ByteLatentTransformerArgs:
    return ByteLatentTransformerArgs(
        dim=32, n_layers=1, n_heads=2, n_kv_heads_global=1, multiple_of=32, max_seqlen=32,
        dim_local_encoder=32, dim_local_decoder=32, n_layers_local_encoder=1,
        n_layers_local_decoder=1, n_heads_local_encoder=2, n_heads_local_decoder=2,
        max_encoder_seq_length=64, global_init={"path": str(path)},
    )  # fmt: skip


def _load(args: ByteLatentTransformerArgs) -> int:
    from bytelatent.checkpoint.hf_llama import load_hf_llama

    with torch.device("meta"):
        model = ByteLatentTransformer(args)
    model.to_empty(device="cpu")
    return load_hf_llama(model, args)


@pytest.mark.parametrize("how", ["header_length", "offsets", "truncated"])
def test_malformed_safetensors_is_one_line(tmp_path, how):
    args = small_args(tmp_path / "llama")
    save_llama(tmp_path / "llama", args)
    assert _load(args) == 9  # the intact folder loads
    damage(tmp_path / "llama" / SHARD, how)
    with pytest.raises(CheckpointError) as info:
        _load(args)
    line = str(info.value)
    assert "\n" not in line and line.startswith(f"{tmp_path / 'llama' / SHARD}: not a readable")


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_nonfinite_global_init_weights_are_refused_naming_the_tensor(tmp_path, value):
    from safetensors.torch import load_file, save_file

    args = small_args(tmp_path / "llama")
    save_llama(tmp_path / "llama", args)
    file = tmp_path / "llama" / SHARD
    tensors = load_file(str(file))
    tensors["model.layers.0.mlp.up_proj.weight"][3, 5] = value
    save_file(tensors, str(file))
    with pytest.raises(CheckpointError) as info:
        _load(args)
    line = str(info.value)
    assert "\n" not in line and "model.layers.0.mlp.up_proj.weight has " in line
    assert ("1 NaN" if value != value else "1 inf") in line


@pytest.mark.slow
def test_train_with_a_truncated_global_init_fails_in_one_line(tmp_path, corpus_root):
    llama = tmp_path / "llama"
    argv = [*TINY_BLT, "model.n_kv_heads_global=1", f"model.global_init.path={llama}",
            f"dump_dir={tmp_path / 'run'}", f"data.root_dir={corpus_root}", "steps=2"]  # fmt: skip
    save_llama(llama, parse_args(TrainArgs, [f"config={REPO / 'configs/debug.yaml'}", *argv]).model)
    damage(llama / SHARD, "truncated")
    res = run_cli("bytelatent.train", argv)
    assert res.returncode == 2, res.stderr[-3000:]
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("checkpoint error: "), res.stderr[-3000:]
    assert f"{llama / SHARD}: not a readable safetensors file" in lines[0]


# ------------------------------------------------------------------ refused final save: exit code
def _trainer_stub(streak: int) -> SimpleNamespace:
    model = torch.nn.Linear(2, 2)
    guard = NonFiniteGuard(torch.optim.AdamW(model.parameters()), torch.device("cpu"))
    guard.streak.fill_(streak)  # the last update was skipped (non-finite loss)
    guard.what.fill_(1)
    return SimpleNamespace(_last_saved_step=-1, guard=guard, model=model,
                           state=SimpleNamespace(step=7), exit_code=0)  # fmt: skip


def test_refused_final_save_sets_a_nonzero_exit_code(caplog):
    stub = _trainer_stub(streak=1)
    Trainer.save(stub, "dump")  # a periodic save refused: the run goes on, nothing to report
    assert stub.exit_code == 0
    with caplog.at_level("WARNING", logger="bytelatent"):
        Trainer.save(stub, "final")
    assert stub.exit_code == NONFINITE_EXIT_CODE
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "without its final checkpoint" in errors[0].getMessage()
    stub = _trainer_stub(streak=1)
    stub.exit_code = 5  # an action's own code is kept
    Trainer.save(stub, ["final"])
    assert stub.exit_code == 5


@pytest.mark.slow
def test_run_whose_final_save_is_refused_exits_nonzero(tmp_path, corpus_root):
    dump = tmp_path / "diverge"
    res = run_cli(
        "bytelatent.train",
        [*TINY_ENTROPY, f"dump_dir={dump}", f"data.root_dir={corpus_root}", "steps=30",
         "optim.lr=1e4", "optim.clip=0", "optim.warmup=0", "optim.max_skipped_steps=0",
         "checkpoint.dump.every=0", "logging.console=false"],
    )  # fmt: skip
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["global_step"] == 30 and rows[-1]["skipped_streak"] > 0, rows[-1]
    assert res.returncode == NONFINITE_EXIT_CODE, res.stderr[-3000:]
    assert "not saving a final checkpoint" in res.stdout + res.stderr
    assert not list((dump / "checkpoints").glob("[0-9]" * 10))
