"""bf16 on a CPU without bf16 matmul instructions: the GEMMs in fp32 on bf16-rounded values.

On an x86 CPU without avx512_bf16 or AMX (oneDNN reports no bf16 support: AVX2-only servers, most
laptops) a bf16 matmul falls back to a generic loop, 16-46x slower than an fp32 one, and the CPU
flash attention's backward 3-3.6x (`bench/cpu_dtype_kernels.py`). Hardware that has bf16 GEMMs
multiplies bf16 inputs exactly and accumulates in fp32, then rounds the result to bf16. Here the
same numbers come from upcasting the bf16-rounded inputs (exact), an fp32 GEMM, and rounding the
result to bf16: only the order of the fp32 sums differs. Activations and what autograd keeps
stay bf16 for the linears (`Linear`); attention keeps its fp32 copies of q, k, v for backward.

`BYTELATENT_CPU_BF16` picks: ``auto`` (the default: fp32 GEMMs where the CPU lacks bf16 ones),
``fp32`` (always, on any CPU), ``native`` (the bf16 kernels, however slow).
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from bytelatent.errors import ConfigError

ENV = "BYTELATENT_CPU_BF16"
MODES = ("auto", "fp32", "native")


@functools.cache
def cpu_has_bf16_matmul() -> bool:
    """Whether oneDNN computes bf16 matmuls natively on this CPU (avx512_bf16, AMX, ARM bf16)."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def cpu_bf16_mode() -> str:
    """`BYTELATENT_CPU_BF16` resolved: ``fp32`` or ``native``."""
    mode = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise ConfigError(f"{ENV}={os.environ[ENV]!r}: use one of {', '.join(MODES)}")
    if mode == "auto":
        return "native" if cpu_has_bf16_matmul() else "fp32"
    return mode


_FP32_GEMMS: bool | None = None  # resolved on first use; `reread_env` resets it


def _fp32_gemms() -> bool:
    """The resolved mode, a module global: dynamo guards on it (`resolve` before compiling, so
    it never traces the CPU query)."""
    global _FP32_GEMMS
    if _FP32_GEMMS is None:
        _FP32_GEMMS = cpu_bf16_mode() == "fp32"
    return _FP32_GEMMS


def resolve() -> None:
    """Read `BYTELATENT_CPU_BF16` and the CPU now (before torch.compile traces a linear)."""
    _fp32_gemms()


def reread_env() -> None:
    """Resolve `BYTELATENT_CPU_BF16` again at the next use (after changing it in-process)."""
    global _FP32_GEMMS
    _FP32_GEMMS = None


def fp32_gemms(device_type: str, dtype: torch.dtype) -> bool:
    """Whether a bf16 GEMM on `device_type` runs as an fp32 one here (the mode is read once)."""
    return device_type == "cpu" and dtype == torch.bfloat16 and _fp32_gemms()


def cpu_bf16_line(device: torch.device, model_dtype: str) -> str | None:
    """The run log's line on how a bf16 run computes on this CPU (None: not a bf16 CPU run)."""
    if device.type != "cpu" or model_dtype != "bf16":
        return None
    native = cpu_has_bf16_matmul()
    if _fp32_gemms():
        why = "this CPU has no bf16 matmul instructions" if not native else f"{ENV}=fp32"
        return (
            f"distributed.model_dtype=bf16 on CPU: {why}, so matmuls and attention run as fp32 "
            "kernels on bf16-rounded inputs, results rounded to bf16 (a bf16 GEMM's numbers up to "
            f"the order of its fp32 sums; {ENV}=native runs the bf16 kernels)"
        )
    if not native:
        return (
            f"distributed.model_dtype=bf16 with {ENV}=native on a CPU without bf16 matmul "
            "instructions (no avx512_bf16/AMX): its matmuls run 20-150x slower than in fp32 here; "
            f"unset {ENV} for fp32 kernels on bf16-rounded values"
        )
    return None


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a matmul of x computes in: autocast's when autocast is on, else x's."""
    device_type = x.device.type
    if x.is_floating_point() and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype


def autocast_off(device_type: str) -> contextlib.AbstractContextManager:
    return torch.autocast(device_type, enabled=False)


class _Fp32Linear(torch.autograd.Function):
    """y = x @ w.T (+ b) of bf16 x, w, b computed in fp32 and rounded to bf16; the backward's two
    GEMMs the same way. Keeps bf16 x and w for backward, as a bf16 linear does."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        with autocast_off(x.device.type):
            out = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        with autocast_off(x.device.type):
            grad32 = grad.float()
            rows = grad32.reshape(-1, grad32.shape[-1])
            grad_x = grad_w = grad_b = None
            if ctx.needs_input_grad[0]:
                grad_x = (grad32 @ weight.float()).to(x.dtype)
            if ctx.needs_input_grad[1]:
                grad_w = (rows.T @ x.reshape(-1, x.shape[-1]).float()).to(weight.dtype)
            if ctx.has_bias and ctx.needs_input_grad[2]:
                grad_b = rows.sum(0).to(weight.dtype)
        return grad_x, grad_w, grad_b


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear`, with a bf16 one (bf16 inputs, or bf16 autocast) as fp32 GEMMs where
    `fp32_gemms` says so. Tensor-parallel (DTensor) weights keep `F.linear`."""
    dtype = compute_dtype(x)
    if (
        not fp32_gemms(x.device.type, dtype)
        or isinstance(weight, DTensor)
        or isinstance(x, DTensor)
    ):
        return F.linear(x, weight, bias)
    if weight.dtype != dtype and not torch.is_autocast_enabled(x.device.type):
        return F.linear(x, weight, bias)  # mixed dtypes without autocast: F.linear's own error
    # the casts autocast would make (their backward casts the gradients back), then fp32 GEMMs
    x, weight = x.to(dtype), weight.to(dtype)
    return _Fp32Linear.apply(x, weight, None if bias is None else bias.to(dtype))


class Linear(nn.Linear):
    """`nn.Linear` whose bf16 matmuls run as fp32 GEMMs on CPUs without bf16 ones (see module)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def fp32_attention(q: torch.Tensor) -> bool:
    """Whether attention over bf16 `q` (k, v alike) should run in fp32 here."""
    return fp32_gemms(q.device.type, q.dtype)
