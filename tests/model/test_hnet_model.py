"""The H-Net model (`arch: hnet`, bytelatent/archs/hnet/model.py): shapes, aux terms, document
isolation, the registry spec and its config rules, and a few training steps in-process."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from bytelatent.archs.hnet.args import HNetArgs
from bytelatent.archs.hnet.model import HNet
from bytelatent.archs.hnet.sizes import hnet_training_flops
from bytelatent.args import TrainArgs
from bytelatent.config import parse_args
from bytelatent.data.batch import Batch
from bytelatent.model.loss import forward_outputs
from bytelatent.model.registry import arch_of, get_arch
from bytelatent.trainer.build import build_parallel_model
from bytelatent.trainer.interval import IntervalMetrics, StepOutput
from bytelatent.trainer.model_info import estimate_memory, parameter_table, render
from bytelatent.trainer.throughput import FlopsCounter

EOS = 2
ONE_STAGE = [dict(dim=32, n_heads=2, sliding_window=16, target_ratio=3.0)]
TWO_STAGES = [
    *ONE_STAGE,
    dict(dim=48, n_heads=2, n_layers_encoder=1, n_layers_decoder=1, sliding_window=8,
         target_ratio=2.0, ratio_loss_weight=0.05),
]  # fmt: skip


def tiny(stages, seed: int = 0) -> HNet:
    args = HNetArgs(stages=stages, dim=64, n_layers=2, n_heads=4, max_seqlen=64, multiple_of=16)
    with torch.device("meta"):
        model = HNet(args)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights()
    return model


def tokens(seed: int = 0, batch: int = 2, length: int = 64) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(4, 260, (batch, length), generator=gen)
    x[0, 20] = EOS
    x[-1, 40] = EOS
    return x


@pytest.mark.parametrize("stages", [ONE_STAGE, TWO_STAGES], ids=["1stage", "2stage"])
def test_forward_shapes_aux_and_gradients(stages) -> None:
    model = tiny(stages)
    logits, aux = model(tokens())
    assert logits.shape == (2, 64, 260) and logits.dtype == torch.float32
    names = {"ratio_loss"} | {
        f"{kind}/stage{s}"
        for s in range(len(stages))
        for kind in ("ratio_loss", "chunk_len_mean", "bytes_per_chunk")
    }
    assert set(aux) == names
    weighted = sum(st.get("ratio_loss_weight", 0.03) * aux[f"ratio_loss/stage{s}"]
                   for s, st in enumerate(stages))  # fmt: skip
    torch.testing.assert_close(aux["ratio_loss"].detach(), weighted.float())
    (logits.logsumexp(-1).mean() + aux["ratio_loss"]).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, f"parameters without a gradient: {missing}"
    # the main network is the BLT's global transformer (same parameter names)
    assert "global_transformer.layers.0.attention.wq.weight" in dict(model.named_parameters())


@pytest.mark.parametrize("stages", [ONE_STAGE, TWO_STAGES], ids=["1stage", "2stage"])
def test_documents_do_not_see_each_other(stages) -> None:
    """Document starts are forced boundaries, the EMA restarts there and attention is per
    document: a document's logits are the same alone and after another document in the row."""
    model = tiny(stages)
    x = tokens(batch=1)
    together, _ = model(x)
    alone, _ = model(x[:, 21:])
    torch.testing.assert_close(alone[0], together[0, 21:], atol=2e-5, rtol=2e-5)
    other = x.clone()
    other[0, :20] = torch.randint(4, 260, (20,), generator=torch.Generator().manual_seed(9))
    changed, _ = model(other)
    torch.testing.assert_close(changed[0, 21:], together[0, 21:], atol=2e-5, rtol=2e-5)


def test_document_start_is_a_boundary() -> None:
    model = tiny(ONE_STAGE)
    stage = model.stages[0]
    h = torch.randn(1, 10, 32)
    starts = torch.zeros(1, 10, dtype=torch.bool)
    starts[0, [0, 6]] = True
    routing = stage.routing_module(h, mask=torch.ones_like(starts), starts=starts)
    assert routing.boundary_mask[0, 6] and routing.boundary_prob[0, 6, 1] == 1.0


def test_spec_forward_outputs_and_flops() -> None:
    model = tiny(TWO_STAGES)
    spec = get_arch("hnet")
    assert arch_of(model) is spec
    batch = type("B", (), {"x": tokens().numpy(), "patch_lengths": None})()
    logits, aux = forward_outputs(model, batch, torch.device("cpu"))
    assert "chunk_len_mean/stage1" in aux  # metrics-only entries pass the aux check
    flops = hnet_training_flops(model.args, type("D", (), {"seq_len": 64})())
    assert flops(128, 0) == 2 * flops(64, 0) > 0


def test_bf16_autocast_keeps_fp32_islands() -> None:
    model = tiny(ONE_STAGE)
    x = tokens()
    ref, _ = model(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low, aux = model(x)
    assert low.dtype == torch.float32 and torch.isfinite(low).all()
    assert (low - ref).abs().max() < 0.5


def test_tiny_hnet_trains_a_few_steps() -> None:
    model = tiny(ONE_STAGE, seed=3)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x = tokens(seed=5, length=65)
    inputs, targets = x[:, :-1], x[:, 1:]
    losses = []
    for _ in range(8):
        logits, aux = model(inputs)
        ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        (ce + aux["ratio_loss"]).backward()
        opt.step()
        opt.zero_grad()
        losses.append(ce.item())
    assert losses[-1] < losses[0] - 0.5, losses


def test_tp_plan_splits_every_block() -> None:
    """Every encoder, decoder and global block is split; the rest stays replicated
    (tests/distributed/test_multirank.py runs it on 2 ranks)."""
    model = tiny(TWO_STAGES)
    plan = model.tp_plan(2)
    split = [id(block) for blocks in plan.blocks for block in blocks]
    assert sorted(split) == sorted(id(block) for block in model.ac_units())
    assert not plan.sequence_parallel


def test_mfu_counts_the_measured_chunks() -> None:
    """The log step's FLOPs use the interval's measured bytes per chunk (the `aux/` means), not
    the target ratios: twice the target chunks per byte give more FLOPs, exactly the count at
    the measured values; without the metrics the per-batch target count stays."""
    args = TrainArgs.model_validate(_train_args(max_seqlen=64, stages=ONE_STAGE, dim=64,
                                                n_layers=2, n_heads=4))  # fmt: skip
    counter = FlopsCounter(args)
    x = np.full((2, 64), 7, dtype=np.int64)
    batch = Batch(x, x.copy(), np.ones_like(x, dtype=bool), None)

    def interval_flops(aux: dict[str, float]) -> float:
        interval = IntervalMetrics(torch.device("cpu"), counter, 1e12, 1, 1, lambda: None)
        interval.clock.pop = lambda: 1.0
        sums = {k: torch.tensor(2 * v, dtype=torch.float64) for k, v in aux.items()}
        loss = torch.tensor(1.0, dtype=torch.float64)
        out = StepOutput(loss, 128, 128, torch.tensor(1.0), sums, n_micro_batches=2)
        interval.add(out, [batch], data_time=0.0)
        m = interval.compute(1)
        assert m["mfu"] == pytest.approx(m["flops_per_s"] / 1e12)
        return m["flops_per_s"]

    target = hnet_training_flops(args.model, args.data)(128, 0)
    measured = hnet_training_flops(args.model, args.data, [1.5])(128, 0)
    assert measured > target * 1.1  # 1.5 bytes per chunk: a busier global transformer
    assert interval_flops({}) == pytest.approx(target)
    # ratio_loss/stage0 alone is not a chunk count: the target estimate stays
    assert interval_flops({"ratio_loss/stage0": 1.0}) == pytest.approx(target)
    got = interval_flops({"bytes_per_chunk/stage0": 1.5, "chunk_len_mean/stage0": 1.5})
    assert got == pytest.approx(measured)


def _train_args(**arch_args) -> dict:
    return {
        "dump_dir": "runs/x",
        "arch": "hnet",
        "model": None,
        "arch_args": arch_args,
        "data": {"seq_len": 64, "add_patches": False, "patcher_args": {"patching_mode": "byte"}},
    }


def test_config_rules() -> None:
    args = TrainArgs.model_validate(_train_args(max_seqlen=64))
    assert isinstance(args.model, HNetArgs)
    tp2 = TrainArgs.model_validate({**_train_args(max_seqlen=64), "distributed": {"tp_size": 2}})
    assert tp2.distributed.tp_size == 2
    with pytest.raises(
        ValueError, match=r"tp_size=4 does not divide arch_args.stages\[0\].n_heads=2"
    ):
        bad = _train_args(max_seqlen=64, stages=[dict(n_heads=2)])
        TrainArgs.model_validate({**bad, "distributed": {"tp_size": 4}})
    with pytest.raises(ValueError, match="arch_args.max_seqlen"):
        TrainArgs.model_validate(_train_args(max_seqlen=32))
    with pytest.raises(ValueError, match=r"stages\[1\].dim=16 < stages\[0\].dim=32"):
        HNetArgs(stages=[dict(dim=32, n_heads=2), dict(dim=16, n_heads=2)], dim=64, n_heads=4)
    with pytest.raises(ValueError, match="patching_mode"):
        bad = _train_args(max_seqlen=64)
        bad["data"]["patcher_args"]["patching_mode"] = "space"
        TrainArgs.model_validate(bad)


REPO = Path(__file__).resolve().parents[2]
HNET_2STAGE_PARAMS = 974_255_616  # configs/hnet_2stage_xl.yaml


def test_two_stage_config_dry_run_in_process(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(REPO)
    args = parse_args(TrainArgs, ["config=configs/hnet_2stage_xl.yaml", f"dump_dir={tmp_path}",
                                  "dry_run=true"])  # fmt: skip
    model = build_parallel_model(args, None)  # on meta: nothing allocated
    assert sum(p.numel() for p in model.parameters()) == HNET_2STAGE_PARAMS
    mem = estimate_memory(model, parameter_table(model), args)
    assert mem.params == 4 * HNET_2STAGE_PARAMS and mem.activations > 0
    per_byte = hnet_training_flops(args.model, args.data)(1, 0)
    text, _, _ = render(model, args, 1, 0)
    assert f"training FLOPs per byte: {per_byte:,.0f} (an estimate at the target" in text
    names = {n for n, _ in model.named_parameters()}
    # widths 1024 -> 1024 -> 1536: only the innermost stage pads its chunks (official layout)
    assert "stages.0.pad_dimension" not in names and "stages.1.pad_dimension" in names
