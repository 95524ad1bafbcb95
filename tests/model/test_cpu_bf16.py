"""bf16 on a CPU without bf16 GEMMs: fp32 kernels on bf16-rounded values give a bf16 GEMM's numbers
(only the order of the fp32 sums differs), keep bf16 for backward, and the run log says so."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import yaml
from torch.utils._python_dispatch import TorchDispatchMode

from bytelatent.errors import ConfigError
from bytelatent.model import cpu_bf16
from bytelatent.model.attention.masks import Causal
from bytelatent.model.attention.sdpa import SdpaBackend
from bytelatent.model.cpu_bf16 import ENV, Linear, cpu_bf16_line
from bytelatent.train import main
from tests.conftest import TINY_ENTROPY
from tests.trainer.test_cli import REPO

BF = torch.bfloat16
SLOW_LINE = "its matmuls run 20-150x slower"
FP32_LINE = "matmuls and attention run as fp32 kernels on bf16-rounded inputs"


@pytest.fixture
def cpu_mode(monkeypatch):
    """Set BYTELATENT_CPU_BF16 (and whether the CPU has bf16 GEMMs) for this test only."""

    def set_mode(mode: str, native: bool | None = None) -> None:
        monkeypatch.setenv(ENV, mode)
        if native is not None:
            monkeypatch.setattr(cpu_bf16, "cpu_has_bf16_matmul", lambda: native)
        cpu_bf16.reread_env()

    yield set_mode
    monkeypatch.undo()
    cpu_bf16.reread_env()


class GemmDtypes(TorchDispatchMode):
    """The dtypes of the GEMM and attention kernels dispatched inside it (forward and backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[tuple[str, torch.dtype]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name()
        if any(key in name for key in ("mm", "linear", "attention", "matmul")):
            first = next(a for a in args if isinstance(a, torch.Tensor))
            self.seen.add((name, first.dtype))
        return func(*args, **(kwargs or {}))

    def dtypes(self) -> set[torch.dtype]:
        return {dtype for _, dtype in self.seen}


def _rounded_gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b of bf16-rounded values, summed in fp32, rounded to bf16: what the path must give."""
    return (a.to(BF).float() @ b.to(BF).float()).to(BF)


def _linear_grads(layer: Linear, x: torch.Tensor, grad: torch.Tensor, autocast: bool, kernel):
    layer.zero_grad()
    x = x.detach().requires_grad_()
    with GemmDtypes() as gemms:
        with torch.autocast("cpu", dtype=BF, enabled=autocast):
            out = layer(x)
        out.backward(grad)
    assert gemms.dtypes() == {kernel}, gemms.seen
    return out, x.grad, layer.weight.grad


@pytest.mark.parametrize("autocast", [False, True])
def test_linear_is_the_rounded_fp32_gemm_forward_and_backward(cpu_mode, autocast):
    cpu_mode("fp32")
    torch.manual_seed(0)
    layer = Linear(48, 40, bias=False)
    if not autocast:
        layer.to(BF)  # FSDP's all-gathered bf16 params: bf16 x and w, no autocast
    x = torch.randn(3, 7, 48, dtype=torch.float32 if autocast else BF)
    grad = torch.randn(3, 7, 40, dtype=BF)
    out, grad_x, grad_w = _linear_grads(layer, x, grad, autocast, torch.float32)
    w = layer.weight.detach()
    assert out.dtype == BF and grad_x.dtype == x.dtype and grad_w.dtype == w.dtype
    torch.testing.assert_close(out, _rounded_gemm(x, w.T), atol=0, rtol=0)
    torch.testing.assert_close(grad_x, _rounded_gemm(grad, w).to(x.dtype), atol=0, rtol=0)
    rows = grad.reshape(-1, 40)
    expected_w = _rounded_gemm(rows.T, x.reshape(-1, 48)).to(w.dtype)
    torch.testing.assert_close(grad_w, expected_w, atol=0, rtol=0)
    # and the bf16 kernels give the same numbers up to the order of their fp32 sums
    cpu_mode("native")
    out_n, grad_x_n, grad_w_n = _linear_grads(layer, x, grad, autocast, BF)
    for ours, native in ((out, out_n), (grad_x, grad_x_n), (grad_w, grad_w_n)):
        torch.testing.assert_close(ours.float(), native.float(), atol=2e-2, rtol=1e-2)


def test_linear_with_bias_and_what_it_keeps_for_backward_is_bf16(cpu_mode):
    cpu_mode("fp32")
    torch.manual_seed(0)
    layer = Linear(16, 8, bias=True)
    x = torch.randn(5, 16, requires_grad=True)
    kept: list[torch.dtype] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        kept.append(t.dtype)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=BF):
            out = layer(x)
    assert kept and all(dtype == BF for dtype in kept), kept
    expected = (_rounded_gemm(x, layer.weight.detach().T).float() + layer.bias.to(BF).float()).to(
        BF
    )
    torch.testing.assert_close(out, expected, atol=0, rtol=1e-2)  # bias added in fp32, one rounding
    out.float().sum().backward()
    assert layer.bias.grad.dtype == torch.float32
    torch.testing.assert_close(layer.bias.grad, torch.full((8,), 5.0))


def test_fp32_params_without_autocast_stay_fp32(cpu_mode):
    cpu_mode("fp32")
    layer = Linear(8, 4, bias=False)
    x = torch.randn(2, 8)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight), atol=0, rtol=0)
    assert layer(x).dtype == torch.float32


def test_sdpa_backend_runs_bf16_attention_in_fp32(cpu_mode):
    cpu_mode("fp32")
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 9, 8, dtype=BF, requires_grad=True) for _ in range(3))
    backend = SdpaBackend()
    with GemmDtypes() as gemms:
        out = backend.attend(q, k, v, backend.build(Causal()))
        out.float().sum().backward()
    assert gemms.dtypes() == {torch.float32}, gemms.seen
    expected = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    assert out.dtype == BF
    torch.testing.assert_close(out, expected.to(BF), atol=0, rtol=0)
    assert q.grad.dtype == BF


def test_blt_loss_and_grads_match_the_bf16_kernels(cpu_mode):
    """The whole debug BLT: the fp32-kernel path is as far from fp32 as the bf16 kernels are."""
    from bytelatent.archs.blt.args import ByteLatentTransformerArgs
    from bytelatent.archs.blt.model import ByteLatentTransformer

    torch.manual_seed(0)
    with open(REPO / "configs" / "debug.yaml") as f:
        model = ByteLatentTransformer(ByteLatentTransformerArgs(**yaml.safe_load(f)["model"]))
    model.init_weights()
    generator = torch.Generator().manual_seed(0)
    x = torch.randint(4, 260, (2, 128), generator=generator)
    y = torch.randint(4, 260, (2, 128), generator=generator)
    lengths = torch.full((2, 33), 4)
    lengths[:, 0], lengths[:, -1] = 1, 129 - 1 - 4 * 31

    def loss_and_grads(mode: str, bf16: bool):
        cpu_mode(mode)
        model.zero_grad()
        with GemmDtypes() as gemms:
            with torch.autocast("cpu", dtype=BF, enabled=bf16):
                logits = model(x, lengths)
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
            loss.backward()
        # every GEMM and attention kernel, forward and backward, in fp32 on the fp32-kernel path
        expected = {torch.float32} if mode == "fp32" or not bf16 else {BF}
        assert gemms.dtypes() == expected, sorted(map(str, gemms.seen))
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        return loss.item(), grads

    loss32, grads32 = loss_and_grads("native", bf16=False)
    loss_native, grads_native = loss_and_grads("native", bf16=True)
    loss_ours, grads_ours = loss_and_grads("fp32", bf16=True)

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a - b).norm() / b.norm()).item()

    assert abs(loss_ours - loss_native) < 2e-3 and abs(loss_native - loss32) < 2e-3
    # bf16 rounding (not fp32 throughout, which would be ~100x closer), and nothing worse
    bf16_error = rel(grads_native, grads32)
    assert 0.5 * bf16_error < rel(grads_ours, grads32) < 1.5 * bf16_error


def test_compiled_linears_take_the_fp32_path_in_one_graph(cpu_mode):
    cpu_mode("fp32")
    torch.manual_seed(0)
    stack = torch.nn.Sequential(Linear(16, 32), torch.nn.SiLU(), Linear(32, 16))
    x = torch.randn(4, 16)
    cpu_bf16.resolve()
    with torch.autocast("cpu", dtype=BF):
        eager = stack(x)
        compiled = torch.compile(stack, backend="aot_eager", fullgraph=True)(x)
    assert compiled.dtype == BF
    torch.testing.assert_close(compiled, eager, atol=0, rtol=0)


def test_the_mode_is_checked(cpu_mode):
    cpu_mode("fastest")
    with pytest.raises(ConfigError, match=f"{ENV}='fastest': use one of auto, fp32, native"):
        cpu_bf16.cpu_bf16_mode()


def test_the_line_says_what_runs(cpu_mode):
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    cpu_mode("auto", native=False)
    assert FP32_LINE in cpu_bf16_line(cpu, "bf16")
    assert cpu_bf16_line(cpu, "fp32") is None and cpu_bf16_line(cuda, "bf16") is None
    cpu_mode("auto", native=True)
    assert cpu_bf16_line(cpu, "bf16") is None
    cpu_mode("fp32", native=True)
    assert f"{ENV}=fp32" in cpu_bf16_line(cpu, "bf16")
    cpu_mode("native", native=False)
    assert SLOW_LINE in cpu_bf16_line(cpu, "bf16")


def test_a_training_run_logs_the_line_in_its_log_not_on_stderr(
    cpu_mode, monkeypatch, tmp_path, corpus_root, capsys
):
    cpu_mode("auto", native=False)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_JOB_ID", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(REPO)
    dump = tmp_path / "run"
    argv = [
        "config=configs/entropy_debug.yaml",
        *TINY_ENTROPY,
        "steps=1",
        f"dump_dir={dump}",
        f"data.root_dir={corpus_root}",
        "distributed.model_dtype=bf16",
        "checkpoint.dump.every=0",
    ]
    assert main(argv) == 0
    out = capsys.readouterr()
    assert FP32_LINE not in out.err  # stderr is for a failing run's one line
    assert sum(FP32_LINE in line for line in out.out.splitlines()) == 1
    assert sum(FP32_LINE in line for line in (dump / "train.log").read_text().splitlines()) == 1
