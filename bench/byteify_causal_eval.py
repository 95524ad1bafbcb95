"""Validation bits per byte of a BLT checkpoint under a chosen patch rule, to score models trained
with `patching_mode=tokenizer` as causal byte models (docs/byteify.md, "Token patching").

A BLT patched at the teacher's token starts is scored by the trainer with those starts, which
depend on the bytes to come (bench/token_boundary_bits.py): not a causal code. Here the same
checkpoint reads the same validation windows with patch starts from a rule that sees only the
past, so its bpb compares with space-patched runs and the teacher:

- `token`: the tokenizer's starts (what training and the trainer's evaluation use; this rule
  reproduces the trainer's val/bpb, a check of this script);
- `predicted`: a causal boundary predictor's guess, decided left to right: a patch starts at p
  when P(start | the 7 tokens before p, distance from the last start) > 0.5 under the counts of
  bench/token_boundary_bits.py fitted on the training text (a stand-in for Bolmo's learned
  boundary predictor, which is not built);
- `space`: the space rule.

    python bench/byteify_causal_eval.py --ckpt runs/byteify_stage2_tok/checkpoints/0000000200 \
        --rules token predicted space

Windows: the validation documents (BOS text EOS) as one stream, cut into rows of 512 + 1 bytes
overlapping by one, as the trainer's evaluation reads them (first --windows rows); a row's first
byte is a patch of its own, as in training.
"""

from __future__ import annotations

import argparse
import glob
import math
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from token_boundary_bits import MAX_DIST, BackoffCounts, stream  # noqa: E402

from bytelatent.checkpoint.pretrained import load_any_checkpoint  # noqa: E402
from bytelatent.data.patch_rules import (  # noqa: E402
    lengths_from_starts,
    patch_document,
    starts_from_lengths,
)
from bytelatent.data.patcher_args import PatcherArgs  # noqa: E402
from bytelatent.eval.generation.engines import model_spec  # noqa: E402

BASE = 261
K, MIN_COUNT = 7, 8  # what bench/token_boundary_bits.py picks on the stdlib corpus


def predicted_starts(counts: BackoffCounts, tokens: np.ndarray) -> np.ndarray:
    """Left to right: start at p when the counts say P(start | context before p) > 0.5; the
    distance in the context counts from the predicted starts."""
    lookup = []
    for k in range(K, -1, -1):
        uniq, total, ones = counts.tables[k]
        lookup.append((k, dict(zip(uniq.tolist(), zip(total.tolist(), ones.tolist())))))
    starts = np.zeros(len(tokens), dtype=bool)
    starts[0] = True
    last = 0
    history = [BASE - 1] * K + tokens.tolist()
    for p in range(1, len(tokens)):
        dist = min(p - last, MAX_DIST)
        prob = 0.5
        for k, table in lookup:
            key = 0
            for token in history[p + K - k : p + K]:
                key = key * BASE + token
            hit = table.get(key * (MAX_DIST + 1) + dist)
            if hit is not None and hit[0] >= (MIN_COUNT if k else 0):
                prob = (hit[1] + 0.5) / (hit[0] + 1.0)
                break
        if prob > 0.5:
            starts[p] = True
            last = p
    return starts


def space_starts(tokens: np.ndarray, bounds: list[tuple[int, int]]) -> np.ndarray:
    args = PatcherArgs(patching_mode="space")
    out = np.zeros(len(tokens), dtype=bool)
    for a, b in bounds:
        lengths = patch_document(args, tokens[a:b], None)
        out[a:b] = starts_from_lengths(lengths[None], b - a)[0]
    return out


def doc_bounds(tokens: np.ndarray) -> list[tuple[int, int]]:
    begins = np.flatnonzero(tokens == 1).tolist() + [len(tokens)]  # BOS_ID
    return list(zip(begins[:-1], begins[1:]))


@torch.no_grad()
def bpb(model, tokens: np.ndarray, starts: np.ndarray, windows: int, width: int) -> float:
    spec = model_spec(model)
    nats, count = 0.0, 0
    for w in range(windows):
        a = w * width
        row = torch.from_numpy(tokens[a : a + width + 1].astype(np.int64))
        mask = starts[a : a + width + 1].copy()
        mask[0] = mask[1] = True  # the carried byte alone, then the row's first patch
        lengths = torch.from_numpy(lengths_from_starts(mask[None]))
        logits = spec.logits(model(row[None, :-1], lengths)).float()
        nats += torch.nn.functional.cross_entropy(logits[0], row[1:], reduction="sum").item()
        count += width
    return nats / count / math.log(2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt", nargs="+", required=True)
    parser.add_argument("--rules", nargs="+", default=["token", "predicted", "space"])
    parser.add_argument("--tokenizer", default="hf/stdlib-teacher")
    parser.add_argument("--data", default="data/stdlib")
    parser.add_argument("--windows", type=int, default=100)
    parser.add_argument("--width", type=int, default=512)
    args = parser.parse_args()
    patcher = PatcherArgs(patching_mode="tokenizer", tokenizer_path=args.tokenizer)
    val_files = sorted(glob.glob(os.path.join(args.data, "*.val.jsonl")))
    tokens, token_starts = stream(val_files, patcher, args.windows * args.width + 1)
    rules = {"token": token_starts}
    if "predicted" in args.rules:
        train_files = sorted(glob.glob(os.path.join(args.data, "*.chunk.*.jsonl")))
        train_tokens, train_starts = stream(train_files, patcher, 3_000_000)
        rules["predicted"] = predicted_starts(BackoffCounts(train_tokens, train_starts, K), tokens)
        agree = (rules["predicted"] == token_starts)[1:].mean()
        print(f"predicted starts: {rules['predicted'].mean():.3f} per byte, agree {agree:.3f}")
    if "space" in args.rules:
        rules["space"] = space_starts(tokens, doc_bounds(tokens))
    for ckpt in args.ckpt:
        model, _, _ = load_any_checkpoint(ckpt, "cpu")
        model = model.float().eval()
        scores = {r: bpb(model, tokens, rules[r], args.windows, args.width) for r in args.rules}
        print(ckpt, " ".join(f"{r}={v:.4f}" for r, v in scores.items()), flush=True)


if __name__ == "__main__":
    main()
