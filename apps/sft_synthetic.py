"""A synthetic instruction set that needs the instruction: reverse / upper-case / count the letters
of a word, mixed, so the answer depends on which task the prompt asks for (docs/sft.md).

    python -m apps.sft_synthetic --out data/sft_synth [--train 20000] [--eval 200] [--seed 0]

Writes `{out}/train/train.jsonl` (the three record shapes a chat reader takes, mixed: messages,
prompt/response, instruction/input/output) and `{out}/eval.jsonl` (messages; the last turn is
the reference answer) whose words never occur in the training set.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

LETTERS = "abcdefghijklmnopqrstuvwxyz"
TASKS = ("reverse", "upper", "count")
SHAPES = ("messages",) * 5 + ("prompt",) * 4 + ("instruction",)  # mixed record shapes


def answer(task: str, word: str) -> str:
    if task == "reverse":
        return word[::-1]
    if task == "upper":
        return word.upper()
    return str(len(word))


def words(n: int, rng: random.Random, min_len: int = 3, max_len: int = 6) -> list[str]:
    """`n` distinct random lowercase words."""
    seen: set[str] = set()
    while len(seen) < n:
        length = rng.randint(min_len, max_len)
        seen.add("".join(rng.choice(LETTERS) for _ in range(length)))
    return sorted(seen)


def record(task: str, word: str, shape: str) -> dict:
    """One example in a chat record shape (messages, prompt, instruction)."""
    prompt, reply = f"{task} {word}", answer(task, word)
    if shape == "prompt":
        return {"prompt": prompt, "response": reply}
    if shape == "instruction":
        return {"instruction": task, "input": word, "output": reply}
    return {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": reply}]}  # fmt: skip


def build(n_train: int, n_eval: int, seed: int) -> tuple[list[dict], list[dict]]:
    """(training records, evaluation records); no evaluation word is a training word."""
    rng = random.Random(seed)
    # one word per example: a few words seen again and again are memorised (held-out bpb rises
    # while the training loss falls) instead of teaching the operation
    vocab = words(n_train + n_eval, rng)
    rng.shuffle(vocab)
    held_out, seen = vocab[:n_eval], vocab[n_eval:]
    train = [record(rng.choice(TASKS), word, rng.choice(SHAPES)) for word in seen]
    evals = [record(TASKS[i % 3], word, "messages") for i, word in enumerate(held_out)]
    return train, evals


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--train", type=int, default=20000, help="training examples")
    parser.add_argument("--eval", type=int, default=200, help="held-out evaluation examples")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.train < 3 or args.eval < 1:
        print("sft_synthetic: --train must be >= 3 and --eval >= 1", file=sys.stderr)
        return 2
    train, evals = build(args.train, args.eval, args.seed)
    out = Path(args.out)
    write_jsonl(out / "train" / "train.jsonl", train)
    write_jsonl(out / "eval.jsonl", evals)
    print(f"{out}: {len(train)} training and {len(evals)} held-out examples")
    return 0


if __name__ == "__main__":
    sys.exit(main())
