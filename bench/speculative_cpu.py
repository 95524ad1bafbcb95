"""Acceptance rate, global steps per byte and bytes/s of BLT self-speculative decoding on the
debug BLT's shape (configs/debug.yaml, random init, sharpened outputs as in the generation tests)
with its space patching and with byte patching, or of a checkpoint with its own patcher; plain
cached decoding for comparison (greedy: the same bytes, checked; sampling: the same seed, the
same distribution but not the same bytes, so only the statistics are compared).

    PYTHONPATH=. OMP_NUM_THREADS=1 python bench/speculative_cpu.py [--bytes 64] [--ckpt DIR]
        [--temperature 0.8] [--corpus-prompts data/stdlib/stdlib.val.jsonl --n-prompts 4]

``--corpus-prompts`` takes the first 48 bytes (cut at a character boundary) of the first
``--n-prompts`` documents of a JSONL file (its ``text`` field) instead of the fixed prompts.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from bytelatent.archs.blt.model import ByteLatentTransformer
from bytelatent.args import TrainArgs
from bytelatent.config.parser import parse_args
from bytelatent.data.patcher import PatcherArgs
from bytelatent.eval.generation import GenerationArgs, Generator, load_generator
from bytelatent.eval.generation.engines import CachedEngine

PROMPTS = ["def main(argv):\n    ", "The quick brown fox ", "import os\nimport sys\n", "Hello"]


def debug_blt() -> tuple[ByteLatentTransformer, PatcherArgs]:
    args = parse_args(TrainArgs, ["config=configs/debug.yaml"])
    torch.manual_seed(0)
    with torch.device("meta"):
        model = ByteLatentTransformer(args.model)
    model.to_empty(device="cpu")
    model.init_weights()
    with torch.no_grad():
        model.local_decoder.output.weight.mul_(20.0)
    return model.eval(), args.data.patcher_args


def corpus_prompts(path: str, count: int, length: int = 48) -> list[str]:
    """The first ``length`` bytes (whole characters) of the first ``count`` documents of ``path``."""
    prompts = []
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            text = json.loads(line)["text"]
            prompts.append(text.encode()[:length].decode("utf-8", errors="ignore"))
            if len(prompts) == count:
                break
    return prompts


def plain_global_steps(gen: Generator, results) -> int:
    """Global transformer calls of plain cached decoding, one row at a time, after the prompts'
    prefill: the fed bytes of each continuation (its last byte is chosen, never fed)."""
    total = 0
    for result in results:
        row = result.prompt_tokens
        capacity = len(row) + len(result.tokens)
        engine = CachedEngine(gen.model, gen.patcher_args, gen.entropy_model, capacity)
        engine.start([row])
        before = engine.impl.global_steps
        for token in result.tokens[:-1]:
            engine.advance([token], [True])
        total += engine.impl.global_steps - before
    return total


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bytes", type=int, default=64)
    parser.add_argument("--ckpt", help="a BLT checkpoint (its own patcher) instead of debug.yaml")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--corpus-prompts", help="JSONL file whose documents' starts are prompts")
    parser.add_argument("--n-prompts", type=int, default=4)
    parser.add_argument("--ks", default="2,4,8", help="comma-separated draft lengths")
    options = parser.parse_args()
    torch.set_num_threads(1)
    prompts = (
        corpus_prompts(options.corpus_prompts, options.n_prompts)
        if options.corpus_prompts
        else PROMPTS
    )
    greedy = options.temperature == 0.0
    if options.ckpt:
        loaded = load_generator(options.ckpt)
        cases = [(loaded.patcher_args.patching_mode.value, loaded)]
    else:
        model, space = debug_blt()
        cases = [("space", Generator(model, space))]
        cases.append(("byte", Generator(model, PatcherArgs(patching_mode="byte"))))
    print(
        f"temperature {options.temperature}, {len(prompts)} prompts, {options.bytes} new bytes each"
    )
    header = (
        "| patching | k | acceptance | global steps / byte | rounds (row steps) | s | bytes/s |"
    )
    print(header)
    print("|---|---|---|---|---|---|---|")
    for name, gen in cases:
        args = GenerationArgs(
            max_new_bytes=options.bytes,
            stop_at_eos=False,
            batch_size=1,
            temperature=options.temperature,
            seed=options.seed,
        )
        start = time.perf_counter()
        plain = gen.generate(prompts, args)
        seconds = time.perf_counter() - start
        new = sum(len(r.tokens) for r in plain)
        steps = plain_global_steps(gen, plain) / new
        print(f"| {name} | plain | - | {steps:.3f} | {new} | {seconds:.1f} | {new / seconds:.0f} |")
        for k in [int(k) for k in options.ks.split(",")]:
            start = time.perf_counter()
            fast = gen.generate(prompts, args.model_copy(update={"speculative_k": k}))
            seconds = time.perf_counter() - start
            if greedy:
                assert [r.tokens for r in fast] == [r.tokens for r in plain], "greedy differs"
            s = gen.speculative_stats
            print(
                f"| {name} | {k} | {s.acceptance_rate:.3f} | {s.global_steps_per_byte:.3f} "
                f"| {s.rounds} | {seconds:.1f} | {s.new_bytes / seconds:.0f} |"
            )


if __name__ == "__main__":
    main()
