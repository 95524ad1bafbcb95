"""bytelatent: pretraining for byte-level language models (BLT and its entropy model)."""

__version__ = "0.1.0"


def load_pretrained(path, device="cpu", kind="auto", allow_arch_import=False):
    """Load `params.json` + `consolidated.pth` (released BLT layout or ours); returns (model, args).
    `allow_arch_import`: import the module an arch "pkg.module:name" in params.json names."""
    from bytelatent.checkpoint.pretrained import load_pretrained as _load

    return _load(path, device=device, kind=kind, allow_arch_import=allow_arch_import)


__all__ = ["load_pretrained", "__version__"]
