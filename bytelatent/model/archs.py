"""The built-in architectures' specs (torch-free: everything that needs torch is a lazy reference).

`blt`: the Byte Latent Transformer (`model:` section). `entropy` (alias `lm`): the byte-level
LMTransformer, the BLT's entropy model (`entropy_model:` section). `hnet`: H-Net with dynamic
chunking (`arch_args:` section; docs/hnet.md). Their run checks (the
cross-section rules `TrainArgs` validates) live here too, next to the specs that name them.
"""

from __future__ import annotations

from typing import Any

from bytelatent.archs.blt.args import ByteLatentTransformerArgs
from bytelatent.archs.hnet.args import HNetArgs
from bytelatent.model.args import LMTransformerArgs
from bytelatent.model.registry import ArchSpec, AuxLoss, register_arch


def check_entropy_run(args: Any) -> None:
    """Cross-section rules of an entropy-model (byte LM) run; `args` is a TrainArgs."""
    if args.entropy_model is None:
        raise ValueError("entropy_model: must be set when arch=entropy (train_entropy_model=true)")
    if args.data.patcher_args.patching_mode != "byte":
        raise ValueError(
            "data.patcher_args.patching_mode: the entropy model trains on bytes; "
            f"set it to 'byte' (got '{args.data.patcher_args.patching_mode}')"
        )
    if args.entropy_model.max_seqlen < args.data.seq_len:
        raise ValueError(
            f"entropy_model.max_seqlen ({args.entropy_model.max_seqlen}) < data.seq_len "
            f"({args.data.seq_len}): RoPE tables would be too short"
        )


def check_blt_run(args: Any) -> None:
    """Cross-section rules of a BLT run; `args` is a TrainArgs."""
    if args.model is None:
        raise ValueError("model: must be set unless train_entropy_model=true")
    if args.model.global_init is not None and args.checkpoint.init_ckpt_path:
        raise ValueError(
            "model.global_init and checkpoint.init_ckpt_path both initialise weights; set one"
        )
    if args.data.patcher_args.patching_mode == "byte" and not args.data.add_patches:
        return
    enc_len = args.model.max_encoder_seq_length
    if enc_len is not None and enc_len != args.data.max_encoder_seq_length:
        raise ValueError(
            f"model.max_encoder_seq_length ({enc_len}) != data.max_encoder_seq_length "
            f"({args.data.max_encoder_seq_length}); set them equal"
        )


BLT = register_arch(
    ArchSpec(
        name="blt",
        description="Byte Latent Transformer: local encoder, global latent transformer over "
        "patches, local decoder",
        args_class=ByteLatentTransformerArgs,
        section="model",
        model="bytelatent.archs.blt.model:ByteLatentTransformer",
        patched=True,
        batch_inputs=("patch_lengths",),
        host_batch=True,
        flops="bytelatent.model.flops:blt_training_flops",
        activation_bytes="bytelatent.model.activations:activation_bytes",
        size_lower_bound="bytelatent.checkpoint.model_size:blt_lower_bound",
        check_run="bytelatent.model.archs:check_blt_run",
        read_params="bytelatent.checkpoint.pretrained:blt_args_from_params",
        reference_state_dict="bytelatent.archs.blt.reference_compat:adapt_reference_blt_state_dict",
        warm_start="bytelatent.checkpoint.hf_llama:warm_start_global",
        hf_export="bytelatent.archs.blt.hf:export_hf",
        hf_import="bytelatent.archs.blt.hf:import_hf",
        generation_engine="bytelatent.archs.blt.generation:IncrementalBLT",
    )
)

ENTROPY = register_arch(
    ArchSpec(
        name="entropy",
        aliases=("lm",),
        description="byte-level LMTransformer (the BLT's entropy model)",
        args_class=LMTransformerArgs,
        section="entropy_model",
        model="bytelatent.archs.lm.model:LMTransformer",
        host_batch=True,
        flops="bytelatent.model.flops:lm_training_flops",
        activation_bytes="bytelatent.model.activations:activation_bytes",
        size_lower_bound="bytelatent.checkpoint.model_size:lm_lower_bound",
        check_run="bytelatent.model.archs:check_entropy_run",
        read_params="bytelatent.checkpoint.pretrained:entropy_args_from_params",
        hf_export="bytelatent.archs.blt.hf:export_hf",  # as HF's BltPatcher
        generation_engine="bytelatent.archs.lm.generation:IncrementalLM",
    )
)


def check_hnet_run(args: Any) -> None:
    """Cross-section rules of an H-Net run; `args` is a TrainArgs."""
    hnet = args.arch_args
    if args.data.patcher_args.patching_mode != "byte" or args.data.add_patches:
        raise ValueError(
            "data.patcher_args.patching_mode: an H-Net chunks bytes itself; set "
            "data.patcher_args.patching_mode=byte and data.add_patches=false"
        )
    if hnet.max_seqlen < args.data.seq_len:
        raise ValueError(
            f"arch_args.max_seqlen ({hnet.max_seqlen}) < data.seq_len ({args.data.seq_len}): "
            "RoPE tables would be too short; raise arch_args.max_seqlen"
        )
    _check_hnet_fits_row(hnet, args.data.seq_len)
    if hnet.global_init is not None and args.checkpoint.init_ckpt_path:
        raise ValueError(
            "arch_args.global_init and checkpoint.init_ckpt_path both initialise weights; set one"
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
                f"arch_args.stages[{s}].target_ratio: the targets of {which} ({ratios}) make "
                f"{bytes_per_chunk:.4g} bytes per chunk, {chunks:.3g} chunks in a row of "
                f"data.seq_len={row} bytes (at least {MIN_TARGET_CHUNKS_PER_ROW} needed); lower "
                "the target ratios, use fewer stages or longer rows"
            )


def _check_hnet_tp(hnet: HNetArgs, tp: int) -> None:
    """Tensor parallelism splits every block's heads (`HNet.tp_plan`): tp must divide them."""
    if tp <= 1:
        return
    heads = {f"arch_args.stages[{i}].n_heads": s.n_heads for i, s in enumerate(hnet.stages)}
    heads["arch_args.n_heads"] = hnet.n_heads
    if hnet.n_kv_heads is not None:
        heads["arch_args.n_kv_heads"] = hnet.n_kv_heads
    for key, value in heads.items():
        if value % tp:
            raise ValueError(
                f"distributed.tp_size={tp} does not divide {key}={value} (tensor parallelism "
                "splits the heads of every H-Net block); change one of them"
            )


HNET = register_arch(
    ArchSpec(
        name="hnet",
        description="H-Net: dynamic chunking stages (learned byte boundaries) around a global "
        "transformer",
        args_class=HNetArgs,
        section="arch_args",
        model="bytelatent.archs.hnet.model:HNet",
        host_batch=True,
        # Σ_s alpha_s * ratio loss_s (alpha_s = arch_args.stages[s].ratio_loss_weight)
        aux_losses=(AuxLoss("ratio_loss", 1.0),),
        aux_metrics=("ratio_loss/", "chunk_len_mean/", "bytes_per_chunk/"),
        flops="bytelatent.archs.hnet.model:hnet_training_flops",
        measured_flops="bytelatent.archs.hnet.model:hnet_measured_flops",
        activation_bytes="bytelatent.model.activations:hnet_activation_bytes",
        check_run="bytelatent.model.archs:check_hnet_run",
        warm_start="bytelatent.checkpoint.hf_llama:warm_start_global",
        # a save_pretrained-style folder with our names (transformers has no H-Net class)
        hf_export="bytelatent.archs.hnet.hf:export_hnet_hf",
        hf_import="bytelatent.archs.hnet.hf:import_hnet_hf",
        generation_engine="bytelatent.archs.hnet.generation:IncrementalHNet",
        actions="bytelatent.archs.hnet.dc.monitor:hnet_actions",
    )
)
