"""Recognise a reference (facebookresearch/blt) training config and name the converter.

`TrainArgs.config_format_hint` asks this module when a config fails to parse, so a reference file
gets one line pointing at the converter instead of its first unknown key. The converter itself
(`bytelatent/archs/blt/from_reference.py`) is not imported here: it sits above `TrainArgs`.
"""

from __future__ import annotations

from bytelatent.archs.blt.args import ByteLatentTransformerArgs
from bytelatent.archs.blt.reference_compat import reference_blt_fields

CONVERTER = "python -m bytelatent.archs.blt.from_reference"
# keys only the reference has: one of them at the top level marks a file as the reference's
REFERENCE_ONLY_TOP = frozenset({"probe_freq", "profiling", "eval_on_gpus", "async_eval_gpus"})


def looks_like_reference(tree: dict) -> bool:
    """True if a config tree uses keys only the reference's TrainArgs has."""
    if REFERENCE_ONLY_TOP & set(tree):
        return True
    model = tree.get("model")
    a_blt = tree.get("arch") in (None, "blt") and not tree.get("train_entropy_model")
    if a_blt and isinstance(model, dict):  # another arch's `model` holds its own args
        # only reference field names (a typo of ours gets the parser's did-you-mean instead)
        extra = set(model) - set(ByteLatentTransformerArgs.model_fields)
        return bool(extra) and extra <= reference_blt_fields()
    return False


def reference_hint(path: str | None = None) -> str:
    """The one line print_config / train show for a reference-format file."""
    where = f"{path}: " if path else ""
    target = path or "REF.yaml"
    return (
        f"{where}this is a reference (facebookresearch/blt) training config; convert it first: "
        f"{CONVERTER} {target} -o converted.yaml"
    )
