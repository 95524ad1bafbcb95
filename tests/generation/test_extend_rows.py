"""``IncrementalBLT.extend_rows``: several rows extended by different numbers of bytes in one
call (one encoder, one global and one decoder forward) equal the rows extended one at a time;
batched prefill and speculative verification use it, with one global call per round."""

from __future__ import annotations

import pytest
import torch

from bytelatent.archs.blt.generation import IncrementalBLT
from bytelatent.archs.lm.generation import IncrementalLM
from bytelatent.data.patcher import PatcherArgs
from bytelatent.eval.generation import GenerationArgs, Generator, encode_prompt
from bytelatent.eval.generation.engines import CachedEngine
from bytelatent.tokenizers.constants import EOS_ID
from tests.generation.conftest import BLT_VARIANTS, tiny_blt, tiny_lm
from tests.generation.test_generation_cache_api import assert_close

TEXT = (
    "The quick brown fox, jumps over the lazy dog; def f(x): return x * 2 and more text. "
    "Pack my box with five dozen liquor jugs!"
)
PATCHERS = {
    "space": dict(patching_mode="space", max_patch_length=5),
    "entropy": dict(patching_mode="entropy", threshold=0.3),
    "byte": dict(patching_mode="byte"),
}
CASES = [(variant, "space") for variant in BLT_VARIANTS] + [
    ("released_flags", "entropy"),
    ("all_layers_windows_norope", "entropy"),
    ("pooling_avg_max", "byte"),
]


def _row(seed: int, n: int) -> torch.Tensor:
    data = [b + 4 for b in TEXT.encode()]
    shift = 7 * seed
    return torch.tensor([1] + (data[shift:] + data[:shift])[: n - 1])


def _engines(variant: str, patcher: str, batch: int, capacity: int = 120):
    model = tiny_blt(variant)
    args = PatcherArgs(**PATCHERS[patcher])
    # entropy model window 32 < the rows: its cache restarts inside some rows' new bytes
    entropy = tiny_lm(max_seqlen=32, window=None, seed=3) if patcher == "entropy" else None

    def engine():
        return IncrementalBLT.for_engine(model, args, entropy, batch, capacity)

    return engine


def _assert_rows_equal(a: IncrementalBLT, b: IncrementalBLT, rows) -> None:
    for row in rows:
        assert a.host_tokens[row] == b.host_tokens[row]
        assert a.starts[row] == b.starts[row] and a.closed[row] == b.closed[row]


@pytest.mark.parametrize("variant,patcher", CASES)
def test_extend_rows_equals_extending_each_row_alone(variant: str, patcher: str) -> None:
    engine = _engines(variant, patcher, batch=5)
    batched, alone = engine(), engine()
    rows = [_row(b, 100) for b in range(5)]
    rows[2][60] = EOS_ID  # an EOS inside row 2's second extension
    rows[3][10] = EOS_ID  # and inside row 3's prompt
    # prompts of 1..40 bytes, all at once (the batched prefill) and one by one
    prompt = [1, 40, 13, 25, 7]
    got = batched.prefill_rows([r[:n] for r, n in zip(rows, prompt)])
    for b in range(5):
        assert_close(got[b], alone.prefill(b, rows[b][: prompt[b]]))
    _assert_rows_equal(batched, alone, range(5))
    assert batched.global_steps == 1 and alone.global_steps == 5
    # very different lengths; rows 1 and 3 given out of order, row 4 not given (in the span)
    for grow in ([30, 3, 45, 0], [1, 50, 8, 2]):
        given = [0, 3, 2, 1]
        ends = {b: batched.length[b] + g for b, g in zip(given, grow)}
        tokens = [rows[b][batched.length[b] : ends[b]] for b in given]
        steps = batched.global_steps
        logits = batched.extend_rows(given, tokens)
        assert batched.global_steps == steps + 1  # one global call for every row's patches
        for b, t, out in zip(given, tokens, logits):
            assert out.shape == (t.numel(), got.shape[-1])
            if t.numel():
                assert_close(out, alone.extend(b, t))
        _assert_rows_equal(batched, alone, range(5))
    # a row given nothing next to one given two bytes (the entropy model runs that one alone)
    n = batched.length[1]
    empty, two = batched.extend_rows([4, 1], [rows[4][:0], rows[1][n : n + 2]])
    assert empty.shape == (0, two.shape[-1])
    assert_close(two, alone.extend(1, rows[1][n : n + 2]))
    # the caches hold the same rows: a step of every row after them agrees
    nxt = [int(rows[b][batched.length[b]]) for b in range(5)]
    assert_close(batched.step(nxt, [True] * 5), alone.step(nxt, [True] * 5))
    _assert_rows_equal(batched, alone, range(5))


def test_extend_rows_after_truncating_into_the_entropy_window() -> None:
    """Rows rolled back across an entropy-model restart (re-fed alone) next to rows that are not."""
    engine = _engines("released_flags", "entropy", batch=3)
    batched, alone = engine(), engine()
    rows = [_row(b, 110) for b in range(3)]
    for inc in (batched, alone):
        for b in range(3):
            inc.prefill(b, rows[b][:70])
        inc.truncate(0, 30)  # before the restart at 32 and 64
        inc.truncate(1, 64)  # on one
        inc.truncate(2, 50)
    cuts = [(30, 70), (64, 66), (50, 96)]  # row 0 crosses 32 and 64, row 2 crosses 64
    tokens = [rows[b][lo:hi] for b, (lo, hi) in enumerate(cuts)]
    for b, out in enumerate(batched.extend_rows([0, 1, 2], tokens)):
        assert_close(out, alone.extend(b, tokens[b]))
    _assert_rows_equal(batched, alone, range(3))
    assert batched.entropy_model.tokens == alone.entropy_model.tokens


def test_lm_extend_rows_runs_rows_without_restarts_in_one_forward() -> None:
    model = tiny_lm(max_seqlen=16, window=None)
    calls = []
    handle = model.register_forward_hook(lambda m, i, o: calls.append(tuple(i[0].shape)))
    data = torch.randint(3, 256, (4, 40), generator=torch.Generator().manual_seed(2))
    data[1, 9] = EOS_ID
    lms = [IncrementalLM(model, 4, 64, restart_every=16) for _ in range(2)]
    for lm in lms:
        for b, n in enumerate([3, 5, 16, 10]):
            lm.prefill(b, data[b, :n])
    calls.clear()
    cuts = [(3, 12), (5, 15), (16, 33), (10, 16)]  # row 2 restarts at 16 and 32
    tokens = [data[b, lo:hi] for b, (lo, hi) in enumerate(cuts)]
    got = lms[0].extend_rows([0, 1, 2, 3], tokens)
    # row 2 alone, window by window; rows 0, 1, 3 together (row 2 pads in their span)
    assert calls == [(1, 16), (1, 1), (4, 10)]
    for b in range(4):
        assert_close(got[b], lms[1].extend(b, tokens[b]))
    # a row given no tokens, next to one other row: nothing to run for it
    empty, more = lms[0].extend_rows([0, 3], [data[0, :0], data[3, 16:19]])
    assert empty.shape == (0, model.args.vocab_size)
    assert_close(more, lms[1].extend(3, data[3, 16:19]))
    assert lms[0].tokens == lms[1].tokens
    handle.remove()


@pytest.mark.parametrize("patcher", ["space", "entropy", "byte"])
def test_speculative_checks_a_batch_with_one_global_call_per_round(patcher: str) -> None:
    entropy = tiny_lm(max_seqlen=32, window=None, seed=3) if patcher == "entropy" else None
    gen = Generator(tiny_blt(), PatcherArgs(**PATCHERS[patcher]), entropy)
    prompts = ["Hello, world", "def f(x):\n    return", "é", "The quick brown fox jumps over"]
    args = GenerationArgs(max_new_bytes=30, stop_at_eos=False)
    plain = gen.generate(prompts, args)
    calls, rounds = [], []
    glob = gen.model.global_transformer
    handle = glob.register_forward_hook(lambda m, i, o: calls.append(i[0].shape[0]))
    extend_rows = IncrementalBLT.extend_rows

    def spy(self, rows, tokens):
        before = len(calls)
        out = extend_rows(self, rows, tokens)
        rounds.append((len(list(rows)), len(calls) - before))
        return out

    IncrementalBLT.extend_rows = spy
    try:
        fast = gen.generate(prompts, args.model_copy(update={"speculative_k": 4}))
    finally:
        IncrementalBLT.extend_rows = extend_rows
        handle.remove()
    assert [(r.tokens, r.patch_lengths) for r in fast] == [
        (r.tokens, r.patch_lengths) for r in plain
    ]
    assert rounds[0] == (4, 1)  # the batched prefill: four prompts, one global call
    checks = rounds[1:]
    assert checks and all(n_calls <= 1 for _, n_calls in checks)
    assert sum(1 for n_rows, n_calls in checks if n_rows == 4 and n_calls == 1) > 2
    # every global call after the prompts is one of the rounds' checks
    assert gen.speculative_stats.global_steps == sum(n for _, n in checks) == len(calls) - 1


def test_cached_engine_prefills_blt_rows_in_one_call() -> None:
    gen = Generator(tiny_blt(), PatcherArgs(**PATCHERS["space"]))
    rows = [encode_prompt(p) for p in ["x", TEXT[:80], "Hello, world"]]
    engine = CachedEngine(gen.model, gen.patcher_args, None, 100)
    logits = engine.start(rows)
    assert engine.impl.global_steps == 1
    for b, row in enumerate(rows):
        single = CachedEngine(gen.model, gen.patcher_args, None, 100)
        assert_close(logits[b], single.start([row])[0])
        assert engine.impl.starts[b] == single.impl.starts[0]
