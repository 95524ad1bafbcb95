"""The real loop (`Trainer.train`) is a model-level replay of its own batches, bitwise.

Everything the Trainer adds around the model (the guard, the clip, the schedule, logging,
the probe, metrics) must not change an update: the same batches through the model, our
optimizer and clip give the same weights, bit for bit, after every step.
"""

import torch

from bytelatent.args import TrainArgs
from bytelatent.config import parse_args
from bytelatent.distributed.clip import clip_grad_norm_
from bytelatent.distributed.env import detect_env
from bytelatent.distributed.parallelize import forward_context, init_model_weights
from bytelatent.model.loss import batch_losses
from bytelatent.model.registry import get_arch
from bytelatent.trainer.optim import build_optimizer
from bytelatent.trainer.trainer import Trainer
from tests.trainer.test_cli import REPO, TINY_BLT

STEPS = 3


def replay(args: TrainArgs, steps: list[list]) -> dict[str, torch.Tensor]:
    """The weights after `steps` (each a list of micro-batches) without the Trainer."""
    torch.manual_seed(args.seed)
    with torch.device("meta"):
        model = get_arch(args.arch).build(args.active_model_args())
    model.to_empty(device="cpu")
    init_model_weights(model, seed=args.active_model_args().seed)
    model.train()
    optimizer, scheduler = build_optimizer(model, args.optim, args.steps, "cpu")
    context = forward_context(None, args.distributed, "cpu")
    for batches in steps:
        targets = sum(int(b.mask.sum()) for b in batches)
        for batch in batches:
            loss_sum, _ = batch_losses(model, batch, torch.device("cpu"), context)
            (loss_sum * (1 / targets)).backward()
        clip_grad_norm_(model.parameters(), args.optim.clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def test_training_loop_equals_model_level_replay(tmp_path, corpus_root, monkeypatch):
    monkeypatch.chdir(REPO)
    argv = [
        *TINY_BLT,
        f"dump_dir={tmp_path}",
        f"data.root_dir={corpus_root}",
        f"steps={STEPS}",
        "grad_acc_steps=2",
        "data.batch_size=2",
        "optim.clip=0.2",  # the clip acts
        "checkpoint.dump.every=0",
    ]
    args = parse_args(TrainArgs, argv)
    trainer = Trainer(args, detect_env())
    recorded: list[list] = []
    next_batches = trainer.next_batches

    def recording() -> list:
        recorded.append(next_batches())
        return recorded[-1]

    trainer.next_batches = recording
    try:
        trainer.train()
        trained = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    finally:
        trainer.close()
    assert len(recorded) == STEPS
    replayed = replay(args, recorded)
    assert trained.keys() == replayed.keys()
    differ = [name for name in trained if not torch.equal(trained[name], replayed[name])]
    assert not differ, f"{len(differ)} of {len(trained)} tensors differ: {differ[:5]}"
