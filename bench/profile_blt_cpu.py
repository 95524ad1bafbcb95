"""torch.profiler table of training steps of the bench/blt_cpu.py model (where the time goes).

python bench/profile_blt_cpu.py --dtype bf16 --steps 2 --rows 25
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
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(opts.steps):
            step()
    print(f"load average {os.getloadavg()}; {opts.steps} steps")
    print(prof.key_averages().table(sort_by=opts.sort, row_limit=opts.rows))


if __name__ == "__main__":
    main()
