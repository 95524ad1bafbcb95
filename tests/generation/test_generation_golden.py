"""Greedy bytes recorded before generation moved onto the training modules (issue 32 item 1)
and checks that generation runs those modules with their KV cache."""

from __future__ import annotations

import pytest
import torch

from bytelatent.archs.lm.generation import IncrementalLM
from bytelatent.data.patcher import PatcherArgs
from bytelatent.eval.generation import GenerationArgs, Generator
from tests.generation.conftest import tiny_blt, tiny_lm

PROMPTS = ["Hello, world", "def f(x):\n    return", "é"]

# recorded with the hand-written CachedStack blocks (commit bcaf0ef), use_cache=True
# fmt: off
GREEDY = {
    "lm": [
        [26, 1, 149, 149, 71, 71, 44, 44, 211, 71, 137, 40, 18, 15, 221, 221, 110, 190, 27, 249, 57, 106, 18, 57],
        [245, 227, 147, 190, 190, 190, 190, 190, 190, 190, 190, 190, 190, 190, 151, 57, 151, 122, 151, 122, 147, 190, 122, 122],
        [176, 218, 27, 188, 62, 212, 193, 106, 241, 212, 249, 226, 62, 165, 188, 221, 249, 213, 249, 213, 221, 233, 5, 221],
    ],
    "lm_causal": [
        [120, 209, 20, 95, 142, 142, 142, 133, 209, 80, 142, 142, 142, 142, 142, 142, 180, 90, 142, 142, 142, 142, 142, 142],
        [29, 224, 58, 29, 224, 130, 219, 219, 219, 219, 219, 80, 256, 54, 1, 146, 4, 224, 256, 54, 1, 237, 65, 228],
        [241, 65, 15, 90, 90, 59, 30, 42, 146, 53, 19, 53, 19, 51, 19, 80, 80, 80, 80, 202, 90, 65, 145, 65],
    ],
    "blt_released_flags": [
        [166, 50, 218, 250, 114, 50, 50, 50, 44, 239, 50, 135, 31, 50, 136, 218, 157, 143, 94, 136, 114, 6, 92, 89],
        [167, 75, 241, 235, 132, 136, 94, 132, 37, 136, 8, 243, 193, 94, 132, 107, 50, 132, 8, 250, 14, 157, 140, 243],
        [186, 206, 132, 6, 114, 58, 136, 58, 27, 50, 218, 31, 58, 28, 58, 148, 58, 74, 94, 58, 50, 218, 56, 94],
    ],
    "blt_all_layers_windows_norope": [
        [94, 225, 114, 214, 230, 70, 125, 161, 195, 189, 124, 214, 214, 110, 124, 64, 46, 8, 102, 28, 137, 39, 97, 11],
        [178, 114, 178, 150, 198, 198, 188, 28, 10, 50, 38, 94, 114, 155, 205, 198, 10, 186, 133, 10, 10, 124, 87, 36],
        [216, 173, 76, 173, 87, 250, 132, 193, 67, 87, 108, 250, 239, 70, 38, 87, 184, 70, 87, 112, 213, 237, 87, 239],
    ],
}
# fmt: on


def _generator(name: str) -> Generator:
    if name == "lm":
        return Generator(tiny_lm(max_seqlen=48, window=8))
    if name == "lm_causal":
        return Generator(tiny_lm(max_seqlen=64, window=None, seed=5))
    entropy_model = tiny_lm(max_seqlen=32, window=None, seed=3)
    patcher_args = PatcherArgs(patching_mode="entropy", threshold=0.3)
    return Generator(tiny_blt(name.removeprefix("blt_")), patcher_args, entropy_model)


@pytest.mark.parametrize("name", list(GREEDY))
def test_greedy_bytes_unchanged(name: str) -> None:
    args = GenerationArgs(max_new_bytes=24, use_cache=True, stop_at_eos=False)
    assert [r.tokens for r in _generator(name).generate(PROMPTS, args)] == GREEDY[name]


# logits are sharpened 20x; sdpa over a cache slice with an explicit mask sums in another order
# than the whole-sequence kernel (a few ulps), so equality is up to rounding, not bitwise
TOL = dict(atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 8])
def test_lm_cache_runs_the_training_modules(window: int | None) -> None:
    """Prefill and steps go through LMTransformer.forward and every block's Attention.forward
    (no second implementation), and their logits match the uncached forward in fp32."""
    model = tiny_lm(max_seqlen=48, window=window)
    calls = []
    hooks = [model.register_forward_hook(lambda *_: calls.append("model"))]
    hooks += [
        layer.attention.register_forward_hook(lambda *_: calls.append("attention"))
        for layer in model.layers
    ]
    tokens = torch.randint(3, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    tokens[1, [5, 27]] = model.args.eos_id  # documents: split by EOS unless the mask is causal
    with torch.no_grad():
        full = model(tokens)
    calls.clear()
    lm = IncrementalLM(model, batch=2, capacity=48)
    for row in range(2):
        torch.testing.assert_close(lm.prefill(row, tokens[row, :20]), full[row, :20], **TOL)
    for t in range(20, 40):
        torch.testing.assert_close(lm.step(tokens[:, t].tolist(), [True, True]), full[:, t], **TOL)
    for hook in hooks:
        hook.remove()
    assert calls.count("model") == 2 + 20
    assert calls.count("attention") == len(model.layers) * (2 + 20)


def test_blt_generation_runs_the_global_transformer_and_blocks() -> None:
    """The BLT's global model runs its own forward (with its caches) once per prompt and once
    per closing patch; every local block runs its own forward."""
    gen = _generator("blt_released_flags")
    model = gen.model
    calls = []
    hooks = [model.global_transformer.register_forward_hook(lambda *_: calls.append("global"))]
    for local in (model.local_encoder, model.local_decoder):
        hooks += [
            layer.register_forward_hook(lambda *_: calls.append("block")) for layer in local.layers
        ]
    args = GenerationArgs(max_new_bytes=24, use_cache=True, stop_at_eos=False)
    results = gen.generate(PROMPTS[:1], args)
    for hook in hooks:
        hook.remove()
    assert results[0].tokens == GREEDY["blt_released_flags"][0]
    assert calls.count("global") >= 2
    n_local = len(model.local_encoder.layers) + len(model.local_decoder.layers)
    assert calls.count("block") >= n_local * 24
