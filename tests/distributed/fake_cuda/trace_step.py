"""Trace one training step of a model with fake CUDA tensors, on a CPU-only torch.

    python trace_step.py SHIM.so CASE_JSON
    python trace_step.py SHIM.so --serve     (cases on stdin, one process forked for each)

Run in a process of its own (tests/distributed/test_fake_cuda_trace.py): the shim
(fake_cuda_shim.cpp: a no-op CUDA device guard and CUDA hooks) is loaded before torch. The model
is built as the trainer builds it (meta device, `to_empty(device="cuda")`, `init_model_weights`),
under `FakeTensorMode`; then `Trainer.train_step` itself over two micro-batches: loss, backward,
clipping, the non-finite guard, fused AdamW and the scheduler. Every CUDA tensor is fake: nothing runs, but each op checks
devices, so a CPU tensor that meets CUDA ones fails, and a host read of device data (`.item()`,
`.tolist()`, `bool(t)`, a copy to the CPU: a sync on a GPU) raises where it is made.

Stand-ins, in this process only: pinned host copies (`pin_memory` has no fake kernel), so
`host_to_device` copies plainly; `nn.init.trunc_normal_` (it reads a value) draws a normal;
flex attention compiles with `aot_eager` (inductor cannot build kernels for a missing GPU).

CASE_JSON: {"argv": [config dotlist], "plant": null | "cpu_arange" | "item" | "cpu_tensor",
"host_syncs": ["module:function", ...] (optional: documented host syncs, counted)}.
Prints `TRACE OK ...` (with `host syncs NAME xCOUNT` per allowed sync) and exits 0, or prints `TRACE FAILED at FILE:LINE: message` (the innermost
frame of this repository's code, planted code included) and exits 1.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import traceback
from pathlib import Path

ctypes.CDLL(sys.argv[1], os.RTLD_GLOBAL | os.RTLD_NOW)  # before torch: its CUDA hooks are read once

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

REPO = Path(__file__).resolve().parents[3]
HERE = Path(__file__).resolve()
sys.path.insert(0, str(REPO))


class HostReadError(RuntimeError):
    """A host read of fake CUDA data: on a GPU, a device sync in the training step."""


def _host_read(name: str, method):
    def guarded(self, *args, **kwargs):
        if self.device.type == "cuda":
            raise HostReadError(f"{name} of a CUDA tensor: a host read (a device sync on a GPU)")
        return method(self, *args, **kwargs)

    return guarded


def _guarded_to(method):
    def to(self, *args, **kwargs):
        if self.device.type == "cuda":
            target = torch._C._nn._parse_to(*args, **kwargs)[0]
            if target is not None and target.type == "cpu":
                raise HostReadError("copy of a CUDA tensor to the CPU (a device sync on a GPU)")
        return method(self, *args, **kwargs)

    return to


def guard_host_reads() -> None:
    """Host reads of CUDA tensors raise where they are made (the traceback names the caller).
    Reads inside ops (boolean indexing, nonzero, repeat_interleave without output_size) already
    fail under FakeTensorMode: their output shape depends on data. A dispatch mode would see
    both, but torch.compile (flex) refuses to trace under one, so these are Tensor methods."""
    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu"):
        setattr(torch.Tensor, name, _host_read(name, getattr(torch.Tensor, name)))
    torch.Tensor.to = _guarded_to(torch.Tensor.to)


def install_stand_ins() -> None:
    import bytelatent.distributed.env as env_module
    import bytelatent.model.loss as loss_module

    def host_to_device(array, device):  # no fake kernel for pinning
        return torch.from_numpy(array).to(device, non_blocking=True)

    for module in (env_module, loss_module):
        if hasattr(module, "host_to_device"):
            module.host_to_device = host_to_device

    def trunc_normal_(tensor, mean=0.0, std=1.0, a=-2.0, b=2.0, generator=None):
        with torch.no_grad():
            return tensor.normal_(mean, std)

    torch.nn.init.trunc_normal_ = trunc_normal_
    torch.cuda.is_available = lambda: True  # autocast("cuda") stays on, as on a GPU
    torch.cuda.device_count = lambda: 1
    torch.cuda.current_device = lambda: 0
    torch.cuda.is_bf16_supported = lambda including_emulation=True: True
    # saved and restored around each compile once CUDA "is available"; there is no generator
    torch.cuda.get_rng_state = lambda device="cuda": torch.zeros(0, dtype=torch.uint8)
    torch.cuda.set_rng_state = lambda new_state, device="cuda": None
    torch.accelerator.is_available = lambda: False  # dynamo would ask the (absent) current stream
    _compile_flex_with_aot_eager()


def _compile_flex_with_aot_eager() -> None:
    """Where the attention code keeps its compiled flex_attention, put an aot_eager one."""
    from torch.nn.attention.flex_attention import flex_attention

    import bytelatent.model.attention as attention

    compiled = torch.compile(flex_attention, backend="aot_eager", dynamic=False)
    if hasattr(attention, "__path__"):  # a package: the compiled flex may sit in any module
        import importlib
        import pkgutil

        for info in pkgutil.iter_modules(attention.__path__, "bytelatent.model.attention."):
            importlib.import_module(info.name)
    modules = [attention] + [
        m for name, m in sys.modules.items() if name.startswith("bytelatent.model.attention.")
    ]
    patched = False
    for module in modules:
        if hasattr(module, "_flex_fn"):
            module._flex_fn = compiled
            patched = True
    if not patched:
        raise RuntimeError(
            "no `_flex_fn` found in bytelatent.model.attention: update trace_step.py"
        )


def synthetic_batch(args, rng: np.random.Generator):
    """A batch shaped like the data pipeline's: rows of bytes, a padded tail, and for a BLT patch
    lengths whose rows sum to L + 1 (first column 1, right-padded with 0)."""
    from bytelatent.data.batch import Batch
    from bytelatent.model.registry import get_arch

    bsz = args.data.batch_size
    spec = get_arch(args.arch)
    length = spec.row_length(args.data)
    x = rng.integers(4, 260, size=(bsz, length)).astype(np.int64)
    y = np.roll(x, -1, axis=1)
    mask = np.ones((bsz, length), dtype=bool)
    mask[-1, length - length // 4 :] = False  # padding in the last row
    lengths = None
    if spec.patched:
        cols = args.data.seq_len
        lengths = np.zeros((bsz, cols), dtype=np.int64)
        for row in range(bsz):
            parts, left = [1], length
            while left > 0 and len(parts) < cols:
                parts.append(int(min(left, rng.integers(4, 9))))
                left -= parts[-1]
            parts[-1] += left  # the last patch takes what is left
            lengths[row, : len(parts)] = parts
    return Batch(x=x, y=y, mask=mask, patch_lengths=lengths)


class StepHost:
    """What `Trainer.train_step` reads of a trainer, and the trainer's own step methods: the
    step traced is the one that trains, not a copy of it (no data, checkpoints or logging)."""

    def __init__(self, args, model, device) -> None:
        from bytelatent.model.registry import get_arch
        from bytelatent.trainer.distill_loss import build_extra_losses
        from bytelatent.trainer.guard import NonFiniteGuard
        from bytelatent.trainer.optim import build_optimizer
        from bytelatent.trainer.probe import NoProbe
        from bytelatent.trainer.trainer import Trainer

        self.args, self.model, self.device = args, model, device
        self.mesh, self.dp_size = None, 1
        self.optimizer, self.scheduler = build_optimizer(model, args.optim, args.steps, device.type)
        self.guard = NonFiniteGuard(self.optimizer, device)
        self.probe = NoProbe()
        self.tokenizer = args.data.tokenizer_args.build()
        self.logit_terms = build_extra_losses(args, device)
        self.aux_terms = (*get_arch(args.arch).aux_losses, *(t.spec for t in self.logit_terms))
        self.step = Trainer.train_step.__get__(self)
        self.forward_backward = Trainer.forward_backward.__get__(self)
        self._all_reduce_count = Trainer._all_reduce_count.__get__(self)


def allow_host_syncs(names: list[str]) -> dict[str, int]:
    """The named host syncs ("module:function(tensor, limit) -> int", e.g. H-Net's
    `padded_width`), each counted and standing in with its static bound `limit` (fake tensors hold
    no values); every other host read still raises. Returns the live call counts."""
    import importlib

    calls = dict.fromkeys(names, 0)
    for name in names:
        module_name, _, attr = name.partition(":")
        module = importlib.import_module(module_name)
        getattr(module, attr)  # the function must exist: a rename fails the trace here

        def stand_in(tensor, limit, _name=name):
            calls[_name] += 1
            return limit

        setattr(module, attr, stand_in)
    return calls


def trace(case: dict) -> str:
    from bytelatent.args import TrainArgs
    from bytelatent.config import parse_args
    from bytelatent.distributed.parallelize import init_model_weights
    from bytelatent.trainer.build import build_parallel_model

    args = parse_args(TrainArgs, [*case["argv"], "distributed.single_device_fsdp=false"])
    device = torch.device("cuda", 0)
    model = build_parallel_model(args, mesh=None)  # on meta, outside the fake mode
    if case.get("plant"):
        import plants

        plants.plant(case["plant"], model)
    rng = np.random.default_rng(0)
    batches = [synthetic_batch(args, rng) for _ in range(2)]  # two micro-batches: accumulation
    syncs = allow_host_syncs(case.get("host_syncs", []))
    guard_host_reads()
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device=device)  # as Trainer._build_model
        init_model_weights(model, seed=args.active_model_args().seed)
        model.train()
        out = StepHost(args, model, device).step(batches)
        devices = {str(t.device) for t in (*model.parameters(), out.loss_sum, out.grad_norm)}
        if devices != {"cuda:0"}:
            raise RuntimeError(f"parameters or step outputs on {sorted(devices)} after the step")
    n_params = sum(p.numel() for p in model.parameters())
    allowed = "".join(f", host syncs {name} x{n}" for name, n in syncs.items())
    return f"{type(model).__name__}, {n_params} parameters, {out.n_targets} targets{allowed}"


def user_frame(exc: BaseException) -> str:
    """FILE:LINE of the innermost frame of this repository's code (the trace helper excluded, and
    installed packages: CI's virtual environment lives inside the clone)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if f.filename.startswith(str(REPO)) and Path(f.filename) != HERE
              and "site-packages" not in Path(f.filename).parts]  # fmt: skip
    if not frames:
        return "?"
    frame = frames[-1]
    return f"{os.path.relpath(frame.filename, REPO)}:{frame.lineno}"


def run_case(case: dict) -> int:
    try:
        summary = trace(case)
    except Exception as e:  # noqa: BLE001 - the failure, with where it happened, is the result
        traceback.print_exc()
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        print(f"TRACE FAILED at {user_frame(e)}: {type(e).__name__}: {first[:300]}", flush=True)
        return 1
    print(f"TRACE OK {summary}", flush=True)
    return 0


def preload() -> None:
    """Import what `trace` imports, so that each forked case starts with it loaded."""
    import bytelatent.args
    import bytelatent.config
    import bytelatent.data.batch
    import bytelatent.distributed.parallelize
    import bytelatent.model.registry
    import bytelatent.trainer.build
    import bytelatent.trainer.guard
    import bytelatent.trainer.optim
    import bytelatent.trainer.probe
    import bytelatent.trainer.trainer  # noqa: F401


def serve() -> int:
    """One case per line of stdin (CASE_JSON plus "out" and "err": files for the case's stdout
    and stderr), each traced in a process forked from this one, which has imported torch, the shim
    and the trainer once (~4 CPU-s a case saved); answers each with `{"rc": EXIT_STATUS}` on
    stdout. A case's stand-ins and planted bugs stay in its own process."""
    preload()
    for line in sys.stdin:
        case = json.loads(line)
        sys.stdout.flush(), sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the case: its output to its files, its exit status to the parent
            code = 1
            try:
                for fd, name in ((1, "out"), (2, "err")):
                    os.dup2(os.open(case[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
                code = run_case(case)
            finally:
                sys.stdout.flush(), sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), flush=True)
    return 0


def main() -> int:
    sys.path.insert(0, str(HERE.parent))
    install_stand_ins()
    if sys.argv[2] == "--serve":
        return serve()
    return run_case(json.loads(sys.argv[2]))


if __name__ == "__main__":
    sys.exit(main())
