"""The chat template is the same in training, generation and the lm-eval harness (issue 41):
the harness's `apply_chat_template` text scores and generates the rows `encode_chat_prompt`
builds (training's row up to the answer); cached chat generation equals the full-recompute
oracle for the BLT (patches cut after markers online) and the H-Net (forced chunk starts)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from bytelatent.data.chat import END_ID, encode_chat_prompt, encode_conversation
from bytelatent.data.patcher_args import PatcherArgs
from bytelatent.eval.chat import generate_answers
from bytelatent.eval.generation import GenerationArgs, Generator
from tests.generation.conftest import tiny_blt
from tests.generation.test_hnet_generation import TWO_STAGES, tiny_hnet

TURNS = [("system", "be brief"), ("user", "reverse abcd")]


def generators() -> dict[str, Generator]:
    return {
        "blt": Generator(tiny_blt(), PatcherArgs(patching_mode="space")),
        "hnet": Generator(tiny_hnet(TWO_STAGES, "perturbed", seed=3)),
    }


def test_generation_prompt_is_the_training_row_up_to_the_answer() -> None:
    tokens, mask = encode_conversation([*TURNS, ("assistant", "dcba")])
    prompt = encode_chat_prompt(TURNS)
    assert tokens[: len(prompt)].tolist() == prompt
    assert not mask[: len(prompt)].any() and mask[len(prompt)]  # the answer starts right there


@pytest.mark.parametrize("arch", ["blt", "hnet"])
def test_cached_chat_answers_equal_the_recompute_oracle(arch) -> None:
    gen = generators()[arch]
    conversations = [TURNS, [("user", "upper xyz")], [("user", "count hello")]]
    args = dict(max_new_bytes=12, temperature=0.0, batch_size=3)
    cached = generate_answers(gen, conversations, GenerationArgs(**args))
    oracle = generate_answers(gen, conversations, GenerationArgs(**args, use_cache=False))
    assert [(a.data, a.closed) for a in cached] == [(a.data, a.closed) for a in oracle]


def test_harness_uses_the_training_template() -> None:
    pytest.importorskip("lm_eval")
    from bytelatent.eval.harness import BytelatentLM, _byte_tokens

    gen = generators()["blt"]
    lm = BytelatentLM(gen.model, gen.patcher_args)
    history = [{"role": role, "content": content} for role, content in TURNS]
    context = lm.apply_chat_template(history)
    assert [1, *_byte_tokens(context)] == encode_chat_prompt(TURNS)
    # generate_until on a templated context gives the chat path's answer (stops at <end>)
    args = {"until": [], "max_gen_toks": 12}
    [text] = lm.generate_until([SimpleNamespace(args=(context, args))])
    [answer] = generate_answers(gen, [TURNS], GenerationArgs(max_new_bytes=12, batch_size=1))
    assert text == answer.text
    # scoring sees the marker ids too: the answer after the template, closed by <end>
    row = encode_chat_prompt(TURNS)
    logprobs, _ = lm.token_logprobs([*row, 4 + ord("a"), END_ID])
    assert torch.isfinite(logprobs).all() and logprobs.shape[0] == len(row) + 1
