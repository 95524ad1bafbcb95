"""H-Net generation with caches (`eval/generation/hnet.py`, issues 30 and 32): the incremental
engine gives the logits of the full forward on the whole row, byte after byte, for 1- and 2-stage
H-Nets whose learned boundaries vary, with documents (EOS) inside the rows, rows of different
lengths and rows that stop while others go on; greedy generation is the same with and without
the cache; `python -m bytelatent.generate` runs a trained H-Net checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from bytelatent.archs.hnet.args import HNetArgs
from bytelatent.archs.hnet.generation import IncrementalHNet
from bytelatent.archs.hnet.model import HNet
from bytelatent.eval.generation import GenerationArgs, Generator, load_generator
from bytelatent.model.registry import get_arch
from bytelatent.tokenizers.constants import BOS_ID, EOS_ID
from tests.conftest import train_tiny
from tests.limits import hang_limit
from tests.shared_fixtures import built_once

REPO = Path(__file__).resolve().parents[2]
ONE_STAGE = [dict(dim=32, n_heads=2, sliding_window=8, target_ratio=3.0)]
TWO_STAGES = [
    *ONE_STAGE,
    dict(dim=48, n_heads=2, n_layers_encoder=1, n_layers_decoder=1, sliding_window=4,
         target_ratio=2.0),
]  # fmt: skip
STAGES = {"1stage": ONE_STAGE, "2stage": TWO_STAGES}
LENGTH = 60  # bytes per row at the end of a test (capacity)
TOL = dict(atol=3e-5, rtol=3e-5)


def tiny_hnet(stages, routing: str, seed: int = 0, **kw) -> HNet:
    """Random init (W_q = W_k = I: few boundaries besides the forced document starts);
    ``routing="perturbed"``: independent random W_q, W_k, so that about every other position is
    a boundary at every stage (chunks of varying length, the inner stage chunking too)."""
    args = HNetArgs(stages=stages, dim=64, n_layers=2, n_heads=4, max_seqlen=64, multiple_of=16,
                    eos_id=EOS_ID, **kw)  # fmt: skip
    with torch.device("meta"):
        model = HNet(args)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights()
    with torch.no_grad():
        for stage in model.stages:
            stage.residual_proj.weight.normal_(0, 0.05)  # the residual path in play too
            if routing == "perturbed":
                q, k = stage.routing_module.q_proj_layer, stage.routing_module.k_proj_layer
                q.weight.normal_(0, q.weight.shape[1] ** -0.5)
                k.weight.normal_(0, k.weight.shape[1] ** -0.5)
    return model.eval().requires_grad_(False)


def rows(seed: int = 0) -> list[list[int]]:
    """BOS + bytes, three lengths, documents ending inside (EOS, then a new document)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for length, eos_at in ((5, ()), (17, (6,)), (30, (3, 4, 20))):
        row = [BOS_ID] + torch.randint(4, 260, (length - 1,), generator=gen).tolist()
        for i in eos_at:
            row[i] = EOS_ID
        out.append(row)
    return out


def full_logits(model: HNet, row: list[int]) -> torch.Tensor:
    return model(torch.tensor([row]))[0][0]


def boundary_fractions(model: HNet, row: list[int]) -> list[float]:
    """The share of boundaries among the positions of each stage in the full forward."""
    seen: list[float] = []

    def record(module, inputs, out) -> None:
        seen.append(out.boundary_mask.float().mean().item())

    hooks = [stage.routing_module.register_forward_hook(record) for stage in model.stages]
    model(torch.tensor([row]))
    for hook in hooks:
        hook.remove()
    return seen


@pytest.mark.parametrize("routing", ["identity", "perturbed"])
@pytest.mark.parametrize("stages", STAGES.values(), ids=STAGES.keys())
def test_cached_logits_equal_the_full_forward(stages, routing) -> None:
    """Prefill rows of different lengths, then step them (teacher-forced, EOS among the new
    bytes, some rows frozen for a while): every logit equals the full forward's at that byte."""
    model = tiny_hnet(stages, routing)
    prompts = rows()
    engine = IncrementalHNet.for_engine(model, None, None, len(prompts), LENGTH)
    for b, row in enumerate(prompts):
        got = engine.prefill(b, torch.tensor(row))
        torch.testing.assert_close(got, full_logits(model, row), **TOL)
    gen = torch.Generator().manual_seed(7)
    eos_at = {2: 2, 3: 0, 7: 1, 9: 1}  # step: row (row 1 is frozen at step 7)
    grown = [list(row) for row in prompts]
    for step in range(LENGTH - len(prompts[-1])):
        tokens = torch.randint(4, 260, (len(grown),), generator=gen).tolist()
        if step in eos_at:
            tokens[eos_at[step]] = EOS_ID  # a document ends (a frozen row ignores its token)
        active = [len(row) < LENGTH and not (b == 1 and 4 <= step < 8)
                  for b, row in enumerate(grown)]  # fmt: skip
        logits = engine.step(tokens, active)
        for b, on in enumerate(active):
            if on:
                grown[b].append(tokens[b])
                torch.testing.assert_close(logits[b], full_logits(model, grown[b])[-1], **TOL)
    if routing == "perturbed":  # chunks of varying length at every stage
        fractions = boundary_fractions(model, grown[-1])
        assert all(0.2 < f < 0.8 for f in fractions), fractions


@pytest.mark.parametrize("stages", STAGES.values(), ids=STAGES.keys())
def test_greedy_generation_with_cache_equals_recompute(stages) -> None:
    gen = Generator(tiny_hnet(stages, "perturbed", seed=3))
    args = dict(max_new_bytes=20, stop_at_eos=False, temperature=0.0)
    cached = gen.generate_tokens(rows(seed=1), GenerationArgs(**args))
    oracle = gen.generate_tokens(rows(seed=1), GenerationArgs(**args, use_cache=False))
    assert [r.tokens for r in cached] == [r.tokens for r in oracle]
    assert all(len(r.tokens) == 20 for r in cached)
    assert len({tuple(r.tokens) for r in cached}) > 1  # rows continue differently


def test_bf16_kernel_ema_close_to_the_full_forward() -> None:
    """kernel_dtype=bf16 (the official EMA rounding): one EMA step at a time rounds as the scan
    does, up to the order of the fp32 additions."""
    model = tiny_hnet(TWO_STAGES, "perturbed", kernel_dtype="bf16")
    row = rows()[-1]
    engine = IncrementalHNet(model, 1, LENGTH)
    torch.testing.assert_close(
        engine.prefill(0, torch.tensor(row)), full_logits(model, row), atol=2e-3, rtol=2e-3
    )


def test_capacity_beyond_max_seqlen_is_refused() -> None:
    with pytest.raises(ValueError, match="max_seqlen=64"):
        IncrementalHNet(tiny_hnet(ONE_STAGE, "identity"), 1, 65)


def test_spec_names_the_engine() -> None:
    assert get_arch("hnet").generation_engine() is IncrementalHNet


# ---- a trained checkpoint through the CLI ----


@pytest.fixture(scope="module")
def tiny_hnet_run(tmp_path_factory, corpus_root) -> Path:
    """configs/hnet_debug.yaml shrunk (2 stages, width 32/48/64), trained 2 steps."""

    def build(dump: Path) -> None:
        config = yaml.safe_load((REPO / "configs" / "hnet_debug.yaml").read_text())
        config["model"].update(
            stages=[{**ONE_STAGE[0], "n_layers_encoder": 1, "n_layers_decoder": 1},
                    TWO_STAGES[1]],
            dim=64, n_layers=1, n_heads=2, max_seqlen=64, multiple_of=16,
        )  # fmt: skip
        path = dump.parent / "hnet_tiny.yaml"
        path.write_text(yaml.safe_dump(config))
        extra = ["data.seq_len=64", "data.batch_size=2", "data.load_async=false"]
        train_tiny(str(path), dump, corpus_root, 2, extra)

    return built_once(tmp_path_factory, "tiny_hnet", build)


@pytest.mark.slow
def test_cli_generates_from_a_trained_hnet_checkpoint(tiny_hnet_run, tmp_path) -> None:
    ckpt = tiny_hnet_run / "checkpoints" / "0000000002"
    prompts = ["def f(x):\n    return", "import os"]
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps({"prompt": p}) for p in prompts))
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    argv = [f"ckpt={ckpt}", f"prompts_file={tmp_path / 'in.jsonl'}",
            f"output={tmp_path / 'out.jsonl'}", "max_new_bytes=16", "stop_at_eos=false"]  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "bytelatent.generate", *argv], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=hang_limit(300))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [o["prompt"] for o in out] == prompts
    assert all(o["n_bytes"] == 16 and o["finish_reason"] == "length" for o in out), out
    oracle = load_generator(str(ckpt)).generate(
        prompts, GenerationArgs(max_new_bytes=16, stop_at_eos=False, use_cache=False)
    )
    assert [o["continuation"] for o in out] == [r.text for r in oracle]
