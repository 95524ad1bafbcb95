"""The model registry (bytelatent/model/registry.py): specs by name, the config key `arch` and
its compatibility rule, lookups by model and args, and the auxiliary-loss plumbing of the loss and
the interval metrics (the toy architecture of tests/toy_arch/__init__.py)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from bytelatent.archs.blt.args import ByteLatentTransformerArgs
from bytelatent.args import TrainArgs
from bytelatent.checkpoint.pretrained import model_args_from_params
from bytelatent.data.batch import Batch
from bytelatent.model.args import LMTransformerArgs
from bytelatent.model.loss import batch_losses, forward_logits, masked_cross_entropy_sum
from bytelatent.model.registry import (
    ArchSpec,
    arch_name_from_params,
    arch_of,
    arch_of_args,
    get_arch,
    register_arch,
    unregister_arch,
)
from bytelatent.trainer.interval import IntervalMetrics, StepOutput
from bytelatent.trainer.throughput import FlopsCounter

TOY = "tests.toy_arch:toy"
get_arch(TOY, allow_import=True)  # registers the toy (the tests below look it up)
LM_ARGS = {"dim": 16, "n_layers": 1, "n_heads": 2, "max_seqlen": 64}
BYTE_DATA = {"seq_len": 32, "add_patches": False, "patcher_args": {"patching_mode": "byte"}}


def test_builtin_archs_and_aliases() -> None:
    assert get_arch("blt").args_class is ByteLatentTransformerArgs
    assert get_arch("entropy") is get_arch("lm")
    assert get_arch("blt").legacy_section == "model"
    assert get_arch("lm").legacy_section == "entropy_model"
    assert get_arch("blt").patched and not get_arch("entropy").patched
    with pytest.raises(ValueError, match="unknown architecture 'nope'.*blt"):
        get_arch("nope")


def test_external_arch_is_imported_by_its_module_name() -> None:
    spec = get_arch(TOY, allow_import=True)
    assert spec.name == "toy" and spec.legacy_section == "arch_args" and spec.aux_losses
    with pytest.raises(ValueError, match="registered no arch 'other'"):
        get_arch("tests.toy_arch:other")
    # a module nobody imported is imported only when the caller allows it (issue 38, item 1)
    with pytest.raises(ValueError, match="would import module 'tests.model.not_imported'"):
        get_arch("tests.model.not_imported:x")
    with pytest.raises(ValueError, match="already registered"):
        register_arch(ArchSpec(name="blt", args_class=LMTransformerArgs, model=None))


def test_a_spec_reads_its_args_from_a_known_section() -> None:
    with pytest.raises(ValueError, match="legacy_section 'mine'"):
        spec = ArchSpec(name="x", args_class=LMTransformerArgs, legacy_section="mine", model=None)
        register_arch(spec)
    unregister_arch("x")


def test_train_entropy_model_means_arch_entropy() -> None:
    old = TrainArgs(dump_dir="d", train_entropy_model=True, model=None, entropy_model=LM_ARGS,
                    data=BYTE_DATA)  # fmt: skip
    new = TrainArgs(dump_dir="d", arch="lm", model=None, entropy_model=LM_ARGS, data=BYTE_DATA)
    assert old.arch == new.arch == "entropy"
    assert old.train_entropy_model and new.train_entropy_model  # old readers of params.json
    assert old.active_model_args() == new.active_model_args()
    with pytest.raises(ValueError, match="train_entropy_model=true means arch=entropy"):
        TrainArgs(dump_dir="d", arch="blt", train_entropy_model=True, entropy_model=LM_ARGS)


def test_arch_args_are_validated_by_the_arch_args_class() -> None:
    args = TrainArgs(dump_dir="d", arch=TOY, arch_args={"dim": 8}, data=BYTE_DATA)
    assert type(args.active_model_args()).__name__ == "ToyArgs" and args.model.dim == 8
    dumped = args.model_dump()
    assert "arch_args" not in dumped and TrainArgs.model_validate(dumped).model == args.model
    same = TrainArgs(dump_dir="d", arch=TOY, model={"dim": 8}, data=BYTE_DATA)
    assert same.model == args.model  # `model` is the section; arch_args its old name
    with pytest.raises(
        ValueError,
        match=r"arch_args.dimm: unknown key \(did you mean arch_args.dim\?\); arch=tests.toy_arch:toy does not read",
    ):
        TrainArgs(dump_dir="d", arch=TOY, arch_args={"dimm": 8}, data=BYTE_DATA)
    with pytest.raises(
        ValueError, match="model.dimm: unknown key .*arch=tests.toy_arch:toy does not read"
    ):
        TrainArgs(dump_dir="d", arch=TOY, model={"dimm": 8}, data=BYTE_DATA)
    with pytest.raises(ValueError, match="arch_args: arch=blt does not read it"):
        TrainArgs(dump_dir="d", arch="blt", arch_args={"dim": 8})
    with pytest.raises(ValueError, match="the toy trains on bytes"):  # the spec's check_run
        TrainArgs(dump_dir="d", arch=TOY, data={"patcher_args": {"patching_mode": "space"}})


def test_a_section_the_arch_does_not_read_is_refused() -> None:
    """One `model` section whose schema is the chosen arch's args: a key that arch does not read
    is a config error, not a silently unused value; an old-named section of another arch too
    (issue 37). A saved file from before one section loads as before."""
    hnet = TrainArgs(dump_dir="d", arch="hnet", data=BYTE_DATA)
    assert type(hnet.model).__name__ == "HNetArgs" and "entropy_model" not in hnet.model_dump()
    with pytest.raises(
        ValueError, match="model.cross_attn_k: unknown key; arch=hnet does not read it"
    ):
        TrainArgs(dump_dir="d", arch="hnet", data=BYTE_DATA, model={"cross_attn_k": 2})
    with pytest.raises(ValueError, match="entropy_model: arch=toy does not read"):
        TrainArgs(dump_dir="d", arch=TOY, data=BYTE_DATA, entropy_model=LM_ARGS)
    with pytest.raises(
        ValueError, match="model.patch_size: unknown key.*arch=entropy does not read"
    ):
        TrainArgs(dump_dir="d", arch="entropy", data=BYTE_DATA, model={"patch_size": 4})
    entropy = TrainArgs(dump_dir="d", arch="entropy", data=BYTE_DATA, entropy_model=LM_ARGS)
    assert entropy.model == LMTransformerArgs(**LM_ARGS) and entropy._model_key == "entropy_model"
    # an old entropy run's params.json: the BLT's section, read by nothing, next to its own
    saved = {"dump_dir": "d", "train_entropy_model": True, "model": {"patch_size": 4},
             "entropy_model": LM_ARGS, "data": BYTE_DATA}  # fmt: skip
    assert TrainArgs.from_saved(saved).model == entropy.model
    with pytest.raises(
        ValueError, match="model.patch_size: unknown key.*arch=entropy does not read"
    ):
        TrainArgs.model_validate(saved)  # the same in a user's config is refused


def test_old_params_json_layouts_resolve_as_before() -> None:
    assert arch_name_from_params({"train_entropy_model": True, "model": {}}) == "entropy"
    assert arch_name_from_params({"dim": 512, "n_layers": 14}) == "entropy"  # released flat
    assert arch_name_from_params({"model": {"dim": 32}}) == "blt"
    assert arch_name_from_params({"arch": TOY, "model": {"dim": 32}}) == TOY
    args, name, _ = model_args_from_params({"train_entropy_model": True, "entropy_model": LM_ARGS})
    assert name == "entropy" and isinstance(args, LMTransformerArgs)


def test_models_and_args_find_their_spec() -> None:
    with torch.device("meta"):
        lm = get_arch("entropy").build(LMTransformerArgs(**LM_ARGS))
        toy = get_arch(TOY).build(get_arch(TOY).args_class())
    assert arch_of(lm).name == "entropy" and arch_of(toy).name == "toy"
    assert arch_of(torch.nn.Linear(2, 2)) is None
    assert arch_of_args(lm.args).name == "entropy"
    plan = lm.tp_plan(2)
    assert plan.sequence_parallel and plan.blocks == [lm.layers]


def _toy_batch(rows: int = 2, length: int = 12) -> Batch:
    rng = np.random.default_rng(0)
    x = rng.integers(4, 260, size=(rows, length), dtype=np.int64)
    y = np.roll(x, -1, axis=1)
    return Batch(x=x, y=y, mask=np.ones_like(x, dtype=bool))


def test_aux_losses_come_back_apart_from_the_lm_loss() -> None:
    spec = get_arch(TOY)
    torch.manual_seed(0)
    model = spec.build(spec.args_class())
    model.init_weights()
    batch = _toy_batch()
    ce_sum, aux = batch_losses(model, batch, torch.device("cpu"))
    logits = forward_logits(model, batch, torch.device("cpu"))
    y, mask = torch.from_numpy(batch.y), torch.from_numpy(batch.mask)
    assert torch.equal(ce_sum, masked_cross_entropy_sum(logits, y, mask))
    assert set(aux) == {"act_l2"} and aux["act_l2"].ndim == 0 and aux["act_l2"] > 0


def test_interval_metrics_log_aux_terms_apart_from_bpb() -> None:
    args = TrainArgs(dump_dir="d", arch=TOY, data=BYTE_DATA)
    interval = IntervalMetrics(torch.device("cpu"), FlopsCounter(args), None, 1, 1, lambda: None)
    loss = torch.tensor(12.0, dtype=torch.float64)
    for aux in (1.0, 3.0):  # two steps of two micro-batches: sums 1.0 and 3.0 over 2 each
        out = StepOutput(loss, 10, 10, torch.tensor(1.0),
                         aux_sums={"act_l2": torch.tensor(aux, dtype=torch.float64)},
                         n_micro_batches=2)  # fmt: skip
        interval.add(out, [_toy_batch()], 0.0)
    m = interval.compute(2)
    assert m["aux/act_l2"] == pytest.approx(1.0)  # (1 + 3) / 4 micro-batches
    assert m["loss"] == pytest.approx(24.0 / 20) and m["bpb"] == pytest.approx(1.2 / math.log(2))


def test_one_model_section_from_configs_and_dotlists(tmp_path) -> None:
    """`model:` and its old name are one key: whichever name a later file or dotlist uses wins,
    messages name keys as the user last did, and a key the arch does not read is one line."""
    from bytelatent.config import parse_args
    from bytelatent.errors import ConfigError

    configs = Path(__file__).resolve().parents[2] / "configs"
    hnet = [f"config={configs / 'hnet_debug.yaml'}", f"dump_dir={tmp_path}"]
    with pytest.raises(ConfigError, match=r"^model\.cross_attn_k: unknown key; arch=hnet"):
        parse_args(TrainArgs, [*hnet, "model.cross_attn_k=2"])
    assert parse_args(TrainArgs, [*hnet, "model.dim=64"]).model.dim == 64  # read, not ignored
    narrowed = parse_args(TrainArgs, [*hnet, "arch_args.dim=96"])  # an old name over `model:`
    assert narrowed.model.dim == 96 and narrowed.model_key == "arch_args"
    old = tmp_path / "old.yaml"  # an H-Net config from before one section
    old.write_text(
        "arch: hnet\nmodel: null\narch_args:\n  dim: 512\n  n_layers: 1\ndata:\n  seq_len: 256\n  add_patches: false\n  patcher_args: {patching_mode: byte}\n"
    )
    args = parse_args(TrainArgs, [f"config={old}", f"dump_dir={tmp_path}", "model.dim=384"])
    assert (args.model.dim, args.model.n_layers, args.model_key) == (384, 1, "model")
    assert "arch_args" not in args.model_dump() and "entropy_model" not in args.model_dump()
    entropy = [f"config={configs / 'entropy_debug.yaml'}", f"dump_dir={tmp_path}"]
    assert parse_args(TrainArgs, [*entropy, "entropy_model.dim=32"]).model.dim == 32
    with pytest.raises(ConfigError, match=r"^entropy_model: arch=blt does not read it"):
        parse_args(TrainArgs, [f"config={configs / 'debug.yaml'}", f"dump_dir={tmp_path}",
                               "entropy_model.dim=32"])  # fmt: skip
