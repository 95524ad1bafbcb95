"""The BLT's spec (torch-free: each hook imports what it needs when called)."""

from __future__ import annotations

from typing import Any

from bytelatent.archs.blt.args import ByteLatentTransformerArgs
from bytelatent.model.spec import Adapters, ArchSpec, Forward, Sizes
from bytelatent.tokenizers.constants import VOCAB_SIZE


def check_blt_run(args: Any) -> None:
    """Cross-section rules of a BLT run; `args` is a TrainArgs."""
    if args.model.global_init is not None and args.checkpoint.init_ckpt_path:
        raise ValueError(
            "model.global_init and checkpoint.init_ckpt_path both initialise weights; set one"
        )
    head, targets = args.model.boundary_head, args.data.boundary_targets
    if head != targets:
        raise ValueError(
            f"model.boundary_head={head} but data.boundary_targets={targets}: a boundary-head "
            "model is trained on the batches' boundary classes; set both (or neither)"
        )
    if head and (args.model.vocab_size != VOCAB_SIZE or args.model.pm_size):
        raise ValueError(
            f"model.boundary_head needs vocab_size={VOCAB_SIZE} and pm_size=0 (byte ids)"
        )
    if head and (other := sorted(set(args.eval.tasks) - {"bpb"})):
        raise ValueError(
            f"eval.tasks={other}: a boundary-head BLT is scored by bpb only (its logits hold "
            "byte-and-boundary classes; generation and the harness do not read them yet)"
        )
    if args.data.patcher_args.patching_mode == "byte" and not args.data.add_patches:
        return
    enc_len = args.model.max_encoder_seq_length
    if enc_len is not None and enc_len != args.data.max_encoder_seq_length:
        raise ValueError(
            f"model.max_encoder_seq_length ({enc_len}) != data.max_encoder_seq_length "
            f"({args.data.max_encoder_seq_length}); set them equal"
        )


def _model() -> type:
    from bytelatent.archs.blt.model import ByteLatentTransformer

    return ByteLatentTransformer


def _flops(model_args: Any, data_args: Any) -> Any:
    from bytelatent.archs.blt.sizes import blt_training_flops

    return blt_training_flops(model_args, data_args)


def _activation_bytes(model: Any, args: Any, tp: int = 1) -> int:
    from bytelatent.model.activations import activation_bytes

    return activation_bytes(model, args, tp)


def _lower_bound(args: Any) -> tuple[int, int]:
    from bytelatent.archs.blt.sizes import blt_lower_bound

    return blt_lower_bound(args)


def _read_params(params: dict, where: str) -> Any:
    from bytelatent.archs.blt.reference_compat import blt_args_from_params

    return blt_args_from_params(params, where)


def _patcher_settings(params: dict) -> dict:
    from bytelatent.archs.blt.reference_compat import patcher_fields_from_params

    return patcher_fields_from_params(params)


def _config_format_hint(tree: dict, path: str | None) -> str | None:
    from bytelatent.archs.blt.reference_format import looks_like_reference, reference_hint

    return reference_hint(path) if looks_like_reference(tree) else None


def _reference_state_dict(state: dict, args: Any) -> Any:
    from bytelatent.archs.blt.reference_compat import adapt_reference_blt_state_dict

    return adapt_reference_blt_state_dict(state, args)


def _warm_start(model: Any, model_args: Any) -> bool:
    from bytelatent.checkpoint.hf_llama import warm_start_global

    return warm_start_global(model, model_args)


def _hf_export(ckpt: str, out: str, entropy_model: Any, allow_window_mismatch: bool) -> list:
    from bytelatent.archs.blt.hf import export_hf

    return export_hf(ckpt, out, entropy_model, allow_window_mismatch)


def _hf_import(hf_dir: str, out: str) -> str:
    from bytelatent.archs.blt.hf import import_hf

    return import_hf(hf_dir, out)


def _generation_engine() -> type:
    from bytelatent.archs.blt.generation import IncrementalBLT

    return IncrementalBLT


SPEC = ArchSpec(
    name="blt",
    description="Byte Latent Transformer: local encoder, global latent transformer over "
    "patches, local decoder",
    args_class=ByteLatentTransformerArgs,
    legacy_section="model",
    model=_model,
    forward=Forward(patched=True, batch_inputs=("patch_lengths",), host_batch=True),
    sizes=Sizes(flops=_flops, activation_bytes=_activation_bytes, lower_bound=_lower_bound),
    adapters=Adapters(
        read_params=_read_params,
        patcher_settings=_patcher_settings,
        config_format_hint=_config_format_hint,
        reference_state_dict=_reference_state_dict,
        warm_start=_warm_start,
        hf_export=_hf_export,
        hf_import=_hf_import,
        hf_model_types=("blt", "blt_patcher"),
    ),
    check_run=check_blt_run,
    generation_engine=_generation_engine,
)
