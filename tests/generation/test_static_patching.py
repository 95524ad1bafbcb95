"""Static patching in BLT generation: the patches a BLT trained with static patching sees.

Training patches a document into ``patch_size`` patches from its first byte (BOS) and the
sequence iterator's patches mode splits a window's first token off, so a window that starts a
document holds ``[1, ps - 1, ps, ...]``; generation (online patcher, cached engine, speculative
decoding) must cut exactly those patches.
"""

from __future__ import annotations

import pytest
import torch

from bytelatent.data.patcher import Patcher, PatcherArgs
from bytelatent.eval.generation import GenerationArgs, Generator
from bytelatent.eval.generation.patching import OnlinePatcher, blt_patch_lengths
from bytelatent.model.patch_lengths import first_token_alone
from tests.generation.conftest import tiny_blt

STATIC = {
    "ps4": dict(patch_size=4),
    "ps4_max3": dict(patch_size=4, max_patch_length=3),
    "ps8_max5": dict(patch_size=8, max_patch_length=5),
}


def test_first_token_alone_splits_only_longer_first_patches() -> None:
    lengths = torch.tensor([[4, 4, 2], [1, 3, 0], [2, 1, 0]])
    assert first_token_alone(lengths).tolist() == [[1, 3, 4, 2], [1, 3, 0, 0], [1, 1, 1, 0]]
    ones = torch.tensor([[1, 2, 3]])
    assert first_token_alone(ones).tolist() == [[1, 2, 3]]


@pytest.mark.parametrize("rule", list(STATIC))
def test_online_static_starts_are_the_training_windows(rule: str) -> None:
    args = PatcherArgs(patching_mode="static", **STATIC[rule])
    tokens = torch.cat([torch.tensor([1]), torch.randint(4, 260, (60,))])
    # training: the document's patches, then the window's first token alone
    doc = Patcher(args).patch_document(tokens.numpy(), None)
    assert doc[0] > 1  # without the split the BLT could not read them
    window = first_token_alone(torch.from_numpy(doc)[None])[0]
    expected = [0] + torch.cumsum(window, 0)[:-1].tolist()
    online = OnlinePatcher(args)
    starts = [0, 1]
    for position in range(2, len(tokens)):
        if online.starts_here(tokens.tolist(), None, position, starts[-1]):
            starts.append(position)
    assert starts == expected
    for n in (1, 2, 5, 17, 33):  # prompts of every length agree with the online decisions
        prefix = online.prefix_starts(tokens[:n], None)
        assert prefix == [s for s in expected if s <= n] or prefix == [
            s for s in expected if s < n
        ] + [n]


def _full_forward_greedy(model, args: PatcherArgs, prompt: list[int], count: int) -> list[int]:
    """The oracle: every byte from a full forward on the whole row, patched as in training."""
    patcher = Patcher(args)
    row = list(prompt)
    with torch.no_grad():
        for _ in range(count):
            tokens = torch.tensor([row])
            logits = model(tokens, blt_patch_lengths(patcher, tokens))
            row.append(int(logits[0, -1].argmax()))
    return row[len(prompt) :]


@pytest.mark.parametrize("rule", list(STATIC))
def test_static_cached_and_speculative_equal_full_forward(rule: str) -> None:
    args = PatcherArgs(patching_mode="static", **STATIC[rule])
    model = tiny_blt("released_flags")
    gen = Generator(model, args)
    prompts = ["Hello, world", "def f(x):\n    return"]
    plain = GenerationArgs(max_new_bytes=20, stop_at_eos=False)
    cached = gen.generate(prompts, plain)
    for result in cached:
        assert result.tokens == _full_forward_greedy(model, args, result.prompt_tokens, 20)
        final = torch.tensor([result.prompt_tokens + result.tokens])
        lengths = first_token_alone(Patcher(args).patch(final)[0])[0]
        assert result.patch_lengths == lengths.tolist()
        assert result.patch_lengths[:2] == [
            1,
            min(args.patch_size, args.max_patch_length or 99) - 1,
        ]
    fast = gen.generate(prompts, plain.model_copy(update={"speculative_k": 4}))
    assert [r.tokens for r in fast] == [r.tokens for r in cached]
    assert [r.patch_lengths for r in fast] == [r.patch_lengths for r in cached]
    recomputed = gen.generate(prompts, plain.model_copy(update={"use_cache": False}))
    assert [r.tokens for r in recomputed] == [r.tokens for r in cached]
    assert [r.patch_lengths for r in recomputed] == [r.patch_lengths for r in cached]


def test_blt_forward_patches_static_rows_itself() -> None:
    model = tiny_blt("released_flags")
    args = PatcherArgs(patching_mode="static", patch_size=4)
    model.args.patch_in_forward = True
    model.attach_patcher(Patcher(args))
    tokens = torch.cat([torch.tensor([[1]]), torch.randint(4, 260, (1, 21))], dim=1)
    with torch.no_grad():
        own = model(tokens)
        given = model(tokens, blt_patch_lengths(Patcher(args), tokens))
    assert torch.equal(own, given)


@pytest.mark.slow
def test_blt_trained_with_static_patching_generates(tmp_path, corpus_root) -> None:
    from bytelatent.eval.generation import load_generator
    from tests.conftest import TINY_BLT, train_tiny
    from tests.tiny import BLT_CONFIG

    static = ["data.patcher_args.patching_mode=static", "data.patcher_args.patch_size=4"]
    run = train_tiny(str(BLT_CONFIG), tmp_path / "blt", corpus_root, 20, [*TINY_BLT, *static])
    gen = load_generator(run / "checkpoints" / "0000000020")
    assert gen.patcher_args.patching_mode.value == "static"
    prompts = ["def f(x):\n    return", "Hello"]
    args = GenerationArgs(max_new_bytes=16, stop_at_eos=False)
    cached = gen.generate(prompts, args)
    for result in cached:
        expected = _full_forward_greedy(gen.model, gen.patcher_args, result.prompt_tokens, 16)
        assert result.tokens == expected
        assert result.patch_lengths[:3] == [1, 3, 4]
    fast = gen.generate(prompts, args.model_copy(update={"speculative_k": 4}))
    assert [r.tokens for r in fast] == [r.tokens for r in cached]
