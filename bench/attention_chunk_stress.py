"""Stress the chunked CPU attention path (ChunkPlan + the CPU flash kernel) for a race, an
uninitialised buffer or a stale cache (issue 18, item 4).

Once, under heavy machine load, an fp64 comparison saw our logits off by up to 1e-3 at every
position >= 256 (the first chunk boundary, attention.SDPA_CHUNK) of long rows. This script runs
forward + backward of `attend` on block_causal / local_block_causal masks of packed rows long
enough for several chunks, many times, and checks every run:

* against a float64 brute force (masked softmax), positions < 256 and >= 256 reported apart;
* bitwise against the first run of the same configuration (a race or an uninitialised read
  shows up as a difference between repeats);
* with the allocator's free blocks poisoned with NaN before each run (`--poison`): a buffer
  read before it is written then gives NaN;
* with the mask built once and reused across dtypes (the per-dtype additive-mask cache) and
  with masks built afresh;
* at 1 and 2 threads, optionally with `--load N` busy processes beside it.

    python bench/attention_chunk_stress.py --repeats 50 --load 2 --poison
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bytelatent.model.attention import SDPA_CHUNK, SdpaChunked, attend, self_attn_mask  # noqa: E402

EOS = 2


def packed_rows(bsz: int, seqlen: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(4, 260, (bsz, seqlen), generator=gen)
    for row in range(bsz):
        cuts = torch.randperm(seqlen, generator=gen)[: 3 + 4 * row]
        tokens[row, cuts] = EOS
    return tokens


def brute_force(q, k, v, allowed, g) -> tuple[torch.Tensor, ...]:
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    out = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ v
    (out * g.double()).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def run_once(q, k, v, g, mask) -> tuple[torch.Tensor, ...]:
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = attend(q, k, v, mask, "sdpa")
    (out * g).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def poison_free_blocks(n_bytes: int) -> None:
    """Fill memory the allocator will hand out next with NaN (glibc reuses freed blocks)."""
    junk = [torch.full((n_bytes // 8 // 4,), float("nan"), dtype=torch.float64) for _ in range(4)]
    del junk


def busy(stop_at: float) -> None:
    torch.set_num_threads(1)
    a = torch.randn(256, 256)
    while time.time() < stop_at:
        a = torch.tanh(a @ a)


def errors(got, ref, boundary: int) -> dict[str, float]:
    """Max abs error of out/dq/dk/dv, for query positions < boundary and >= boundary."""
    found = {}
    for name, x, y in zip(("out", "dq", "dk", "dv"), got, ref):
        diff = (x.double() - y).abs()
        found[f"{name}<{boundary}"] = float(diff[:, :, :boundary].max())
        found[f"{name}>={boundary}"] = float(diff[:, :, boundary:].max())
    return found


def stress(args, kind: str, dtype: torch.dtype, threads: int) -> dict:
    torch.set_num_threads(threads)
    tokens = packed_rows(args.batch, args.seqlen, seed=7)
    window = 300 if kind == "local_block_causal" else None
    gen = torch.Generator().manual_seed(1)
    shape = (args.batch, args.heads, args.seqlen, args.head_dim)
    q, k, v, g = (
        torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype) for _ in range(4)
    )
    shared = self_attn_mask(kind, tokens, EOS, window)
    if not isinstance(shared, SdpaChunked):  # a long local mask runs banded, not chunked
        return None
    ref = brute_force(q, k, v, shared.dense, g)
    first, worst, mismatches, nans = None, {}, 0, 0
    for i in range(args.repeats):
        if args.poison:
            poison_free_blocks(64 * 2**20)
        mask = shared if i % 2 else self_attn_mask(kind, tokens, EOS, window)
        if i % 3 == 2:  # the shared plan's additive-mask cache also holds another dtype
            shared.chunks.additive(torch.float32 if dtype == torch.float64 else torch.float64)
        got = run_once(q, k, v, g, mask)
        nans += sum(int(not torch.isfinite(t).all()) for t in got)
        if first is None:
            first = got
        elif any(not torch.equal(a, b) for a, b in zip(first, got)):
            mismatches += 1
        for key, value in errors(got, ref, SDPA_CHUNK).items():
            worst[key] = max(worst.get(key, 0.0), value)
    return {"kind": kind, "dtype": str(dtype)[6:], "threads": threads, "repeats": args.repeats,
            "not_bitwise_repeats": mismatches, "nonfinite": nans, "worst": worst}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--seqlen", type=int, default=1024)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--load", type=int, default=0, help="busy processes beside the stress")
    p.add_argument("--poison", action="store_true", help="NaN-fill free memory before each run")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--kinds", nargs="+", default=["block_causal", "local_block_causal"])
    args = p.parse_args()
    loaders = []
    if args.load:
        stop_at = time.time() + 3600
        loaders = [mp.Process(target=busy, args=(stop_at,), daemon=True) for _ in range(args.load)]
        for proc in loaders:
            proc.start()
    print(f"torch {torch.__version__}, S={args.seqlen}, chunk {SDPA_CHUNK}, load {args.load}, "
          f"poison {args.poison}")  # fmt: skip
    print(
        "| mask | dtype | threads | repeats | not bitwise | non-finite | out err <256 | >=256 | dq err <256 | >=256 |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    try:
        for threads in args.threads:
            for dtype in (torch.float64, torch.float32):
                for kind in args.kinds:
                    r = stress(args, kind, dtype, threads)
                    if r is None:
                        print(f"| {kind} | banded at S={args.seqlen}: not the chunk path |")
                        continue
                    w = r["worst"]
                    print(f"| {kind} | {r['dtype']} | {threads} | {r['repeats']} | "
                          f"{r['not_bitwise_repeats']} | {r['nonfinite']} | {w['out<256']:.1e} | "
                          f"{w['out>=256']:.1e} | {w['dq<256']:.1e} | {w['dq>=256']:.1e} |",
                          flush=True)  # fmt: skip
    finally:
        for proc in loaders:
            proc.terminate()


if __name__ == "__main__":
    main()
