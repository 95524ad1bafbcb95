"""The byte LM's estimates: training FLOPs (MFU) and a parameter lower bound (no build)."""

from __future__ import annotations

from typing import Any

from bytelatent.checkpoint.model_size import _block_params, _rope_values
from bytelatent.model.flops import lm_flops_per_token


def lm_training_flops(model_args: object, data_args: object):
    """A byte LM: every token costs `lm_flops_per_token` at the run's row length."""
    import torch  # the counter builds the model on meta to count its parameters

    from bytelatent.archs.lm.model import LMTransformer

    with torch.device("meta"):
        n_non_embedding = LMTransformer(model_args).num_params(exclude_embeddings=True)
    per_token = lm_flops_per_token(
        n_non_embedding,
        model_args.n_layers,
        model_args.dim,
        data_args.seq_len,
        model_args.sliding_window,
    )
    return lambda tokens, patches: tokens * per_token


def lm_lower_bound(args: Any) -> tuple[int, int]:
    """`lower_bound` of a byte LM (LMTransformerArgs)."""
    vocab, dim = args.vocab_size, args.dim
    embeddings = vocab * dim * (1 if args.weight_tying else 2)
    rope = _rope_values(args, args.max_seqlen)
    return args.n_layers * _block_params(args) + embeddings + rope, args.n_layers
