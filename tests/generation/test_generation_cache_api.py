"""The cache API generation and speculative decoding build on: cached logits equal the training
forward's, ``truncate`` + ``extend`` equal a fresh prefill, draft steps read the last closed patch,
and no generation module reads a layer's weights or buffers."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from bytelatent.archs.blt.generation import IncrementalBLT
from bytelatent.archs.lm.generation import IncrementalLM
from bytelatent.data.patcher import Patcher, PatcherArgs
from bytelatent.eval.generation.patching import OnlinePatcher
from tests.generation.conftest import BLT_VARIANTS, tiny_blt, tiny_lm

GENERATION = Path(__file__).parents[2] / "bytelatent" / "eval" / "generation"
# a layer's weights, RoPE tables, projections, norms or embedding tables
FORBIDDEN = re.compile(r"\.weight|freqs_cis|\.w[qkvo]\b|_norm|tok_embeddings|pos_embeddings")

# fp32, logits sharpened 20x (|logit| up to ~90): cache slices and the gathered slot attention sum
# in another order than the whole-row kernels. Measured max |diff| <= 7.5e-7 * max |logit| (a few
# ulps at that scale); the bound leaves a factor ~3.
REL = 2e-6


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """|got - want| <= REL * max|want| everywhere (rounding at the logits' scale)."""
    assert got.shape == want.shape
    worst = (got - want).abs().max().item()
    bound = REL * want.abs().max().item()
    assert worst <= bound, f"max |diff| {worst:.3g} > {bound:.3g}"


def test_generation_reads_no_weights_or_buffers() -> None:
    sources = sorted(GENERATION.glob("*.py"))
    assert len(sources) >= 5
    hits = [
        f"{path.name}:{number}: {line.strip()}"
        for path in sources
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if FORBIDDEN.search(line)
    ]
    assert hits == []
    assert FORBIDDEN.search("h = cross.wq(cross.cross_attn_norm_q(h))")  # the scan can fail


def _tokens(n: int, seed: int = 0) -> torch.Tensor:
    text = "The quick brown fox, jumps over the lazy dog; def f(x): return x * 2 and more text"
    tokens = torch.tensor([1] + [b + 4 for b in text.encode()][: n - 1])
    return tokens


def _engine(variant: str, mode: str = "space", batch: int = 1, capacity: int = 96):
    model = tiny_blt(variant)
    args = PatcherArgs(patching_mode=mode, max_patch_length=5)
    return model, args, IncrementalBLT(model, OnlinePatcher(args), None, batch, capacity)


def _full_logits(model, args: PatcherArgs, tokens: torch.Tensor) -> torch.Tensor:
    """Logits [N, V] of the training forward, patched as the reference generate_blt does."""
    lengths, _ = Patcher(args).patch(tokens[None], include_next_token=True)
    with torch.no_grad():
        return model(tokens[None], lengths)[0]


@pytest.mark.parametrize("variant", list(BLT_VARIANTS))
def test_blt_prefill_and_steps_equal_the_training_forward(variant: str) -> None:
    model, args, inc = _engine(variant, batch=2)
    tokens = torch.stack([_tokens(40), _tokens(40).flip(0)])
    tokens[1, 0] = 1
    prompt = 12
    for row in range(2):
        got = inc.prefill(row, tokens[row, :prompt])
        full = _full_logits(model, args, tokens[row, :prompt])
        assert_close(got, full[-1])
    for t in range(prompt, 40):
        got = inc.step(tokens[:, t].tolist(), [True, True])
        for row in range(2):
            full = _full_logits(model, args, tokens[row, : t + 1])
            assert_close(got[row], full[-1])
    assert inc.global_steps > 2  # patches closed while stepping


def test_blt_extend_returns_every_position_and_counts_global_steps() -> None:
    model, args, inc = _engine("released_flags")
    tokens = _tokens(36)
    inc.prefill(0, tokens[:10])
    assert inc.global_steps == 1
    got = inc.extend(0, tokens[10:36])
    assert got.shape == (26, model.args.vocab_size + model.args.pm_size)
    assert inc.global_steps == 2  # one global call for all the patches the bytes closed
    full = _full_logits(model, args, tokens)
    # byte i's logits only read patches ending at or before i+1: a prefix of the row's patching
    for i in range(10, 36):
        expected = _full_logits(model, args, tokens[: i + 1])[-1]
        assert_close(got[i - 10], expected)
    assert inc.patch_lengths(0, 36) == [
        int(x) for x in Patcher(args).patch(tokens[None], include_next_token=False)[0][0]
    ]
    assert full.shape[0] == 36


@pytest.mark.parametrize("variant", ["released_flags", "all_layers_windows_norope", "concat"])
def test_blt_truncate_then_extend_equals_a_fresh_prefill(variant: str) -> None:
    model, args, inc = _engine(variant)
    tokens = _tokens(40)
    other = tokens.clone()
    other[20:] = other[20:].flip(0)
    inc.prefill(0, other[:15])
    for t in range(15, 34):  # steps on a different continuation, then roll back
        inc.step([int(other[t])], [True])
    inc.truncate(0, 20)
    assert inc.length[0] == 20 and inc.host_tokens[0] == other[:20].tolist()
    got = inc.extend(0, tokens[20:40])
    fresh = _engine(variant)[2]
    expected = fresh.prefill(0, tokens[:20])
    assert_close(got[-1], fresh.extend(0, tokens[20:40])[-1])
    assert_close(got[-1], _full_logits(model, args, tokens)[-1])
    assert inc.starts[0] == fresh.starts[0] and inc.closed[0] == fresh.closed[0]
    assert expected.shape[-1] == got.shape[-1]


def test_blt_entropy_patching_truncate_rolls_back_the_entropy_model() -> None:
    """Entropy model window 32 < row: truncating past a restart rebuilds its window."""
    entropy_model = tiny_lm(max_seqlen=32, window=None, seed=3)
    model = tiny_blt("released_flags")
    args = PatcherArgs(patching_mode="entropy", threshold=0.3)

    def engine():
        return IncrementalBLT.for_engine(model, args, entropy_model, 1, 96)

    tokens, other = _tokens(70), _tokens(70).flip(0)
    inc = engine()
    inc.prefill(0, tokens[:30])
    for t in range(30, 60):
        inc.step([int(other[t])], [True])
    inc.truncate(0, 30)
    got = inc.extend(0, tokens[30:70])
    fresh = engine()
    fresh.prefill(0, tokens[:30])
    assert_close(got, fresh.extend(0, tokens[30:70]))
    assert inc.starts[0] == fresh.starts[0]
    offline = Patcher(args, entropy_model=entropy_model)
    lengths, _ = offline.patch(tokens[None], include_next_token=False)
    assert inc.patch_lengths(0, 70) == [int(x) for x in lengths[0]]


@pytest.mark.parametrize("variant", ["released_flags", "pooling_avg_max"])
def test_blt_draft_steps_read_the_last_closed_patch(variant: str) -> None:
    model, args, inc = _engine(variant, batch=2)
    tokens = torch.stack([_tokens(30), _tokens(30)])
    tokens[1, 5:] = tokens[1, 5:].flip(0)
    for row in range(2):
        inc.prefill(row, tokens[row, :18])
    steps, starts = inc.global_steps, [list(s) for s in inc.starts]
    for t in range(18, 26):
        got = inc.step(tokens[:, t].tolist(), [True, True], close_patches=False)
        for row in range(2):
            # the oracle: the row's committed patches, the open one running past the drafts
            bounds = starts[row] + [t + 2]
            lengths = torch.tensor(bounds).diff()[None]
            with torch.no_grad():
                full = model(tokens[row : row + 1, : t + 1], lengths)[0, -1]
            assert_close(got[row], full)
    assert inc.global_steps == steps and inc.starts == starts
    with pytest.raises(ValueError, match="draft"):
        inc.step(tokens[:, 26].tolist(), [True, True])
    with pytest.raises(ValueError, match="draft"):
        inc.extend(0, tokens[0, 26:28])
    inc.truncate(0, 18)
    inc.truncate(1, 18)
    got = inc.extend(0, tokens[0, 18:30])
    assert_close(got[-1], _full_logits(model, args, tokens[0])[-1])


def test_lm_truncate_and_extend_across_restarts() -> None:
    model = tiny_lm(max_seqlen=16, window=None)
    tokens = torch.randint(3, 256, (40,), generator=torch.Generator().manual_seed(2))
    lm = IncrementalLM(model, 1, 64, restart_every=16)
    lm.prefill(0, tokens[:10])
    for t in range(10, 37):
        lm.step([int(tokens[t])], [True])
    for n in (33, 20, 16, 5, 0):  # same window, an earlier window, a boundary, the start
        lm.truncate(0, n)
        got = lm.extend(0, tokens[n:40])
        fresh = IncrementalLM(model, 1, 64, restart_every=16)
        expected = fresh.prefill(0, tokens[:40])[n:]
        assert_close(got, expected)
    with pytest.raises(ValueError, match="truncate"):
        lm.truncate(0, 41)


def test_blt_bf16_cached_logits_within_bf16_rounding() -> None:
    """bf16 parameters and caches: cached logits within 3e-2 * max|logit| of the bf16 training
    forward (measured <= 1.2e-2 over the four variants; bf16 has 8 bits of mantissa)."""
    from bytelatent.eval.generation.generator import cast_parameters

    model, args, _ = _engine("released_flags")
    cast_parameters(model, torch.bfloat16)
    inc = IncrementalBLT(model, OnlinePatcher(args), None, 1, 96)
    tokens = _tokens(30)
    inc.prefill(0, tokens[:12])
    for t in range(12, 30):
        got = inc.step([int(tokens[t])], [True])[0]
        full = _full_logits(model, args, tokens[: t + 1])[-1]
        assert (got - full).abs().max() <= 3e-2 * full.abs().max()
