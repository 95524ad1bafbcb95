"""CPU tensors that say ``cuda:0``: every op runs for real, every host sync is recorded at its line.

Load the fake-CUDA shim (tests/distributed/fake_cuda/fake_cuda_shim.cpp) before torch: it gives
CUDA a device guard, "available" hooks and a pinned host allocator. Then, inside ``SyncTrace()``,
``tag_module(model)`` makes the parameters and buffers ``Tagged`` (device cuda:0, values on the
CPU), factories with ``device="cuda"`` make tagged tensors, and host logic reads true values, so
generation and validation run as on a GPU. FakeTensorMode cannot do this (the host logic reads
values) and does not see host-to-device copies.

Recorded (each at the innermost frame of this repository, or of the checkout ``bytelatent`` is
imported from, outside this file, with its function):

* device-to-host reads: ``.item()``, ``bool()``, ``.tolist()``, ``.numpy()``, ``.cpu()``, a copy
  into a host tensor; ops whose output shape depends on device data (``nonzero``, boolean
  indexing, ...): each a sync on a GPU;
* host-to-device copies that make the host wait: a blocking copy (``.to(device)``,
  ``torch.tensor(data, device=...)``, ``copy_`` without ``non_blocking``: a stream sync), and a
  ``non_blocking`` copy from pageable (not pinned) memory, which waits as well;
* a host tensor (not a 0-d scalar) meeting device tensors in an op: an error on a GPU, or an
  implicit blocking copy when it indexes one.
"""

from __future__ import annotations

import collections
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

aten = torch.ops.aten
CUDA = torch.device("cuda", 0)
REPO = Path(__file__).resolve().parents[3]
_THIS = str(Path(__file__).resolve())

# outputs whose shape depends on the values of their (device) input: the host must wait for them
DATA_DEPENDENT = {
    aten.nonzero.default,
    aten.masked_select.default,
    aten.unique_consecutive.default,
    aten._unique2.default,
    aten.masked_scatter.default,
}
SCALAR_READS = {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.equal.default}
INDEX_PUTS = {aten.index_put_.default, aten.index_put.default, aten._index_put_impl_.default}
UNTOUCHED = {aten._pin_memory.default, aten.is_pinned.default}  # host-side pinning


class Tagged(torch.Tensor):
    """A tensor that reports ``cuda:0`` and holds its values in ``host`` (a CPU tensor)."""

    host: torch.Tensor

    @staticmethod
    def __new__(cls, host: torch.Tensor) -> Tagged:
        out = torch.Tensor._make_wrapper_subclass(
            cls,
            host.shape,
            strides=host.stride(),
            storage_offset=host.storage_offset(),
            dtype=host.dtype,
            device=CUDA,
            requires_grad=host.requires_grad,
        )
        out.host = host
        return out

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self) -> str:  # noqa: D105
        return f"Tagged({self.host!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"{func}: a tagged tensor outside SyncTrace")


def _tagged(value: object) -> bool:
    return isinstance(value, Tagged)


def _host(value: object) -> object:
    return value.host if isinstance(value, Tagged) else value


def _is_cuda(device: object) -> bool:
    return device is not None and torch.device(device).type == "cuda"


@dataclass(frozen=True)
class Site:
    """Where a sync happened: repository-relative file, line and the function's qualified name."""

    file: str
    line: int
    function: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line} ({self.function})"


def code_roots() -> tuple[str, ...]:
    """This repository, and the one ``bytelatent`` is imported from (bench/generation_syncs.py
    traces another checkout with these scenarios)."""
    roots = {str(REPO) + "/"}
    package = sys.modules.get("bytelatent")
    if package is not None and package.__file__:
        roots.add(str(Path(package.__file__).resolve().parents[1]) + "/")
    return tuple(sorted(roots, key=len, reverse=True))


def caller_site(roots: tuple[str, ...]) -> Site:
    """The innermost frame of the code under ``roots`` outside this file."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        root = next((r for r in roots if name.startswith(r)), None)
        # a virtual environment inside the clone (CI's .venv) holds torch: not our code
        if root is not None and name != _THIS and "/site-packages/" not in name:
            return Site(name[len(root) :], frame.f_lineno, frame.f_code.co_qualname)
        frame = frame.f_back
    return Site("?", 0, "?")


class SyncTrace:
    """``with SyncTrace() as trace:`` records ``trace.events[(kind, Site)] = count``."""

    def __init__(self) -> None:
        self.events: collections.Counter = collections.Counter()
        self._dispatch = _DispatchMode(self)
        self._functions = _FunctionMode(self)
        self._roots = code_roots()

    def record(self, kind: str) -> None:
        self.events[(kind, caller_site(self._roots))] += 1

    def take(self) -> collections.Counter:
        """The events since the last ``take`` (and forget them)."""
        events, self.events = self.events, collections.Counter()
        return events

    def __enter__(self) -> SyncTrace:
        self._dispatch.__enter__()
        self._functions.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._functions.__exit__(*exc)
        self._dispatch.__exit__(*exc)


class _DispatchMode(TorchDispatchMode):
    def __init__(self, trace: SyncTrace) -> None:
        super().__init__()
        self.trace = trace

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in UNTOUCHED:
            return func(*tree_map(_host, args), **kwargs)
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        on_device = any(_tagged(t) for t in tensors)
        to_cuda = _is_cuda(kwargs.get("device"))
        self._check(func, args, kwargs, tensors, on_device, to_cuda)
        if func is aten._to_copy.default and _tagged(args[0]) and not to_cuda:
            if kwargs.get("device") is not None:  # to the host: a plain host tensor
                return func(args[0].host, **kwargs)
        if func in SCALAR_READS:
            return func(*tree_map(_host, args), **kwargs)
        call_kwargs = dict(kwargs, device=torch.device("cpu")) if to_cuda else kwargs
        if func is aten._to_copy.default:
            call_kwargs = {k: v for k, v in call_kwargs.items() if k != "non_blocking"}
        out = func(*tree_map(_host, args), **tree_map(_host, call_kwargs))
        if func is aten.copy_.default:
            return args[0]  # in place: the destination, host or tagged
        if not (on_device or to_cuda):
            return out
        if func._schema.is_mutable and args and _tagged(args[0]) and out is args[0].host:
            return args[0]
        return tree_map(lambda t: Tagged(t) if isinstance(t, torch.Tensor) else t, out)

    def _check(self, func, args, kwargs, tensors, on_device: bool, to_cuda: bool) -> None:
        record = self.trace.record
        if func is aten._to_copy.default:
            src = args[0]
            if _tagged(src) and kwargs.get("device") is not None and not to_cuda:
                record("device-to-host copy (.cpu / .to(cpu))")
            elif not _tagged(src) and to_cuda:
                if not kwargs.get("non_blocking"):
                    record("blocking host-to-device copy (a stream sync)")
                elif not src.is_pinned():
                    record("non_blocking host-to-device copy from pageable memory (waits)")
            return
        if func is aten.copy_.default:
            dst, src = args[0], args[1]
            blocking = not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
            if _tagged(dst) and not _tagged(src) and src.dim() > 0:
                if blocking:
                    record("blocking host-to-device copy_ (a stream sync)")
                elif not src.is_pinned():
                    record("non_blocking host-to-device copy_ from pageable memory (waits)")
            elif _tagged(src) and not _tagged(dst):
                record("device-to-host copy_ into a host tensor")
            return
        if func in SCALAR_READS and any(_tagged(a) for a in args):
            record(f"host read of device data ({func.__name__}: .item / bool / int)")
            return
        if not on_device:
            return
        if func in DATA_DEPENDENT:
            record(f"data-dependent output shape ({func.__name__}) of device data")
            return
        if func is aten.index.Tensor or func in INDEX_PUTS:
            indices = [i for i in args[1] if i is not None]
            if any(i.dtype == torch.bool for i in indices):
                record("boolean-mask indexing of device data (a data-dependent shape)")
            if any(not _tagged(i) and i.dim() > 0 for i in indices):
                record("host index tensor into a device tensor (an implicit blocking copy)")
            if func in INDEX_PUTS and not _tagged(args[2]) and args[2].dim() > 0:
                record("host values written into a device tensor (an implicit blocking copy)")
            return
        if any(not _tagged(t) and t.dim() > 0 for t in tensors):
            record(f"host tensor meets device tensors in {func.__name__} (an error on a GPU)")


class _FunctionMode(TorchFunctionMode):
    """What never reaches the dispatcher: tensors built from Python data directly on the device,
    and ``tolist`` / ``numpy`` (they read the storage)."""

    def __init__(self, trace: SyncTrace) -> None:
        super().__init__()
        self.trace = trace

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.tensor, torch.as_tensor) and _is_cuda(kwargs.get("device")):
            self.trace.record(f"blocking host-to-device copy (torch.{func.__name__}(data, device))")
            return Tagged(func(*args, **dict(kwargs, device="cpu")))
        if func in (torch.Tensor.tolist, torch.Tensor.numpy) and args and _tagged(args[0]):
            self.trace.record(f"device-to-host read ({func.__name__})")
            return func(args[0].host, *args[1:], **kwargs)
        return func(*args, **kwargs)


def tag_module(module: torch.nn.Module) -> torch.nn.Module:
    """Parameters and buffers of ``module`` tagged as cuda:0 (values kept), in place."""
    for mod in module.modules():
        for name, param in list(mod._parameters.items()):
            if param is not None and not _tagged(param):
                mod._parameters[name] = torch.nn.Parameter(
                    Tagged(param.detach()), requires_grad=False
                )
        for name, buf in list(mod._buffers.items()):
            if buf is not None and not _tagged(buf):
                mod._buffers[name] = Tagged(buf)
    return module


def fake_cuda_is_available() -> None:
    """``torch.cuda`` answers as on a one-GPU host (the shim has no runtime to ask)."""
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    torch.cuda.current_device = lambda: 0
    torch.cuda._lazy_init = lambda: None
    torch.cuda.is_bf16_supported = lambda including_emulation=True: True
