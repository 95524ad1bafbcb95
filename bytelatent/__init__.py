"""bytelatent: pretraining for byte-level language models (BLT and its entropy model)."""

import sys as _sys

__version__ = "0.1.0"

# Import names of setup.py's install_requires. A clone's `bytelatent/` imports under any python,
# its dependencies do not: `python -m bytelatent.train` outside the venv would end in a
# ModuleNotFoundError traceback from deep inside the package.
REQUIRED_MODULES = ("torch", "numpy", "pydantic", "omegaconf", "yaml", "pyarrow", "fsspec",
                    "zstandard")  # fmt: skip
INSTALL_HINT = (
    "python3 -m venv .venv && .venv/bin/pip install -e . (then source .venv/bin/activate)"
)


def missing_dependencies() -> list[str]:
    """The required modules this interpreter cannot find (found, not imported: ~1 ms)."""
    from importlib.util import find_spec

    return [name for name in REQUIRED_MODULES if find_spec(name) is None]


def _check_entry_point_dependencies() -> None:
    """Under `python -m bytelatent...` (argv[0] is "-m" while the package is imported): a missing
    dependency is one line and exit 2, not a traceback."""
    if _sys.argv[:1] != ["-m"]:
        return
    missing = missing_dependencies()
    if missing:
        import os

        names = ", ".join(repr(n) for n in missing)
        venv = os.path.join(".venv", "bin", "python")
        fix = f"run {venv} -m ... or source .venv/bin/activate" if os.path.exists(venv) else (
            f"run: {INSTALL_HINT}"
        )  # fmt: skip
        print(
            f"bytelatent: missing dependenc{'y' if len(missing) == 1 else 'ies'} {names} in "
            f"{_sys.executable}; {fix}",
            file=_sys.stderr,
        )
        raise SystemExit(2)


_check_entry_point_dependencies()


def load_pretrained(path, device="cpu", kind="auto", allow_arch_import=False):
    """Load `params.json` + `consolidated.pth` (released BLT layout or ours); returns (model, args).
    `allow_arch_import`: import the module an arch "pkg.module:name" in params.json names."""
    from bytelatent.checkpoint.pretrained import load_pretrained as _load

    return _load(path, device=device, kind=kind, allow_arch_import=allow_arch_import)


__all__ = ["load_pretrained", "__version__"]
