"""Single-process checks of parallelize_model's pieces, init_model_weights and clip_grad_norm_."""

from __future__ import annotations

import contextlib
import sys
import types

import _parity
import pytest
import torch
import torch.nn.functional as F
from _parity import build_model, make_batch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy

from bytelatent.archs.lm.model import LMTransformer
from bytelatent.distributed.args import DistributedArgs
from bytelatent.distributed.clip import clip_grad_norm_
from bytelatent.distributed.parallelize import (
    _save_ops,
    _selective_policy,
    apply_activation_checkpointing,
    apply_compile,
    checkpoint_blocks,
    forward_context,
    init_model_weights,
    parallelize_model,
    set_gradient_sync,
    tp_parallelize_blocks,
)
from bytelatent.errors import ConfigError

FP32 = {"model_dtype": "fp32"}


def ready(kind: str, **overrides) -> nn.Module:
    model = build_model(kind)
    parallelize_model(model, None, DistributedArgs(**{**FP32, **overrides}))
    model.to_empty(device="cpu")
    init_model_weights(model, 0)
    return model


def loss_and_grads(model: nn.Module, kind: str) -> tuple[torch.Tensor, dict]:
    x, y = make_batch(0)
    patches = torch.tensor([[1, 4, 4, 4, 3]] * x.shape[0])
    logits = model(x) if kind == "lm" else model(x, patches)
    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


class CountMatmuls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            self.count += 1
        return func(*args, **(kwargs or {}))


def backward_matmuls(model: nn.Module) -> int:
    x, y = make_batch(0)
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    with CountMatmuls() as counter:
        loss.backward()
    return counter.count


# --- activation checkpointing ----------------------------------------------------------------


@pytest.mark.parametrize("kind", ["lm", "blt"])
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_same_grads_same_names(kind: str, mode: str):
    plain = ready(kind)
    wrapped = ready(kind, activation_checkpointing=mode)
    assert [n for n, _ in wrapped.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert wrapped.state_dict().keys() == plain.state_dict().keys()
    loss_a, grads_a = loss_and_grads(plain, kind)
    loss_b, grads_b = loss_and_grads(wrapped, kind)
    torch.testing.assert_close(loss_a, loss_b, rtol=0, atol=0)
    for name, grad in grads_a.items():
        torch.testing.assert_close(grads_b[name], grad, rtol=1e-6, atol=1e-7, msg=name)


def test_checkpoint_modes_recompute_what_they_promise():
    """full recomputes every block matmul in backward; selective saves them (none recomputed)."""
    counts = {
        m: backward_matmuls(ready("lm", activation_checkpointing=m))
        for m in ("none", "full", "selective")
    }
    # Each block's forward has 7 matmuls; non-reentrant recompute stops once the tensors
    # backward needs exist, so w2 (whose output nothing saves) is not redone: 6 per block.
    n_layers = 2
    assert counts["full"] == counts["none"] + 6 * n_layers
    assert counts["selective"] == counts["none"]


def test_selective_policy_saves_matmuls_recomputes_elementwise():
    assert _selective_policy(None, torch.ops.aten.mm.default) == CheckpointPolicy.MUST_SAVE
    assert _selective_policy(None, torch.ops.aten.mul.Tensor) == CheckpointPolicy.PREFER_RECOMPUTE


def test_selective_policy_saves_flex_and_xformers_attention(monkeypatch):
    from torch._higher_order_ops.flex_attention import flex_attention

    save = CheckpointPolicy.MUST_SAVE
    assert _selective_policy(None, flex_attention) == save
    assert _selective_policy(None, torch.ops.aten._efficient_attention_forward.default) == save
    # xformers' own kernels count once xformers is imported (a stand-in op of the same name)
    library = torch.library.Library("xformers_flash", "FRAGMENT")
    if not hasattr(torch.ops.xformers_flash, "flash_fwd"):
        library.define("flash_fwd(Tensor q) -> Tensor")
    monkeypatch.setitem(sys.modules, "xformers", types.ModuleType("xformers"))
    _save_ops.cache_clear()
    try:
        assert _selective_policy(None, torch.ops.xformers_flash.flash_fwd.default) == save
    finally:
        _save_ops.cache_clear()


def test_cross_attention_layers_are_checkpointed_in_forward_order():
    from bytelatent.archs.blt.args import ByteLatentTransformerArgs
    from bytelatent.archs.blt.model import ByteLatentTransformer

    fields = {**_parity.BLT_ARGS.model_dump(), "n_layers_local_decoder": 2}
    fields.update(cross_attn_encoder=True, cross_attn_decoder=True, cross_attn_k=2)
    fields.update(cross_attn_all_layers_decoder=True, cross_attn_init_by_pooling=True)
    args = ByteLatentTransformerArgs(**fields)

    def build(mode: str | None) -> nn.Module:
        torch.manual_seed(0)
        model = ByteLatentTransformer(args)
        model.init_weights()
        if mode:
            apply_activation_checkpointing(model, mode)
        return model

    plain = build(None)
    enc, dec = plain.local_encoder, plain.local_decoder
    assert checkpoint_blocks(plain) == [
        enc.layers[0],
        enc.cross_attn_layers[0],
        *plain.global_transformer.layers,
        dec.cross_attn_layers[0],
        dec.layers[0],
        dec.cross_attn_layers[1],
        dec.layers[1],
    ]
    x, y = make_batch(0)
    patches = torch.tensor([[1, 4, 4, 4, 3]] * x.shape[0])
    expected = F.cross_entropy(plain(x, patches).flatten(0, 1), y.flatten())
    for mode in ("full", "selective"):
        model = build(mode)
        assert all("forward" in vars(block) for block in checkpoint_blocks(model))
        loss = F.cross_entropy(model(x, patches).flatten(0, 1), y.flatten())
        assert torch.equal(loss, expected)
        loss.backward()


def test_checkpoint_blocks_cover_every_layer_stack():
    blt = build_model("blt")
    expected = [
        *blt.local_encoder.layers,
        *blt.global_transformer.layers,
        *blt.local_decoder.layers,
    ]
    assert {id(b) for b in checkpoint_blocks(blt)} == {id(b) for b in expected}
    with pytest.raises(ConfigError, match="no `layers` blocks"):
        parallelize_model(nn.Linear(2, 2), None, DistributedArgs(activation_checkpointing="full"))


def test_compile_per_block_matches_eager():
    """Graph capture of checkpointed blocks; aot_eager keeps it fast (inductor codegen is torch's
    own business and takes a minute on 2 cores)."""
    eager = ready("lm")
    compiled = ready("lm", activation_checkpointing="selective")
    apply_compile(compiled, cache_size_limit=8, backend="aot_eager")
    assert [n for n, _ in compiled.named_parameters()] == [n for n, _ in eager.named_parameters()]
    loss_a, grads_a = loss_and_grads(eager, "lm")
    loss_b, grads_b = loss_and_grads(compiled, "lm")
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-5, atol=1e-5)
    for name, grad in grads_a.items():
        torch.testing.assert_close(grads_b[name], grad, rtol=1e-4, atol=1e-5, msg=name)


# --- init ------------------------------------------------------------------------------------


def test_init_matches_plain_seeded_init_and_restores_rng():
    model = ready("lm")
    with torch.device("meta"):
        plain = LMTransformer(build_model("lm").args)
    plain.to_empty(device="cpu")
    torch.manual_seed(0)
    plain.init_weights()
    for (name, a), (_, b) in zip(model.named_parameters(), plain.named_parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    torch.testing.assert_close(
        model.rope_embeddings.freqs_cis, plain.rope_embeddings.freqs_cis, rtol=0, atol=0
    )
    state = torch.random.get_rng_state()
    init_model_weights(model, 5)
    assert torch.equal(torch.random.get_rng_state(), state)


def test_init_same_seed_same_weights_different_seed_differs():
    a, b, c = ready("blt"), ready("blt"), build_model("blt")
    c.to_empty(device="cpu")
    init_model_weights(c, 1)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["local_decoder.output.weight"], sc["local_decoder.output.weight"])


def test_init_keeps_tied_weights_tied():
    args = build_model("lm").args.model_copy(update={"weight_tying": True})
    with torch.device("meta"):
        model = LMTransformer(args)
    model.to_empty(device="cpu")
    init_model_weights(model, 0)
    assert model.output.weight is model.tok_embeddings.weight
    assert model.output.weight.std() > 0


def test_init_on_meta_is_an_error():
    with pytest.raises(RuntimeError, match="to_empty"):
        init_model_weights(build_model("lm"), 0)


# --- misc ------------------------------------------------------------------------------------


def test_float8_is_rejected_clearly():
    with pytest.raises(ConfigError, match="float8_recipe"):
        parallelize_model(build_model("lm"), None, DistributedArgs(float8_recipe="rowwise"))


class FakeTPMesh:
    def size(self) -> int:
        return 3


def test_tp_heads_must_divide():
    model = build_model("lm")  # 4 heads, 2 kv heads
    with pytest.raises(ConfigError, match=r"tp_size=3 must divide the attention heads"):
        tp_parallelize_blocks(model.layers, FakeTPMesh(), sequence_parallel=True)


def test_set_gradient_sync_is_a_noop_without_fsdp():
    """Without FSDP, sync off changes nothing: same modules, weights and gradients as never called."""
    _, expected = loss_and_grads(ready("lm"), "lm")
    model = ready("lm")
    before = {n: (type(m), dict(vars(m))) for n, m in model.named_modules()}
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    set_gradient_sync(model, False)
    assert {n: (type(m), dict(vars(m))) for n, m in model.named_modules()} == before
    _, grads = loss_and_grads(model, "lm")  # a backward with sync "off"
    set_gradient_sync(model, True)
    assert {n: (type(m), dict(vars(m))) for n, m in model.named_modules()} == before
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
    assert grads.keys() == expected.keys()
    assert all(torch.equal(grads[k], expected[k]) for k in expected)


def test_forward_context_autocasts_only_without_fsdp():
    bf16 = DistributedArgs(model_dtype="bf16")
    with forward_context(None, bf16, "cpu"):
        assert torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype == torch.bfloat16
    assert isinstance(forward_context(None, DistributedArgs(**FP32), "cpu"), contextlib.nullcontext)
    assert isinstance(forward_context(object(), bf16, "cpu"), contextlib.nullcontext)


# --- clip --------------------------------------------------------------------------------------


def grads_of(seed: int) -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    params = []
    for shape in [(5, 3), (7,), (2, 2, 2)]:
        p = nn.Parameter(torch.zeros(shape))
        p.grad = torch.randn(shape, generator=gen) * 3
        params.append(p)
    params.append(nn.Parameter(torch.zeros(2)))  # no grad: ignored
    return params


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
@pytest.mark.parametrize("foreach", [None, False])
def test_clip_matches_torch(norm_type: float, foreach: bool | None):
    ours, ref = grads_of(0), grads_of(0)
    norm = clip_grad_norm_(ours, max_norm=1.0, norm_type=norm_type, foreach=foreach)
    expected = torch.nn.utils.clip_grad_norm_(ref, max_norm=1.0, norm_type=norm_type)
    torch.testing.assert_close(norm, expected)
    for a, b in zip(ours, ref, strict=True):
        if b.grad is not None:
            torch.testing.assert_close(a.grad, b.grad)


def test_clip_disabled_still_reports_norm():
    params = grads_of(1)
    before = [p.grad.clone() for p in params if p.grad is not None]
    norm = clip_grad_norm_(params, max_norm=0.0)
    assert norm > 1.0
    after = [p.grad for p in params if p.grad is not None]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert clip_grad_norm_([nn.Parameter(torch.zeros(1))], 1.0).item() == 0.0
