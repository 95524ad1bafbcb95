"""bytelatent: pretraining for byte-level language models (BLT and its entropy model)."""

__version__ = "0.1.0"


def load_pretrained(path, device="cpu", kind="auto"):
    """Load `params.json` + `consolidated.pth` (released BLT layout or ours); returns (model, args)."""
    from bytelatent.checkpoint.pretrained import load_pretrained as _load

    return _load(path, device=device, kind=kind)


__all__ = ["load_pretrained", "__version__"]
