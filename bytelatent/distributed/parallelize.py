"""Apply TP, activation checkpointing, compile and FSDP2 to a model built on the meta device.

Order (as torchtitan): tensor parallel -> activation checkpointing -> torch.compile per block ->
FSDP2 per unit, then the root. Then the caller does `model.to_empty(device=...)` and
`init_model_weights(model, seed)`, which gives the same weights on every layout.

Every wrapper works in place and keeps parameter names unchanged (no `_checkpoint_wrapped_module`
or `_orig_mod` prefixes), so checkpoints and init-by-name do not depend on the layout.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from bytelatent.distributed.args import DistributedArgs
from bytelatent.errors import ConfigError

logger = logging.getLogger(__name__)


def parallelize_model(
    model: nn.Module, mesh: DeviceMesh | None, args: DistributedArgs
) -> nn.Module:
    """Parallelize `model` in place (and return it); `mesh` None means a single process."""
    if args.float8_recipe is not None:
        raise ConfigError(
            "distributed.float8_recipe: float8 training is not implemented in bytelatent; "
            "remove it (bf16 via distributed.model_dtype=bf16 is supported)"
        )
    tp_size = mesh["tp"].size() if mesh is not None else 1
    if tp_size > 1:
        apply_tp(model, mesh["tp"])
    if args.activation_checkpointing != "none":
        apply_activation_checkpointing(model, args.activation_checkpointing)
    if args.compile:
        apply_compile(model, args.compile_cache_size_limit)
    if mesh is not None:
        apply_fsdp(model, fsdp_mesh(mesh), args)
    return model


# ---------------------------------------------------------------------------------------------
# Tensor parallel


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Megatron-style TP of what `model.tp_plan(tp)` (`TPPlan`) declares.

    The blocks are split column/row parallel. With `sequence_parallel` (the LMTransformer's
    plan): vocab-sharded embedding with sequence-parallel output, sequence-parallel norms, and the
    residual stream is the local sequence shard (so tokens.shape[1] must be divisible by tp).
    Without (the BLT's plan: only `global_transformer.layers`), inputs and outputs of the blocks
    are replicated and everything else stays replicated over the TP group.
    """
    tp = tp_mesh.size()
    plan = model.tp_plan(tp) if hasattr(model, "tp_plan") else None
    if plan is None:
        raise ConfigError(
            f"distributed.tp_size={tp}: tensor parallelism is not supported for "
            f"{type(model).__name__}; set distributed.tp_size=1"
        )
    for blocks in plan.blocks:
        tp_parallelize_blocks(blocks, tp_mesh, sequence_parallel=plan.sequence_parallel)
    if not plan.sequence_parallel:
        return
    root = {
        plan.embedding: RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        plan.norm: SequenceParallel(),
        plan.output: ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    parallelize_module(model, tp_mesh, {name: style for name, style in root.items() if name})
    model.register_forward_pre_hook(functools.partial(_check_seq_divisible, tp=tp))
    _ignore_tp_output_view_warning()


def _ignore_tp_output_view_warning() -> None:
    """FSDP2 warns once per process that the FSDP-wrapped `tok_embeddings` (FSDPEmbedding) and
    `output` (FSDPLinear) "returned a view tensor ... can cause backward to fail or produce wrong
    gradients". The view is DTensor.to_local()'s (use_local_output of the TP plan above), and the
    harm needs an in-place op on it: LMTransformer.forward only feeds the embedding to the first
    block (`x + ...`, out of place) and the logits to `.float()` and the cross-entropy, and
    tests/distributed/test_multirank.py checks TP losses and gradients against one process. Only
    those two modules' warning is ignored, and only once a TP plan made their outputs views."""
    import warnings

    warnings.filterwarnings(
        "ignore",
        message=r"FSDP2-wrapped module \((FSDPEmbedding|FSDPLinear)\) returned a view tensor",
        category=UserWarning,
    )


def _check_seq_divisible(module: nn.Module, inputs: tuple, tp: int) -> None:
    seqlen = inputs[0].shape[1]
    if seqlen % tp:
        raise ConfigError(
            f"sequence length {seqlen} is not divisible by distributed.tp_size={tp} "
            "(sequence parallelism splits it); change data.seq_len or tp_size"
        )


def tp_parallelize_blocks(
    blocks: nn.ModuleList, tp_mesh: DeviceMesh, sequence_parallel: bool
) -> None:
    """Split each TransformerBlock's heads and FFN width over `tp_mesh`.

    With sequence_parallel the block input/output is the local sequence shard (Shard(1)) and the
    norms run on it; without, input and output are full replicated tensors.
    """
    tp = tp_mesh.size()
    for index, block in enumerate(blocks):
        attention = block.attention
        if attention.n_heads % tp or attention.n_kv_heads % tp:
            raise ConfigError(
                f"distributed.tp_size={tp} must divide the attention heads "
                f"(n_heads={attention.n_heads}, n_kv_heads={attention.n_kv_heads}) of "
                f"block {index}; change the model's n_heads/n_kv_heads or tp_size"
            )
        plan: dict[str, Any] = {
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
        }
        if sequence_parallel:
            # one layout per positional input of Attention.forward(x, freq_cis, mask)
            seq, full = (Shard(1), None, None), (Replicate(), None, None)
            plan |= {
                "attention_norm": SequenceParallel(),
                "attention": PrepareModuleInput(input_layouts=seq, desired_input_layouts=full),
                "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                "ffn_norm": SequenceParallel(),
                "feed_forward": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                ),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            }
        else:
            plan |= {
                "attention.wo": RowwiseParallel(),
                "feed_forward.w2": RowwiseParallel(),
            }
        parallelize_module(block, tp_mesh, plan)
        # Column-parallel q/k/v give each rank n_heads / tp heads of the same size.
        attention.n_heads //= tp
        attention.n_kv_heads //= tp


# ---------------------------------------------------------------------------------------------
# Activation checkpointing and compile


def checkpoint_blocks(model: nn.Module) -> list[nn.Module]:
    """Blocks to checkpoint/compile: `model.ac_units()` if defined, else every entry of every
    ModuleList named `layers` (LMTransformer.layers; BLT local encoder/decoder and global)."""
    if hasattr(model, "ac_units"):
        return list(model.ac_units())
    blocks: list[nn.Module] = []
    for name, module in model.named_modules():
        if name.rpartition(".")[2] == "layers" and isinstance(module, nn.ModuleList):
            blocks.extend(module)
    return blocks


# Ops whose outputs selective checkpointing keeps: the matmuls and attention (expensive to
# recompute) and TP collectives (recomputing them would add communication). Everything else in
# a block (norms, RoPE, SiLU, products, residual adds) is cheap and recomputed in backward.
_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops._c10d_functional.all_reduce.default,
    torch.ops._c10d_functional.all_gather_into_tensor.default,
}
# attention kernels of the flex_attention and xformers backends, saved too when they exist:
# (namespace, op) pairs looked up lazily (xformers registers its ops when it is imported)
_OPTIONAL_SAVE_OPS = (
    ("aten", "_flash_attention_forward"),  # xformers' flash path on PyTorch builds with it
    ("aten", "_efficient_attention_forward"),  # xformers' cutlass path on PyTorch builds
    ("xformers", "efficient_attention_forward_cutlass"),
    ("xformers", "efficient_attention_forward_ck"),
    ("xformers_flash", "flash_fwd"),
    ("xformers_flash3", "flash_fwd"),
    ("bytelatent", "chunked_attention"),  # the CPU chunk plan's op (model/attention/chunked.py)
)


@functools.cache
def _save_ops(xformers_loaded: bool) -> frozenset:
    """_SAVE_OPS plus the flex_attention operator and the attention ops of _OPTIONAL_SAVE_OPS
    that are registered (the xformers ones only once xformers is imported)."""
    ops = set(_SAVE_OPS)
    try:
        from torch._higher_order_ops.flex_attention import flex_attention  # torch's flex stack
    except ImportError:  # pragma: no cover - torch builds without flex_attention
        flex_attention = None
    if flex_attention is not None:
        ops.add(flex_attention)
    for namespace, name in _OPTIONAL_SAVE_OPS:
        if namespace.startswith("xformers") and not xformers_loaded:
            continue
        try:
            ops.add(getattr(getattr(torch.ops, namespace), name).default)
        except (AttributeError, RuntimeError):
            continue
    return frozenset(ops)


def _selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    if op in _save_ops("xformers" in sys.modules):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context() -> tuple[Any, Any]:
    return create_selective_checkpoint_contexts(_selective_policy)


def apply_activation_checkpointing(model: nn.Module, mode: str) -> None:
    """Wrap each block's forward in non-reentrant checkpointing (`full` or `selective`).

    `full` keeps only the block input and recomputes the whole block in backward; `selective`
    additionally keeps matmul and attention outputs (see _SAVE_OPS), so backward only redoes
    the element-wise ops: less memory saved than full, but almost no extra compute.
    """
    if mode not in ("full", "selective"):
        raise ConfigError(f"distributed.activation_checkpointing={mode!r} is unknown")
    blocks = checkpoint_blocks(model)
    if not blocks:
        raise ConfigError(
            f"distributed.activation_checkpointing={mode}: {type(model).__name__} has no "
            "`layers` blocks to checkpoint"
        )
    for block in blocks:
        _checkpoint_forward(block, mode)


def _checkpoint_forward(block: nn.Module, mode: str) -> None:
    inner = block.forward
    options: dict[str, Any] = {"use_reentrant": False}
    if mode == "selective":
        options["context_fn"] = _selective_context

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(inner, *args, **options, **kwargs)

    # An instance attribute, so module hooks (FSDP) still run around it and names are unchanged.
    block.forward = forward


def apply_compile(model: nn.Module, cache_size_limit: int = 8, backend: str = "inductor") -> None:
    """torch.compile each block in place (identical blocks share one compiled graph).

    Past `cache_size_limit` recompiles of a block dynamo would run it eagerly without a word
    (slower, and more memory); `fail_on_recompile_limit_hit` makes that an error naming the
    limit. Shapes that change with the data (H-Net's inner widths, validation lengths, a short
    last batch) take dynamo's automatic dynamic shapes: one more graph, not one per shape."""
    torch._dynamo.config.cache_size_limit = cache_size_limit
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    for block in checkpoint_blocks(model):
        block.compile(backend=backend)


# ---------------------------------------------------------------------------------------------
# FSDP2


def fsdp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """HSDP mesh (dp_replicate, dp_shard) when replicating, else the 1-D dp_shard mesh."""
    if mesh["dp_replicate"].size() > 1:
        return mesh["dp_replicate", "dp_shard"]
    return mesh["dp_shard"]


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    if hasattr(model, "fsdp_units"):
        return list(model.fsdp_units())
    return list(model.layers)


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, args: DistributedArgs) -> None:
    """fully_shard each unit of `model.fsdp_units()` (or `model.layers`), then the root.

    Params are all-gathered in `model_dtype` and gradients reduced in `fsdp_reduce_dtype`
    (fp32 by default); sharded params and optimizer state stay fp32.
    """
    policy = MixedPrecisionPolicy(param_dtype=args.param_dtype, reduce_dtype=args.reduce_dtype)
    units = fsdp_units(model)
    for index, unit in enumerate(units):
        # a unit may keep its own parameter dtype (H-Net's fp32 residual projection)
        if (unit_dtype := getattr(unit, "fsdp_param_dtype", None)) is not None:
            unit_policy = MixedPrecisionPolicy(
                param_dtype=unit_dtype, reduce_dtype=args.reduce_dtype
            )
        else:
            unit_policy = policy
        fully_shard(
            unit, mesh=dp_mesh, mp_policy=unit_policy,
            reshard_after_forward=_reshard_after_forward(unit, index, len(units), args),
        )  # fmt: skip
    fully_shard(model, mesh=dp_mesh, mp_policy=policy)


def _reshard_after_forward(
    unit: nn.Module, index: int, n_units: int, args: DistributedArgs
) -> bool:
    """Free a unit's gathered parameters after its forward (re-gathered for backward)?

    Not the last unit (its backward runs right after its forward), and not lookup tables (hash
    and n-gram embeddings): embedding backward needs only the ids, yet a resharded table would be
    all-gathered again just to hold its gradient.
    """
    if isinstance(unit, nn.Embedding):
        return False
    return args.reshard_after_forward and index < n_units - 1


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Turn FSDP gradient reduction on/off (off for all but the last micro-batch).

    With sync off FSDP2 accumulates unsharded gradients locally and reduce-scatters their sum
    once; a model without FSDP is left alone.
    """
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_requires_gradient_sync(enabled, recurse=False)


def forward_context(
    mesh: DeviceMesh | None, args: DistributedArgs, device_type: str
) -> contextlib.AbstractContextManager:
    """Autocast to model_dtype when FSDP is not there to cast (single process), else no-op."""
    if mesh is None and args.model_dtype != "fp32":
        return torch.autocast(device_type, dtype=args.param_dtype)
    return contextlib.nullcontext()


# ---------------------------------------------------------------------------------------------
# Initialisation


def _param_slots(model: nn.Module) -> Iterator[tuple[nn.Module, str, torch.Tensor]]:
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                yield module, name, param


@torch.no_grad()
def init_model_weights(model: nn.Module, seed: int) -> None:
    """Run `model.init_weights()` so every layout gets the single-process weights for `seed`.

    DTensor random init cannot be trusted for this (on a CPU mesh every shard gets the same
    numbers; on CUDA the values depend on the layout). Instead rank 0 swaps in full-size CPU
    tensors, runs `init_weights()` under a forked CPU RNG seeded with `seed`, and each full
    tensor is broadcast (one at a time) and cut into this rank's shard. Other ranks run
    `init_weights()` on meta stand-ins, so their non-parameter buffers (RoPE tables) are
    recomputed too. Rank 0 needs host memory for one full fp32 copy of the parameters.
    """
    slots = list(_param_slots(model))
    if any(param.is_meta for _, _, param in slots):
        raise RuntimeError(
            "init_model_weights: parameters are on meta; call model.to_empty(device=...) first"
        )
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    source = not distributed or dist.get_rank() == 0
    full: dict[int, torch.Tensor] = {}
    for _, _, param in slots:
        if id(param) not in full:  # tied parameters share one full tensor
            full[id(param)] = torch.empty(
                param.shape, dtype=param.dtype, device="cpu" if source else "meta"
            )
    try:
        for module, name, param in slots:
            module._parameters[name] = full[id(param)]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model.init_weights()
    finally:
        for module, name, param in slots:
            module._parameters[name] = param
    done: set[int] = set()
    for _, _, param in slots:
        if id(param) not in done:
            done.add(id(param))
            _copy_full_into(param, full.pop(id(param)), distributed)


def _copy_full_into(param: torch.Tensor, full: torch.Tensor, distributed: bool) -> None:
    device = param.device
    if distributed:
        buffer = full.to(device) if not full.is_meta else torch.empty_like(full, device=device)
        dist.broadcast(buffer, src=0)
    else:
        buffer = full.to(device)
    if isinstance(param, DTensor):
        shard = distribute_tensor(buffer, param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(shard.to_local())
    else:
        param.copy_(buffer)
