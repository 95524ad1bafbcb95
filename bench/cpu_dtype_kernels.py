"""bf16 vs fp32 kernel speed on this CPU: the matmuls and the flash attention of bench/blt_cpu.py.

On a CPU without bf16 matmul instructions (no avx512_bf16 / AMX; oneDNN reports no bf16
support) a bf16 matmul falls back to a generic loop. This prints, at 1 thread, the median process
CPU time of each kernel in both dtypes so the gap is measured on the machine at hand:

    OMP_NUM_THREADS=1 python bench/cpu_dtype_kernels.py

and a debug-config training step three ways: bf16 on the bf16 kernels, bf16 on fp32 kernels over
bf16-rounded values (`bytelatent/model/cpu_bf16.py`), and fp32.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.nn.functional as F
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run from a checkout without installing

# the GEMM shapes of the bench model (local 4096 x 256 <-> 704, global 1028 x 512 -> 1408) and 1024^3
MATMULS = [(1024, 1024, 1024), (4096, 256, 704), (4096, 704, 256), (1028, 512, 1408)]
# local (batch 4, 4 heads, 1024 bytes) and global (8 heads, 257 patches) causal attention
ATTENTION = [(4, 4, 1024, 64), (4, 8, 257, 64)]


def cpu_ms(fn, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return sorted(times)[len(times) // 2] * 1e3


def matmul_ms(m: int, k: int, n: int, dtype: torch.dtype) -> float:
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    return cpu_ms(lambda: a @ b)


def attention_ms(shape: tuple[int, ...], dtype: torch.dtype) -> list[float]:
    """[forward ms, forward + backward ms] of causal sdpa (the CPU flash kernels)."""
    q, k, v = (torch.randn(*shape, dtype=dtype, requires_grad=True) for _ in range(3))
    grad = torch.randn(*shape, dtype=dtype)

    def forward() -> None:
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def forward_backward() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)

    return [cpu_ms(forward), cpu_ms(forward_backward)]


def debug_step_cpu_s(rounds: int = 3) -> dict[str, float]:
    """Median CPU s of a training step of the configs/debug.yaml BLT (batch 4 x 500 bytes, static
    4-byte patches, AdamW) after one warm-up step each, interleaved: bf16 autocast with the bf16
    kernels (`BYTELATENT_CPU_BF16=native`), bf16 autocast with fp32 kernels on bf16-rounded values
    (`=fp32`, the default where the CPU has no bf16 GEMMs), and fp32."""
    from bytelatent.archs.blt.args import ByteLatentTransformerArgs
    from bytelatent.archs.blt.model import ByteLatentTransformer
    from bytelatent.model import cpu_bf16

    with open(os.path.join(ROOT, "configs", "debug.yaml")) as f:
        model = ByteLatentTransformer(ByteLatentTransformerArgs(**yaml.safe_load(f)["model"]))
    model.init_weights()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(0)
    x = torch.randint(4, 260, (4, 500), generator=generator)
    y = torch.randint(4, 260, (4, 500), generator=generator)
    lengths = torch.full((4, 126), 4)
    lengths[:, 0], lengths[:, -1] = 1, 501 - 1 - 4 * 124  # rows sum to N + 1

    def step(name: str) -> float:
        bf16 = name != "fp32"
        os.environ[cpu_bf16.ENV] = "native" if name == "bf16-native" else "fp32"
        cpu_bf16.reread_env()
        start = time.process_time()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(x, lengths)
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return time.process_time() - start

    times: dict[str, list[float]] = {"bf16-native": [], "bf16-fp32-kernels": [], "fp32": []}
    for i in range(rounds + 1):
        for name in times:
            elapsed = step(name)
            if i:  # the first round warms up
                times[name].append(elapsed)
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}


def main() -> None:
    torch.set_num_threads(1)
    native = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    print(
        f"torch {torch.__version__}, cpu capability {torch.backends.cpu.get_cpu_capability()}, "
        f"oneDNN bf16 {native}, load average {os.getloadavg()}"
    )
    print("| matmul (m, k, n) | bf16 GFLOP/s | fp32 GFLOP/s |")
    print("|---|---|---|")
    for m, k, n in MATMULS:
        rates = []
        for dtype in (torch.bfloat16, torch.float32):
            rates.append(2 * m * k * n / matmul_ms(m, k, n, dtype) / 1e6)
        print(f"| {m} x {k} x {n} | {rates[0]:.1f} | {rates[1]:.1f} |")
    print(
        "| causal sdpa (b, h, n, d) | bf16 fwd ms | bf16 fwd+bwd ms | fp32 fwd ms | fp32 fwd+bwd ms |"
    )
    print("|---|---|---|---|---|")
    for shape in ATTENTION:
        cells = []
        for dtype in (torch.bfloat16, torch.float32):
            cells += attention_ms(shape, dtype)
        print(f"| {shape} | " + " | ".join(f"{c:.1f}" for c in cells) + " |")
    debug = debug_step_cpu_s()
    cells = ", ".join(f"{name} {seconds:.2f}" for name, seconds in debug.items())
    print(f"configs/debug.yaml BLT step, CPU s: {cells}")
    print(f"load average at the end {os.getloadavg()}")


if __name__ == "__main__":
    main()
