"""A toy architecture from one folder outside `bytelatent/` (issues 28, 37): this module (its
spec), `model.py`, `generation.py` (a cached engine) and `hf.py` (an HF-style export).

Importing this module registers `toy`; a config selects it with
`arch: tests.toy_arch:toy` (the trainer imports the module, which registers the spec) and
puts its args under `arch_args:`. The module stays torch-free, like the built-in specs: its hooks
import the model module when called, so a config error answers without importing torch.

The toy's forward returns an auxiliary loss term (`act_l2`, the mean square of its hidden
state), which the trainer adds with weight `AUX_WEIGHT` and logs as `aux/act_l2`, apart from the
LM loss that `loss` and `bpb` report.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from bytelatent.model.registry import (
    Adapters,
    ArchSpec,
    AuxLoss,
    Forward,
    Sizes,
    register_arch,
)

AUX_WEIGHT = 0.5


class ToyArgs(BaseModel):
    """A byte LM of one embedding, one causal two-byte mixing layer and an output head."""

    model_config = ConfigDict(extra="forbid")

    dim: int = Field(16, ge=1, description="embedding width")
    vocab_size: int = Field(260, ge=1, description="token ids (BLT bytes: 260)")
    seed: int = Field(42, description="weight init seed (the trainer reads `seed` of every arch)")
    max_seqlen: int = Field(1024, ge=1, description="longest row generation holds (no RoPE)")


def check_toy_run(args) -> None:  # a TrainArgs
    if args.data.patcher_args.patching_mode != "byte":
        raise ValueError(
            "data.patcher_args.patching_mode: the toy trains on bytes; set it to 'byte'"
        )


def _model() -> type:
    from tests.toy_arch.model import ToyByteLM

    return ToyByteLM


def _flops(model_args, data_args):
    from tests.toy_arch.model import toy_flops

    return toy_flops(model_args, data_args)


def _generation_engine() -> type:
    from tests.toy_arch.generation import IncrementalToy

    return IncrementalToy


def _hf_export(ckpt, out, entropy_model, allow_window_mismatch):
    from tests.toy_arch.hf import export_toy_hf

    return export_toy_hf(ckpt, out, entropy_model, allow_window_mismatch)


def _hf_import(hf_dir, out):
    from tests.toy_arch.hf import import_toy_hf

    return import_toy_hf(hf_dir, out)


TOY = register_arch(
    ArchSpec(
        name="toy",
        description="toy byte LM with an auxiliary loss (tests)",
        args_class=ToyArgs,
        model=_model,
        forward=Forward(aux_losses=(AuxLoss("act_l2", AUX_WEIGHT),)),
        sizes=Sizes(flops=_flops),
        adapters=Adapters(
            hf_export=_hf_export, hf_import=_hf_import, hf_model_types=("bytelatent_toy",)
        ),
        check_run=check_toy_run,
        generation_engine=_generation_engine,
    )
)

# The same model with its auxiliary term weighted 0: its first step's loss and bpb must equal
# the toy's (the term is not part of them), its later losses must not (the term trains the toy).
TOY_ZERO_AUX = register_arch(
    ArchSpec(
        name="toy_zero_aux",
        description="the toy with its auxiliary loss weighted 0 (tests)",
        args_class=ToyArgs,
        model=_model,
        forward=Forward(aux_losses=(AuxLoss("act_l2", 0.0),)),
        sizes=Sizes(flops=_flops),
        check_run=check_toy_run,
    )
)
