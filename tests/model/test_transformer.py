"""LMTransformer: init contract, shapes, GQA, weight tying, training, document isolation."""

import pytest
import torch
from pydantic import ValidationError

from bytelatent.archs.lm.model import LMTransformer
from bytelatent.model import attention
from bytelatent.model.args import LMTransformerArgs
from bytelatent.model.layers import (
    FeedForward,
    RotaryEmbedding,
    apply_rotary_emb,
    precompute_freqs_cis,
)

EOS = 2


def tiny_args(**overrides) -> LMTransformerArgs:
    fields = {
        "dim": 32,
        "n_layers": 2,
        "n_heads": 4,
        "max_seqlen": 64,
        "vocab_size": 260,
        "seed": 3,
    }
    fields.update(overrides)
    return LMTransformerArgs(**fields)


def build_initialised(args: LMTransformerArgs, seed: int | None = None) -> LMTransformer:
    """The training recipe: build on meta, to_empty, poison the memory, init_weights."""
    with torch.device("meta"):
        model = LMTransformer(args)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.fill_(float("nan"))  # stands for whatever garbage to_empty left behind
    torch.manual_seed(args.seed if seed is None else seed)
    model.init_weights()
    return model


def random_tokens(bsz: int, seqlen: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(4, 260, (bsz, seqlen), generator=torch.Generator().manual_seed(seed))


def test_meta_init_fills_everything_deterministically():
    args = tiny_args()
    model = build_initialised(args)
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        assert torch.isfinite(tensor).all(), name
    table = precompute_freqs_cis(args.dim // args.n_heads, args.max_seqlen, args.rope_theta)
    assert torch.equal(model.rope_embeddings.freqs_cis, table)
    again = build_initialised(args)
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), name
    other = build_initialised(args, seed=args.seed + 1)
    assert not torch.equal(model.layers[0].attention.wq.weight, other.layers[0].attention.wq.weight)


def test_init_std_follows_reference_rules():
    args = tiny_args(dim=256, n_layers=2, n_heads=4, init_std_factor="current_depth")
    model = build_initialised(args)
    truncation = 0.9866  # std of a normal truncated at ±3σ, relative to σ
    wq0 = model.layers[0].attention.wq.weight
    wq1 = model.layers[1].attention.wq.weight
    w2 = model.layers[0].feed_forward.w2.weight
    assert wq0.std().item() == pytest.approx(truncation * 256**-0.5 / 2**0.5, rel=0.03)
    assert wq1.std().item() == pytest.approx(truncation * 256**-0.5 / 4**0.5, rel=0.03)
    assert w2.std().item() == pytest.approx(truncation * 768**-0.5 / 2**0.5, rel=0.03)
    assert wq0.abs().max() <= 3 * 256**-0.5 / 2**0.5
    assert model.tok_embeddings.weight.std().item() == pytest.approx(
        truncation * 256**-0.5, rel=0.03
    )
    assert torch.equal(model.norm.weight, torch.ones(256))


def test_state_dict_uses_reference_names():
    model = LMTransformer(tiny_args(n_layers=1))
    expected = {
        "tok_embeddings.weight",
        "norm.weight",
        "output.weight",
        *(f"layers.0.attention.{w}.weight" for w in ("wq", "wk", "wv", "wo")),
        *(f"layers.0.feed_forward.{w}.weight" for w in ("w1", "w3", "w2")),
        "layers.0.attention_norm.weight",
        "layers.0.ffn_norm.weight",
    }
    assert set(model.state_dict()) == expected


@pytest.mark.parametrize(
    ("dim", "hidden"),
    [(256, 768), (512, 1536), (768, 2048), (1024, 2816), (2048, 5632)],
)
def test_ffn_width_rule(dim, hidden):
    assert FeedForward(dim, 4 * dim, 256, 1.0).hidden_dim == hidden


def test_param_count_formula_and_dim_dependence():
    args = tiny_args(dim=64, n_layers=3, n_heads=4)
    model = LMTransformer(args)
    ffn = 256  # round_up(int(2*256/3)=170, 256)
    per_layer = 4 * 64 * 64 + 3 * 64 * ffn + 2 * 64
    embeddings = 260 * 64
    assert model.num_params() == 3 * per_layer + 64 + 2 * embeddings
    assert model.num_params(exclude_embeddings=True) == 3 * per_layer + 64 + embeddings
    bigger = LMTransformer(tiny_args(dim=128, n_layers=3, n_heads=4))
    assert bigger.num_params() > model.num_params()


def test_forward_shape_and_dtype():
    model = build_initialised(tiny_args())
    tokens = random_tokens(2, 16)
    logits = model(tokens)
    assert logits.shape == (2, 16, 260) and logits.dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low_precision = model(tokens)
    assert low_precision.dtype == torch.float32
    assert (low_precision - logits).abs().max() < 0.1  # same function, bf16 matmuls


def test_gqa_equals_mha_with_repeated_kv_heads():
    gqa = build_initialised(tiny_args(n_heads=4, n_kv_heads=2))
    assert gqa.layers[0].attention.wk.weight.shape == (2 * 8, 32)
    mha = LMTransformer(tiny_args(n_heads=4))
    state = gqa.state_dict()
    for name in list(state):
        if name.endswith(("attention.wk.weight", "attention.wv.weight")):
            # kv head g serves query heads 2g and 2g+1
            state[name] = state[name].view(2, 8, 32).repeat_interleave(2, dim=0).reshape(32, 32)
    mha.load_state_dict(state)
    mha.rope_embeddings.reset_parameters()
    tokens = random_tokens(2, 12)
    torch.testing.assert_close(gqa(tokens), mha(tokens))


def test_weight_tying_shares_the_embedding():
    args = tiny_args(weight_tying=True)
    model = build_initialised(args)
    assert model.output.weight is model.tok_embeddings.weight
    untied = LMTransformer(tiny_args())
    assert model.num_params() == untied.num_params() - 260 * 32
    assert model.num_params(exclude_embeddings=True) == model.num_params()
    logits = model(random_tokens(1, 8))
    logits.sum().backward()
    assert model.tok_embeddings.weight.grad is not None
    assert model.tok_embeddings not in model.fsdp_units()
    copy = LMTransformer(args)
    copy.load_state_dict(model.state_dict())
    assert copy.output.weight is copy.tok_embeddings.weight


def test_fsdp_units_in_forward_order():
    model = LMTransformer(tiny_args())
    units = model.fsdp_units()
    assert units[0] is model.tok_embeddings and units[-1] is model.output
    assert units[1:-1] == list(model.layers)


def test_adamw_reduces_loss_on_repeated_batch():
    model = build_initialised(tiny_args(attn_bias_type="block_causal"))
    tokens = random_tokens(2, 33, seed=5)
    tokens[:, 10] = EOS
    x, y = tokens[:, :-1], tokens[:, 1:]
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        optim.zero_grad()
        loss.backward()
        optim.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5


@pytest.mark.parametrize(("kind", "window"), [("block_causal", None), ("local_block_causal", 5)])
def test_document_in_packed_row_equals_document_alone(kind, window):
    """RoPE positions are not reset at EOS, but RoPE is relative, so a document's logits do not
    depend on where it sits in the row (up to float error) once the mask isolates it."""
    model = build_initialised(tiny_args(attn_bias_type=kind, sliding_window=window))
    doc1 = random_tokens(1, 9, seed=1)
    doc1[0, -1] = EOS
    doc2 = random_tokens(1, 14, seed=2)
    packed = torch.cat([doc1, doc2], dim=1)
    with torch.no_grad():
        alone = model(doc2)
        in_row = model(packed)[:, doc1.shape[1] :]
    torch.testing.assert_close(in_row, alone, rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        causal = build_initialised(tiny_args(attn_bias_type="causal"))
        leaked = causal(packed)[:, doc1.shape[1] :]
    assert (leaked - causal(doc2)).abs().max() > 1e-3  # without the doc mask, doc 1 leaks in


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"dim": 30, "n_heads": 4}, "not divisible by n_heads"),
        ({"n_heads": 4, "n_kv_heads": 3}, "multiple of n_kv_heads"),
        ({"attn_bias_type": "local_block_causal"}, "needs sliding_window"),
        ({"attn_impl": "fmha"}, "without any mask"),
        ({"attn_impl": "flash"}, "attn_impl='flash' is unknown"),
        ({"attn_bias_type": "local"}, "attn_bias_type='local' is unknown"),
        ({"init_std_factor": "depth"}, "init_std_factor='depth' is unknown"),
        ({"n_heads": None}, "set n_heads"),
        ({"vocab_size": -1}, "vocab_size=-1 must be a positive integer"),
        ({"dim_global": 3}, "Extra inputs are not permitted"),
    ],
)
def test_invalid_args_are_rejected(overrides, message):
    with pytest.raises(ValidationError, match=message):
        tiny_args(**overrides)


def test_sequence_longer_than_rope_table_fails_clearly():
    model = build_initialised(tiny_args(max_seqlen=8))
    with pytest.raises(ValueError, match="max_seqlen=8"):
        model(random_tokens(1, 9))


def test_rotary_embedding_rotates_interleaved_pairs_like_the_2x2_table():
    rope = RotaryEmbedding(theta=500.0, head_dim=8, max_seqlen=16)
    freqs = rope(seqlen=5)
    assert freqs.shape == (5, 4, 2, 2)
    xq = torch.randn(2, 5, 3, 8)
    xk = torch.randn(2, 5, 1, 8)
    out_q, out_k = apply_rotary_emb(xq, xk, freqs)
    for x, out in ((xq, out_q), (xk, out_k)):
        pairs = x.unflatten(-1, (4, 2))  # (x[2i], x[2i+1])
        expected = torch.einsum("sirc,bshic->bshir", freqs, pairs).flatten(-2)
        torch.testing.assert_close(out, expected)
    # position 0 is the identity; the rotation angle of pair i is pos * theta^(-2i/d)
    torch.testing.assert_close(out_q[:, 0], xq[:, 0])
    angle = 3 * 500.0 ** (-2 / 8)
    assert freqs[3, 1, 1, 0].item() == pytest.approx(torch.tensor(angle).sin().item(), rel=1e-6)
    with torch.no_grad():
        rope.freqs_cis.zero_()
    rope.reset_parameters()
    torch.testing.assert_close(rope(seqlen=5), freqs)


def test_banded_local_attention_gives_the_same_logits_as_the_dense_mask(monkeypatch):
    args = tiny_args(attn_bias_type="local_block_causal", sliding_window=6, max_seqlen=300)
    model = build_initialised(args)
    tokens = random_tokens(2, 300, seed=4)
    tokens[0, [10, 40, 41]] = EOS
    tokens[1, [70, 250]] = EOS
    assert isinstance(
        attention.self_attn_mask("local_block_causal", tokens, window=6), attention.SdpaBanded
    )
    with torch.no_grad():
        banded = model(tokens)
        monkeypatch.setattr(attention.chunked, "band_chunk", lambda seqlen, window: None)
        dense_mask = attention.self_attn_mask("local_block_causal", tokens, window=6)
        assert isinstance(dense_mask, attention.SdpaDense)
        dense = model(tokens)
    torch.testing.assert_close(banded, dense, rtol=1e-5, atol=1e-5)


def test_compiled_block_matches_eager():
    """The compiled path (real-valued RoPE, fused by inductor) computes the same function."""
    model = build_initialised(tiny_args(attn_bias_type="block_causal", n_layers=1))
    tokens = random_tokens(2, 16, seed=6)
    tokens[0, 5] = EOS
    with torch.no_grad():
        eager = model(tokens)
        model.layers[0].compile(backend="aot_eager")
        compiled = model(tokens)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
