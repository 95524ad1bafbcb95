"""Loss on the answers only (issue 41): the targets of prompt and system turns give no gradient,
for every registered architecture (BLT, H-Net, byte LM), and the H-Net starts a chunk after every chat-template marker."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from bytelatent.data.args import DataArgs
from bytelatent.data.batch import Batch
from bytelatent.data.chat import encode_conversation, is_marker
from bytelatent.model.loss import batch_losses
from tests.generation.conftest import tiny_blt, tiny_lm
from tests.generation.test_hnet_generation import ONE_STAGE, TWO_STAGES, tiny_hnet

CONVERSATIONS = [
    {"messages": [{"role": "system", "content": "answer briefly"},
                  {"role": "user", "content": "reverse abcd"},
                  {"role": "assistant", "content": "dcba"}]},
    {"prompt": "upper word", "response": "WORD"},
    {"instruction": "count", "input": "hello", "output": "5"},
] * 3  # fmt: skip


def chat_batch(tmp_path, patched: bool) -> Batch:
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in CONVERSATIONS))
    mode = {"patching_mode": "space"} if patched else {"patching_mode": "byte"}
    args = DataArgs(dataset_files=[str(path)], chat_template="bytelatent-chat-v1",
                    load_async=False, batch_size=2, seq_len=24 if patched else 60,
                    max_encoder_seq_length=64, buffer_size=1, add_patches=patched,
                    patcher_args=mode)  # fmt: skip
    return next(args.build_from_rank(0, 1))


def grads(model: torch.nn.Module, batch: Batch) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss, _ = batch_losses(model, batch, torch.device("cpu"))
    loss.backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def perturbed(batch: Batch, where: np.ndarray, seed: int = 0) -> Batch:
    """The batch with every target at `where` replaced by another byte id."""
    y = batch.y.copy()
    rng = np.random.default_rng(seed)
    y[where] = 4 + (y[where] - 4 + rng.integers(1, 255, size=int(where.sum()))) % 256
    return Batch(batch.x, y, batch.mask, batch.patch_lengths, batch.loss_mask)


@pytest.mark.parametrize("arch", ["blt", "hnet", "lm"])
def test_prompt_targets_give_zero_gradient(arch, tmp_path) -> None:
    torch.manual_seed(0)
    if arch == "blt":
        model = tiny_blt().train().requires_grad_(True)
    elif arch == "lm":
        model = tiny_lm(max_seqlen=64).train().requires_grad_(True)
    else:
        model = tiny_hnet(ONE_STAGE, "perturbed").train().requires_grad_(True)
    batch = chat_batch(tmp_path, patched=arch == "blt")
    scored = batch.target_mask
    assert scored.any() and (batch.mask & ~scored).any()  # both answers and prompts present
    reference = grads(model, batch)
    same = grads(model, perturbed(batch, batch.mask & ~scored))
    assert all(torch.equal(a, b) for a, b in zip(reference, same, strict=True))
    moved = grads(model, perturbed(batch, scored))  # the answers' targets do move them
    assert not all(torch.equal(a, b) for a, b in zip(reference, moved, strict=True))


@pytest.mark.parametrize("stages", [ONE_STAGE, TWO_STAGES], ids=["1stage", "2stage"])
def test_hnet_chunk_starts_after_every_marker(stages) -> None:
    model = tiny_hnet(stages, "identity")  # identity routing: few boundaries of its own
    tokens, _ = encode_conversation([("system", "s"), ("user", "reverse abcd"), ("assistant", "dcba")])  # fmt: skip
    seen: list[torch.Tensor] = []
    hook = model.stages[0].routing_module.register_forward_hook(
        lambda module, inputs, out: seen.append(out.boundary_mask[0].clone())
    )
    model(torch.from_numpy(tokens)[None])
    hook.remove()
    boundaries = seen[0].numpy()
    after = np.flatnonzero(is_marker(tokens[:-1])) + 1
    assert boundaries[after].all()
    assert boundaries.sum() < len(tokens)  # not every position: the forcing is what we see
