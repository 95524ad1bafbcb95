"""token_targets: the per-byte Python loop (the first version, one `next_byte_target` per byte)
against the vectorised `TokenByteTrie.token_rows` (one gather + one scatter for a whole text).

    OMP_NUM_THREADS=1 python bench/distill_targets.py --teacher hf/stdlib-teacher --bytes 2048

Process CPU-seconds per call at 1 thread, the variants interleaved after a warm-up, medians of
--repeats; random teacher distributions (the cost does not depend on the values). Prints the
load (`uptime`) with the table. Results: bench/RESULTS_byteify_distill_cpu.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from bytelatent.tokenizers.hf_bpe import byte_level_vocab
from bytelatent.trainer.distill import TokenByteTrie


def loop_targets(trie: TokenByteTrie, probs: torch.Tensor, token_ids: list[int]) -> torch.Tensor:
    """The first version of `token_targets`: one 257-class row per byte, in Python."""
    rows = []
    for dist, token in zip(trie.sorted_probs(probs), token_ids):
        data = trie.vocab[int(token)]
        rows.extend(trie.next_byte_target(dist, data[:k]) for k in range(len(data)))
    return torch.stack(rows)


def cpu_seconds(fn) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--teacher", default="hf/stdlib-teacher", help="folder with tokenizer.json")
    parser.add_argument("--data", default="data/stdlib/stdlib.val.jsonl")
    parser.add_argument("--bytes", type=int, default=2048, help="text bytes per call")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(args.teacher, "tokenizer.json"))
    vocab = byte_level_vocab(tok)
    with open(args.data) as f:
        text = json.loads(f.readline())["text"].encode()[: args.bytes].decode(errors="ignore")
    ids = tok.encode(text, add_special_tokens=False).ids
    generator = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(len(ids), len(vocab), generator=generator).double(), -1)
    trie = TokenByteTrie(vocab)
    init_s = cpu_seconds(lambda: TokenByteTrie(vocab))
    variants = {
        "loop": lambda: loop_targets(trie, probs, ids),
        "vectorised": lambda: trie.token_targets(probs, ids),
    }
    torch.testing.assert_close(variants["loop"](), variants["vectorised"]())  # same targets
    for fn in variants.values():
        fn()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name, fn in variants.items():  # interleaved: load changes hit both
            times[name].append(cpu_seconds(fn))
    n_bytes = sum(len(vocab[i]) for i in ids)
    print(
        f"vocab {len(vocab)}, {len(ids)} tokens, {n_bytes} bytes; trie build {init_s * 1e3:.1f} ms CPU"
    )
    print("| variant | median CPU ms / call | min | max | bytes per CPU-second |")
    print("|---|---|---|---|---|")
    for name, values in times.items():
        med = statistics.median(values)
        print(
            f"| {name} | {med * 1e3:.1f} | {min(values) * 1e3:.1f} | {max(values) * 1e3:.1f} | {n_bytes / med:,.0f} |"
        )
    print("load:", os.popen("uptime").read().strip())


if __name__ == "__main__":
    main()
