"""The byte LM's spec (the BLT's entropy model; torch-free: each hook imports when called)."""

from __future__ import annotations

from typing import Any

from bytelatent.model.args import LMTransformerArgs
from bytelatent.model.spec import Adapters, ArchSpec, Forward, Sizes


def check_entropy_run(args: Any) -> None:
    """Cross-section rules of an entropy-model (byte LM) run; `args` is a TrainArgs."""
    if args.data.patcher_args.patching_mode != "byte":
        raise ValueError(
            "data.patcher_args.patching_mode: the entropy model trains on bytes; "
            f"set it to 'byte' (got '{args.data.patcher_args.patching_mode}')"
        )
    if args.model.max_seqlen < args.data.seq_len:
        raise ValueError(
            f"model.max_seqlen ({args.model.max_seqlen}) < data.seq_len "
            f"({args.data.seq_len}): RoPE tables would be too short"
        )


def _model() -> type:
    from bytelatent.archs.lm.model import LMTransformer

    return LMTransformer


def _flops(model_args: Any, data_args: Any) -> Any:
    from bytelatent.archs.lm.sizes import lm_training_flops

    return lm_training_flops(model_args, data_args)


def _activation_bytes(model: Any, args: Any, tp: int = 1) -> int:
    from bytelatent.model.activations import activation_bytes

    return activation_bytes(model, args, tp)


def _lower_bound(args: Any) -> tuple[int, int]:
    from bytelatent.archs.lm.sizes import lm_lower_bound

    return lm_lower_bound(args)


def _read_params(params: dict, where: str) -> Any:
    from bytelatent.archs.lm.params import lm_args_from_params

    return lm_args_from_params(params, where)


def _hf_export(ckpt: str, out: str, entropy_model: Any, allow_window_mismatch: bool) -> list:
    # as transformers' BltPatcher: the format the BLT's HF adapter writes its entropy model in
    from bytelatent.archs.blt.hf import export_hf

    return export_hf(ckpt, out, entropy_model, allow_window_mismatch)


def _generation_engine() -> type:
    from bytelatent.archs.lm.generation import IncrementalLM

    return IncrementalLM


SPEC = ArchSpec(
    name="entropy",
    aliases=("lm",),
    description="byte-level LMTransformer (the BLT's entropy model)",
    args_class=LMTransformerArgs,
    legacy_section="entropy_model",
    model=_model,
    forward=Forward(host_batch=True),
    sizes=Sizes(flops=_flops, activation_bytes=_activation_bytes, lower_bound=_lower_bound),
    adapters=Adapters(read_params=_read_params, hf_export=_hf_export),
    check_run=check_entropy_run,
    generation_engine=_generation_engine,
)
