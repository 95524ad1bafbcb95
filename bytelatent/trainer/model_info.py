"""`dump_dir/model-info.txt`: every parameter with its layout, totals, and a memory estimate per rank.

Works on a parallelized model on the meta device (the dry run) as well as on a real one (every
run writes it): only shapes, dtypes and DTensor placements are read, never values.

The memory estimate is analytic, per rank, for one micro-batch:

* parameters, gradients: this rank's shard in the parameters' dtype (fp32 master weights; FSDP
  reduces gradients into the same dtype), plus, under FSDP sharding, the unsharded
  `model_dtype` copies of the two largest FSDP units (one computing, one prefetched) and of the
  root's own parameters while they are gathered;
* optimizer state: AdamW's two moments per parameter of the shard, in the parameters' dtype;
* activations: what autograd keeps for backward, from the blocks' shapes (per token of a
  transformer block: 6·dim + 2·kv_dim + 4·ffn_hidden values without checkpointing, the block
  input plus matmul/attention outputs with `selective`, the block input with `full` plus one
  block recomputed), in `model_dtype`, plus the dense attention masks of `attn_impl=sdpa` and
  the logits and fp32 log-softmax of the loss. Not included: small tensors (hash ids, pooling
  indices), the allocator's fragmentation, communication buffers and the CUDA context. Against
  the tensors autograd really saves (bench/model_info_activations.py, debug configs on CPU) the
  estimate is 0.85x in fp32 and 0.7x in bf16 (CPU autocast keeps norms and the residual stream
  in fp32): read it as a lower bound.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from bytelatent.args import TrainArgs
from bytelatent.distributed.mesh import tp_rank_and_size
from bytelatent.distributed.parallelize import forward_context, fsdp_units
from bytelatent.model.loss import batch_loss_sum
from bytelatent.model.registry import get_arch
from bytelatent.trainer.optim import group_label
from bytelatent.trainer.run_files import write_text_atomic

GIB = 2**30
MODEL_INFO = "model-info.txt"


@dataclass(frozen=True)
class ParamInfo:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    numel: int  # global count (the whole tensor, over every shard)
    local_shape: tuple[int, ...]
    local_numel: int  # this rank's shard
    placement: str
    fsdp_sharded: bool  # split over a data-parallel shard dimension larger than 1

    @property
    def component(self) -> str:
        return self.name.split(".", 1)[0]


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank."""

    params: int
    grads: int
    optimizer: int
    activations: int
    gathered_params: int  # FSDP all-gather copies alive at once (0 without sharding)

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.gathered_params


def _fsdp_sharded(param: torch.Tensor) -> bool:
    if not isinstance(param, DTensor):
        return False
    names = param.device_mesh.mesh_dim_names or ()
    return any(
        name == "dp_shard" and size > 1 and p.is_shard()
        for name, size, p in zip(names, param.device_mesh.shape, param.placements)
    )


def _placement(param: torch.Tensor) -> str:
    if not isinstance(param, DTensor):
        return "local (whole tensor on this rank)"
    mesh = param.device_mesh
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    parts = [f"{name}={size}:{p}" for name, size, p in zip(names, mesh.shape, param.placements)]
    return "DTensor " + ", ".join(parts)


def parameter_table(model: nn.Module) -> list[ParamInfo]:
    """One row per distinct parameter (tied ones once, under their first name)."""
    rows = []
    for name, param in model.named_parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        rows.append(
            ParamInfo(
                name=name,
                shape=tuple(param.shape),
                dtype=param.dtype,
                numel=param.numel(),
                local_shape=tuple(local.shape),
                local_numel=local.numel(),
                placement=_placement(param),
                fsdp_sharded=_fsdp_sharded(param),
            )
        )
    return rows


def component_totals(rows: list[ParamInfo]) -> dict[str, tuple[int, int]]:
    """Top-level module name -> (global count, local count), in the model's order."""
    totals: dict[str, tuple[int, int]] = {}
    for row in rows:
        glob, loc = totals.get(row.component, (0, 0))
        totals[row.component] = (glob + row.numel, loc + row.local_numel)
    return totals


# ------------------------------------------------------------------------------ memory
def activation_bytes(model: nn.Module, args: TrainArgs, tp: int = 1) -> int:
    """The architecture's activation estimate (`Sizes.activation_bytes` of its spec); 0 without one."""
    estimate = get_arch(args.arch).sizes.activation_bytes
    return estimate(model, args, tp) if estimate is not None else 0


def estimate_memory(
    model: nn.Module, rows: list[ParamInfo], args: TrainArgs, tp: int = 1
) -> MemoryEstimate:
    local_bytes = sum(r.local_numel * r.dtype.itemsize for r in rows)
    gathered = 0
    if any(r.fsdp_sharded for r in rows):
        unit_sizes = sorted(
            (sum(p.numel() for p in unit.parameters()) for unit in fsdp_units(model)),
            reverse=True,
        )
        in_units = {id(p) for unit in fsdp_units(model) for p in unit.parameters()}
        root_only = sum(p.numel() for p in model.parameters() if id(p) not in in_units)
        gathered = (sum(unit_sizes[:2]) + root_only) * args.distributed.param_dtype.itemsize
    return MemoryEstimate(
        params=local_bytes,
        grads=local_bytes,
        optimizer=2 * local_bytes,
        activations=activation_bytes(model, args, tp),
        gathered_params=gathered,
    )


# ------------------------------------------------------------------------------ report
def _fmt_shape(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


# What the training log measures instead (trainer/metrics.py `peak_memory_gib`).
MEASURED_NOTE = (
    "  (tensors only, a lower bound; the log's `mem` / `peak_mem_gib` is measured: the CUDA "
    "allocator's peak on GPU, the process's peak RSS on CPU, which also counts the interpreter, "
    "libraries (~0.3 GiB) and allocator caches)"
)


def render(
    model: nn.Module, args: TrainArgs, world_size: int, rank: int, tp: int = 1
) -> tuple[str, int, MemoryEstimate]:
    """(model-info.txt text, global parameter count, memory estimate of this rank)."""
    rows = parameter_table(model)
    total = sum(r.numel for r in rows)
    local_total = sum(r.local_numel for r in rows)
    mem = estimate_memory(model, rows, args, tp)
    name_w = max([len(r.name) for r in rows] + [4])
    lines = [
        f"model: {type(model).__name__}",
        f"parameters: {total:,} (this rank's shard: {local_total:,}; rank {rank} of {world_size})",
        "",
        "per component (global / this rank):",
    ]
    for component, (glob, loc) in component_totals(rows).items():
        lines.append(f"  {component:<32} {glob:>16,} {loc:>16,}")
    lines += [
        "",
        f"estimated memory per rank (micro-batch {args.data.batch_size} rows, "
        f"activation_checkpointing={args.distributed.activation_checkpointing}):",
        *(f"  {k:<16} {v / GIB:10.3f} GiB" for k, v in memory_items(mem)),
        MEASURED_NOTE,
        *flops_lines(args),
        "",
        "parameters (name, shape, dtype, count, local shape, local count, placement, optim group):",
    ]
    groups = args.optim.groups
    for r in rows:
        lines.append(
            f"  {r.name:<{name_w}}  {_fmt_shape(r.shape):<16} {str(r.dtype).removeprefix('torch.'):<9}"
            f" {r.numel:>14,}  {_fmt_shape(r.local_shape):<16} {r.local_numel:>14,}  {r.placement}"
            f"  group={group_label(r.name, groups)}"
        )
    return "\n".join(lines) + "\n", total, mem


def flops_lines(args: TrainArgs) -> list[str]:
    """Training FLOPs per byte of an unpatched architecture (`Sizes.flops` on one full row);
    where the model decides its own work (`measured_flops`: H-Net's chunk counts) this is the
    estimate at the targets, and the log's `flops_per_s` / `mfu` count what was measured."""
    spec = get_arch(args.arch)
    factory = spec.sizes.flops
    if factory is None or spec.patched:
        return []
    seq_len = args.data.seq_len
    per_byte = factory(args.active_model_args(), args.data)(seq_len, 0) / seq_len
    line = f"training FLOPs per byte: {per_byte:,.0f}"
    if spec.sizes.measured_flops is not None:
        line += (
            " (an estimate at the target chunk ratios; the log's flops_per_s and mfu count "
            "the measured chunks)"
        )
    return ["", line]


def memory_items(mem: MemoryEstimate) -> list[tuple[str, int]]:
    return [
        ("parameters", mem.params),
        ("gradients", mem.grads),
        ("optimizer", mem.optimizer),
        ("fsdp gathered", mem.gathered_params),
        ("activations", mem.activations),
        ("total", mem.total),
    ]


def write_model_info(
    model: nn.Module,
    args: TrainArgs,
    mesh: DeviceMesh | None,
    rank: int = 0,
    path: str | Path | None = None,
) -> tuple[int, MemoryEstimate]:
    """Write `dump_dir/model-info.txt` (or `path`); returns (global parameter count, memory
    estimate of this rank)."""
    world_size = mesh.size() if mesh is not None else 1
    text, total, mem = render(model, args, world_size, rank, tp_rank_and_size(mesh)[1])
    path = Path(path) if path is not None else Path(args.dump_dir) / MODEL_INFO
    write_text_atomic(path, text)
    return total, mem


def summary_line(total: int, mem: MemoryEstimate) -> str:
    parts = ", ".join(f"{k} {v / GIB:.2f}" for k, v in memory_items(mem) if k != "total")
    return (
        f"parameters: {total:,}; estimated memory per rank: {mem.total / GIB:.2f} GiB ({parts} GiB)"
    )


def measured_activation_bytes(model: nn.Module, args: TrainArgs, batch) -> int:
    """Bytes of the tensors autograd saves in one forward + loss on `batch` (a real, materialised
    model; parameters and their views excluded, each storage once). Checks the estimate above in
    tests and bench/model_info_activations.py; checkpointed blocks' recomputation is not seen."""
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        saved[storage.data_ptr()] = max(saved.get(storage.data_ptr(), 0), storage.nbytes())
        return t

    device = next(model.parameters()).device
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        batch_loss_sum(model, batch, device, forward_context(None, args.distributed, device.type))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(n for ptr, n in saved.items() if ptr not in params)
