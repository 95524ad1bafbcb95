"""AdamW and learning-rate schedules (constant, linear, cosine, inv_sqrt, wsd) with linear warmup."""

from __future__ import annotations

import math
from functools import partial
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch.optim.lr_scheduler import LambdaLR


class OptimArgs(BaseModel):
    """Optimizer and schedule. Field names follow the reference BLT/lingua `OptimArgs`."""

    model_config = ConfigDict(extra="forbid")

    lr: float = 3e-4
    weight_decay: float = 0.1
    epsilon: float = 1e-8
    beta1: float = 0.9
    beta2: float = 0.95
    clip: float = 1.0  # max global grad norm, applied once per optimizer step; <= 0 disables
    scheduler: Literal["constant", "linear", "inv_sqrt", "cosine", "wsd"] = "cosine"
    warmup: int = 2000
    lr_min_ratio: float = 0.1
    cycle_length: float = 1.0  # cosine / wsd: cycle length as a fraction of `steps`
    cosine_theta: float = 1.0
    decay_fraction: float = 0.1  # wsd: fraction of each cycle spent decaying
    exp_factor: float = 0.5  # inv_sqrt exponent
    # None: fused AdamW on CUDA and CPU (the CPU kernel is several times faster than foreach:
    # bench/RESULTS_blt_cpu.md); False: foreach
    fused: bool | None = None
    # Non-finite guard: stop after this many consecutive skipped updates (0: never stop, only skip).
    max_skipped_steps: int = Field(5, ge=0)

    @model_validator(mode="after")
    def _check(self) -> OptimArgs:
        if self.lr <= 0:
            raise ValueError(f"optim.lr must be > 0, got {self.lr}")
        if self.warmup < 0:
            raise ValueError(f"optim.warmup must be >= 0, got {self.warmup}")
        if not 0.0 <= self.lr_min_ratio <= 1.0:
            raise ValueError(f"optim.lr_min_ratio must be in [0, 1], got {self.lr_min_ratio}")
        if self.cycle_length <= 0:
            raise ValueError(f"optim.cycle_length must be > 0, got {self.cycle_length}")
        if not 0.0 < self.decay_fraction <= 1.0:
            raise ValueError(f"optim.decay_fraction must be in (0, 1], got {self.decay_fraction}")
        return self


def _warmup(step: int, warmup: int) -> float | None:
    return step / warmup if step < warmup else None


def lr_constant(step: int, warmup: int) -> float:
    w = _warmup(step, warmup)
    return 1.0 if w is None else w


def lr_linear(step: int, warmup: int, n_steps: int, min_ratio: float) -> float:
    w = _warmup(step, warmup)
    if w is not None:
        return w
    if step >= n_steps:
        return min_ratio
    s = (step - warmup) / max(1, n_steps - warmup)
    return s * min_ratio + (1.0 - s)


def lr_inv_sqrt(step: int, warmup: int, exp_factor: float, min_ratio: float) -> float:
    w = _warmup(step, warmup)
    if w is not None:
        return w
    return max((max(warmup, 1) ** exp_factor) / (max(step, 1) ** exp_factor), min_ratio)


def lr_cosine(step: int, warmup: int, n_steps: int, cycle: float, theta: float, min_ratio: float) -> float:
    w = _warmup(step, warmup)
    if w is not None:
        return w
    if step > n_steps:
        return min_ratio
    s = (step - warmup) / max(1, n_steps - warmup)
    # Alternate direction every cycle so that cycle_length < 1 gives restarts (reference semantics);
    # a cycle owns its right end point, so the last step is at min_ratio (the reference jumps to 1).
    cycle_index = math.ceil(s / cycle) - 1 if s > 0 else 0
    sign = -1.0 if cycle_index % 2 else 1.0
    return min_ratio + 0.5 * (1 - min_ratio) * (sign * math.cos(math.pi * s**theta / cycle) + 1)


def lr_wsd(step: int, warmup: int, n_steps: int, cycle: float, decay_fraction: float, min_ratio: float) -> float:
    """Warmup-stable-decay: flat at 1, then decays to min_ratio over the last `decay_fraction` of each cycle."""
    w = _warmup(step, warmup)
    if w is not None:
        return w
    if step > n_steps:
        return min_ratio
    cycle_steps = max(1, int(n_steps * cycle))
    pos = step % cycle_steps if step < n_steps else cycle_steps  # the last step ends a cycle
    decay_steps = max(1, int(cycle_steps * decay_fraction))
    start = cycle_steps - decay_steps
    if pos <= start:
        return 1.0
    p = (pos - start) / decay_steps
    # 1/lr interpolates linearly from 1 to 1/min_ratio (reference "1-sqrt"-free inverse schedule).
    return 1.0 / (p / max(min_ratio, 1e-12) + (1.0 - p))


def lr_factor_fn(args: OptimArgs, n_steps: int):
    """Return f(step) -> multiplier; `step` counts optimizer steps already taken (0 before the first)."""
    name = args.scheduler
    if name == "constant":
        fn = partial(lr_constant, warmup=args.warmup)
    elif name == "linear":
        fn = partial(lr_linear, warmup=args.warmup, n_steps=n_steps, min_ratio=args.lr_min_ratio)
    elif name == "inv_sqrt":
        fn = partial(lr_inv_sqrt, warmup=args.warmup, exp_factor=args.exp_factor, min_ratio=args.lr_min_ratio)
    elif name == "cosine":
        fn = partial(
            lr_cosine,
            warmup=args.warmup,
            n_steps=n_steps,
            cycle=args.cycle_length,
            theta=args.cosine_theta,
            min_ratio=args.lr_min_ratio,
        )
    else:
        fn = partial(
            lr_wsd,
            warmup=args.warmup,
            n_steps=n_steps,
            cycle=args.cycle_length,
            decay_fraction=args.decay_fraction,
            min_ratio=args.lr_min_ratio,
        )
    # Optimizer step i (0-based) uses the factor of step i + 1, so the first update is not lr=0.
    return lambda step: fn(step + 1)


def build_optimizer(model: torch.nn.Module, args: OptimArgs, n_steps: int, device_type: str):
    """AdamW over all trainable parameters (as the reference) plus its LambdaLR schedule."""
    params = [p for p in model.parameters() if p.requires_grad]
    fused = args.fused if args.fused is not None else device_type in ("cuda", "cpu")
    optimizer = torch.optim.AdamW(
        params,
        lr=args.lr,
        betas=(args.beta1, args.beta2),
        eps=args.epsilon,
        weight_decay=args.weight_decay,
        fused=fused,
        foreach=None if fused else True,
    )
    scheduler = LambdaLR(optimizer, lr_factor_fn(args, n_steps))
    return optimizer, scheduler
