"""Self-speculative BLT decoding: the rollback primitives equal a prefill from scratch, greedy
output is the plain cached output byte for byte with fewer global steps, and sampled output
follows the model's distribution (exact, computed from the model) rather than the drafts'."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from bytelatent.archs.blt.generation import IncrementalBLT
from bytelatent.data.patcher import PatcherArgs
from bytelatent.errors import ConfigError
from bytelatent.eval.generation import GenerationArgs, Generator, encode_prompt
from bytelatent.eval.generation.engines import CachedEngine
from bytelatent.eval.generation.speculative import SpeculativeEngine, filtered_probs
from bytelatent.tokenizers.constants import EOS_ID
from tests.generation.conftest import tiny_blt, tiny_lm

PROMPTS = ["Hello, world", "def f(x):\n    return", "é", "The quick brown fox jumps over"]
TEXT = "Hello, world. The quick brown fox jumps over the lazy dog"

PATCHERS = {
    "space": (dict(patching_mode="space", max_patch_length=5), False),
    "entropy": (dict(patching_mode="entropy", threshold=0.3), True),
    "byte": (dict(patching_mode="byte"), False),
}


def _generator(patcher: str, variant: str = "released_flags") -> Generator:
    settings, needs_entropy = PATCHERS[patcher]
    # entropy model window 32 < the rows: its cache restarts, and truncation crosses restarts
    entropy_model = tiny_lm(max_seqlen=32, window=None, seed=3) if needs_entropy else None
    return Generator(tiny_blt(variant), PatcherArgs(**settings), entropy_model)


def _engine(gen: Generator, capacity: int = 80) -> IncrementalBLT:
    return IncrementalBLT.for_engine(gen.model, gen.patcher_args, gen.entropy_model, 1, capacity)


@pytest.mark.parametrize(
    "variant,patcher",
    [
        ("released_flags", "entropy"),
        ("released_flags", "space"),
        ("all_layers_windows_norope", "entropy"),
        ("pooling_avg_max", "byte"),
        ("concat", "space"),
    ],
)
def test_truncate_and_extend_equal_a_prefill_from_scratch(variant: str, patcher: str) -> None:
    gen = _generator(patcher, variant)
    tokens = torch.tensor(encode_prompt(TEXT))
    n = tokens.numel()

    def reference(length: int) -> tuple[torch.Tensor, list[int], int]:
        fresh = _engine(gen)
        logits = fresh.prefill(0, tokens[:length])
        return logits, fresh.starts[0], fresh.closed[0]

    inc = _engine(gen)
    inc.prefill(0, tokens[:5])
    for t in tokens[5:12].tolist():  # a draft: no patch closes, no global step
        inc.step([t], [True], close_patches=False)
    inc.truncate(0, 11)  # into the draft: its bytes read stale patches, not extendable
    with pytest.raises(ValueError, match="draft"):
        inc.extend(0, tokens[11:12])
    # past the entropy model's window (32), back before it (re-fed), onto it, and onward
    for keep, grow in [(5, 40), (29, 35), (32, 44), (44, n)]:
        inc.truncate(0, keep)
        logits = inc.extend(0, tokens[keep:grow])
        for i in (0, grow - keep - 1):  # the logits after the first and the last new byte
            expected = reference(keep + i + 1)[0]
            torch.testing.assert_close(logits[i], expected, atol=1e-4, rtol=1e-4)
        _, starts, closed = reference(grow)
        assert inc.starts[0] == starts and inc.closed[0] == closed
    assert inc.global_steps > 4
    with pytest.raises(ValueError, match="truncate"):
        inc.truncate(0, n + 1)


def _plain_and_speculative(gen: Generator, k: int, **kw):
    args = GenerationArgs(**{"stop_at_eos": False, **kw})
    plain = gen.generate(PROMPTS, args)
    fast = gen.generate(PROMPTS, args.model_copy(update={"speculative_k": k}))
    return plain, fast


def _assert_same(a_results, b_results) -> None:
    for a, b in zip(a_results, b_results, strict=True):
        assert (a.tokens, a.finish_reason, a.patch_lengths) == (
            b.tokens,
            b.finish_reason,
            b.patch_lengths,
        )


@pytest.mark.parametrize("patcher", ["entropy", "space", "byte"])
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_greedy_speculative_equals_plain_cached(patcher: str, k: int) -> None:
    gen = _generator(patcher)
    plain, fast = _plain_and_speculative(gen, k, max_new_bytes=40)
    _assert_same(plain, fast)
    stats = gen.speculative_stats
    assert stats.new_bytes == sum(len(r.tokens) for r in fast) == 40 * len(PROMPTS)
    assert 0 < stats.accepted <= stats.drafted
    assert len({tuple(r.tokens) for r in fast}) == len(PROMPTS)  # not a constant output


def test_greedy_speculative_honors_stops_and_the_context_limit() -> None:
    gen = _generator("space")
    # the model's 128 tokens end the long prompts first
    plain, fast = _plain_and_speculative(gen, 4, max_new_bytes=110)
    _assert_same(plain, fast)
    assert {r.finish_reason for r in fast} == {"context_limit", "length"}
    seventh = plain[0].tokens[6]
    # a stop string from inside the first continuation (an ASCII byte) ends it there, in both
    stop = chr(next(b for b in plain[0].data[8:] if b < 128))
    plain, fast = _plain_and_speculative(gen, 8, max_new_bytes=40, stop=[stop])
    _assert_same(plain, fast)
    assert fast[0].finish_reason == "stop" and [r.data for r in fast] == [r.data for r in plain]
    # EOS: give EOS the output row of the first row's 7th byte (a bit larger): it ends there
    output = gen.model.local_decoder.output.weight
    with torch.no_grad():
        output[EOS_ID] = output[seventh] * 1.01
    plain, fast = _plain_and_speculative(gen, 4, max_new_bytes=40, stop_at_eos=True)
    _assert_same(plain, fast)
    assert fast[0].finish_reason == "eos" and len(fast[0].tokens) == 6
    for k in (0, 2):  # plain and speculative: no bytes, the prompt's patches
        (result, *_) = gen.generate(PROMPTS, GenerationArgs(max_new_bytes=0, speculative_k=k))
        assert result.tokens == [] and result.finish_reason == "length"
        assert sum(result.patch_lengths) == len(result.prompt_tokens)


def _plain_global_steps(gen: Generator, row: list[int], tokens: list[int]) -> int:
    """Global transformer calls of plain cached decoding of ``tokens`` after ``row``."""
    engine = CachedEngine(gen.model, gen.patcher_args, gen.entropy_model, len(row) + len(tokens))
    engine.start([row])
    before = engine.impl.global_steps
    for token in tokens[:-1]:  # the last byte is chosen, never fed
        engine.advance([token], [True])
    return engine.impl.global_steps - before


@pytest.mark.parametrize("patcher", ["byte", "entropy", "space"])
def test_fewer_global_steps_per_byte_than_plain(patcher: str) -> None:
    """A round closes all its rows' patches in one global call; but the patches of a rejected
    tail are closed again next round, so the saving needs drafts longer than the patches (byte
    patching: every k; longer patches: k = 8)."""
    gen = _generator(patcher)
    rows = gen.encode(PROMPTS)
    results = gen.generate(PROMPTS, GenerationArgs(max_new_bytes=40))
    plain = sum(_plain_global_steps(gen, row, r.tokens) for row, r in zip(rows, results))
    per_k = {}
    for k in (2, 8):
        fast = gen.generate(PROMPTS, GenerationArgs(max_new_bytes=40, speculative_k=k))
        _assert_same(results, fast)
        per_k[k] = gen.speculative_stats.global_steps
    assert per_k[8] < plain
    # one prompt per batch: every row's checks are its own global calls (still fewer than
    # plain); a batch checks all its open rows in one global call per round
    gen.generate(PROMPTS, GenerationArgs(max_new_bytes=40, speculative_k=8, batch_size=1))
    assert per_k[8] < gen.speculative_stats.global_steps < plain
    assert gen.speculative_stats.new_bytes == sum(len(r.tokens) for r in results)
    if patcher == "byte":
        assert plain == 4 * 39  # one per fed byte
        assert per_k[8] < per_k[2] < plain


def _exact_distributions(gen: Generator, prompt: list[int], args: GenerationArgs):
    """P(first three bytes) of the model (filtered as sampling filters them) and of its drafts
    taken without checks (the first byte is exact, the next two from draft steps)."""

    def probs(prefix: list[int], drafted: list[int]) -> torch.Tensor:
        engine = _engine(gen, 32)
        logits = engine.prefill(0, torch.tensor(prefix))
        for t in drafted:
            logits = engine.step([t], [True], close_patches=False)[0]
        return filtered_probs(logits, args)

    def support(p: torch.Tensor) -> list[int]:
        return torch.nonzero(p).flatten().tolist()

    exact: dict[tuple, float] = {}
    drafts: dict[tuple, float] = {}
    first = probs(prompt, [])
    for b1 in support(first):
        p2, q2 = probs(prompt + [b1], []), probs(prompt, [b1])
        for b2 in sorted(set(support(p2)) | set(support(q2))):
            p3, q3 = probs(prompt + [b1, b2], []), probs(prompt, [b1, b2])
            for b3 in range(p3.numel()):
                key = (b1, b2, b3)
                exact[key] = float(first[b1] * p2[b2] * p3[b3])
                drafts[key] = float(first[b1] * q2[b2] * q3[b3])
    return exact, drafts


def _tv(a: dict, b: dict) -> float:
    return 0.5 * sum(abs(a.get(x, 0.0) - b.get(x, 0.0)) for x in set(a) | set(b))


def test_sampling_with_top_k_1_is_greedy_and_seeds_fix_the_draws() -> None:
    # top_k=1: p and q are one-hot, so every differing draft is rejected and the residual
    # max(0, p - q) is p's argmax: the rejection path must give the greedy bytes exactly
    gen = _generator("byte")
    greedy = gen.generate(PROMPTS, GenerationArgs(max_new_bytes=30, stop_at_eos=False))
    kw = dict(max_new_bytes=30, stop_at_eos=False, speculative_k=4, temperature=1.0)
    one = gen.generate(PROMPTS, GenerationArgs(**kw, top_k=1))
    _assert_same(greedy, one)
    assert gen.speculative_stats.accepted < gen.speculative_stats.drafted  # rejections ran
    sampled = gen.generate(PROMPTS, GenerationArgs(**kw, top_p=0.9, seed=3))
    _assert_same(sampled, gen.generate(PROMPTS, GenerationArgs(**kw, top_p=0.9, seed=3)))
    other = gen.generate(PROMPTS, GenerationArgs(**kw, top_p=0.9, seed=4))
    assert [r.tokens for r in other] != [r.tokens for r in sampled]


@pytest.mark.slow  # ~15-20 s: 600 sampled rows
def test_sampled_output_follows_the_model_not_the_drafts() -> None:
    # byte patching: every drafted byte reads a stale global state, so drafts differ from p
    gen = _generator("byte")
    prompt = gen.encode(["Hello"])[0]
    args = GenerationArgs(max_new_bytes=4, temperature=1.0, top_k=3, stop_at_eos=False)
    exact, drafts = _exact_distributions(gen, prompt, args)
    assert sum(exact.values()) == pytest.approx(1.0, abs=1e-5)
    samples = 600
    engine = SpeculativeEngine(gen, 2)  # the first byte, then two drafts per round
    generators = [torch.Generator().manual_seed(seed) for seed in range(samples)]
    results = engine.generate_tokens([prompt] * samples, args, generators)
    empirical: dict[tuple, float] = {}
    for result in results:
        key = tuple(result.tokens[:3])
        empirical[key] = empirical.get(key, 0.0) + 1 / samples
    support = sum(1 for p in exact.values() if p > 0)
    bound = 0.5 * math.sqrt(support / samples)  # >= the expected TV of `samples` exact draws
    assert _tv(exact, empirical) < bound
    assert _tv(drafts, empirical) > 3 * bound  # the test tells the two apart
    assert 0.2 < engine.stats.acceptance_rate < 0.95  # rejections happened, and acceptances


def test_speculative_options_are_checked() -> None:
    from tests.generation.test_hnet_generation import ONE_STAGE, tiny_hnet

    # a byte LM and an H-Net (chunked by its own router, no patcher) have no patches to draft past
    for model in (tiny_lm(), tiny_hnet(ONE_STAGE, "identity")):
        gen = Generator(model)
        with pytest.raises(ConfigError, match="speculative_k=2: .*patched architecture"):
            gen.generate(["ab"], GenerationArgs(max_new_bytes=3, speculative_k=2))
    with pytest.raises(ValidationError, match="use_cache"):
        GenerationArgs(speculative_k=2, use_cache=False)
    with pytest.raises(ValidationError):
        GenerationArgs(speculative_k=-1)


@pytest.mark.conformance("blt/params.json")
def test_released_layout_greedy_speculative_equals_plain() -> None:
    from bytelatent.eval.generation import load_generator
    from tests.paths import CONFORMANCE

    gen = load_generator(str(CONFORMANCE / "blt"))  # entropy patching with its entropy model
    args = GenerationArgs(max_new_bytes=32, stop_at_eos=False)
    plain = gen.generate(PROMPTS, args)
    fast = gen.generate(PROMPTS, args.model_copy(update={"speculative_k": 4}))
    _assert_same(plain, fast)
    assert gen.speculative_stats.drafted > gen.speculative_stats.accepted > 0


@pytest.mark.conformance("blt/params.json")
def test_cli_speculative_k(capsys) -> None:
    from bytelatent.generate import main
    from tests.paths import CONFORMANCE

    argv = [f"ckpt={CONFORMANCE / 'blt'}", "prompt=Hello, world", "max_new_bytes=12"]
    assert main(argv) == 0
    plain = capsys.readouterr().out
    assert main([*argv, "speculative_k=4"]) == 0
    assert capsys.readouterr().out == plain
    # a byte LM (the entropy model) has no patches to draft past: one line, exit 2
    lm = [f"ckpt={CONFORMANCE / 'entropy_model'}", "prompt=Hi", "speculative_k=2"]
    assert main(lm) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("config error: speculative_k=2: "), err
    assert main([*argv, "speculative_k=2", "use_cache=false"]) == 2
    assert "use_cache" in capsys.readouterr().err
