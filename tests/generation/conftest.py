"""Tiny in-process models for generation tests (random init, sharpened outputs)."""

from __future__ import annotations

import pytest
import torch

from bytelatent.archs.blt.args import ByteLatentTransformerArgs
from bytelatent.archs.blt.model import ByteLatentTransformer
from bytelatent.archs.lm.model import LMTransformer
from bytelatent.model.args import LMTransformerArgs


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    """Tiny models are dominated by thread hand-offs on a shared 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def build(cls, args, seed: int = 0, sharpen: float = 1.0):
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = cls(args)
    model.to_empty(device="cpu")
    model.init_weights()
    output = model.output if cls is LMTransformer else model.local_decoder.output
    with torch.no_grad():  # peaky predictions: spread entropies, fewer near-ties
        output.weight.mul_(sharpen)
    return model.eval()


def tiny_lm(max_seqlen: int = 64, window: int | None = 16, seed: int = 0, **kw) -> LMTransformer:
    kind = "local_block_causal" if window else "causal"
    args = LMTransformerArgs(
        dim=32,
        n_layers=2,
        n_heads=2,
        max_seqlen=max_seqlen,
        attn_bias_type=kind,
        sliding_window=window,
        **kw,
    )
    return build(LMTransformer, args, seed, sharpen=20.0)


BLT_BASE = dict(
    dim=32,
    n_layers=2,
    n_heads=2,
    dim_local_encoder=16,
    dim_local_decoder=16,
    n_layers_local_encoder=1,
    n_layers_local_decoder=2,
    n_heads_local_encoder=2,
    n_heads_local_decoder=2,
    cross_attn_k=2,
    cross_attn_nheads=2,
    max_seqlen=96,
    max_encoder_seq_length=128,
    encoder_hash_byte_group_size=[3, 4],
    encoder_hash_byte_group_vocab=97,
)

# the released 1B's flags; all-layer cross-attention with windows, no RoPE; pooling; concat
BLT_VARIANTS = {
    "released_flags": dict(
        cross_attn_encoder=True,
        cross_attn_decoder=True,
        cross_attn_init_by_pooling=True,
        local_attention_window_len=16,
        attn_bias_type="block_causal",
    ),
    "all_layers_windows_norope": dict(
        n_layers_local_encoder=2,
        cross_attn_encoder=True,
        cross_attn_decoder=True,
        cross_attn_init_by_pooling=True,
        cross_attn_all_layers_encoder=True,
        cross_attn_all_layers_decoder=True,
        cross_attn_window_encoder=2,
        cross_attn_window_decoder=2,
        use_rope=False,
        n_kv_heads=1,
    ),
    "pooling_avg_max": dict(downsampling_by_pooling="avg,max", dim=24),
    "concat": dict(downsampling_by_pooling=None, patch_size=2, encoder_hash_byte_group_size=None),
}


def tiny_blt(variant: str = "released_flags", seed: int = 1) -> ByteLatentTransformer:
    args = ByteLatentTransformerArgs(**{**BLT_BASE, **BLT_VARIANTS[variant]})
    return build(ByteLatentTransformer, args, seed, sharpen=20.0)
