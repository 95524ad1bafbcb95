"""A BLT patched by `patching_mode=tokenizer` (its patch starts depend on the bytes after them)
cannot generate or score online: the generator, the online patcher and the forward-time patcher
refuse it in one config line (the path is never read)."""

from __future__ import annotations

import pytest
import torch

from bytelatent.data.patcher import Patcher, PatcherArgs
from bytelatent.errors import ConfigError
from bytelatent.eval.generation import Generator
from bytelatent.eval.generation.patching import OnlinePatcher, blt_patch_lengths
from tests.generation.conftest import tiny_blt

ARGS = PatcherArgs(patching_mode="tokenizer", tokenizer_path="hf/never-read")


def test_generation_refuses_tokenizer_patching() -> None:
    with pytest.raises(ConfigError, match="patching_mode=tokenizer cannot generate or score"):
        Generator(tiny_blt(), ARGS)
    with pytest.raises(ConfigError, match="patcher.patching_mode=space"):
        OnlinePatcher(ARGS)
    with pytest.raises(ConfigError, match="cannot patch online"):
        blt_patch_lengths(Patcher(ARGS), torch.tensor([[1, 100, 101, 102]]))
