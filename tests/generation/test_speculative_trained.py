"""Self-speculative decoding on a trained BLT (200 steps on the stdlib corpus, the eval tests'
run: patches of a few bytes, not the one-patch output of a 20-step run): greedy output equals plain cached
decoding byte for byte, with fewer global-transformer calls per byte at k = 8."""

from __future__ import annotations

import pytest
import torch

from bytelatent.eval.generation import GenerationArgs, load_generator
from bytelatent.eval.generation.engines import CachedEngine

STEPS = 200  # tests/conftest.py: blt_200_run
# prompts that end inside code: a prompt ending in a newline makes this model emit spaces only
PROMPTS = ["class Foo:\n    def ", "    return self.", "if x is None:\n    raise Value"]


def plain_global_steps(gen, results) -> int:
    """Global calls of plain cached decoding after each prompt's prefill (one row at a time)."""
    total = 0
    for result in results:
        capacity = len(result.prompt_tokens) + len(result.tokens)
        engine = CachedEngine(gen.model, gen.patcher_args, gen.entropy_model, capacity)
        engine.start([result.prompt_tokens])
        before = engine.impl.global_steps
        for token in result.tokens[:-1]:
            engine.advance([token], [True])
        total += engine.impl.global_steps - before
    return total


@pytest.mark.slow
def test_trained_blt_speculative_greedy_is_plain_with_fewer_global_steps(blt_200_run) -> None:
    torch.set_num_threads(1)
    gen = load_generator(blt_200_run / "checkpoints" / f"{STEPS:010d}")
    args = GenerationArgs(max_new_bytes=128, stop_at_eos=False)
    plain = gen.generate(PROMPTS, args)
    new_bytes = sum(len(r.tokens) for r in plain)
    plain_per_byte = plain_global_steps(gen, plain) / new_bytes
    # trained patches: a global step every few bytes, not one patch for the whole output
    assert plain_per_byte > 1 / 16, plain_per_byte
    fast = gen.generate(PROMPTS, args.model_copy(update={"speculative_k": 8}))
    assert [r.tokens for r in fast] == [r.tokens for r in plain]
    assert [r.patch_lengths for r in fast] == [r.patch_lengths for r in plain]
    stats = gen.speculative_stats
    assert stats.new_bytes == new_bytes
    assert stats.global_steps_per_byte < plain_per_byte
    assert 0.0 < stats.acceptance_rate < 1.0
