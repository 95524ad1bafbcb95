"""The H-Net's spec (torch-free: each hook imports what it needs when called)."""

from __future__ import annotations

from typing import Any

from bytelatent.archs.hnet.args import HNetArgs
from bytelatent.model.spec import Adapters, ArchSpec, AuxLoss, Forward, Sizes


def check_hnet_run(args: Any) -> None:
    """Cross-section rules of an H-Net run; `args` is a TrainArgs."""
    hnet = args.model
    if args.data.patcher_args.patching_mode != "byte" or args.data.add_patches:
        raise ValueError(
            "data.patcher_args.patching_mode: an H-Net chunks bytes itself; set "
            "data.patcher_args.patching_mode=byte and data.add_patches=false"
        )
    if hnet.max_seqlen < args.data.seq_len:
        raise ValueError(
            f"model.max_seqlen ({hnet.max_seqlen}) < data.seq_len ({args.data.seq_len}): "
            "RoPE tables would be too short; raise model.max_seqlen"
        )
    _check_hnet_fits_row(hnet, args.data.seq_len)
    if hnet.global_init is not None and args.checkpoint.init_ckpt_path:
        raise ValueError(
            "model.global_init and checkpoint.init_ckpt_path both initialise weights; set one"
        )
    _check_hnet_tp(hnet, args.distributed.tp_size)


# A stage whose target leaves fewer chunks than this per row has nothing to route: its main
# network sees one position (50 stages of N = 4 on 256-byte rows: stages 4-49 hold one chunk).
MIN_TARGET_CHUNKS_PER_ROW = 2


def _check_hnet_fits_row(hnet: HNetArgs, row: int) -> None:
    """The target ratios multiplied down to each stage must leave >= 2 chunks in a row."""
    for s, bytes_per_chunk in enumerate(hnet.cumulative_ratios()):
        chunks = row / bytes_per_chunk
        if chunks < MIN_TARGET_CHUNKS_PER_ROW:
            ratios = " x ".join(f"{t.target_ratio:g}" for t in hnet.stages[: s + 1])
            which = f"stages 0-{s}" if s else "stage 0"
            raise ValueError(
                f"model.stages[{s}].target_ratio: the targets of {which} ({ratios}) make "
                f"{bytes_per_chunk:.4g} bytes per chunk, {chunks:.3g} chunks in a row of "
                f"data.seq_len={row} bytes (at least {MIN_TARGET_CHUNKS_PER_ROW} needed); lower "
                "the target ratios, use fewer stages or longer rows"
            )


def _check_hnet_tp(hnet: HNetArgs, tp: int) -> None:
    """Tensor parallelism splits every block's heads (`HNet.tp_plan`): tp must divide them."""
    if tp <= 1:
        return
    heads = {f"model.stages[{i}].n_heads": s.n_heads for i, s in enumerate(hnet.stages)}
    heads["model.n_heads"] = hnet.n_heads
    if hnet.n_kv_heads is not None:
        heads["model.n_kv_heads"] = hnet.n_kv_heads
    for key, value in heads.items():
        if value % tp:
            raise ValueError(
                f"distributed.tp_size={tp} does not divide {key}={value} (tensor parallelism "
                "splits the heads of every H-Net block); change one of them"
            )


def _model() -> type:
    from bytelatent.archs.hnet.model import HNet

    return HNet


def _flops(model_args: Any, data_args: Any) -> Any:
    from bytelatent.archs.hnet.sizes import hnet_training_flops

    return hnet_training_flops(model_args, data_args)


def _measured_flops(model_args: Any, data_args: Any, aux: dict) -> Any:
    from bytelatent.archs.hnet.sizes import hnet_measured_flops

    return hnet_measured_flops(model_args, data_args, aux)


def _activation_bytes(model: Any, args: Any, tp: int = 1) -> int:
    from bytelatent.archs.hnet.sizes import hnet_activation_bytes

    return hnet_activation_bytes(model, args, tp)


def _warm_start(model: Any, model_args: Any) -> bool:
    from bytelatent.checkpoint.hf_llama import warm_start_global

    return warm_start_global(model, model_args)


def _hf_export(ckpt: str, out: str, entropy_model: Any, allow_window_mismatch: bool) -> list:
    from bytelatent.archs.hnet.hf import export_hnet_hf

    return export_hnet_hf(ckpt, out, entropy_model, allow_window_mismatch)


def _hf_import(hf_dir: str, out: str) -> str:
    from bytelatent.archs.hnet.hf import import_hnet_hf

    return import_hnet_hf(hf_dir, out)


def _actions(train_args: Any, rank: int) -> list:
    from bytelatent.archs.hnet.dc.monitor import hnet_actions

    return hnet_actions(train_args, rank)


def _generation_engine() -> type:
    from bytelatent.archs.hnet.generation import IncrementalHNet

    return IncrementalHNet


SPEC = ArchSpec(
    name="hnet",
    description="H-Net: dynamic chunking stages (learned byte boundaries) around a global "
    "transformer",
    args_class=HNetArgs,
    model=_model,
    forward=Forward(
        host_batch=True,
        # Σ_s alpha_s * ratio loss_s (alpha_s = model.stages[s].ratio_loss_weight)
        aux_losses=(AuxLoss("ratio_loss", 1.0),),
        aux_metrics=("ratio_loss/", "chunk_len_mean/", "bytes_per_chunk/"),
    ),
    sizes=Sizes(flops=_flops, measured_flops=_measured_flops, activation_bytes=_activation_bytes),
    adapters=Adapters(
        warm_start=_warm_start,
        # a save_pretrained-style folder with our names (transformers has no H-Net class)
        hf_export=_hf_export,
        hf_import=_hf_import,
        hf_model_types=("bytelatent_hnet",),
    ),
    check_run=check_hnet_run,
    generation_engine=_generation_engine,
    actions=_actions,
)
