"""Generation for entropy models (LMTransformer) and BLTs, with KV caches and online patching.

``load_generator(ckpt)`` / ``Generator(model, patcher_args, entropy_model)`` then
``generate(prompts, GenerationArgs(...))``; see ``generator.py``.
"""

from bytelatent.eval.generation.generator import (
    GenerationResult,
    Generator,
    encode_prompt,
    load_generator,
    patcher_args_from_params,
    token_bytes,
)
from bytelatent.eval.generation.sampling import GenerationArgs

__all__ = [
    "GenerationArgs",
    "GenerationResult",
    "Generator",
    "encode_prompt",
    "load_generator",
    "patcher_args_from_params",
    "token_bytes",
]
