"""H-Net dynamic-chunking modules: the parallel EMA scan against a sequential loop (values and
gradients, long sequences, resets, p at the clamp limits), padded vs packed layouts, and the
small contracts (identity/zero init, STE, ratio loss, nested stages)."""

from __future__ import annotations

import pytest
import torch

from bytelatent.archs.hnet.dc import (
    ChunkLayer,
    DCStage,
    DeChunkLayer,
    ResidualProjection,
    RoutingModule,
    dechunk,
    ema_scan,
    ema_scan_sequential,
    load_balancing_loss,
    ratio_loss,
    straight_through,
)
from bytelatent.archs.hnet.dc.chunking import PROB_CLAMP
from bytelatent.archs.hnet.dc.residual import merge_residual


def scan_inputs(length: int, seed: int, batch: int = 2, dim: int = 3, reset_rate: float = 0.01):
    """log(1 - p) with p in [1e-4, 1 - 1e-4] (long runs at both limits), inputs, resets; fp64."""
    gen = torch.Generator().manual_seed(seed)
    prob = torch.rand(batch, length, generator=gen, dtype=torch.float64)
    prob[0, : length // 3] = PROB_CLAMP  # decay 0.9999: a state that barely fades
    prob[-1, length // 3 :] = 1 - PROB_CLAMP  # decay 1e-4: a cumulative product underflows
    prob = prob.clamp(PROB_CLAMP, 1 - PROB_CLAMP)
    inputs = torch.randn(batch, length, dim, generator=gen, dtype=torch.float64)
    reset = torch.rand(batch, length, generator=gen) < reset_rate
    return torch.log1p(-prob), inputs, reset


@pytest.mark.parametrize("length", [1, 63, 64, 65, 1000, 4099])
@pytest.mark.parametrize("block_size", [16, 64])
def test_scan_matches_sequential_fp64(length: int, block_size: int) -> None:
    log_decay, inputs, reset = scan_inputs(length, seed=length)
    expected = ema_scan_sequential(log_decay, inputs, reset)
    for resets in (reset, None):
        got = ema_scan(log_decay, inputs, resets, block_size=block_size)
        want = expected if resets is not None else ema_scan_sequential(log_decay, inputs)
        assert torch.isfinite(got).all()
        err = (got - want).abs().max().item()
        assert err < 1e-12, f"L={length} block={block_size}: max err {err}"


def test_scan_fp32_long_sequence_at_the_clamp_limits() -> None:
    """8192 positions of decay 1e-4 (and of 0.9999): no inf/nan, fp32-accurate."""
    log_decay, inputs, reset = scan_inputs(8192, seed=1, reset_rate=0.0)
    expected = ema_scan_sequential(log_decay, inputs)
    got = ema_scan(log_decay.float(), inputs.float())
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    assert (got.double() - expected).abs().max().item() < 1e-4


def test_scan_resets_isolate_documents() -> None:
    log_decay, inputs, _ = scan_inputs(300, seed=3, batch=1)
    reset = torch.zeros(1, 300, dtype=torch.bool)
    reset[0, [0, 100, 101, 250]] = True
    whole = ema_scan(log_decay, inputs, reset, block_size=16)
    for start, end in ((0, 100), (100, 101), (101, 250), (250, 300)):
        alone = ema_scan(log_decay[:, start:end], inputs[:, start:end], block_size=16)
        assert torch.allclose(whole[:, start:end], alone, atol=1e-14, rtol=0)


def test_scan_gradcheck() -> None:
    """Three levels of blocks (L=40, block 3), resets, both limits of p: autograd is exact."""
    log_decay, inputs, reset = scan_inputs(40, seed=5, dim=2, reset_rate=0.1)
    log_decay.requires_grad_(True)
    inputs.requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda a, x: ema_scan(a, x, reset, block_size=3), (log_decay, inputs)
    )


def test_scan_gradients_match_sequential_on_a_long_sequence() -> None:
    log_decay, inputs, reset = scan_inputs(3000, seed=7)
    cotangent = torch.randn_like(inputs)
    grads = []
    for scan in (lambda a, x: ema_scan(a, x, reset), lambda a, x: ema_scan_sequential(a, x, reset)):
        a, x = log_decay.clone().requires_grad_(True), inputs.clone().requires_grad_(True)
        grads.append(torch.autograd.grad((scan(a, x) * cotangent).sum(), [a, x]))
    for got, want in zip(*grads):
        assert (got - want).abs().max().item() < 1e-10


def test_scan_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match="expected inputs"):
        ema_scan(torch.zeros(2, 5), torch.zeros(2, 4, 3))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_scan_cuda_matches_cpu() -> None:
    log_decay, inputs, reset = scan_inputs(5000, seed=9)
    cpu = ema_scan(log_decay.float(), inputs.float(), reset)
    cuda = ema_scan(log_decay.float().cuda(), inputs.float().cuda(), reset.cuda())
    assert (cuda.cpu() - cpu).abs().max().item() < 1e-5


# ----------------------------------------------------------------------------- layouts


def padded_and_packed(seed: int, lengths: list[int], dim: int = 8):
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    hidden = torch.randn(len(lengths), width, dim, generator=gen, dtype=torch.float64)
    mask = torch.arange(width)[None] < torch.tensor(lengths)[:, None]
    packed = torch.cat([hidden[row, :n] for row, n in enumerate(lengths)])
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return hidden, mask, packed, cu_seqlens


@pytest.mark.parametrize("kernel_dtype", [None, torch.float64])
def test_chunk_dechunk_padded_equals_packed(kernel_dtype: torch.dtype | None) -> None:
    """Rows of a padded batch and documents of a packed stream: same values and gradients."""
    lengths = [37, 1, 20]
    hidden, mask, packed, cu_seqlens = padded_and_packed(0, lengths)
    router = RoutingModule(8, dtype=torch.float64)
    chunker, dechunker = ChunkLayer(), DeChunkLayer(kernel_dtype=kernel_dtype, block_size=4)
    results = []
    for x, layout in ((hidden, {"mask": mask}), (packed, {"cu_seqlens": cu_seqlens})):
        x = x.clone().requires_grad_(True)
        routing = router(x, **layout)
        chunks = chunker(x, routing.boundary_mask, **layout)
        main_out = chunks.hidden_states * 2 + 1  # something the chunk level did
        out = dechunker(
            main_out, routing.boundary_mask, routing.boundary_prob, cu_seqlens=chunks.cu_seqlens
        )
        assert out.shape == x.shape and out.dtype == x.dtype
        valid = out if "cu_seqlens" in layout else out[mask]
        (grad,) = torch.autograd.grad(
            (valid * torch.arange(valid.numel()).view_as(valid)).sum(), [x]
        )
        results.append(
            (valid.detach(), routing, chunks, grad if "cu_seqlens" in layout else grad[mask])
        )
    (padded_out, padded_routing, padded_chunks, padded_grad) = results[0]
    (packed_out, packed_routing, packed_chunks, packed_grad) = results[1]
    assert torch.equal(padded_routing.boundary_mask[mask], packed_routing.boundary_mask)
    assert torch.equal(padded_chunks.num_tokens, packed_chunks.num_tokens)
    assert torch.allclose(padded_out, packed_out, atol=1e-12, rtol=0)
    assert torch.allclose(padded_grad, packed_grad, atol=1e-10, rtol=0)
    chunk_rows = padded_chunks.hidden_states[padded_chunks.mask]
    assert torch.equal(chunk_rows.detach(), packed_chunks.hidden_states.detach())


def test_dechunk_first_output_is_clamped_prob_times_state() -> None:
    """p = 1 at a row start is clamped to 1 - 1e-4: out_0 = 0.9999 h_0, not h_0."""
    hidden, mask, _, _ = padded_and_packed(1, [5, 3])
    routing = RoutingModule(8, dtype=torch.float64)(hidden, mask=mask)
    chunks = ChunkLayer()(hidden, routing.boundary_mask, mask=mask)
    out = dechunk(
        chunks.hidden_states, routing.boundary_mask, routing.boundary_prob, fp32_prob=False
    )
    assert torch.allclose(out[:, 0], (1 - PROB_CLAMP) * hidden[:, 0], atol=1e-15, rtol=0)


def test_routing_contract() -> None:
    """Identity init; first position and document starts are boundaries with p = 1; p = 0.5
    (orthogonal neighbours) is not a boundary; padding never is."""
    router = RoutingModule(4, dtype=torch.float64)
    assert torch.equal(router.q_proj_layer.weight, torch.eye(4, dtype=torch.float64))
    e0, e1 = torch.eye(4, dtype=torch.float64)[:2]
    x = torch.stack([e0, e0, e1, e1, -e1, e0])  # p: 1, 0, 0.5, 0, 1, 0.5
    out = router(x, cu_seqlens=torch.tensor([0, 3, 6], dtype=torch.int32))
    assert out.boundary_prob[:, 1].tolist() == [1, 0, 0.5, 1, 1, 0.5]  # doc start at 3
    assert out.boundary_mask.tolist() == [True, False, False, True, True, False]
    assert out.selected_probs[:, 0].tolist() == [1, 1, 0.5, 1, 1, 0.5]
    padded = router(x[None], mask=torch.tensor([[True] * 4 + [False] * 2]))
    assert padded.boundary_mask[0].tolist() == [True, False, False, False, False, False]
    assert padded.boundary_prob[0, 4, 1] == 1  # computed at padding too


# ----------------------------------------------------------------------------- small contracts


def test_residual_projection_is_fp32_and_zero_initialised() -> None:
    proj = ResidualProjection(8)
    assert proj.weight.dtype == torch.float32 and not proj.weight.any()
    out = proj(torch.randn(2, 3, 8, dtype=torch.bfloat16))
    assert out.dtype == torch.float32
    assert torch.equal(out, proj.bias.expand(2, 3, 8))


def test_straight_through_is_one_forward_identity_backward() -> None:
    probs = torch.rand(5, 1, dtype=torch.float64, requires_grad=True)
    ones = straight_through(probs)
    assert torch.equal(ones, torch.ones_like(probs))
    cotangent = torch.randn(5, 1, dtype=torch.float64)
    (grad,) = torch.autograd.grad((ones * cotangent).sum(), [probs])
    assert torch.equal(grad, cotangent)


def test_ratio_loss_is_one_at_the_target_and_weighted() -> None:
    n = 4
    mask = torch.zeros(2, 8, dtype=torch.bool)
    mask[:, ::4] = True  # F = 1/4
    prob = torch.full((2, 8), 0.25)  # G = 1/4
    boundary_prob = torch.stack([1 - prob, prob], -1)
    assert load_balancing_loss(boundary_prob, mask, n).item() == pytest.approx(1.0)
    stage = DCStage(8)
    routing = stage(torch.randn(2, 8, 8), mask=torch.ones(2, 8, dtype=torch.bool)).routing
    single = load_balancing_loss(routing[0].boundary_prob, routing[0].boundary_mask, 3.0)
    assert torch.allclose(ratio_loss(routing, [3.0], weight=0.03), 0.03 * single)
    with pytest.raises(ValueError, match="must be > 1"):
        load_balancing_loss(boundary_prob, mask, 1.0)
    with pytest.raises(ValueError, match="target ratios"):
        ratio_loss(routing, [3.0, 2.0], weight=0.03)


@pytest.mark.parametrize("form", ["padded", "packed"])
def test_nested_stages_bf16(form: str) -> None:
    """A two-stage H-Net in bf16 with the official default bf16 EMA route: shapes, dtypes,
    two routing outputs, finite gradients everywhere."""
    torch.manual_seed(0)
    inner = DCStage(16, dtype=torch.bfloat16, kernel_dtype=torch.bfloat16)
    outer = DCStage(16, main_network=inner, dtype=torch.bfloat16, kernel_dtype=torch.bfloat16)
    if form == "padded":
        x = torch.randn(2, 40, 16, dtype=torch.bfloat16, requires_grad=True)
        out = outer(x, mask=torch.arange(40)[None] < torch.tensor([[40], [25]]))
    else:
        x = torch.randn(70, 16, dtype=torch.bfloat16, requires_grad=True)
        out = outer(x, cu_seqlens=torch.tensor([0, 30, 31, 70], dtype=torch.int32), max_seqlen=39)
    assert out.hidden_states.shape == x.shape and out.hidden_states.dtype == torch.bfloat16
    assert len(out.routing) == 2
    loss = out.hidden_states.float().sum() + ratio_loss(out.routing, [3.0, 2.0], weight=0.03)
    loss.backward()
    for param in outer.parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all()


def test_stage_builds_on_meta_and_initialises() -> None:
    with torch.device("meta"):
        stage = DCStage(8)
    stage.to_empty(device="cpu")
    stage.routing_module.init_weights()
    stage.residual_proj.init_weights()
    assert torch.equal(stage.routing_module.k_proj_layer.weight, torch.eye(8))
    assert not stage.residual_proj.weight.any()
    with pytest.raises(ValueError, match="exactly one of mask"):
        stage(torch.zeros(1, 4, 8))


# ------------------------------------------------------- fp32 islands under bf16 autocast (#39)


def _boundaries(length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    prob = torch.rand(2, length, generator=gen)
    prob[:, 0] = 1.0
    return prob > 0.5, torch.stack([1 - prob, prob], -1)


def test_residual_projection_keeps_fp32_under_bf16_autocast() -> None:
    proj = ResidualProjection(16)
    with torch.no_grad():
        proj.weight.normal_(generator=torch.Generator().manual_seed(0))
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = proj(x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, proj(x), rtol=1e-6, atol=1e-6)  # not bf16's ~4e-3


@pytest.mark.parametrize("kernel_dtype", [None, torch.bfloat16])
def test_standalone_dechunk_runs_its_ema_as_without_autocast(kernel_dtype) -> None:
    """Under bf16 autocast the EMA gives the values it gives without autocast (before: its scan
    ran in bf16, ~1.5e-2 off the fp32 EMA)."""
    mask, prob = _boundaries(300, 2)
    chunks = torch.randn(2, int(mask.sum(-1).max()), 32, generator=torch.Generator().manual_seed(3))
    reference = dechunk(chunks, mask, prob, kernel_dtype=kernel_dtype)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = dechunk(chunks, mask, prob, kernel_dtype=kernel_dtype)
    assert out.dtype == reference.dtype == torch.float32
    torch.testing.assert_close(out, reference, rtol=1e-6, atol=1e-6)


def test_dc_stage_keeps_its_fp32_island_under_bf16_autocast() -> None:
    """DCStage under bf16 autocast equals, given the router's (autocast) output, the fp32
    composition: fp32 residual projection, fp32 EMA, fp32 merge."""
    torch.manual_seed(0)
    stage = DCStage(16)
    with torch.no_grad():
        stage.residual_proj.weight.normal_()
    x = torch.randn(2, 64, 16)
    mask = torch.ones(2, 64, dtype=torch.bool)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = stage(x, mask=mask)
    routing = out.routing[0]
    chunks = stage.chunk_layer(x, routing.boundary_mask, mask=mask)
    spread = dechunk(chunks.hidden_states, routing.boundary_mask, routing.boundary_prob)
    expected = merge_residual(spread, stage.residual_proj(x), routing.selected_probs)
    assert out.hidden_states.dtype == torch.float32
    torch.testing.assert_close(out.hidden_states, expected, rtol=1e-6, atol=1e-6)
