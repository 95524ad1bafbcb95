"""Building the fake-CUDA shim (fake_cuda_shim.cpp) with g++ against the installed torch.

Used by the ``fake_cuda_shim`` session fixture (tests/conftest.py: one build per test run, shared
by the xdist workers) and by bench/generation_syncs.py.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import torch

from tests.limits import hang_limit

SOURCE = Path(__file__).resolve().parent / "fake_cuda_shim.cpp"
LIBRARY = "fake_cuda_shim.so"


def shim_skip_reason() -> str | None:
    """Why the shim cannot be built or loaded here, or None."""
    if torch.version.cuda is not None or torch.version.hip is not None:
        return "torch is built with a GPU backend: its own CUDA hooks are registered"
    if shutil.which("g++") is None:
        return "g++ not found (needed to build the fake-CUDA shim)"
    from torch.utils.cpp_extension import include_paths

    if not any((Path(p) / "ATen/detail/CUDAHooksInterface.h").exists() for p in include_paths()):
        return "torch's C++ headers are not installed"
    return None


def build_shim(folder: Path, timeout: float | None = None) -> Path:
    """Compile the shim into ``folder``; its path. Raises RuntimeError with g++'s output."""
    from torch.utils.cpp_extension import include_paths, library_paths

    out = Path(folder) / LIBRARY
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    cmd = ["g++", "-shared", "-fPIC", "-O0", "-std=c++20", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
           *(f"-I{p}" for p in include_paths()), str(SOURCE), "-o", str(out),
           *(f for p in library_paths() for f in (f"-L{p}", f"-Wl,-rpath,{p}")),
           "-lc10", "-ltorch_cpu"]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout or hang_limit(600))
    if res.returncode != 0:
        raise RuntimeError(f"g++ could not build the fake-CUDA shim:\n{res.stderr[-3000:]}")
    return out
