"""Every BLT option combination builds on meta, initialises, and trains (forward + backward)."""

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from bytelatent.archs.blt.args import ByteLatentTransformerArgs
from bytelatent.archs.blt.local_models import PatchQueries
from bytelatent.archs.blt.model import ByteLatentTransformer
from bytelatent.archs.blt.patch_utils import patch_ids_from_lengths
from bytelatent.errors import ConfigError
from bytelatent.model.attention import self_attn_mask
from bytelatent.tokenizers.constants import BOS_ID, EOS_ID

TINY: dict[str, Any] = {
    "dim": 32,
    "n_layers": 2,
    "n_heads": 4,
    "dim_local_encoder": 16,
    "dim_local_decoder": 16,
    "n_layers_local_encoder": 2,
    "n_layers_local_decoder": 2,
    "n_heads_local_encoder": 2,
    "n_heads_local_decoder": 2,
    "multiple_of": 16,
    "max_seqlen": 64,
    "max_encoder_seq_length": 64,
    "rope_theta": 500000.0,
}
RELEASED = {
    "cross_attn_encoder": True,
    "cross_attn_decoder": True,
    "cross_attn_k": 2,
    "cross_attn_nheads": 2,
    "cross_attn_all_layers_decoder": True,
    "cross_attn_init_by_pooling": True,
    "downsampling_by_pooling": "max",
    "encoder_hash_byte_group_size": [3, 4, 5],
    "encoder_hash_byte_group_vocab": 97,
    "encoder_hash_byte_group_nb_functions": 1,
}
OPTIONS: dict[str, dict[str, Any]] = {
    "released_flags": RELEASED,
    "all_layers_both_avg_max_2fn": {
        **RELEASED,
        "cross_attn_all_layers_encoder": True,
        "downsampling_by_pooling": "avg,max",
        "encoder_hash_byte_group_nb_functions": 2,
    },
    "enc_cross_learned_queries": {
        "cross_attn_encoder": True,
        "cross_attn_k": 3,
        "cross_attn_all_layers_encoder": True,
        "encoder_hash_byte_group_size": "3,6",
        "encoder_hash_byte_group_vocab": 97,
    },
    "pooling_min_no_hash": {"downsampling_by_pooling": "min"},
    "concat_static": {"patch_size": 2, "downsampling_by_pooling": None},
    "decoder_cross_only_k3": {
        "cross_attn_decoder": True,
        "cross_attn_k": 3,
        "downsampling_by_pooling": "mean",
    },
    "windows": {
        **RELEASED,
        "cross_attn_all_layers_encoder": True,
        "cross_attn_window_encoder": 2,
        "cross_attn_window_decoder": 2,
        "local_attention_window_len": 4,
    },
    "ngram_tables": {**RELEASED, "encoder_ngram_to_size_str": "2:50,3:40"},
    "gqa_global_projection": {
        **RELEASED,
        "dim": 48,
        "n_kv_heads_global": 2,
        "n_kv_heads": 1,
    },
    "learned_positions_dropout": {
        **RELEASED,
        "use_rope": False,
        "dropout": 0.1,
        "attn_bias_type": "block_causal",
        "init_std_factor": "current_depth",
    },
    "head_dim_pm_size": {
        **RELEASED,
        "head_dim": 8,
        "pm_size": 3,
        "init_base_std": 0.02,
    },
}


def packed_batch(bsz: int, seq_len: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random bytes with several documents per row (EOS then BOS) and random patch lengths."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(4, 260, (bsz, seq_len + 1), generator=gen)
    tokens[:, 0] = BOS_ID
    for b in range(bsz):
        for pos in torch.randint(2, seq_len - 2, (2,), generator=gen).tolist():
            tokens[b, pos], tokens[b, pos + 1] = EOS_ID, BOS_ID
    rows = []
    for b in range(bsz):
        total = seq_len + (b % 2)  # rows summing to N and to N+1
        row = [1]
        while sum(row) < total:
            row.append(min(int(torch.randint(1, 6, (1,), generator=gen)), total - sum(row)))
        rows.append(row)
    width = max(len(r) for r in rows) + 1
    lengths = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    return tokens, lengths


def build(overrides: dict[str, Any]) -> ByteLatentTransformer:
    args = ByteLatentTransformerArgs(**{**TINY, **overrides})
    with torch.device("meta"):
        model = ByteLatentTransformer(args)
    model.to_empty(device="cpu")
    with torch.no_grad():  # garbage that init_weights must overwrite everywhere
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.fill_(float("nan"))
    torch.manual_seed(0)
    model.init_weights()
    return model


def ngram_ids_for(model: ByteLatentTransformer, tokens: torch.Tensor) -> torch.Tensor | None:
    if model.encoder_ngram_embedding is None:
        return None
    sizes = [table.num_embeddings for table in model.encoder_ngram_embedding]
    return torch.stack([torch.randint(0, size, tokens.shape) for size in sizes])


def loss_of(
    model: ByteLatentTransformer, tokens: torch.Tensor, lengths: torch.Tensor
) -> torch.Tensor:
    x, y = tokens[:, :-1], tokens[:, 1:]
    logits = model(x, lengths, ngram_ids_for(model, x))
    assert logits.shape == (*x.shape, model.args.vocab_size + model.args.pm_size)
    assert logits.dtype == torch.float32
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


@pytest.mark.parametrize("name", list(OPTIONS))
def test_option_builds_inits_and_trains(name: str) -> None:
    model = build(OPTIONS[name])
    for key, tensor in [*model.named_parameters(), *model.named_buffers()]:
        assert torch.isfinite(tensor).all(), f"{key} not initialised"
    tokens, lengths = packed_batch(3, 24, seed=1)
    loss = loss_of(model, tokens, lengths)
    assert torch.isfinite(loss)
    assert abs(loss.item() - math.log(260)) < 1.5  # sane init: close to uniform
    loss.backward()
    for key, param in model.named_parameters():
        assert param.grad is not None, f"{key} got no gradient"
        assert torch.isfinite(param.grad).all(), f"{key} has a non-finite gradient"
        assert param.grad.abs().sum() > 0, f"{key} has an all-zero gradient"


@pytest.mark.parametrize("name", ["released_flags", "windows", "enc_cross_learned_queries"])
def test_structured_and_dense_cross_attention_agree(name: str) -> None:
    model = build(OPTIONS[name]).eval()
    tokens, lengths = packed_batch(2, 20, seed=2)
    with torch.no_grad():
        structured = model(tokens[:, :-1], lengths)
        model.structured_cross_attn = False
        dense = model(tokens[:, :-1], lengths)
    torch.testing.assert_close(structured, dense, atol=2e-5, rtol=1e-5)


def test_documents_do_not_see_each_other() -> None:
    """Local byte states and global patch states of a document do not depend on earlier documents
    (document-causal local masks, block_causal global mask, patches aligned with the boundary).

    Logits can: as in the reference, the byte after an EOS reads the global state of the patch
    holding the EOS (the previous document's last patch), and hash n-grams span the boundary.
    """
    no_hash = {key: value for key, value in RELEASED.items() if not key.startswith("encoder_hash")}
    model = build({**no_hash, "attn_bias_type": "block_causal"}).eval()
    second = [BOS_ID, 20, 21, 22, 23, 24]
    lengths = torch.tensor([[1, 2, 2, 2, 2, 2]])  # patch 2 ends at the EOS (byte 4)
    captured: list[tuple[torch.Tensor, torch.Tensor]] = []
    hooks = [
        model.local_encoder.register_forward_hook(lambda m, a, out: captured.append(out)),
        model.global_transformer.register_forward_hook(lambda m, a, out: captured.append(out)),
    ]
    with torch.no_grad():
        model(torch.tensor([[BOS_ID, 10, 11, 12, EOS_ID] + second]), lengths)
        model(torch.tensor([[BOS_ID, 50, 60, 70, EOS_ID] + second]), lengths)
    for hook in hooks:
        hook.remove()
    (bytes_a, _), global_a, (bytes_b, _), global_b = captured
    torch.testing.assert_close(bytes_a[0, 5:], bytes_b[0, 5:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(global_a[0, 3:], global_b[0, 3:], atol=1e-5, rtol=1e-5)
    assert (global_a[0, :3] - global_b[0, :3]).abs().max() > 1e-4


def test_init_std_follows_reference() -> None:
    model = build(
        {
            **RELEASED,
            "dim_local_encoder": 64,
            "dim_local_decoder": 64,
            "n_heads_local_encoder": 4,
        }
    )
    enc = model.local_encoder

    def std(t: torch.Tensor) -> float:
        return t.float().std().item()

    assert std(enc.tok_embeddings.weight) == pytest.approx(64**-0.5, rel=0.1)
    assert std(model.encoder_hash_tok_embedding[0].weight) == pytest.approx(64**-0.5, rel=0.1)
    assert std(model.local_decoder.output.weight) == pytest.approx(64**-0.5, rel=0.1)
    assert std(enc.patch_embedding_projection.weight) == pytest.approx(64**-0.5, rel=0.1)
    assert std(model.local_decoder.patch_embedding_projection.weight) == pytest.approx(
        32**-0.5, rel=0.1
    )
    assert std(enc.cross_attn_layers[0].wq.weight) == pytest.approx(64**-0.5, rel=0.1)
    assert torch.equal(model.local_decoder.norm.weight, torch.ones(64))
    bound = 3 * 64**-0.5 + 1e-6
    assert enc.tok_embeddings.weight.abs().max() <= bound  # truncated at 3 sigma


def test_fsdp_units_are_in_forward_order_and_cover_the_layers() -> None:
    model = build(OPTIONS["all_layers_both_avg_max_2fn"])
    units = model.fsdp_units()
    n_hash = len(model.encoder_hash_tok_embedding)
    expected_count = (
        n_hash + 2 * 2 + 2 + 2 * 2
    )  # tables, enc layers+cross, global, dec cross+layers
    assert len(units) == expected_count
    assert len({id(u) for u in units}) == len(units)
    calls: list[int] = []
    hooks = [
        u.register_forward_pre_hook(lambda m, _a, i=i: calls.append(i)) for i, u in enumerate(units)
    ]
    tokens, lengths = packed_batch(1, 16, seed=3)
    with torch.no_grad():
        model(tokens[:, :-1], lengths)
    for hook in hooks:
        hook.remove()
    assert calls == list(range(len(units)))


def test_adamw_steps_reduce_loss() -> None:
    torch.manual_seed(0)
    model = build(RELEASED)
    tokens, lengths = packed_batch(2, 32, seed=4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        loss = loss_of(model, tokens, lengths)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses


class FakePatcher:
    def __init__(self) -> None:
        self.calls = 0

    def patch(
        self, tokens: torch.Tensor, include_next_token: bool = True
    ) -> tuple[torch.Tensor, None]:
        self.calls += 1
        assert include_next_token
        bsz, seq_len = tokens.shape
        rest = seq_len  # N + 1 - first patch
        lengths = [1] + [2] * (rest // 2) + ([1] if rest % 2 else [])
        return torch.tensor([lengths] * bsz), None


def test_patch_in_forward_uses_attached_patcher() -> None:
    model = build({**RELEASED, "patch_in_forward": True})
    patcher = FakePatcher()
    model.attach_patcher(patcher)
    tokens = torch.randint(4, 260, (2, 11))
    logits = model(tokens)
    assert patcher.calls == 1 and logits.shape == (2, 11, 260)
    assert not any("patcher" in key for key in model.state_dict())


def test_missing_patch_lengths_without_patcher_is_a_config_error() -> None:
    model = build(RELEASED)
    with pytest.raises(ConfigError, match="patch_lengths"):
        model(torch.randint(4, 260, (1, 8)))
    with pytest.raises(ConfigError, match="patch_in_forward"):
        model.attach_patcher(FakePatcher())


def test_rows_longer_than_the_position_tables_are_config_errors() -> None:
    model = build({**RELEASED, "max_encoder_seq_length": 16, "max_seqlen": 64})
    tokens, lengths = packed_batch(1, 24, seed=5)
    with pytest.raises(ConfigError, match="model.max_encoder_seq_length=16"):
        model(tokens[:, :-1], lengths)
    model = build({**RELEASED, "max_seqlen": 4})
    with pytest.raises(ConfigError, match="model.max_seqlen=4"):
        model(tokens[:, :-1], lengths)


def test_encoder_cross_attention_runs_right_after_its_layer() -> None:
    """The reference's encoder order (layer i, then the cross-attention paired with it, then layer
    i+1): autograd sums a layer's gradient contributions in the order their ops ran, so another
    order changes the encoder's gradients in the last bits (4.9e-7 fp32 against the reference with
    cross-attention after every encoder layer) though the loss is the same."""
    model = build(OPTIONS["all_layers_both_avg_max_2fn"])
    enc = model.local_encoder
    named = [(f"layer{i}", m) for i, m in enumerate(enc.layers)]
    named += [(f"cross{i}", m) for i, m in enumerate(enc.cross_attn_layers)]
    calls: list[str] = []
    hooks = [m.register_forward_pre_hook(lambda *_a, n=n: calls.append(n)) for n, m in named]
    tokens, lengths = packed_batch(1, 16, seed=3)
    model(tokens[:, :-1], lengths)
    for hook in hooks:
        hook.remove()
    assert calls == ["layer0", "cross0", "layer1", "cross1"]


def test_training_forward_equals_generation_path() -> None:
    """The training encoder (patch states formed during ``forward``) and the generation one
    (``forward`` then ``encode_patches``) give the same byte and patch states, bitwise."""
    model = build(OPTIONS["all_layers_both_avg_max_2fn"])
    tokens, lengths = packed_batch(2, 16, seed=5)
    x = tokens[:, :-1]
    patch_ids = patch_ids_from_lengths(lengths, x.shape[1])
    mask = self_attn_mask(model.args.local_attn_kind(), x, eos_id=model.args.eos_id, window=64)
    cross_mask = model._cross_mask("encoder", patch_ids, lengths.shape[1], "sdpa")
    with torch.no_grad():
        embeds = model.byte_embeddings(x, None)
        patches = PatchQueries(patch_ids, lengths.shape[1], cross_mask)
        states = model.local_encoder(embeds, mask, patches=patches)
        states2 = model.local_encoder(embeds, mask)
        patches2 = model.local_encoder.encode_patches(
            states2, patch_ids, lengths.shape[1], cross_mask
        )
    assert all(torch.equal(a, b) for a, b in zip(states, states2, strict=True))
    assert torch.equal(patches.embeds, patches2)
