"""Where a bytelatent BLT training step goes, against the time budget the issue-11 targets allow.

One process, the bench/blt_cpu.py model and batch. It times bytelatent and Hugging Face's
BltForCausalLM steps interleaved (same load for both), then profiles bytelatent steps and sorts
every op's self CPU time into four groups:

- ``matmul``: aten::mm/addmm/bmm (the linears, already at the machine's bf16 GEMM rate);
- ``attention``: the CPU flash-attention kernel, forward and backward;
- ``optimizer``: the fused AdamW kernel (a dense update of every parameter: exact AdamW);
- ``other``: everything else (element-wise ops, casts, reductions, hash lookups, autograd).

The floor is what the first three cost per step in wall seconds (their share of the profile times
the unprofiled step time). A target "bytelatent >= R x HF" needs a step of at most HF / R; when the
floor alone exceeds that budget, no change outside those kernels reaches the target.

    python bench/blt_cpu_floor.py --dtype bf16 --ratio 3.0
    python bench/blt_cpu_floor.py --dtype fp32 --ratio 2.0
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from blt_cpu import BATCH, SEQ_LEN, make_train_step  # noqa: E402

GROUPS = {
    "matmul": ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"),
    "attention": (
        "aten::_scaled_dot_product_flash_attention_for_cpu",
        "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
    ),
    "optimizer": ("aten::_fused_adamw_",),
}


def timed(step, n: int) -> list[float]:  # noqa: ANN001
    times = []
    for _ in range(n):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return times


def group_of(name: str) -> str:
    for group, names in GROUPS.items():
        if name in names:
            return group
    return "other"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--ratio", type=float, default=3.0, help="target bytelatent / HF")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per round and model")
    parser.add_argument("--profile-steps", type=int, default=2)
    opts = parser.parse_args()
    print(f"load average before {os.getloadavg()}; torch threads {torch.get_num_threads()}")
    ours, _ = make_train_step("ours", opts.dtype)
    hf, _ = make_train_step("hf", opts.dtype)
    first = {"ours": ours(), "hf": hf()}  # warm-up, and the first-step losses
    ours(), hf()
    times = {"ours": [], "hf": []}
    for _ in range(opts.rounds):
        times["ours"] += timed(ours, opts.steps)
        times["hf"] += timed(hf, opts.steps)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(opts.profile_steps):
            ours()
    times["ours"] += timed(ours, opts.steps)  # the profiled window's neighbourhood
    shares = dict.fromkeys([*GROUPS, "other"], 0.0)
    for event in prof.key_averages():
        shares[group_of(event.key)] += event.self_cpu_time_total
    total = sum(shares.values())
    step_ours = statistics.median(times["ours"])
    step_hf = statistics.median(times["hf"])
    budget = step_hf / opts.ratio
    print(
        f"first-step loss ours {first['ours']:.6f} hf {first['hf']:.6f}; "
        f"{BATCH}x{SEQ_LEN} bytes, {opts.dtype}"
    )
    print(
        f"median step: ours {step_ours:.3f} s ({BATCH * SEQ_LEN / step_ours:,.0f} B/s), "
        f"HF {step_hf:.3f} s ({BATCH * SEQ_LEN / step_hf:,.0f} B/s); "
        f"ours / HF = {step_hf / step_ours:.2f}x"
    )
    print(f"target {opts.ratio}x HF needs a step <= {budget:.3f} s")
    print("| group | share of profiled CPU time | wall s per step |")
    print("|---|---|---|")
    floor = 0.0
    for group, value in shares.items():
        seconds = step_ours * value / total
        if group != "other":
            floor += seconds
        print(f"| {group} | {100 * value / total:.1f}% | {seconds:.3f} |")
    verdict = "above" if floor > budget else "below"
    print(
        f"floor (matmul + attention + optimizer) {floor:.3f} s per step: {verdict} the "
        f"{budget:.3f} s budget; best case with 'other' at zero: {step_hf / floor:.2f}x HF"
    )
    print(f"load average after {os.getloadavg()}")


if __name__ == "__main__":
    main()
