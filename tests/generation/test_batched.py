"""Batched generation: a batch of N rows of very different lengths equals N single-row runs.

Token for token (greedy and seeded sampling), and logits within fp32 tolerance when the rows are
fed the same bytes; the lm-eval adapter's ``generate_until`` answers a batch as it answers each
request alone, in request order.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from bytelatent.archs.lm.generation import IncrementalLM
from bytelatent.data.patcher import PatcherArgs
from bytelatent.eval.generation import GenerationArgs, Generator, encode_prompt
from bytelatent.eval.generation.engines import CachedEngine, RecomputeEngine
from bytelatent.tokenizers.constants import EOS_ID
from tests.generation.conftest import tiny_blt, tiny_lm

LONG = "The quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs!!"
PROMPTS = ["x", LONG, "Hello, world", LONG[:40]]  # 1 to 86 bytes, longest not first


def _generator(kind: str) -> Generator:
    if kind == "lm_window":  # sliding window + documents: the masks the padded prefill needs
        return Generator(tiny_lm(max_seqlen=128, window=16))
    if kind == "lm_causal":
        return Generator(tiny_lm(max_seqlen=128, window=None, seed=2))
    if kind == "blt_space":
        return Generator(tiny_blt(), PatcherArgs(patching_mode="space", max_patch_length=4))
    entropy_model = tiny_lm(max_seqlen=32, window=None, seed=3)  # its context restarts at 32
    return Generator(tiny_blt(), PatcherArgs(patching_mode="entropy", threshold=0.3), entropy_model)


KINDS = ["lm_window", "lm_causal", "blt_space", "blt_entropy"]
SAMPLING = {
    "greedy": {},
    "sampling": dict(temperature=0.9, top_k=30, top_p=0.95, seed=11),
}


@pytest.mark.parametrize("mode", list(SAMPLING))
@pytest.mark.parametrize("kind", KINDS)
def test_batch_equals_rows_one_at_a_time(kind: str, mode: str) -> None:
    gen = _generator(kind)
    args = GenerationArgs(
        max_new_bytes=24, stop_at_eos=False, batch_size=len(PROMPTS), **SAMPLING[mode]
    )
    batched = gen.generate(PROMPTS, args)
    alone = [gen.generate([p], args)[0] for p in PROMPTS]
    for together, single in zip(batched, alone, strict=True):
        assert together.tokens == single.tokens
        assert together.finish_reason == single.finish_reason == "length"
        assert together.patch_lengths == single.patch_lengths
    assert len({tuple(r.tokens) for r in batched}) > 1  # the rows are not one constant output
    if kind.startswith("blt"):
        assert all(len(r.patch_lengths) > 3 for r in batched)


def test_rows_ending_at_different_steps() -> None:
    """Rows that stop early (a stop string, the model's maximum) freeze while the rest go on."""
    gen = Generator(tiny_lm(max_seqlen=100, window=16))
    free = gen.generate(PROMPTS, GenerationArgs(max_new_bytes=20, stop_at_eos=False))
    # an ASCII pair a row generates after a few bytes: that row (maybe others) stops early
    stop = next(
        r.data[i : i + 2].decode()
        for r in free
        for i in range(3, 15)
        if all(32 <= c < 127 for c in r.data[i : i + 2])
    )
    args = GenerationArgs(max_new_bytes=20, stop_at_eos=False, stop=[stop], batch_size=4)
    batched = gen.generate(PROMPTS, args)
    alone = [gen.generate([p], args)[0] for p in PROMPTS]
    assert [(r.tokens, r.finish_reason, r.text) for r in batched] == [
        (r.tokens, r.finish_reason, r.text) for r in alone
    ]
    reasons = {r.finish_reason for r in batched}
    assert "stop" in reasons and "context_limit" in reasons  # the 86-byte row hits 100 tokens


def _teacher_forced(engine, rows: list[list[int]], fed: list[list[int]]) -> torch.Tensor:
    """Logits [B, 1 + steps, V]: after each prompt, then after each fed token."""
    logits = [engine.start(rows)]
    for t in range(len(fed[0])):
        logits.append(engine.advance([f[t] for f in fed], [True] * len(rows)))
    return torch.stack(logits, 1)


@pytest.mark.parametrize("kind", KINDS)
def test_logits_of_a_batch_equal_single_rows(kind: str) -> None:
    gen = _generator(kind)
    rows = [encode_prompt(p) for p in PROMPTS]
    if kind.startswith("lm"):  # an EOS inside a prompt: documents under the padded prefill
        rows[1][-5] = rows[3][-9] = EOS_ID  # inside the 16-byte window of the last byte
    fed = [[4 + (37 * b + 11 * t) % 256 for t in range(12)] for b in range(len(rows))]
    capacity = max(len(r) for r in rows) + 13

    def cached():
        return CachedEngine(gen.model, gen.patcher_args, gen.entropy_model, capacity)

    with torch.no_grad():
        batched = _teacher_forced(cached(), rows, fed)
        for b, (row, tokens) in enumerate(zip(rows, fed)):
            single = _teacher_forced(cached(), [row], [tokens])[0]
            torch.testing.assert_close(batched[b], single, rtol=1e-5, atol=1e-4)
            # and the oracle, which runs the whole model on the row alone at every step
            oracle = RecomputeEngine(gen.model, gen.patcher_args, gen.entropy_model)
            torch.testing.assert_close(
                batched[b], _teacher_forced(oracle, [row], [tokens])[0], rtol=1e-5, atol=1e-4
            )


def test_byte_lm_prefills_a_batch_in_one_forward() -> None:
    model = tiny_lm(max_seqlen=128, window=16)
    calls = []
    handle = model.register_forward_hook(lambda m, i, o: calls.append(i[0].shape))
    rows = [torch.tensor(encode_prompt(p)) for p in PROMPTS]
    lm = IncrementalLM(model, len(rows), 100)
    logits = lm.prefill_rows(rows)
    handle.remove()
    assert calls == [torch.Size([len(rows), max(len(r) for r in rows)])]
    assert logits.shape == (len(rows), model.args.vocab_size)
    assert [len(t) for t in lm.tokens] == [len(r) for r in rows] == lm.stack.length
    assert lm.tokens == [r.tolist() for r in rows]


def test_a_batched_prefill_needs_empty_rows() -> None:
    lm = IncrementalLM(tiny_lm(max_seqlen=64), 2, 32)
    lm.prefill(0, torch.tensor(encode_prompt("ab")))
    with pytest.raises(ValueError, match="empty cache"):
        lm.stack.prefill_rows_caches(torch.zeros(2, 3, dtype=torch.bool), [3, 2])


@pytest.mark.parametrize("kind", ["lm_window", "blt_space"])
def test_harness_generate_until_batches_in_request_order(kind: str, monkeypatch) -> None:
    pytest.importorskip("lm_eval")
    from bytelatent.eval.harness import BytelatentLM

    gen = _generator(kind)
    greedy = {"until": ["\n\n"], "max_gen_toks": 12}
    sampled = {"until": ["zz"], "max_gen_toks": 9, "do_sample": True, "temperature": 0.8}
    requests = [
        SimpleNamespace(args=(context, kwargs))
        for context, kwargs in [
            ("ab", greedy),
            (LONG, sampled),
            ("", greedy),
            (LONG, greedy),
            ("Hello", sampled),
            ("Hello, world", greedy),
        ]
    ]
    lm = BytelatentLM(gen.model, gen.patcher_args, gen.entropy_model, batch_size=3)
    sizes = []
    original = lm.generator.generate_tokens

    def spy(rows, args):
        sizes.append(len(rows))
        return original(rows, args)

    monkeypatch.setattr(lm.generator, "generate_tokens", spy)
    batched = lm.generate_until(requests)
    # two kwargs groups: four greedy requests in batches of 3 and 1, two sampled ones together
    assert sorted(sizes) == [1, 2, 3]
    assert lm.generation_batches(requests) == [[3, 5, 0], [2], [1, 4]]  # longest first
    one_lm = BytelatentLM(gen.model, gen.patcher_args, gen.entropy_model, batch_size=1)
    alone = [one_lm.generate_until([r])[0] for r in requests]
    assert batched == alone
    assert all(isinstance(text, str) for text in batched) and any(batched)


def _write_generation_task(folder) -> None:
    rows = [{"q": "2+2=", "a": "4"}, {"q": "The sky is", "a": "blue"}, {"q": "x", "a": "y"}]
    rows += [{"q": LONG[: 10 + 9 * i], "a": "z"} for i in range(5)]
    data = folder / "gen.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (folder / "gen.yaml").write_text(
        "task: bytelatent_toy_gen\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  cache_dir: {folder / 'hf_cache'}\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: generate_until\n"
        "doc_to_text: '{{q}}'\n"
        "doc_to_target: '{{a}}'\n"
        "generation_kwargs:\n  until: ['\\n\\n']\n  max_gen_toks: 8\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n"
    )


def test_a_real_lm_eval_generation_task_runs_in_batches(tmp_path, monkeypatch) -> None:
    """lm-eval's own requests through `run_harness(batch_size=...)`: the same answers."""
    pytest.importorskip("lm_eval")
    import datasets

    from bytelatent.eval.harness import BytelatentLM, run_harness

    for key in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.setenv(key, "1")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True, raising=False)
    _write_generation_task(tmp_path)
    answers, sizes = {}, []
    generate_until, generate_tokens = BytelatentLM.generate_until, Generator.generate_tokens

    def record(self, requests):
        answers[self.batch_size] = generate_until(self, requests)
        return answers[self.batch_size]

    def count(self, rows, args):
        sizes.append(len(rows))
        return generate_tokens(self, rows, args)

    monkeypatch.setattr(BytelatentLM, "generate_until", record)
    monkeypatch.setattr(Generator, "generate_tokens", count)
    model = tiny_lm(max_seqlen=128, window=16)
    for batch_size in (1, 3):
        run_harness(
            model, ["bytelatent_toy_gen"], str(tmp_path), include_defaults=False,
            batch_size=batch_size,
        )  # fmt: skip
    assert len(answers[1]) == 8 and answers[1] == answers[3]
    assert sizes == [1] * 8 + [3, 3, 2]
