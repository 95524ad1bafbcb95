"""Exact match of a chat checkpoint on held-out conversations, per task of the synthetic set
(the first word of the user turn: reverse / upper / count), and the template-following rate.

    python bench/sft_exact_match.py CKPT data/sft_synth/eval.jsonl [--limit 200] [--max-new-bytes 16]

Prints one markdown table row per task and one for all; results go in bench/RESULTS_sft_cpu.md.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bytelatent.checkpoint.pretrained import read_params  # noqa: E402
from bytelatent.eval.chat import (  # noqa: E402
    chat_template_of,
    check_template,
    generate_answers,
    read_examples,
)
from bytelatent.eval.generation import GenerationArgs, load_generator  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("ckpt")
    parser.add_argument("file")
    parser.add_argument("--limit", type=int, default=200)
    parser.add_argument("--max-new-bytes", type=int, default=16)
    args = parser.parse_args()
    examples = read_examples(args.file, args.limit)
    generator = load_generator(args.ckpt)
    templated = chat_template_of(read_params(args.ckpt.rstrip("/"))) is not None
    if templated:
        check_template(chat_template_of(read_params(args.ckpt.rstrip("/"))), args.ckpt)
    gen_args = GenerationArgs(max_new_bytes=args.max_new_bytes, temperature=0.0, batch_size=16)
    # an untuned checkpoint gets the same template rows: what it does with them is the baseline
    answers = generate_answers(generator, [turns for turns, _ in examples], gen_args)
    by_task: dict[str, list[tuple[bool, bool]]] = defaultdict(list)
    for (turns, reference), answer in zip(examples, answers):
        task = turns[-1][1].split()[0]
        by_task[task].append((answer.closed and answer.text == reference, answer.closed))
    by_task["all"] = [r for task in sorted(by_task) for r in by_task[task]]
    print("| task | n | exact match | follows template |")
    print("|---|---|---|---|")
    for task, rows in by_task.items():
        n = len(rows)
        right, closed = sum(r for r, _ in rows), sum(c for _, c in rows)
        print(f"| {task} | {n} | {right / n:.1%} | {closed / n:.1%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
