"""Hugging Face BltForCausalLM export/import: logits within 1e-4 of ours, bit-exact round trip."""

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from bytelatent.archs.blt.hf import (
    OURS_KEY,
    export_hf,
    import_hf,
    to_hf_patch_lengths,
)
from bytelatent.checkpoint.pretrained import load_any_checkpoint
from tests.extras import lazy_extra
from tests.paths import CONFORMANCE

transformers = lazy_extra("transformers", reason="pip install 'bytelatent[hf]'")
modeling_blt = lazy_extra(
    "transformers.models.blt.modeling_blt", reason="pip install 'bytelatent[hf]'"
)
safetensors_torch = lazy_extra("safetensors.torch", reason="pip install 'bytelatent[hf]'")

REPO = Path(__file__).resolve().parents[2]
needs_fixtures = pytest.mark.conformance()
TOL = 1e-4


def _cli(*args: str) -> subprocess.CompletedProcess:
    """`python -m bytelatent.checkpoint ARGS` in this process (a subprocess costs seconds of imports)."""
    import contextlib
    import io

    from bytelatent.checkpoint.__main__ import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def _hf(out: Path):
    return transformers.BltForCausalLM.from_pretrained(out, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def conformance_export(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hf_conf")
    # the released entropy model has a 512-byte window over 8192-byte rows; the cases are shorter
    export_hf(
        str(CONFORMANCE / "blt"),
        str(out),
        entropy_model=str(CONFORMANCE / "entropy_model"),
        allow_window_mismatch=True,
    )
    return out


@needs_fixtures
def test_conformance_logits_match(conformance_export):
    hf = _hf(conformance_export)
    ours, _, _ = load_any_checkpoint(str(CONFORMANCE / "blt"))
    tokenizer = transformers.AutoTokenizer.from_pretrained(conformance_export)
    for case in torch.load(CONFORMANCE / "cases.pt", weights_only=True):
        ids = torch.tensor([case["input_ids"]])
        lengths = torch.tensor([case["patch_lengths"]])
        assert tokenizer(case["text"]).input_ids == list(case["input_ids"])
        with torch.no_grad():
            theirs = hf(
                input_ids=ids, patch_lengths=to_hf_patch_lengths(lengths, ids.shape[1])
            ).logits
            mine = ours(ids, patch_lengths=lengths)
            entropies, hf_lengths, entropy_logits = hf.model.patcher(
                ids, patch_size=4.5, threshold=hf.config.patching_threshold
            )
        assert (theirs[0] - case["blt_logits"]).abs().max() < TOL
        assert (theirs - mine).abs().max() < TOL
        assert (entropy_logits[0] - case["entropy_logits"]).abs().max() < TOL
        assert hf_lengths.tolist() == [list(case["patch_lengths"])]  # HF's own entropy patching


@needs_fixtures
def test_rows_summing_to_n_differ_only_at_the_last_byte(conformance_export):
    """The documented difference (docs/differences.md): HF's decoder patch rule."""
    hf = _hf(conformance_export)
    case = torch.load(CONFORMANCE / "cases.pt", weights_only=True)[1]
    ids, lengths = torch.tensor([case["input_ids"]]), torch.tensor([case["patch_lengths"]])
    assert int(lengths.sum()) == ids.shape[1]
    with torch.no_grad():
        raw = hf(input_ids=ids, patch_lengths=lengths).logits[0]
    diff = (raw - case["blt_logits"]).abs().amax(dim=-1)
    assert diff[:-1].max() < TOL
    assert diff[-1] > 0.1


@needs_fixtures
def test_round_trip_is_bit_exact(conformance_export, tmp_path):
    import_hf(str(conformance_export), str(tmp_path / "ours"))
    export_hf(
        str(tmp_path / "ours"),
        str(tmp_path / "again"),
        entropy_model=str(tmp_path / "ours" / "entropy_model"),
        allow_window_mismatch=True,
    )
    first = safetensors_torch.load_file(conformance_export / "model.safetensors")
    second = safetensors_torch.load_file(tmp_path / "again" / "model.safetensors")
    assert first.keys() == second.keys()
    assert all(
        torch.equal(first[k], second[k]) and first[k].dtype == second[k].dtype for k in first
    )
    assert json.loads((conformance_export / "config.json").read_text()) == json.loads(
        (tmp_path / "again" / "config.json").read_text()
    )
    original, _, _ = load_any_checkpoint(str(CONFORMANCE / "blt"))
    imported, _, _ = load_any_checkpoint(str(tmp_path / "ours"))
    a, b = original.state_dict(), imported.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@needs_fixtures
def test_import_of_a_plain_hf_config(conformance_export, tmp_path):
    """A folder without our extras (as published by others): args derived from BltConfig alone."""
    plain = tmp_path / "plain"
    plain.mkdir()
    config = json.loads((conformance_export / "config.json").read_text())
    del config[OURS_KEY]
    (plain / "config.json").write_text(json.dumps(config))
    (plain / "model.safetensors").write_bytes(
        (conformance_export / "model.safetensors").read_bytes()
    )
    import_hf(str(plain), str(tmp_path / "ours"))
    model, args, _ = load_any_checkpoint(str(tmp_path / "ours"))
    assert args.local_attention_window_len is None and args.attn_bias_type == "causal"
    hf = _hf(plain)
    ids = torch.tensor([[1] + [b + 4 for b in b"plain import"]])
    lengths = torch.tensor([[1, 6, 7]])
    with torch.no_grad():
        assert (
            hf(input_ids=ids, patch_lengths=lengths).logits - model(ids, patch_lengths=lengths)
        ).abs().max() < TOL


@needs_fixtures
def test_entropy_model_only_export(tmp_path):
    out = str(tmp_path / "ent")
    refused = _cli("export-hf", str(CONFORMANCE / "entropy_model"), out)
    assert (
        refused.returncode == 2
        and "entropy_model.sliding_window=512 < max_seqlen=8192" in refused.stderr
    )
    result = _cli("export-hf", str(CONFORMANCE / "entropy_model"), out, "--allow-window-mismatch")
    assert result.returncode == 0, result.stderr
    patcher = modeling_blt.BltPatcher.from_pretrained(tmp_path / "ent", dtype=torch.float32).eval()
    case = torch.load(CONFORMANCE / "cases.pt", weights_only=True)[0]
    with torch.no_grad():
        _, _, logits = patcher(torch.tensor([case["input_ids"]]))
    assert (logits[0] - case["entropy_logits"]).abs().max() < TOL
    import_hf(str(tmp_path / "ent"), str(tmp_path / "back"))
    model, _, _ = load_any_checkpoint(str(tmp_path / "back"))
    original, _, _ = load_any_checkpoint(str(CONFORMANCE / "entropy_model"))
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in original.state_dict().items())


def test_trained_debug_model(tiny_blt_run, tmp_path):
    from bytelatent.data.patcher import Patcher, PatcherArgs

    step = tiny_blt_run / "checkpoints" / "0000000020"
    # the debug config's 256-byte local window is shorter than its 512-byte rows: consent needed
    result = _cli("export-hf", str(step), str(tmp_path / "hf"), "--allow-window-mismatch")
    assert result.returncode == 0, result.stderr
    assert "note: window mismatch" in result.stderr  # the mask differences are stated
    hf = _hf(tmp_path / "hf")
    ours, _, _ = load_any_checkpoint(str(step))
    text = "def export(model):\n    return model.state_dict()  # ok"
    ids = torch.tensor(
        [transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")(text).input_ids]
    )
    lengths, _ = Patcher(PatcherArgs(patching_mode="space")).patch(ids, include_next_token=False)
    with torch.no_grad():
        mine = ours(ids, patch_lengths=lengths)
        theirs = hf(input_ids=ids, patch_lengths=to_hf_patch_lengths(lengths, ids.shape[1])).logits
    assert (mine - theirs).abs().max() < TOL


def _save_ours(folder: Path, **overrides) -> Path:
    from bytelatent.archs.blt.args import ByteLatentTransformerArgs
    from bytelatent.archs.blt.model import ByteLatentTransformer

    fields = dict(
        dim=32,
        n_layers=1,
        n_heads=2,
        dim_local_encoder=16,
        dim_local_decoder=16,
        n_layers_local_encoder=2,
        n_layers_local_decoder=1,
        n_heads_local_encoder=2,
        n_heads_local_decoder=2,
        cross_attn_encoder=True,
        cross_attn_decoder=True,
        cross_attn_init_by_pooling=True,
        cross_attn_nheads=2,
        encoder_hash_byte_group_size=[3],
        encoder_hash_byte_group_vocab=64,
        encoder_hash_byte_group_nb_functions=1,
        max_encoder_seq_length=64,
        max_seqlen=64,
    )
    args = ByteLatentTransformerArgs(**{**fields, **overrides})
    with torch.random.fork_rng(devices=[]):  # the same weights whatever ran before in this process
        torch.manual_seed(0)
        model = ByteLatentTransformer(args)
        model.init_weights()
    folder.mkdir(parents=True)
    (folder / "params.json").write_text(json.dumps({"model": args.model_dump(mode="json")}))
    torch.save({"model": model.state_dict()}, folder / "consolidated.pth")
    return folder


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"cross_attn_all_layers_encoder": True}, "model.cross_attn_all_layers_encoder"),
        ({"cross_attn_nheads": 1}, "model.cross_attn_nheads"),
        (
            {"downsampling_by_pooling": "avg"},
            "model.cross_attn_init_by_pooling/downsampling_by_pooling",
        ),
    ],
)
def test_refuses_what_hf_cannot_represent(tmp_path, overrides, field):
    ckpt = _save_ours(tmp_path / "ckpt", **overrides)
    result = _cli("export-hf", str(ckpt), str(tmp_path / "out"))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert (
        len(lines) == 1
        and lines[0].startswith("checkpoint error: cannot export")
        and field in lines[0]
    )
    assert not (tmp_path / "out" / "model.safetensors").exists()


@needs_fixtures
def test_bad_inputs_one_line_exit_2(tmp_path):
    other = tmp_path / "llama"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "llama"}))
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    (no_weights / "params.json").write_text((CONFORMANCE / "blt" / "params.json").read_text())
    for args, needle in [
        (("import-hf", str(other), str(tmp_path / "x")), "model_type 'llama' is not a BLT model"),
        (("export-hf", str(no_weights), str(tmp_path / "y")), "no consolidated.pth"),
        (("import-hf", str(tmp_path / "missing"), str(tmp_path / "z")), "not a folder"),
    ]:
        result = _cli(*args)
        assert result.returncode == 2, result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and needle in lines[0], lines


def _compare(
    tmp_path: Path, text: bytes, lengths: list[int], bypass: bool = False, **overrides
) -> float:
    """max |ours - HF| for a small random model; `bypass` exports without the refusal check."""
    from unittest import mock

    import bytelatent.archs.blt.hf as hf_module

    ckpt = _save_ours(tmp_path / "ckpt", **overrides)
    with mock.patch.object(
        hf_module,
        "check_hf_representable",
        (lambda args: []) if bypass else hf_module.check_hf_representable,
    ):
        export_hf(str(ckpt), str(tmp_path / "hf"), allow_window_mismatch=True)
    ours, _, _ = load_any_checkpoint(str(ckpt))
    ids = torch.tensor([[1] + [b + 4 for b in text]])
    patch_lengths = torch.tensor([lengths])
    with torch.no_grad():
        mine = ours(ids, patch_lengths=patch_lengths)
        theirs = _hf(tmp_path / "hf")(
            input_ids=ids, patch_lengths=to_hf_patch_lengths(patch_lengths, ids.shape[1])
        ).logits
    return float((mine - theirs).abs().max())


TEXT, LENGTHS = b"hello world, numbers 12345!", [1, 6, 7, 8, 6]


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {
            "encoder_hash_byte_group_size": [3, 4],
            "encoder_hash_byte_group_nb_functions": 2,
            "cross_attn_k": 3,
        },
        {"cross_attn_k": 1, "dim": 16, "n_heads": 2},  # no decoder projection here: identity in HF
        {"n_kv_heads_global": 1},
    ],
    ids=["base", "two-hash-functions-k3", "k1-identity-projection", "global-gqa"],
)
def test_faithful_configurations(tmp_path, overrides):
    assert _compare(tmp_path, TEXT, LENGTHS, **overrides) < TOL


@pytest.mark.parametrize(
    "overrides",
    [
        {"cross_attn_all_layers_encoder": True},
        {"cross_attn_nheads": 1},
        {"downsampling_by_pooling": "avg"},
    ],
    ids=["all-layers-encoder", "cross-heads", "avg-pooling"],
)
def test_refused_configurations_really_differ(tmp_path, overrides):
    """Why the refusals exist: exported anyway, HF computes another function."""
    assert _compare(tmp_path, TEXT, LENGTHS, bypass=True, **overrides) > 1e-2


def test_local_window_shorter_than_the_row_differs(tmp_path):
    """Why a window needs consent: HF has no local window; equal for rows within the window."""
    assert _compare(tmp_path / "a", TEXT[:7], [1, 4, 3], local_attention_window_len=8) < TOL
    assert _compare(tmp_path / "b", TEXT, LENGTHS, local_attention_window_len=8) > 1e-3


def test_window_shorter_than_the_rows_needs_consent(tmp_path):
    ckpt = _save_ours(tmp_path / "ckpt", local_attention_window_len=8)
    refused = _cli("export-hf", str(ckpt), str(tmp_path / "out"))
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 2 and len(lines) == 1, refused.stderr
    assert "model.local_attention_window_len=8 < max_encoder_seq_length=64" in lines[0]
    assert "--allow-window-mismatch" in lines[0]
    assert not (tmp_path / "out" / "model.safetensors").exists()
    allowed = _cli("export-hf", str(ckpt), str(tmp_path / "out"), "--allow-window-mismatch")
    assert allowed.returncode == 0 and "rows of at most 8 bytes" in allowed.stderr
    weights = tmp_path / "out" / "model.safetensors"
    umask = os.umask(0)
    os.umask(umask)
    assert weights.stat().st_mode & 0o777 == 0o666 & ~umask  # not safetensors' 0600


def test_window_as_long_as_the_rows_exports_without_a_note(tmp_path):
    ckpt = _save_ours(tmp_path / "ckpt", local_attention_window_len=64)
    result = _cli("export-hf", str(ckpt), str(tmp_path / "out"))
    assert result.returncode == 0 and "window" not in result.stderr, result.stderr


def test_generate_works_on_an_export(tmp_path):
    """HF's cached BLT generation is broken (docs/differences.md): the export turns it off."""
    ckpt = _save_ours(tmp_path / "ckpt")
    export_hf(str(ckpt), str(tmp_path / "hf"))
    hf = _hf(tmp_path / "hf")
    ids = torch.tensor([[1] + [b + 4 for b in b"hello"]])
    plain = hf.generate(ids, max_new_tokens=5, do_sample=False)
    assert plain.shape == (1, ids.shape[1] + 5)
    assert torch.equal(plain, hf.generate(ids, max_new_tokens=5, do_sample=False, use_cache=False))
