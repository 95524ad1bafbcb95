"""What to change when the dry run's memory estimate exceeds the device (issue 43).

Each knob is priced with the estimator of `model-info.txt` (`estimate_memory`, the architecture's
`activation_bytes`) on the same model, with one key changed:

* the attention backend (`attn_impl`): sdpa keeps dense [B, 1, Q, K] masks for autograd,
  flex_attention and xformers none (both need CUDA);
* `distributed.activation_checkpointing`: selective, then full;
* a smaller micro-batch (`data.batch_size` halved, `grad_acc_steps` doubled: the same global
  batch, so a resume and the learning dynamics are unchanged);
* more FSDP ranks (`distributed.dp_shard`): parameters, gradients and AdamW state divide by the
  shard count; the gathered copies of the two largest FSDP units (and the root's) appear.

Tensor parallelism is not priced here (which parameters it splits depends on the architecture's
plan); a dry run under torchrun with `distributed.tp_size=N` measures it. "Fits" means the
estimate is at most `HEADROOM` of the device: the estimate is a lower bound (0.7-0.85x of what
autograd really keeps, see model_info.py), and the CUDA context and the allocator take their share.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from bytelatent.args import TrainArgs
from bytelatent.distributed.parallelize import fsdp_units
from bytelatent.trainer.model_info import GIB, MemoryEstimate, ParamInfo, activation_bytes

HEADROOM = 0.85
# On CPU (a dry run on a laptop for a GPU job) the device is assumed to be an 80 GiB H100
# unless `distributed.device_memory_gib` says otherwise.
CPU_DEFAULT_DEVICE_GIB = 80.0
SHARD_COUNTS = (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
SHOWN_SHARDS = (8, 32)  # one node of 8 GPUs, four nodes


@dataclass(frozen=True)
class Knob:
    """One change (`key=value ...` as on the command line) and the estimate it gives per rank."""

    change: str
    total: int

    def fits(self, device_bytes: float) -> bool:
        return self.total <= HEADROOM * device_bytes


def device_memory_gib(args: TrainArgs, device_type: str) -> tuple[float, str]:
    """(GiB of one device, where the number comes from): the config, the CUDA device, or the
    CPU default."""
    if args.distributed.device_memory_gib is not None:
        return args.distributed.device_memory_gib, "distributed.device_memory_gib"
    if device_type == "cuda":
        import torch

        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return props.total_memory / GIB, props.name
    return (
        CPU_DEFAULT_DEVICE_GIB,
        "the CPU default: an 80 GiB H100; set distributed.device_memory_gib",
    )


def _with(args: TrainArgs, changes: dict[str, object]) -> TrainArgs:
    """`args` with dotted keys changed, validated again (as the command line would be)."""
    tree = args.model_dump()
    tree["distributed"]["selective_activation_checkpointing"] = False  # the deprecated alias
    for key, value in changes.items():
        node = tree
        *parents, leaf = key.split(".")
        for part in parents:
            node = node[part]
        node[leaf] = value
    return TrainArgs.model_validate(tree)


def _gathered_bytes(model: nn.Module, args: TrainArgs) -> int:
    """FSDP's gathered copies alive at once: the two largest units and the root's own parameters."""
    units = fsdp_units(model)
    sizes = sorted((sum(p.numel() for p in unit.parameters()) for unit in units), reverse=True)
    in_units = {id(p) for unit in units for p in unit.parameters()}
    root_only = sum(p.numel() for p in model.parameters() if id(p) not in in_units)
    return (sum(sizes[:2]) + root_only) * args.distributed.param_dtype.itemsize


class MemoryPricer:
    """Re-prices the estimate of one built model under changed keys."""

    def __init__(self, model: nn.Module, rows: list[ParamInfo], args: TrainArgs, mesh_shape: dict):
        self.model, self.args = model, args
        self.shard = mesh_shape.get("dp_shard", 1)
        self.tp = mesh_shape.get("tp", 1)
        self.state_bytes = sum(r.local_numel * r.dtype.itemsize for r in rows)  # one copy

    def total(self, args: TrainArgs, shard: int | None = None) -> int:
        shard = shard or self.shard
        states = 4 * self.state_bytes * self.shard // shard  # params, grads, AdamW's two moments
        gathered = _gathered_bytes(self.model, args) if shard > 1 else 0
        return states + gathered + activation_bytes(self.model, args, self.tp)

    def knobs(self, device_bytes: float | None = None) -> list[Knob]:
        """Each change alone, priced; ordered as the docs suggest trying them."""
        args, out = self.args, []
        model_args = args.active_model_args()
        if getattr(model_args, "attn_impl", None) == "sdpa":
            for impl in ("flex_attention",):  # xformers: the same memory, a separate install
                key = "model.attn_impl"
                out.append(Knob(f"{key}={impl}", self.total(_with(args, {key: impl}))))
        modes = ("selective", "full")
        current = args.distributed.activation_checkpointing
        for mode in modes[modes.index(current) + 1 if current in modes else 0 :]:
            key = "distributed.activation_checkpointing"
            out.append(Knob(f"{key}={mode}", self.total(_with(args, {key: mode}))))
        batch, acc = args.data.batch_size, args.grad_acc_steps
        factor = 2
        while batch // factor >= 1 and batch % factor == 0:
            changes = {"data.batch_size": batch // factor, "grad_acc_steps": acc * factor}
            text = f"data.batch_size={batch // factor} grad_acc_steps={acc * factor}"
            out.append(Knob(text, self.total(_with(args, changes))))
            factor *= 2
        out += self._shard_knobs(args, device_bytes)
        return out

    def _shard_knobs(self, args: TrainArgs, device_bytes: float | None = None) -> list[Knob]:
        """More FSDP ranks: one node of 8, four nodes, and the fewest that fit when more."""
        knobs = []
        for shard in SHARD_COUNTS:
            if shard <= self.shard:
                continue
            knob = self._shard_knob(args, shard)
            fits = device_bytes is not None and knob.fits(device_bytes)
            if shard in SHOWN_SHARDS or fits:
                knobs.append(knob)
            if fits:
                break
        return knobs

    def _shard_knob(self, args: TrainArgs, shard: int) -> Knob:
        ranks = shard * self.tp * args.distributed.dp_replicate
        return Knob(f"distributed.dp_shard={shard} ({ranks} GPUs)", self.total(args, shard))

    def combined(self, device_bytes: float) -> Knob | None:
        """The cheapest mix that fits: single-device knobs first (no more GPUs), then the fewest
        FSDP ranks; None when even 1024 ranks with everything on do not fit."""
        args, parts = self.args, []
        for knob in self.knobs():
            if knob.change.startswith("distributed.dp_shard"):
                continue
            if knob.change.startswith("data.batch_size") and any(
                p.startswith("data.batch_size") for p in parts
            ):
                parts = [p for p in parts if not p.startswith("data.batch_size")]
            if knob.change.startswith("distributed.activation_checkpointing"):
                parts = [
                    p for p in parts if not p.startswith("distributed.activation_checkpointing")
                ]
            parts.append(knob.change)
            mixed = _with(args, _parse(parts))
            if self.total(mixed) <= HEADROOM * device_bytes:
                return Knob(" ".join(parts), self.total(mixed))
        mixed = _with(args, _parse(parts))
        for shard in SHARD_COUNTS:
            knob = self._shard_knob(mixed, shard) if shard > self.shard else None
            if knob is not None and knob.fits(device_bytes):
                return Knob(" ".join([*parts, knob.change]), knob.total)
        return None


def _parse(parts: list[str]) -> dict[str, object]:
    changes: dict[str, object] = {}
    for part in parts:
        for item in part.split():
            key, _, value = item.partition("=")
            changes[key] = int(value) if value.isdigit() else value
    return changes


def advice_lines(
    model: nn.Module,
    rows: list[ParamInfo],
    args: TrainArgs,
    mesh_shape: dict,
    mem: MemoryEstimate,
    device_gib: float,
    source: str,
) -> list[str]:
    """Nothing when the estimate fits; else what each knob alone gives, and a mix that fits."""
    device_bytes = device_gib * GIB
    if mem.total <= HEADROOM * device_bytes:
        return []
    pricer = MemoryPricer(model, rows, args, mesh_shape)
    lines = [
        f"dry run: the estimate {mem.total / GIB:.2f} GiB per rank is over {HEADROOM:.0%} of "
        f"the device's {device_gib:.1f} GiB ({source}); each change alone gives:"
    ]
    for knob in pricer.knobs(device_bytes):
        mark = "fits" if knob.fits(device_bytes) else "over"
        lines.append(
            f"  {knob.change}: {knob.total / GIB:.2f} GiB ({(knob.total - mem.total) / GIB:+.2f}, {mark})"
        )
    mix = pricer.combined(device_bytes)
    if mix is None:
        lines.append("  nothing above fits even together: a smaller model or tensor parallelism")
    else:
        lines.append(f"  together: {mix.change}: {mix.total / GIB:.2f} GiB (fits)")
    lines.append("  (docs/scaling.md: what each knob costs in speed)")
    return lines
