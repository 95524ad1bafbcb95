"""What the token boundaries of `patching_mode=tokenizer` tell a BLT about the bytes to come, in
bits per byte: an upper bound on what its validation bpb must add to be a causal code.

A BLT's decoder at byte i (predicting byte i + 1) reads the global output of the last patch that
ends at or before i (bytelatent/archs/blt/patch_utils.py), so it knows whether byte i + 1 starts
a patch. In space or entropy mode that is decided by bytes <= i (no information about byte
i + 1). In tokenizer mode it is whether a teacher token starts at i + 1, which depends on byte
i + 1 and the bytes after it (a word goes on or not): the model is scored with part of the
answer given. A causal code for the bytes must send that bit before each byte; its cost is at
most the cross-entropy of any causal predictor of it. This script fits one (counts of "a patch
starts here" after the last k tokens and the distance to the last start, backing off from the
longest context seen at least `min_count` times; k and min_count picked on a held-out tenth of
the training text) and reports its bits per byte on the validation bytes the trainer's
evaluation reads (the first --val-bytes of the validation stream, documents with BOS/EOS):

    python bench/token_boundary_bits.py --tokenizer hf/stdlib-teacher --data data/stdlib

token-patched val bpb + this = an upper bound on a causal code length, comparable with the
space-patched runs and the teacher. The same bits apply to every token-patched model scored on
the same bytes, so comparisons between token-patched runs need no correction.
"""

from __future__ import annotations

import argparse
import glob
import json
import os

import numpy as np

from bytelatent.data.patch_rules import patch_document, starts_from_lengths
from bytelatent.data.patcher_args import PatcherArgs
from bytelatent.tokenizers.constants import BOS_ID, EOS_ID, OFFSET

BASE = 261  # token ids are < 260; 260 pads contexts that reach before the stream's start
MAX_DIST = 8


def stream(files: list[str], args: PatcherArgs, limit: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, patch-start mask) of the documents of `files` (BOS text EOS each), concatenated,
    cut after `limit` tokens."""
    tokens, starts, total = [], [], 0
    for path in files:
        with open(path) as f:
            for line in f:
                data = json.loads(line)["text"].encode("utf-8")
                row = np.array([BOS_ID, *(b + OFFSET for b in data), EOS_ID], dtype=np.int64)
                lengths = patch_document(args, row, None)
                tokens.append(row)
                starts.append(starts_from_lengths(lengths[None], len(row))[0])
                total += len(row)
                if total >= limit:
                    return np.concatenate(tokens)[:limit], np.concatenate(starts)[:limit]
    return np.concatenate(tokens), np.concatenate(starts)


def context_keys(tokens: np.ndarray, starts: np.ndarray, k: int) -> np.ndarray:
    """int64 key per position p: the k tokens before p and the distance from the last start
    before p (capped): what is known before byte p when its start bit is sent."""
    n = len(tokens)
    padded = np.concatenate([np.full(k, BASE - 1, dtype=np.int64), tokens])
    key = np.zeros(n, dtype=np.int64)
    for j in range(k):  # token p - k + j
        key = key * BASE + padded[j : j + n]
    last = np.maximum.accumulate(np.where(starts, np.arange(n), -1))
    before = np.concatenate([[-1], last[:-1]])  # last start strictly before p
    dist = np.minimum(np.arange(n) - before, MAX_DIST)
    return key * (MAX_DIST + 1) + dist


class BackoffCounts:
    """P(start | context) from counts, the longest context (k = max_k .. 0) seen >= min_count
    times, add-half smoothing."""

    def __init__(self, tokens: np.ndarray, starts: np.ndarray, max_k: int) -> None:
        self.tables = []
        for k in range(max_k + 1):
            keys = context_keys(tokens, starts, k)
            uniq, inverse = np.unique(keys, return_inverse=True)
            total = np.bincount(inverse, minlength=len(uniq))
            ones = np.bincount(inverse, weights=starts.astype(np.float64), minlength=len(uniq))
            self.tables.append((uniq, total, ones))

    def bits(self, tokens: np.ndarray, starts: np.ndarray, max_k: int, min_count: int) -> float:
        """Total bits of coding `starts` at positions 1.. (position 0, a BOS, always starts)."""
        prob = np.full(len(tokens), np.nan)
        for k in range(max_k, -1, -1):
            uniq, total, ones = self.tables[k]
            keys = context_keys(tokens, starts, k)
            where = np.clip(np.searchsorted(uniq, keys), 0, len(uniq) - 1)
            found = (uniq[where] == keys) & (total[where] >= (min_count if k else 0))
            use = found & np.isnan(prob)
            prob[use] = (ones[where[use]] + 0.5) / (total[where[use]] + 1.0)
        prob = np.where(np.isnan(prob), 0.5, prob)
        p_true = np.where(starts, prob, 1.0 - prob)[1:]
        return float(-np.log2(p_true).sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", default="hf/stdlib-teacher")
    parser.add_argument("--data", default="data/stdlib")
    parser.add_argument("--train-bytes", type=int, default=3_000_000)
    parser.add_argument("--val-bytes", type=int, default=51_201, help="stream tokens scored")
    args = parser.parse_args()
    patcher = PatcherArgs(patching_mode="tokenizer", tokenizer_path=args.tokenizer)
    train_files = sorted(glob.glob(os.path.join(args.data, "*.chunk.*.jsonl")))
    val_files = sorted(glob.glob(os.path.join(args.data, "*.val.jsonl")))
    tokens, starts = stream(train_files, patcher, args.train_bytes)
    cut = len(tokens) * 9 // 10
    best = None
    for max_k in (3, 4, 5, 6, 7):
        counts = BackoffCounts(tokens[:cut], starts[:cut], max_k)
        for min_count in (1, 2, 4, 8, 16):
            bpb = counts.bits(tokens[cut:], starts[cut:], max_k, min_count) / (
                len(tokens) - cut - 1
            )
            if best is None or bpb < best[0]:
                best = (bpb, max_k, min_count)
    _, max_k, min_count = best
    counts = BackoffCounts(tokens, starts, max_k)
    val_tokens, val_starts = stream(val_files, patcher, args.val_bytes)
    n_bytes = len(val_tokens) - 1
    bits = counts.bits(val_tokens, val_starts, max_k, min_count)
    print(
        f"train: {len(tokens):,} tokens, {starts.mean():.3f} starts per token; context k={max_k}, "
        f"min_count={min_count} (held-out {best[0]:.4f} bits per byte)"
    )
    print(
        f"validation: {n_bytes:,} predicted tokens, {val_starts[1:].mean():.3f} starts per token; "
        f"start bits {bits / n_bytes:.4f} per byte"
    )


if __name__ == "__main__":
    main()
