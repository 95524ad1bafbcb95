"""Micro-benchmarks of the CPU speed levers tried for issue 11 (kept and rejected alike).

Each case times the alternatives interleaved in one process (median of repeated calls, after
warm-up) on the shapes of the bench/blt_cpu.py model, bf16 autocast, and checks that they
compute the same thing.

    python bench/cpu_levers.py rmsnorm            # RMSNorm: F.rms_norm composite vs our function
    python bench/cpu_levers.py rmsnorm-model      # the same switch in the whole BLT step (A/B)
    python bench/cpu_levers.py attention-backward # CPU flash backward vs a chunked matmul backward
    python bench/cpu_levers.py projections        # wq/wk/wv (w1/w3) as one matmul vs separate
    python bench/cpu_levers.py chunk-plan         # flash call cost, and a cost-optimal chunk plan
    python bench/cpu_levers.py chunk-plan-step    # entropy step: current plan vs two alternatives
    python bench/cpu_levers.py entropy-profile    # entropy step's CPU time by kernel group
    python bench/cpu_levers.py all
"""

# The per-case closures below are timed inside the loop iteration that defines them.
# ruff: noqa: B023

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bytelatent.model import layers  # noqa: E402

BF16 = torch.bfloat16


def median_ms(fn: Callable[[], object], repeats: int = 15, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def interleaved(cases: dict[str, Callable[[], object]], rounds: int = 3) -> dict[str, float]:
    """Median over rounds of each case's median, cases alternating within every round."""
    results: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            results[name].append(median_ms(fn))
    return {name: statistics.median(values) for name, values in results.items()}


def report(title: str, timings: dict[str, float]) -> None:
    base = next(iter(timings.values()))
    cells = ", ".join(f"{name} {ms:.2f} ms ({base / ms:.2f}x)" for name, ms in timings.items())
    print(f"{title}: {cells}")


def bench_rmsnorm() -> None:
    """fp32 residual in, bf16 out (what autocast consumers need), forward + backward."""
    for shape in [(4, 1024, 256), (4, 257, 512)]:
        torch.manual_seed(0)
        x = torch.randn(*shape, requires_grad=True)
        w = (1 + 0.1 * torch.randn(shape[-1])).requires_grad_()
        grad = torch.randn(*shape).to(BF16)

        def composite() -> None:
            F.rms_norm(x, (shape[-1],), w, 1e-5).to(BF16).backward(grad)

        def function() -> None:
            layers._RMSNormFunction.apply(x, w, 1e-5, BF16).backward(grad)

        same = torch.equal(
            F.rms_norm(x, (shape[-1],), w, 1e-5).to(BF16),
            layers._RMSNormFunction.apply(x, w, 1e-5, BF16),
        )
        report(
            f"rmsnorm {shape} fwd+bwd (forward bitwise equal: {same})",
            interleaved({"composite": composite, "function": function}),
        )


def alternating_steps(
    step: Callable[[], object], variants: dict[str, Callable[[], None]], blocks: int, per_block: int
) -> dict[str, list[float]]:
    """Step times (s) per variant: blocks in which each variant is switched on (its callable),
    stepped once untimed and ``per_block`` times timed; the order reverses every other block."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for block in range(blocks):
        order = list(variants) if block % 2 == 0 else list(reversed(variants))
        for name in order:
            variants[name]()
            step()
            for _ in range(per_block):
                start = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - start)
    return times


def bench_rmsnorm_model(blocks: int = 4) -> None:
    """Whole bench-model training steps with the function on/off, alternating blocks of 3."""
    from blt_cpu import make_train_step

    step, _ = make_train_step("ours", "bf16")
    original = layers._use_rmsnorm_function

    def use(function: bool) -> Callable[[], None]:
        def switch() -> None:
            layers._use_rmsnorm_function = original if function else (lambda *a: False)

        return switch

    step()
    try:
        times = alternating_steps(step, {"on": use(True), "off": use(False)}, blocks, 3)
    finally:
        layers._use_rmsnorm_function = original
    on, off = statistics.median(times["on"]), statistics.median(times["off"])
    print(
        f"rmsnorm in the BLT step ({len(times['on'])} steps each): function {on:.3f} s, "
        f"composite {off:.3f} s per step; composite / function = {off / on:.3f}"
    )


def _matmul_attention_backward(g, q, k, v, o, lse, chunk: int = 128):  # noqa: ANN001, ANN202
    """Causal attention backward from the forward's logsumexp: query chunks, bf16 matmuls,
    float32 softmax terms (what a hand-written backward in torch ops can do)."""
    bsz, heads, n, d = q.shape
    scale = d**-0.5
    dq = torch.empty_like(q)
    dk = torch.zeros(k.shape, dtype=torch.float32)
    dv = torch.zeros(v.shape, dtype=torch.float32)
    delta = (g.float() * o.float()).sum(-1, keepdim=True)
    for q0 in range(0, n, chunk):
        q1 = min(n, q0 + chunk)
        s = torch.matmul(q[:, :, q0:q1], k[:, :, :q1].transpose(-1, -2)).float()
        s.mul_(scale).sub_(lse[:, :, q0:q1, None])
        upper = torch.ones(q1 - q0, q1 - q0, dtype=torch.bool).triu(1)
        s[..., q0:q1].masked_fill_(upper, float("-inf"))
        p = s.exp_()
        dv[:, :, :q1] += torch.matmul(p.to(q.dtype).transpose(-1, -2), g[:, :, q0:q1]).float()
        dp = torch.matmul(g[:, :, q0:q1], v[:, :, :q1].transpose(-1, -2)).float()
        ds = p.mul_(dp.sub_(delta[:, :, q0:q1])).to(q.dtype)
        dq[:, :, q0:q1] = torch.matmul(ds, k[:, :, :q1]) * scale
        dk[:, :, :q1] += torch.matmul(ds.transpose(-1, -2), q[:, :, q0:q1]).float()
    return dq, (dk * scale).to(k.dtype), dv.to(v.dtype)


def bench_attention_backward() -> None:
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    for shape in [(4, 4, 1024, 64), (4, 8, 257, 64)]:  # local layers, global layers
        torch.manual_seed(0)
        q, k, v, g = (torch.randn(*shape).to(BF16) for _ in range(4))
        o, lse = flash(q, k, v, is_causal=True)[:2]
        ours = _matmul_attention_backward(g, q, k, v, o, lse)
        ref = flash_backward(g, q, k, v, o, lse, 0.0, True)
        err = max((a.float() - b.float()).abs().max().item() for a, b in zip(ours, ref))
        report(
            f"attention backward {shape} causal (max |difference| {err:.3f})",
            interleaved(
                {
                    "flash kernel": lambda: flash_backward(g, q, k, v, o, lse, 0.0, True),
                    "chunked matmuls": lambda: _matmul_attention_backward(g, q, k, v, o, lse),
                }
            ),
        )


def bench_projections() -> None:
    for rows, dim, outs in [
        (4096, 256, (256, 256, 256)),  # local wq/wk/wv
        (1028, 512, (512, 512, 512)),  # global wq/wk/wv
        (4096, 256, (704, 704)),  # local w1/w3
        (1028, 512, (1408, 1408)),  # global w1/w3
    ]:
        torch.manual_seed(0)
        x = torch.randn(rows, dim, requires_grad=True)
        weights = [torch.randn(o, dim, requires_grad=True) for o in outs]
        grads = [torch.randn(rows, o).to(BF16) for o in outs]

        def separate() -> None:
            with torch.autocast("cpu", dtype=BF16):
                xb = x.to(BF16)
                ys = [F.linear(xb, w) for w in weights]
            torch.autograd.backward(ys, grads)

        def fused() -> None:
            with torch.autocast("cpu", dtype=BF16):
                ys = F.linear(x.to(BF16), torch.cat(weights)).split(list(outs), -1)
            torch.autograd.backward(ys, grads)

        report(
            f"projections {rows}x{dim}->{outs} fwd+bwd",
            interleaved({"separate": separate, "one matmul": fused}),
        )


def _flash_piece_costs() -> tuple[float, float]:
    """Fit ms = c0 + c1 * q * k to masked CPU flash forward + backward calls [1, 8, q|k, 64]."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    sizes, times = [], []
    for q in (16, 32, 64, 128, 256):
        for k in sorted({q, 2 * q, 256, 512, 768}):
            if k < q:
                continue
            qt, gt = (torch.randn(1, 8, q, 64).to(BF16) for _ in range(2))
            kt, vt = (torch.randn(1, 8, k, 64).to(BF16) for _ in range(2))
            mask = torch.zeros(1, 1, q, k, dtype=BF16)

            def call() -> None:
                out, lse = flash(qt, kt, vt, attn_mask=mask)[:2]
                flash_backward(gt, qt, kt, vt, out, lse, 0.0, False, attn_mask=mask)

            ms = median_ms(call, repeats=9, warmup=2)
            sizes.append(q * k)
            times.append(ms)
            print(
                f"  flash fwd+bwd q={q:3d} k={k:3d}: {ms:.3f} ms ({q * k / ms / 1e3:.1f} elements/us)"
            )
    design = torch.tensor([[1.0, n] for n in sizes], dtype=torch.float64)
    c0, c1 = torch.linalg.lstsq(design, torch.tensor(times, dtype=torch.float64)[:, None]).solution
    return float(c0), float(c1)


def _optimal_cuts(first: list[int], starts: list[int], seqlen: int, c0: float) -> list[tuple]:
    """Cost-minimal partition of a row's queries into pieces [a, b) of at most 256 queries,
    cuts at multiples of 32 or document starts, cost = c0 + (b - a) * (b - first[a])."""
    candidates = sorted(set(range(0, seqlen, 32)) | set(starts) | {seqlen})
    best: dict[int, tuple[float, int]] = {0: (0.0, -1)}
    for b in candidates[1:]:
        best[b] = min(
            (best[a][0] + c0 + (b - a) * (b - first[a]), a)
            for a in candidates
            if a < b and b - a <= 256 and a in best
        )
    cuts, b = [], seqlen
    while b:
        a = best[b][1]
        cuts.append((a, b))
        b = a
    return cuts[::-1]


def bench_chunk_plan() -> None:
    """How much of the entropy bench's attention a cost-optimal chunk plan could remove."""
    from entropy_model_cpu import packed_batch

    from bytelatent.model import attention
    from bytelatent.tokenizers.constants import EOS_ID

    c0, c1 = _flash_piece_costs()
    overhead = c0 / c1  # a call's fixed cost in score elements
    print(
        f"  fit: {c0:.3f} ms per call + {c1 * 1e6:.1f} ms per million score elements "
        f"(a call costs as much as {overhead:,.0f} elements)"
    )
    for seed in range(3):
        tokens, _ = packed_batch(4, 1024, seed)
        plan = attention.self_attn_mask("local_block_causal", tokens, EOS_ID, 512).chunks
        needed = int(
            attention.dense_self_attn_mask("local_block_causal", tokens, EOS_ID, 512).sum()
        )
        elements = sum((r1 - r0) * (q1 - q0) * (q1 - k0) for r0, r1, q0, q1, k0 in plan.pieces)
        first = attention.first_visible_key(tokens, EOS_ID, 512).tolist()
        opt_pieces, opt_elements = 0, 0
        for row in range(tokens.shape[0]):
            starts = [i for i in range(1, 1024) if int(tokens[row, i - 1]) == EOS_ID]
            cuts = _optimal_cuts(first[row], starts, 1024, overhead)
            opt_pieces += len(cuts)
            opt_elements += sum((b - a) * (b - first[row][a]) for a, b in cuts)
        now = c0 * len(plan.pieces) + c1 * elements
        best = c0 * opt_pieces + c1 * opt_elements
        print(
            f"  batch {seed}: mask allows {needed:,} scores; current plan {len(plan.pieces)} "
            f"calls / {elements:,} scores (model {now:.1f} ms per layer), optimal plan "
            f"{opt_pieces} calls / {opt_elements:,} scores (model {best:.1f} ms): {best / now:.2f}x"
        )


def _alternative_plans(overhead: float):  # noqa: ANN202
    """Replacements for attention.chunk_plan: per-row cost-optimal cuts, and one call per chunk."""
    from bytelatent.model import attention

    def optimal(dense, tokens, eos_id, window, chunk):  # noqa: ANN001, ANN202
        first = attention.first_visible_key(tokens, eos_id, window).tolist()
        pieces, allowed = [], []
        for row in range(tokens.shape[0]):
            starts = [i for i in range(1, tokens.shape[1]) if int(tokens[row, i - 1]) == eos_id]
            for a, b in _optimal_cuts(first[row], starts, tokens.shape[1], overhead):
                pieces.append((row, row + 1, a, b, first[row][a]))
                allowed.append(dense[row : row + 1, :, a:b, first[row][a] : b])
        return attention.ChunkPlan(seqlen=tokens.shape[1], pieces=pieces, allowed=allowed)

    def one_call(dense, tokens, eos_id, window, chunk):  # noqa: ANN001, ANN202
        first = attention.first_visible_key(tokens, eos_id, window)[:, ::chunk].amin(0).tolist()
        pieces, allowed = [], []
        for j, a in enumerate(range(0, tokens.shape[1], chunk)):
            b = min(tokens.shape[1], a + chunk)
            pieces.append((0, tokens.shape[0], a, b, first[j]))
            allowed.append(dense[:, :, a:b, first[j] : b])
        return attention.ChunkPlan(seqlen=tokens.shape[1], pieces=pieces, allowed=allowed)

    return {
        "current": attention.chunk_plan,
        "optimal cuts": optimal,
        "one call per chunk": one_call,
    }


def _entropy_bench_step():  # noqa: ANN202
    """(step(seed), model): one eager bf16 training step of the entropy bench on packed_batch."""
    from entropy_model_cpu import build_model, packed_batch

    from bytelatent.model.args import LMTransformerArgs

    args = LMTransformerArgs(
        dim=512,
        n_layers=8,
        n_heads=8,
        max_seqlen=1024,
        attn_impl="sdpa",
        sliding_window=512,
        ffn_dim_multiplier=1.0,
        attn_bias_type="local_block_causal",
    )
    model = build_model(args, compile_blocks=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)

    def step(seed: int = 0) -> None:
        x, y = packed_batch(4, 1024, seed)
        with torch.autocast("cpu", dtype=BF16):
            logits = model(x)
        F.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, model


def bench_entropy_profile() -> None:
    """Self CPU time of two eager bf16 entropy-bench steps, grouped as in blt_cpu_floor.py."""
    from blt_cpu_floor import GROUPS, group_of

    step, _ = _entropy_bench_step()
    step(0)
    step(1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step(2)
        step(3)
    shares = dict.fromkeys([*GROUPS, "other"], 0.0)
    for event in prof.key_averages():
        shares[group_of(event.key)] += event.self_cpu_time_total
    total = sum(shares.values())
    cells = ", ".join(f"{group} {100 * value / total:.1f}%" for group, value in shares.items())
    print(f"entropy step (2 steps, {total / 1e6:.2f} CPU s): {cells}")


def bench_chunk_plan_step(blocks: int = 4) -> None:
    """Entropy-bench training steps (bf16, packed documents, window 512) under each chunk plan,
    alternating blocks of 2 timed steps; float32 logits checked against the current plan's."""
    from entropy_model_cpu import packed_batch

    from bytelatent.model import attention

    step, model = _entropy_bench_step()
    plans = _alternative_plans(21_000)
    original = attention.chunked.chunk_plan
    x, _ = packed_batch(4, 1024, seed=0)

    def use(plan) -> Callable[[], None]:  # noqa: ANN001
        def switch() -> None:
            attention.chunked.chunk_plan = plan

        return switch

    try:
        with torch.no_grad():
            outputs = {}
            for name, plan in plans.items():
                use(plan)()
                outputs[name] = model(x)  # float32: plans differ only by rounding
        for name, out in outputs.items():
            diff = (out - outputs["current"]).abs().max().item()
            print(f"  {name}: logits max |difference| to the current plan {diff:.2e}")
        variants = {name: use(plan) for name, plan in plans.items()}
        times = alternating_steps(step, variants, blocks, 2)
    finally:
        attention.chunked.chunk_plan = original
    base = statistics.median(times["current"])
    for name, values in times.items():
        seconds = statistics.median(values)
        print(
            f"  {name}: {seconds:.3f} s per step, {4096 / seconds:,.0f} bytes/s "
            f"({base / seconds:.2f}x the current plan)"
        )


CASES = {
    "rmsnorm": bench_rmsnorm,
    "rmsnorm-model": bench_rmsnorm_model,
    "attention-backward": bench_attention_backward,
    "projections": bench_projections,
    "chunk-plan": bench_chunk_plan,
    "chunk-plan-step": bench_chunk_plan_step,
    "entropy-profile": bench_entropy_profile,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("case", choices=[*CASES, "all"])
    opts = parser.parse_args()
    print(f"load average {os.getloadavg()}, torch threads {torch.get_num_threads()}")
    for name, fn in CASES.items():
        if opts.case in (name, "all"):
            fn()
    print(f"load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
