"""RMSNorm: the CPU autograd function matches F.rms_norm's composite (forward bitwise)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bytelatent.model import layers
from bytelatent.model.layers import RMSNorm


def _reference(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype):
    """F.rms_norm in float32 through autograd's decomposition (the previous code path)."""
    return F.rms_norm(x.float(), (x.shape[-1],), weight, eps).to(out_dtype)


@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_function_matches_rms_norm(in_dtype: torch.dtype, out_dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    x0 = (torch.randn(3, 17, 64) * 3).to(in_dtype)
    w0 = 1 + 0.1 * torch.randn(64)
    grad = torch.randn(3, 17, 64).to(out_dtype)
    results = []
    for fn in (_reference, layers._RMSNormFunction.apply):
        x = x0.clone().requires_grad_()
        w = w0.clone().requires_grad_()
        y = fn(x, w, 1e-5, out_dtype)
        y.backward(grad)
        results.append((y, x.grad, w.grad))
    (y_ref, dx_ref, dw_ref), (y, dx, dw) = results
    assert y.dtype == out_dtype and dx.dtype == in_dtype
    assert torch.equal(y, y_ref)
    tol = 1e-5 if in_dtype == torch.float32 else 1e-2
    torch.testing.assert_close(dx.float(), dx_ref.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(dw, dw_ref, rtol=1e-5, atol=1e-5)


def test_gradcheck_in_float64_math() -> None:
    """The backward formula itself, checked numerically (fp64 bypasses the function: compare the
    function's fp32 gradient with the fp64 composite's)."""
    torch.manual_seed(1)
    x = torch.randn(5, 32, dtype=torch.float64, requires_grad=True)
    w = torch.randn(32, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(5, 32, dtype=torch.float64)
    F.rms_norm(x, (32,), w, 1e-6).backward(grad)
    x32 = x.detach().float().requires_grad_()
    w32 = w.detach().float().requires_grad_()
    layers._RMSNormFunction.apply(x32, w32, 1e-6, torch.float32).backward(grad.float())
    torch.testing.assert_close(x32.grad.double(), x.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(w32.grad.double(), w.grad, rtol=1e-4, atol=1e-5)


def test_module_uses_function_on_cpu_eager_and_autocast_dtype() -> None:
    norm = RMSNorm(16)
    norm.reset_parameters()
    x = torch.randn(2, 4, 16, requires_grad=True)
    assert layers._use_rmsnorm_function(x, norm.weight)
    assert norm(x).dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = norm(x)
    assert out.dtype == torch.bfloat16
    assert out.grad_fn is not None and "RMSNormFunction" in type(out.grad_fn).__name__
    # float64 keeps the exact composite (the function computes in float32)
    assert not layers._use_rmsnorm_function(x.double(), norm.weight)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_grad_forward_is_bitwise_the_autograd_forward(dtype: torch.dtype) -> None:
    """Without grad mode RMSNorm runs the fused op (generation, evaluation): same bits."""
    torch.manual_seed(0)
    norm = RMSNorm(64)
    torch.nn.init.normal_(norm.weight)
    for shape in [(1, 1, 64), (3, 7, 64)]:
        x = (3 * torch.randn(shape)).to(dtype)
        with torch.no_grad():
            fast = norm(x)
        assert torch.equal(fast, norm(x).detach())
