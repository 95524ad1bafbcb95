"""Reference training configs -> ours: the report covers every field once; the output trains."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from bytelatent.archs.blt.from_reference import convert, convert_file
from bytelatent.archs.blt.reference_format import looks_like_reference
from bytelatent.errors import ConfigError
from tests.conftest import train_tiny
from tests.limits import hang_limit
from tests.paths import CONFORMANCE

REPO = Path(__file__).resolve().parents[2]

# facebookresearch/blt @ 9774ed4, bytelatent/configs/debug.yaml (verbatim)
REFERENCE_DEBUG_YAML = """# Template config, need to change dump_dir, data.root_dir and tokenizer.path
# Evals can be activated by uncommenting its config
# python -m launchers.stool config=apps/main/configs/debug.yaml nodes=8 account=fair_amaia_cw_codegen qos=lowest

dump_dir: /tmp/
name: "debug"
steps: 100_000
probe_freq: null
seed: 777
optim:
  lr: 4e-04
  warmup: 500
  lr_min_ratio: 0.1
  clip: 10.0

distributed:
  fsdp_type: full_shard
  model_dtype: bf16
  matmul_allow_tf32: false
  selective_activation_checkpointing: false
  tp_size: 1

model:
  n_heads: 8
  dim: 512
  vocab_size: 260
  dim_token: 256
  patch_size: 6
  patching_mode: "space"
  tie_local_encoder_decoder_logits: false
  patch_in_forward: false
  max_encoder_seq_length: 12288
  pad_to_max_length: true
  patching_threshold: 3.1439168453216553
  encoder_hash_byte_group_size: [4]
  encoder_hash_byte_group_vocab: 50002
  encoder_hash_byte_group_nb_functions: 3
  encoder_enable_byte_ngrams: false
  cross_attn_encoder: true # assuming cross_attention is true
  cross_attn_decoder: true # assuming cross_attention is true
  cross_attn_window_encoder: 512
  cross_attn_window_decoder: 512
  dim_local_encoder: 256
  dim_local_decoder: 256
  cross_attn_k: 8
  cross_attn_nheads: 4
  cross_attn_all_layers_decoder: true
  cross_attn_all_layers_encoder: true
  cross_attn_use_flex_attention: true
  cross_attn_init_by_pooling: true
  log_patch_lengths: true
  non_linearity: "swiglu"
  use_rope: true
  recompute_fc1_out: false
  recompute_fc3_out: false
  recompute_attn: false
  custom_bwd: false
  layer_ckpt: "none"
  use_local_encoder_transformer: true
  init_use_gaussian: true
  init_use_depth: "current"
  attn_impl: "xformers"
  attn_bias_type: "block_causal"
  alpha_depth: "disabled"
  max_length: 256
  local_attention_window_len: 512
  max_seqlen: 12288
  downsampling_by_pooling: "max"

data:
  root_dir: ???
  sources:
    dclm_baseline_1.0: 1.0
  batch_size: 2
  prefetch_size: 64
  seq_len: 4096
  load_async: true
  preprocess_dir: ???
  tokenizer_args:
    name: blt
    init_kwargs:
      bpe_tokenizer_path: ???

profiling:
  run: false

checkpoint:
  dump:
    every: 500
    keep: 3
  eval:
    every: 1000
    keep: -1

logging:
  freq: 10

eval_on_gpus: 8
eval: null
"""

# facebookresearch/blt @ 9774ed4, bytelatent/configs/entropy_model.yaml (verbatim)
REFERENCE_ENTROPY_YAML = """# Template config, need to change dump_dir, data.root_dir and tokenizer.path
# Evals can be activated by uncommenting its config
# python -m launchers.stool config=apps/main/configs/debug.yaml nodes=8 account=fair_amaia_cw_codegen qos=lowest

dump_dir: /tmp/blt-entropy
name: "debug"
steps: 100_000
max_steps: null
probe_freq: null
seed: 777
optim:
  lr: 4e-04
  warmup: 500
  lr_min_ratio: 0.1
  clip: 10.0

distributed:
  fsdp_type: full_shard
  model_dtype: bf16
  matmul_allow_tf32: false
  selective_activation_checkpointing: false
  tp_size: 1

train_entropy_model: true
model: null
entropy_model:
  dim: 768
  n_layers: 14
  n_heads: 12
  max_seqlen: 8192
  # vocab_size: -1
  vocab_size: 260
  ffn_dim_multiplier: 1.0
  sliding_window: 512
  attn_bias_type: "local_block_causal"
  attn_impl: "xformers"

data:
  root_dir: ???
  sources:
    dclm_baseline_1.0: 1.0
  batch_size: 2
  prefetch_size: 64
  # seqlen is in terms of patches and
  # max_encoder_seq_length is in terms of bytes.
  # For entropy model, these are the same since 1 patch=1 byte
  seq_len: 8192
  max_encoder_seq_length: 8192
  load_async: true
  preprocess_dir: ???
  # We don't need patches for this model
  add_patches: false
  patcher_args:
    # This doesn't matter since byte entropy model doesn't use patching,
    # so pick the most efficient, so static
    patching_mode: byte
  tokenizer_args:
    name: blt

profiling:
  run: false

checkpoint:
  dump:
    every: 500
    keep: 3
  eval:
    every: 1000
    keep: -1

logging:
  freq: 10

eval_on_gpus: 8
eval: null
"""

SMALL_BLT = [
    "model.dim=32",
    "model.n_layers=1",
    "model.n_heads=2",
    "model.dim_local_encoder=32",
    "model.dim_local_decoder=32",
    "model.n_layers_local_encoder=1",
    "model.n_layers_local_decoder=1",
    "model.n_heads_local_encoder=2",
    "model.n_heads_local_decoder=2",
    "model.cross_attn_nheads=2",
    "model.cross_attn_k=2",
    "model.encoder_hash_byte_group_vocab=512",
    "model.max_seqlen=64",
    "model.max_encoder_seq_length=256",
    "data.max_encoder_seq_length=256",
    "data.seq_len=24",
    "data.patcher_args.patching_mode=space",
]
SMALL_ENTROPY = [
    "entropy_model.dim=32",
    "entropy_model.n_layers=1",
    "entropy_model.n_heads=2",
    "entropy_model.max_seqlen=128",
    "entropy_model.sliding_window=64",
    "data.seq_len=128",
    "data.max_encoder_seq_length=128",
]
# the values the reports list under "needs you", filled as a user would
DATA = [
    "data.preprocess_dir=null",
    "data.sources={stdlib: 1.0}",
    "data.batch_size=2",
    "data.load_async=false",
    "distributed.model_dtype=fp32",
]


def _leaves(tree: dict, prefix: str = "") -> list[str]:
    keys = []
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value and dotted != "data.sources":
            keys += _leaves(value, dotted + ".")
        else:
            keys.append(dotted)
    return keys


@pytest.mark.parametrize(
    "text", [REFERENCE_DEBUG_YAML, REFERENCE_ENTROPY_YAML], ids=["debug", "entropy"]
)
def test_report_lists_every_input_field_exactly_once(text):
    tree = yaml.safe_load(text)
    _, report = convert(tree)
    assert sorted(report.fields) == sorted(_leaves(tree))
    assert len(report.fields) == len(set(report.fields))
    assert len(report.mapped) + len(report.dropped) + len(report.needs_user) == len(report.fields)


def test_debug_report_details():
    converted, report = convert(yaml.safe_load(REFERENCE_DEBUG_YAML))
    dropped = "\n".join(report.dropped)
    assert (
        "model.dim = 512: dim=512 (the reference ignores it for BLT" not in dropped
    )  # reason only
    assert "model.dim = 512: the reference ignores it for BLT" in dropped
    assert (
        "model.patching_mode = space: the reference reads the model's patcher settings only"
        in dropped
    )
    assert "model.recompute_attn = False: no effect in the reference" in dropped
    assert "data.tokenizer_args.init_kwargs.bpe_tokenizer_path = ???: never loaded" in dropped
    assert "profiling.run = False" in dropped and "eval_on_gpus = 8" in dropped
    assert [line.split(" ->")[0] for line in report.needs_user] == [
        "data.root_dir",
        "data.preprocess_dir",
    ]
    assert (
        converted["model"]["dim"] == 512 and converted["model"]["n_layers"] == 8
    )  # dim_global default
    assert "model.dim_token" not in converted["model"]
    assert any(
        note.startswith("model.n_layers = 8: the reference's default") for note in report.notes
    )


@pytest.mark.parametrize(
    "text, small",
    [(REFERENCE_DEBUG_YAML, SMALL_BLT), (REFERENCE_ENTROPY_YAML, SMALL_ENTROPY)],
    ids=["debug", "entropy"],
)
def test_converted_config_trains_three_steps(text, small, tmp_path, corpus_root):
    ref = tmp_path / "ref.yaml"
    ref.write_text(text)
    converted, _ = convert_file(str(ref))
    out = tmp_path / "converted.yaml"
    out.write_text(converted)
    dump = train_tiny(str(out), tmp_path / "run", corpus_root, 3, [*small, *DATA])
    assert (dump / "checkpoints" / "0000000003").is_dir()


def _run(module: str, *args: str) -> subprocess.CompletedProcess:
    """`python -m MODULE ARGS` in this process (a subprocess costs seconds of imports here)."""
    import contextlib
    import importlib
    import io

    main = importlib.import_module(module).main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def test_train_entry_exit_code_on_a_reference_file(tmp_path):
    ref = tmp_path / "entropy.yaml"
    ref.write_text(REFERENCE_ENTROPY_YAML)
    result = subprocess.run(
        [sys.executable, "-m", "bytelatent.train", f"config={ref}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=hang_limit(120),
    )
    assert result.returncode == 2
    assert "python -m bytelatent.archs.blt.from_reference" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_print_config_on_a_reference_file_names_the_converter(tmp_path):
    ref = tmp_path / "debug.yaml"
    ref.write_text(REFERENCE_DEBUG_YAML)
    result = _run("bytelatent.print_config", f"config={ref}")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"config error: {ref}: this is a reference (facebookresearch/blt) training config; convert "
        f"it first: python -m bytelatent.archs.blt.from_reference {ref} -o converted.yaml"
    ]


def test_cli_writes_output_and_report(tmp_path):
    ref = tmp_path / "entropy.yaml"
    ref.write_text(REFERENCE_ENTROPY_YAML)
    result = _run("bytelatent.archs.blt.from_reference", str(ref), "-o", str(tmp_path / "out.yaml"))
    assert result.returncode == 0, result.stderr
    assert "needs you (2):" in result.stderr and "dropped (5):" in result.stderr
    assert "train_entropy_model -> arch = entropy" in result.stderr  # model: null dropped
    out = yaml.safe_load((tmp_path / "out.yaml").read_text())
    assert out["arch"] == "entropy" and out["model"]["dim"] == 768  # one model section
    assert "entropy_model" not in out and "train_entropy_model" not in out


def test_neither_ours_nor_reference_is_one_line_exit_2(tmp_path):
    bad = tmp_path / "other.yaml"
    bad.write_text("trainer:\n  max_epochs: 3\nmodel:\n  dim: 64\n")
    result = _run("bytelatent.archs.blt.from_reference", str(bad))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "config error: trainer: neither a bytelatent nor a reference (facebookresearch/blt) config key"
    ]
    with pytest.raises(
        ConfigError, match="model.lr_warmup: not a reference ByteLatentTransformerArgs"
    ):
        convert({"model": {"lr_warmup": 1}})


def test_detection():
    assert looks_like_reference(yaml.safe_load(REFERENCE_DEBUG_YAML))
    assert looks_like_reference(yaml.safe_load(REFERENCE_ENTROPY_YAML))  # probe_freq, profiling
    assert not looks_like_reference(yaml.safe_load((REPO / "configs" / "debug.yaml").read_text()))


@pytest.mark.conformance()
@pytest.mark.parametrize("name", ["blt", "entropy_model"])
def test_released_params_json_converts(name, tmp_path):
    import json

    params = json.loads((CONFORMANCE / name / "params.json").read_text())
    converted_text, report = convert_file(str(CONFORMANCE / name / "params.json"))
    assert sorted(report.fields) == sorted(_leaves(params))
    converted = yaml.safe_load(converted_text)
    if name == "blt":
        from bytelatent.archs.blt.reference_compat import blt_args_from_reference

        expected, _ = blt_args_from_reference(params["model"])
        model = dict(converted["model"])
        assert model.pop("max_encoder_seq_length") == 12288  # raised to data's (noted)
        assert all(
            getattr(expected, k) == v or list(getattr(expected, k)) == v for k, v in model.items()
        )
    else:
        assert converted["data"]["patcher_args"]["patching_mode"] == "byte"
