"""The byte LM's args from a params.json (its spec's `read_params`): our layout or the
reference's, including the released entropy model's flat one."""

from __future__ import annotations

import logging
from typing import Any

from pydantic import ValidationError

from bytelatent.archs.blt.reference_compat import lm_args_from_reference
from bytelatent.errors import CheckpointError, UserError
from bytelatent.model.args import LMTransformerArgs
from bytelatent.model.registry import arch_name_from_params, get_arch

logger = logging.getLogger("bytelatent")


def _is_byte_lm_run(params: dict[str, Any]) -> bool:
    """Whether params.json names an architecture whose args are the byte LM's (our layout)."""
    try:
        return get_arch(arch_name_from_params(params)).args_class is LMTransformerArgs
    except ValueError:
        return False


def lm_args_from_params(params: dict[str, Any], where: str = "params.json"):
    """(LMTransformerArgs, []) from a params.json dict: the `model` section of a byte LM run
    (`entropy_model` in files from before one section), or the released entropy model's flat
    layout; reference fields without effect are logged, not returned."""
    section = params.get("entropy_model")
    if not section and _is_byte_lm_run(params):
        section = params.get("model")
    if not section:
        section = params if "dim" in params and "n_layers" in params else None
    if not section:
        raise CheckpointError(
            f"{where}: no 'entropy_model' section; is this an entropy model checkpoint?"
        )
    try:
        return LMTransformerArgs.model_validate(section), []
    except ValidationError:
        pass  # e.g. the reference's vocab_size=-1: map it as the reference would
    try:
        args, ignored = lm_args_from_reference(section)
    except (ValidationError, ValueError, UserError) as exc:
        raise CheckpointError(f"{where}: entropy_model args invalid: {exc}") from None
    if ignored:
        logger.info("%s: reference fields without effect: %s", where, ignored)
    return args, []
