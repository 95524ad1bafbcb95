"""CPU flash attention, forward + backward, on bf16 q/k/v: the bf16 kernel against the fp32
kernel on the upcast values (what `BYTELATENT_CPU_BF16=fp32` runs in the sdpa backend).

    OMP_NUM_THREADS=1 python bench/cpu_attention_dtype.py [--rounds 5]

Shapes of `bench/blt_cpu.py`'s model (batch 4 x 1024 bytes, 4-byte patches): the local models'
self-attention (4 heads x 64, 1024 bytes) and the global transformer's (8 heads x 64, 256
patches), causal. Rows are interleaved within each round; the figure is the median over rounds
of process CPU seconds per forward + backward at 1 thread, with the load average beside it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

SHAPES = {"local (4x4x1024x64)": (4, 4, 1024, 64), "global (4x8x256x64)": (4, 8, 256, 64)}


def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fp32: bool) -> None:
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    if fp32:
        out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
        out = out.to(q.dtype)
    else:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out.backward(torch.ones_like(out))


def cpu_seconds(fn, repeats: int) -> float:
    start = time.process_time()
    for _ in range(repeats):
        fn()
    return (time.process_time() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    print(
        f"torch {torch.__version__}, cpu capability {torch.backends.cpu.get_cpu_capability()}, "
        f"oneDNN bf16 {torch.ops.mkldnn._is_mkldnn_bf16_supported()}, load {os.getloadavg()}"
    )
    tensors = {
        name: [torch.randn(shape, dtype=torch.bfloat16) for _ in range(3)]
        for name, shape in SHAPES.items()
    }
    rows = [(name, fp32) for name in SHAPES for fp32 in (False, True)]
    for name, fp32 in rows:  # warm-up
        step(*tensors[name], fp32)
    times: dict[tuple[str, bool], list[float]] = {row: [] for row in rows}
    for _ in range(args.rounds):
        for name, fp32 in rows:
            times[(name, fp32)].append(
                cpu_seconds(lambda n=name, f=fp32: step(*tensors[n], f), args.repeats)
            )
    print(f"{'shape':<22}{'bf16 kernel ms':>16}{'fp32 kernel ms':>16}{'fp32 / bf16':>13}")
    for name in SHAPES:
        bf16 = statistics.median(times[(name, False)]) * 1e3
        fp32 = statistics.median(times[(name, True)]) * 1e3
        print(f"{name:<22}{bf16:>16.1f}{fp32:>16.1f}{fp32 / bf16:>13.2f}")
    print(f"load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
