"""AdamW and learning-rate schedules (constant, linear, cosine, inv_sqrt, wsd) with linear warmup.

``optim.groups`` splits the parameters into AdamW groups by glob over their names (as in our
checkpoints; the first matching group wins, the rest form the default group): each group has its
own learning-rate scale and weight decay, and may be frozen for its first ``freeze_until_step``
optimizer steps or, with ``frozen: true``, for the whole run. The schedule multiplies every group's lr. Freezing is ``requires_grad=False``:
no gradients (hence no FSDP reduce-scatter for the group's units), no AdamW state until the
group's first real update; the scheduler sets the flags, so they follow resumes.
"""

from __future__ import annotations

import fnmatch
import math
from functools import partial

import torch
from torch.optim.lr_scheduler import LambdaLR

from bytelatent.errors import ConfigError
from bytelatent.trainer.args import OptimArgs, ParamGroupArgs


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


def lr_cosine(
    step: int, warmup: int, n_steps: int, cycle: float, theta: float, min_ratio: float
) -> float:
    w = _warmup(step, warmup)
    if w is not None:
        return w
    if step > n_steps:
        return min_ratio
    s = (step - warmup) / max(1, n_steps - warmup)
    # Alternate direction every cycle so that cycle_length < 1 gives restarts (reference semantics);
    # a cycle owns its right end point, so the last step is at min_ratio.
    cycle_index = math.ceil(s / cycle) - 1 if s > 0 else 0
    sign = -1.0 if cycle_index % 2 else 1.0
    return min_ratio + 0.5 * (1 - min_ratio) * (sign * math.cos(math.pi * s**theta / cycle) + 1)


def lr_wsd(
    step: int, warmup: int, n_steps: int, cycle: float, decay_fraction: float, min_ratio: float
) -> float:
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
        fn = partial(
            lr_inv_sqrt, warmup=args.warmup, exp_factor=args.exp_factor, min_ratio=args.lr_min_ratio
        )
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


DEFAULT_GROUP = "default"
# freeze_until_step of a `frozen: true` group: more optimizer steps than any run takes
FROZEN = 2**62


def group_index(name: str, groups: list[ParamGroupArgs]) -> int | None:
    """Index of the first group whose glob matches `name`; None for the default group."""
    for index, group in enumerate(groups):
        if fnmatch.fnmatchcase(name, group.params):
            return index
    return None


def group_label(name: str, groups: list[ParamGroupArgs]) -> str:
    """How model-info.txt names a parameter's group."""
    index = group_index(name, groups)
    return DEFAULT_GROUP if index is None else f"{index}:{groups[index].params}"


def _param_groups(
    model: torch.nn.Module, args: OptimArgs
) -> tuple[list[dict], list[int], list[str]]:
    """AdamW param-group dicts, each one's freeze_until_step and name (its index in optim.groups,
    or `default`; the default group last)."""
    members: list[list[torch.Tensor]] = [[] for _ in range(len(args.groups) + 1)]
    names: list[str] = []
    for name, param in model.named_parameters():
        if param.requires_grad:
            names.append(name)
            index = group_index(name, args.groups)
            members[len(args.groups) if index is None else index].append(param)
    param_groups, freeze, labels = [], [], []
    for index, params in enumerate(members):
        spec = args.groups[index] if index < len(args.groups) else ParamGroupArgs(params="*")
        if not params:
            if index < len(args.groups):
                raise ConfigError(_empty_group_message(index, args.groups, names))
            continue
        wd = args.weight_decay if spec.weight_decay is None else spec.weight_decay
        param_groups.append({"params": params, "lr": args.lr * spec.lr_scale, "weight_decay": wd})
        labels.append(str(index) if index < len(args.groups) else DEFAULT_GROUP)
        freeze.append(FROZEN if spec.frozen else spec.freeze_until_step)
    return param_groups, freeze, labels


def _empty_group_message(index: int, groups: list[ParamGroupArgs], names: list[str]) -> str:
    """Why group `index` has no parameter: its glob matches none, or earlier groups took them all."""
    glob = groups[index].params
    matched = [name for name in names if fnmatch.fnmatchcase(name, glob)]
    if not matched:
        return (
            f"optim.groups[{index}].params={glob!r} matches no parameter "
            "(names as in model-info.txt, e.g. 'global_transformer.*')"
        )
    example = matched[0]
    first = group_index(example, groups)  # < index: the first matching group wins
    return (
        f"optim.groups[{index}].params={glob!r} overlaps optim.groups[{first}].params="
        f"{groups[first].params!r}: every parameter it matches (e.g. {example}) is already in "
        f"group {first} (the first matching group wins); narrow one glob or put group {index} first"
    )


class GroupScheduler(LambdaLR):
    """LambdaLR (one factor for every group) that also freezes groups for their first steps.

    After `k` optimizer steps a group with freeze_until_step=N has requires_grad = (k >= N), so
    it is frozen for steps 1..N. The flags are data of the step count: set at construction, on
    every `step()` and on `load_state_dict()`.

    The config, not the checkpoint, decides the schedule and each group's hyperparameters: a
    checkpoint's optimizer state brings back the lr, weight decay, betas and eps it was saved
    with, and its scheduler state the old base lrs, so `load_state_dict` (called after the
    optimizer state is loaded) sets the config's values again and the lr of the resumed step.
    Unchanged values give the same numbers, so a plain resume stays bitwise.
    """

    _CONFIG_KEYS = ("weight_decay", "betas", "eps")

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        lr_lambda,
        freeze_until: list[int],
        group_names: list[str] | None = None,
    ):
        self.freeze_until = list(freeze_until)
        self.group_names = list(group_names or [str(i) for i in range(len(freeze_until))])
        self.config_hyperparameters = [
            {k: group[k] for k in self._CONFIG_KEYS} for group in optimizer.param_groups
        ]
        super().__init__(optimizer, lr_lambda)
        self.config_base_lrs = list(self.base_lrs)

    def step(self, epoch: int | None = None) -> None:
        super().step(epoch)
        self.apply_freezing(self.last_epoch)

    def lr_metrics(self, base_lr: float) -> dict[str, float]:
        """`lr`: the schedule's (optim.lr times its factor now), whatever the groups' scales;
        with optim.groups also `lr/<group>` per group (its index in optim.groups, or `default`),
        the lr that group's next update uses (its lr_scale applied; frozen groups included)."""
        out = {"lr": base_lr * self.lr_lambdas[0](self.last_epoch)}
        if self.group_names != [DEFAULT_GROUP]:
            out.update((f"lr/{name}", lr) for name, lr in zip(self.group_names, self.get_last_lr()))
        return out

    # attributes the config decides, not the checkpoint (LambdaLR saves its whole __dict__)
    _FROM_CONFIG = ("freeze_until", "config_hyperparameters", "config_base_lrs", "group_names")

    def state_dict(self) -> dict:
        state = super().state_dict()
        for key in self._FROM_CONFIG:
            state.pop(key, None)
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict({k: v for k, v in state_dict.items() if k not in self._FROM_CONFIG})
        self.base_lrs = list(self.config_base_lrs)
        lrs = [base * fn(self.last_epoch) for base, fn in zip(self.base_lrs, self.lr_lambdas)]
        for group, base, lr, hyper in zip(
            self.optimizer.param_groups, self.base_lrs, lrs, self.config_hyperparameters
        ):
            group.update(hyper, initial_lr=base, lr=lr)
        self._last_lr = lrs
        self.apply_freezing(self.last_epoch)

    def apply_freezing(self, steps_done: int, has_state: bool = False) -> None:
        """Flags for the next step; `has_state`: flags of the groups that have AdamW state after
        `steps_done` steps (updated at least once), which is what a checkpoint of that step holds."""
        for group, until in zip(self.optimizer.param_groups, self.freeze_until):
            trainable = steps_done > until if has_state else steps_done >= until
            for param in group["params"]:
                param.requires_grad_(trainable)

    def prepare_resume(self, step: int | None) -> None:
        """Before loading a checkpoint of `step`: make the optimizer's state layout match it."""
        if step is not None and any(self.freeze_until):
            self.apply_freezing(step, has_state=True)


def build_optimizer(model: torch.nn.Module, args: OptimArgs, n_steps: int, device_type: str):
    """AdamW over all trainable parameters (as the reference; split by `optim.groups`) plus its
    schedule, a `GroupScheduler`."""
    param_groups, freeze_until, group_names = _param_groups(model, args)
    fused = args.fused if args.fused is not None else device_type in ("cuda", "cpu")
    optimizer = torch.optim.AdamW(
        param_groups,
        lr=args.lr,
        betas=(args.beta1, args.beta2),
        eps=args.epsilon,
        weight_decay=args.weight_decay,
        fused=fused,
        foreach=None if fused else True,
    )
    scheduler = GroupScheduler(optimizer, lr_factor_fn(args, n_steps), freeze_until, group_names)
    return optimizer, scheduler
