"""The H-Net's estimates: training FLOPs at the target ratios or the measured chunk counts (MFU)
and the activations autograd keeps (model-info.txt)."""

from __future__ import annotations

from typing import Any

from torch import nn

from bytelatent.archs.hnet.args import HNetArgs
from bytelatent.distributed.parallelize import checkpoint_blocks
from bytelatent.model.activations import _block_dims, _block_values_per_token
from bytelatent.model.flops import _block_params, mean_attended_keys


def hnet_training_flops(
    model_args: HNetArgs, data_args: object, bytes_per_chunk: list[float] | None = None
):
    """Analytic training FLOPs: stage s runs on L / B_{s-1} positions (B_{-1} = 1), the global
    transformer on L / B_{S-1}, where B_s is stage s's bytes per chunk: the measured
    `bytes_per_chunk` when given (`hnet_measured_flops`), else the target ratios N_0 ... N_s
    (an estimate: what the dry run and `model-info.txt` report)."""
    cumulative = model_args.cumulative_ratios() if bytes_per_chunk is None else bytes_per_chunk
    if len(cumulative) != len(model_args.stages):
        raise ValueError(f"bytes_per_chunk: {len(model_args.stages)} values expected")
    seq_len = data_args.seq_len
    per_byte, positions_per_byte = 0.0, 1.0
    for index, stage in enumerate(model_args.stages):
        block = model_args.stage_block_args(index)
        n_blocks = stage.n_layers_encoder + stage.n_layers_decoder
        positions = max(1.0, seq_len * positions_per_byte)
        keys = mean_attended_keys(max(1, round(positions)), stage.sliding_window)
        layer = 6 * _block_params(block) + 12 * stage.dim * keys
        router = 6 * (2 * stage.dim**2 + stage.dim**2)  # W_q, W_k, residual projection
        per_byte += positions_per_byte * (n_blocks * layer + router)
        positions_per_byte = 1.0 / max(cumulative[index], 1.0)
    glob = model_args.global_block_args()
    keys = mean_attended_keys(max(1, round(seq_len * positions_per_byte)))
    per_byte += (
        positions_per_byte
        * model_args.n_layers
        * (6 * _block_params(glob) + 12 * model_args.dim * keys)
    )
    per_byte += 6 * model_args.stages[0].dim * model_args.vocab_size  # LM head
    return lambda tokens, patches: tokens * per_byte


def hnet_measured_flops(model_args: HNetArgs, data_args: object, aux: dict[str, float]):
    """`ArchSpec.measured_flops`: the FLOPs counter at the chunk counts the forward measured
    (`aux` holds the interval means of `bytes_per_chunk/stage{s}`), or None when absent."""
    keys = [f"bytes_per_chunk/stage{s}" for s in range(len(model_args.stages))]
    if not all(key in aux for key in keys):
        return None
    return hnet_training_flops(model_args, data_args, [aux[key] for key in keys])


def hnet_activation_bytes(model: nn.Module, args: Any, tp: int = 1) -> int:
    """The H-Net's estimate (`arch: hnet`): blocks of stage s see seq_len / (N_0 ... N_{s-1})
    positions per row, the global transformer seq_len / (N_0 ... N_{S-1}) (the target ratios,
    not learned ones); sdpa's dense masks per stage; the logits. Routing, chunking, the EMA and
    the residual add a few values per position and stage, not counted."""
    hnet, micro_batch = args.model, args.data.batch_size
    mode = args.distributed.activation_checkpointing
    act_bytes = args.distributed.param_dtype.itemsize
    seq_len = args.data.seq_len
    positions = [seq_len / r for r in [1.0, *hnet.cumulative_ratios()]]  # per stage, then global
    kept, peak_recompute, masks = 0, 0, 0
    block_ids = {id(b) for b in checkpoint_blocks(model)}
    for path, module in model.named_modules():
        dims = _block_dims(module) if id(module) in block_ids else None
        if dims is None:
            continue
        level = int(path.split(".")[1]) if path.startswith("stages.") else len(hnet.stages)
        per_token, recompute = _block_values_per_token(dims, mode, tp)  # HNet.tp_plan: all
        tokens = int(micro_batch * positions[level])
        kept += per_token * tokens
        peak_recompute = max(peak_recompute, recompute * tokens)
    if hnet.attn_impl == "sdpa":
        masks = int(sum(micro_batch * p**2 for p in positions))
    logits = micro_batch * seq_len * hnet.vocab_size * (act_bytes + 4)
    return int((kept + peak_recompute + masks) * act_bytes + logits)
