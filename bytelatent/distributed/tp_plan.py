"""What a model declares for tensor parallelism (`model.tp_plan(tp_size)`), in the pattern of its
`fsdp_units()` and `ac_units()`: the model says which blocks and root modules are split,
`parallelize.apply_tp` says how (DTensor styles), so this layer never imports a model."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class TPPlan:
    # ModuleLists of TransformerBlocks whose heads and FFN width are split over the TP group
    blocks: list[Any] = field(default_factory=list)
    # the residual stream between blocks is the local sequence shard (Megatron sequence
    # parallelism); then the root modules below are split too: a vocab-sharded embedding with a
    # sequence-sharded output, a sequence-parallel final norm and a column-parallel output head
    sequence_parallel: bool = False
    embedding: str | None = None
    norm: str | None = None
    output: str | None = None
