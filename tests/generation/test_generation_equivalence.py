"""Cached generation equals the recompute-everything oracle, byte for byte and patch for patch."""

from __future__ import annotations

import pytest
import torch

from bytelatent.data.patcher import Patcher, PatcherArgs
from bytelatent.eval.generation import GenerationArgs, Generator
from tests.generation.conftest import tiny_blt, tiny_lm

PROMPTS = ["Hello, world", "def f(x):\n    return", "é", "The quick brown fox jumps over"]


def _generate(gen: Generator, prompts, use_cache: bool, **kw):
    args = GenerationArgs(
        max_new_bytes=kw.pop("max_new_bytes", 30), use_cache=use_cache, stop_at_eos=False, **kw
    )
    return gen.generate(prompts, args)


def _assert_same(cached, oracle) -> None:
    for a, b in zip(cached, oracle, strict=True):
        assert a.tokens == b.tokens
        assert a.finish_reason == b.finish_reason
        assert a.patch_lengths == b.patch_lengths


def test_lm_cached_equals_recompute_and_batching() -> None:
    # max_seqlen 48 < prompt + 30 for long prompts: those rows stop at the model's maximum
    gen = Generator(tiny_lm(max_seqlen=48, window=8))
    cached = _generate(gen, PROMPTS, True)
    _assert_same(cached, _generate(gen, PROMPTS, False))
    # short prompts stop at max_new_bytes, long ones at the model's 48 tokens
    assert {r.finish_reason for r in cached} == {"length", "context_limit"}
    for r in cached:
        at_limit = len(r.prompt_tokens) + len(r.tokens) == 48 and len(r.tokens) < 30
        assert r.finish_reason == ("context_limit" if at_limit else "length")
    assert max(len(r.prompt_tokens) + len(r.tokens) for r in cached) == 48
    one_by_one = [_generate(gen, [p], True)[0] for p in PROMPTS]
    _assert_same(cached, one_by_one)
    assert len({tuple(r.tokens) for r in cached}) == len(PROMPTS)  # not a constant output


ENTROPY_PATCHERS = {
    "threshold": dict(threshold=0.3),
    "monotonicity": dict(threshold=0.2, monotonicity=True),
    "threshold_add": dict(threshold=0.1, threshold_add=0.05),
    "max_patch_length": dict(threshold=2.5, max_patch_length=3),
}


@pytest.mark.parametrize("rule", list(ENTROPY_PATCHERS))
def test_blt_entropy_patching(rule: str) -> None:
    # entropy model window 32 < sequence: its context restarts as calculate_entropies does
    entropy_model = tiny_lm(max_seqlen=32, window=None, seed=3)
    patcher_args = PatcherArgs(patching_mode="entropy", **ENTROPY_PATCHERS[rule])
    gen = Generator(tiny_blt("released_flags"), patcher_args, entropy_model)
    prompts = PROMPTS[:2] if rule != "threshold" else PROMPTS
    cached = _generate(gen, prompts, True)
    _assert_same(cached, _generate(gen, prompts, False))
    # the starts chosen online are the patcher's on the final sequence (its own entropies)
    patcher = Patcher(patcher_args, entropy_model=entropy_model)
    for result in cached:
        final = torch.tensor([result.prompt_tokens + result.tokens])
        lengths, _ = patcher.patch(final, include_next_token=False)
        assert result.patch_lengths == [int(x) for x in lengths[0]]
        assert len(result.patch_lengths) > 3  # several patches were closed while generating
    if rule == "threshold":
        _assert_same(cached, [_generate(gen, [p], True)[0] for p in prompts])


@pytest.mark.parametrize(
    "variant", ["released_flags", "all_layers_windows_norope", "pooling_avg_max", "concat"]
)
def test_blt_space_patching(variant: str) -> None:
    gen = Generator(tiny_blt(variant), PatcherArgs(patching_mode="space", max_patch_length=5))
    prompts = PROMPTS[:3]
    cached = _generate(gen, prompts, True, max_new_bytes=30)
    _assert_same(cached, _generate(gen, prompts, False, max_new_bytes=30))
    _assert_same(cached, [_generate(gen, [p], True, max_new_bytes=30)[0] for p in prompts])


def test_blt_sampling_cached_equals_recompute() -> None:
    gen = Generator(tiny_blt("released_flags"), PatcherArgs(patching_mode="byte"))
    kw = dict(temperature=0.8, top_k=20, top_p=0.9, seed=7, max_new_bytes=25)
    cached = _generate(gen, PROMPTS[:2], True, **kw)
    _assert_same(cached, _generate(gen, PROMPTS[:2], False, **kw))
    again = _generate(gen, PROMPTS[:2], True, **kw)
    _assert_same(cached, again)  # the seed fixes the draws
    other = _generate(gen, PROMPTS[:2], True, **{**kw, "seed": 8})
    assert [r.tokens for r in other] != [r.tokens for r in cached]


def test_last_position_hash_embeddings_match_the_model() -> None:
    model = tiny_blt("released_flags")
    tokens = torch.randint(0, 260, (3, 40))
    tokens[:, :2] = torch.tensor([1, 0])  # BOS, then a BOE id as a real token
    full = model.byte_embeddings(tokens)
    window = model.hash_window
    assert window == 4
    for t in range(tokens.shape[1]):
        ids = torch.arange(t - window + 1, t + 1)
        recent = torch.where(ids >= 0, tokens[:, ids.clamp(min=0)], 0)
        assert torch.equal(model.last_byte_embeddings(recent)[:, 0], full[:, t])


def test_context_limit_is_named_and_warned_once(caplog) -> None:
    gen = Generator(tiny_lm(max_seqlen=16, window=None))
    with caplog.at_level("WARNING", logger="bytelatent"):
        first = _generate(gen, ["0123456789"], True, max_new_bytes=20)[0]
        again = _generate(gen, ["0123456789"], True, max_new_bytes=20)[0]
    assert first.finish_reason == again.finish_reason == "context_limit"
    assert len(first.tokens) == 16 - 11  # BOS + 10 prompt bytes + 5 new = the model's 16
    warnings = [r.getMessage() for r in caplog.records if "context limit" in r.getMessage()]
    assert len(warnings) == 1 and "max_new_bytes=20" in warnings[0]
    assert _generate(gen, ["0123456789"], True, max_new_bytes=3)[0].finish_reason == "length"
