"""ByteLatentTransformerArgs validation, the meaning of dim, and reference config/weight compat."""

import json

import pytest
import torch
from pydantic import ValidationError

from bytelatent.archs.blt.args import ByteLatentTransformerArgs
from bytelatent.archs.blt.model import ByteLatentTransformer
from bytelatent.archs.blt.reference_compat import (
    adapt_reference_blt_state_dict,
    blt_args_from_reference,
    lm_args_from_reference,
    patcher_settings_from_reference,
)
from bytelatent.errors import CheckpointError, ConfigError
from tests.paths import CONFORMANCE

SMALL = {
    "dim_local_encoder": 32,
    "dim_local_decoder": 32,
    "n_heads_local_encoder": 4,
    "n_heads_local_decoder": 4,
}


def test_dim_changes_the_global_model() -> None:
    args = ByteLatentTransformerArgs(
        dim=64, n_layers=3, n_heads=4, downsampling_by_pooling="max", **SMALL
    )
    with torch.device("meta"):
        model = ByteLatentTransformer(args)
    glob = model.global_transformer
    assert len(glob.layers) == 3
    assert glob.layers[0].attention.wq.weight.shape == (64, 64)
    assert glob.layers[0].attention.n_heads == 4
    assert glob.token_embedding_projection.weight.shape == (64, 32)


def test_default_args_are_valid() -> None:
    with torch.device("meta"):
        ByteLatentTransformer(ByteLatentTransformerArgs())


def test_global_aliases_follow_or_set_dim() -> None:
    assert ByteLatentTransformerArgs(dim_global=128, n_heads_global=4, **SMALL).dim == 128
    args = ByteLatentTransformerArgs(dim=128, dim_global=128, n_layers_global=3, **SMALL)
    assert (args.dim, args.n_layers, args.n_heads) == (128, 3, 8)
    again = ByteLatentTransformerArgs(**args.model_dump())  # dumps re-validate
    assert again == args


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"dim": 64, "dim_global": 128, "patch_size": 2},
            "model.dim=64 and model.dim_global=128 disagree",
        ),
        ({"n_layers": 2, "n_layers_global": 4, "patch_size": 2}, "n_layers_global"),
        ({"dim": 100, "n_heads": 8, "patch_size": 2}, "global model"),
        (
            {"dim_local_encoder": 30, "dim_local_decoder": 30, "patch_size": 2},
            "encoder model",
        ),
        (
            {"dim_local_decoder": 64, "patch_size": 2},
            "dim_local_decoder=64 must equal dim_local_encoder",
        ),
        ({"downsampling_by_pooling": "sum"}, "unknown pooling 'sum'"),
        ({"downsampling_by_pooling": None}, "set an integer patch_size"),
        (
            {"downsampling_by_pooling": "", "patch_size": 4.5},
            "set an integer patch_size",
        ),
        (
            {
                "cross_attn_encoder": True,
                "cross_attn_init_by_pooling": True,
                "downsampling_by_pooling": None,
            },
            "needs downsampling_by_pooling",
        ),
        (
            {"cross_attn_decoder": True, "cross_attn_nheads": 5, "patch_size": 2},
            "cross_attn_nheads=5",
        ),
        (
            {"attn_bias_type": "local_block_causal", "patch_size": 2},
            "global model's mask",
        ),
        (
            {"encoder_ngram_to_size_str": "2-100", "patch_size": 2},
            "entries must look like",
        ),
        (
            {
                "encoder_hash_byte_group_size": [3],
                "encoder_hash_byte_group_nb_functions": 12,
                "patch_size": 2,
            },
            "=12",
        ),
        ({"attn_impl": "fmha", "patch_size": 2}, "fmha"),
        ({"cross_atn_k": 2, "patch_size": 2}, "Extra inputs are not permitted"),
    ],
)
def test_invalid_configs_name_the_keys(fields: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        ByteLatentTransformerArgs(**{**SMALL, **fields})


def test_hash_sizes_accept_comma_string() -> None:
    args = ByteLatentTransformerArgs(encoder_hash_byte_group_size="3,4,5", patch_size=2, **SMALL)
    assert args.encoder_hash_byte_group_size == [3, 4, 5]


REFERENCE_BASE = {
    "dim": 512,
    "n_layers": 8,
    "dim_global": 64,
    "n_layers_global": 2,
    "n_heads_global": 4,
    "dim_local_encoder": 32,
    "dim_local_decoder": 32,
    "n_layers_local_encoder": 1,
    "n_layers_local_decoder": 1,
    "n_heads_local_encoder": 4,
    "n_heads_local_decoder": 4,
    "use_local_encoder_transformer": True,
    "max_encoder_seq_length": 64,
    "downsampling_by_pooling": "max",
    "patching_mode": "space",
    "patch_size": 6,
    "vocab_size": -1,
    "recompute_attn": True,
}


def test_reference_defaults_and_notes() -> None:
    args, ignored = blt_args_from_reference(REFERENCE_BASE)
    assert (args.dim, args.n_layers, args.n_heads, args.vocab_size) == (64, 2, 4, 260)
    assert args.patch_size is None  # pooling: patch_size only configures the patcher
    assert args.encoder_hash_byte_group_nb_functions == 3  # reference default
    assert any(note.startswith("dim=512") for note in ignored)
    assert any(note.startswith("vocab_size=-1") for note in ignored)
    assert any(note.startswith("patch_size") for note in ignored)
    assert any(note.startswith("recompute_attn") for note in ignored)
    assert patcher_settings_from_reference(REFERENCE_BASE) == {
        "patching_mode": "space",
        "patch_size": 6,
    }


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"cross_atn_k": 2}, "model.cross_atn_k: not a reference"),
        ({"attn_impl": "fmha"}, "fmha"),
        ({"cross_attn_decoder": True}, "cross_attn_k is null"),
        ({"use_local_encoder_transformer": False}, "token embedding width"),
        ({"dim_token": 16}, "token embedding width 16"),
        ({"n_heads_local_encoder": 5}, "encoder model"),
    ],
)
def test_reference_config_errors(fields: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        blt_args_from_reference({**REFERENCE_BASE, **fields})


def test_reference_learned_positions_are_zeroed_on_load() -> None:
    args, ignored = blt_args_from_reference({**REFERENCE_BASE, "use_rope": False, "max_length": 16})
    assert any(note.startswith("use_rope=false") for note in ignored)
    with torch.device("meta"):
        model = ByteLatentTransformer(args)
    model.to_empty(device="cpu")
    model.init_weights()
    state = model.state_dict()
    state["local_encoder.pos_embeddings.weight"] = torch.randn(
        16, 32
    )  # reference shape (max_length)
    state["local_encoder.token_embedding_projection.weight"] = torch.randn(32, 32)
    adapted, notes = adapt_reference_blt_state_dict(state, args)
    assert len(notes) == 3
    model.load_state_dict(adapted, strict=True)
    assert not model.local_encoder.pos_embeddings.weight.any()
    assert not model.local_decoder.pos_embeddings.weight.any()


def test_adapt_rejects_untrainable_reference_layout() -> None:
    args = ByteLatentTransformerArgs(cross_attn_encoder=True, **SMALL)
    with pytest.raises(CheckpointError, match="init_by_pooling"):
        adapt_reference_blt_state_dict({}, args)


@pytest.mark.conformance("entropy_model/params.json")
def test_lm_args_from_reference_entropy_params() -> None:
    params = json.loads((CONFORMANCE / "entropy_model" / "params.json").read_text())
    args, ignored = lm_args_from_reference(params["entropy_model"])
    assert (args.dim, args.n_layers, args.n_heads, args.sliding_window) == (
        64,
        2,
        4,
        512,
    )
    assert args.attn_bias_type == "local_block_causal"
    assert all("fmha" not in note for note in ignored)
    with pytest.raises(ConfigError, match="entropy_model.bogus"):
        lm_args_from_reference({**params["entropy_model"], "bogus": 1})
    with pytest.raises(ConfigError, match="fmha"):
        lm_args_from_reference({**params["entropy_model"], "attn_impl": "fmha"})
