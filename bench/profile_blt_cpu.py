"""torch.profiler table of training steps of the bench/blt_cpu.py model (where the time goes).

python bench/profile_blt_cpu.py --dtype bf16 --steps 2 --rows 25
python bench/profile_blt_cpu.py --impl ours-compile --shapes   # matmuls and attention by shape

--shapes groups the matmul and attention kernels by their input shapes and prints the time per
step of each group, with the GFLOP/s of each matrix product (2*m*k*n per aten::mm): which shapes
run near the CPU's GEMM peak and which do not.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from blt_cpu import batch, build_hf, build_ours  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impl", default="ours", choices=["ours", "ours-compile", "hf"])
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--sort", default="self_cpu_time_total")
    parser.add_argument(
        "--shapes", action="store_true", help="matmul and attention time per input shape"
    )
    opts = parser.parse_args()
    torch.manual_seed(0)
    model = build_hf() if opts.impl == "hf" else build_ours(opts.impl == "ours-compile")
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x, y, lengths = batch(0)

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=opts.dtype == "bf16"):
            if opts.impl == "hf":
                logits = model(input_ids=x, patch_lengths=lengths).logits
            else:
                logits = model(x, lengths)
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        with torch.profiler.record_function("zero_grad"):
            optimizer.zero_grad(set_to_none=True)
        with torch.profiler.record_function("backward"):
            loss.backward()
        with torch.profiler.record_function("optimizer.step"):
            optimizer.step()

    for _ in range(opts.warmup):
        step()
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, record_shapes=opts.shapes) as prof:
        for _ in range(opts.steps):
            step()
    print(f"load average {os.getloadavg()}; {opts.steps} steps")
    if opts.shapes:
        print_shapes(prof, opts.steps, opts.rows)
    else:
        print(prof.key_averages().table(sort_by=opts.sort, row_limit=opts.rows))


def print_shapes(prof: torch.profiler.profile, steps: int, rows: int) -> None:
    """Matmul and attention kernels grouped by input shapes: ms per step, calls, GFLOP/s (mm)."""
    groups = []
    for event in prof.key_averages(group_by_input_shape=True):
        if event.key not in ("aten::mm", "aten::bmm") and "attention" not in event.key:
            continue
        ms = event.self_cpu_time_total / 1e3 / steps
        gflops = ""
        if event.key == "aten::mm" and ms > 0:
            (m, k), (_, n) = event.input_shapes[0], event.input_shapes[1]
            gflops = f"{2 * m * k * n * event.count / steps / ms / 1e6:.0f}"
        groups.append((ms, event.count / steps, event.key, event.input_shapes, gflops))
    groups.sort(key=lambda g: -g[0])
    print(f"{'ms/step':>8} {'calls':>6} {'GFLOP/s':>8}  op  input shapes")
    for ms, calls, key, shapes, gflops in groups[:rows]:
        shown = [s for s in shapes if s][:3]
        print(f"{ms:8.1f} {calls:6.1f} {gflops:>8}  {key}  {shown}")
    print(f"{sum(g[0] for g in groups):8.1f} ms/step in these kernels")


if __name__ == "__main__":
    main()
