"""blt_flops_per_byte against FLOPs counted by torch's FlopCounterMode on a real forward+backward.

FlopCounterMode counts matmuls (mm/addmm/bmm and, on some builds, fused attention kernels), so:

- the parameter terms of the formula (every Linear, 6 FLOPs per parameter per token: forward
  2, input grad 2, weight grad 2) must match the counted matmuls exactly: they count the same
  multiply-adds, so the tolerance is float rounding only (rel 1e-9);
- the attention terms count only attended keys (causal half, one patch per cross-attention
  query). Run with the math SDPA kernel and dense cross-attention masks, every score is a
  counted bmm over the full mask, so the counted excess must equal each attention term scaled by
  (keys in the dense matrix) / (keys the formula counts): S / k_eff for self-attention, P / w for
  cross-attention. Again exact up to rounding (rel 1e-6: k_eff is a float average).
"""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from bytelatent.archs.blt.args import ByteLatentTransformerArgs
from bytelatent.archs.blt.model import ByteLatentTransformer
from bytelatent.archs.blt.sizes import blt_flops_breakdown, blt_flops_per_byte
from bytelatent.model.flops import mean_attended_keys

SEQ_LEN, BATCH = 64, 2
LENGTHS = [1] + [4] * 15 + [3]  # 17 patches, summing to N
N_PATCHES = len(LENGTHS)

CONFIGS = {
    "released_flags_gqa": {
        "cross_attn_encoder": True,
        "cross_attn_decoder": True,
        "cross_attn_k": 2,
        "cross_attn_nheads": 2,
        "cross_attn_all_layers_decoder": True,
        "cross_attn_init_by_pooling": True,
        "downsampling_by_pooling": "max",
        "encoder_hash_byte_group_size": [3, 4],
        "encoder_hash_byte_group_vocab": 97,
        "n_kv_heads_global": 2,
    },
    "pooling_avg_min_projection": {"downsampling_by_pooling": "avg,min", "dim": 48},
    "decoder_cross_k3_all_enc": {
        "cross_attn_encoder": True,
        "cross_attn_all_layers_encoder": True,
        "cross_attn_init_by_pooling": True,
        "cross_attn_decoder": True,
        "cross_attn_k": 3,
        "downsampling_by_pooling": "avg",
    },
}
BASE = {
    "dim": 64,
    "n_layers": 2,
    "n_heads": 4,
    "dim_local_encoder": 32,
    "dim_local_decoder": 32,
    "n_layers_local_encoder": 2,
    "n_layers_local_decoder": 2,
    "n_heads_local_encoder": 2,
    "n_heads_local_decoder": 2,
    "multiple_of": 16,
    "max_seqlen": 64,
    "max_encoder_seq_length": 64,
}
ATTENTION_TERMS = {
    "encoder_attention",
    "decoder_attention",
    "global_attention",
    "encoder_cross_attention",
    "decoder_cross_attention",
}


def counted_flops_per_byte(model: ByteLatentTransformer, math_sdpa: bool) -> float:
    tokens = torch.randint(4, 260, (BATCH, SEQ_LEN))
    lengths = torch.tensor([LENGTHS] * BATCH)
    with FlopCounterMode(display=False) as counter:
        if math_sdpa:
            with sdpa_kernel(SDPBackend.MATH):
                model(tokens, lengths).sum().backward()
        else:
            model(tokens, lengths).sum().backward()
    return counter.get_total_flops() / (BATCH * SEQ_LEN)


def dense_scale(name: str) -> float:
    """Keys per query in the dense score matrix over the keys the formula counts."""
    if name in ("encoder_attention", "decoder_attention"):
        return SEQ_LEN / mean_attended_keys(SEQ_LEN)
    if name == "global_attention":
        return N_PATCHES / mean_attended_keys(N_PATCHES)
    return N_PATCHES  # cross-attention without a window: one patch of P


@pytest.mark.parametrize("name", list(CONFIGS))
def test_formula_matches_counted_flops(name: str) -> None:
    torch.manual_seed(0)
    args = ByteLatentTransformerArgs(**{**BASE, **CONFIGS[name]})
    model = ByteLatentTransformer(args)
    model.init_weights()
    terms = blt_flops_breakdown(args, SEQ_LEN / N_PATCHES, SEQ_LEN)
    parameter_flops = sum(v for k, v in terms.items() if k not in ATTENTION_TERMS)

    counted = counted_flops_per_byte(model, math_sdpa=False)
    if counted != pytest.approx(parameter_flops, rel=1e-9):
        # a torch build that also counts its fused CPU attention kernel counts full score matrices
        fused = sum(
            v * dense_scale(k)
            for k, v in terms.items()
            if k in ("encoder_attention", "decoder_attention", "global_attention")
        )
        assert counted == pytest.approx(parameter_flops + fused, rel=1e-6)

    model.structured_cross_attn = False
    counted_dense = counted_flops_per_byte(model, math_sdpa=True)
    dense_attention = sum(v * dense_scale(k) for k, v in terms.items() if k in ATTENTION_TERMS)
    assert counted_dense == pytest.approx(parameter_flops + dense_attention, rel=1e-6)
    assert blt_flops_per_byte(args, SEQ_LEN / N_PATCHES, SEQ_LEN) == pytest.approx(
        sum(terms.values())
    )


def test_bigger_patches_cost_fewer_flops_per_byte() -> None:
    args = ByteLatentTransformerArgs(**{**BASE, **CONFIGS["released_flags_gqa"]})
    assert blt_flops_per_byte(args, 8.0, 1024) < blt_flops_per_byte(args, 4.0, 1024)
    with pytest.raises(ValueError, match="must be positive"):
        blt_flops_per_byte(args, 0.0, 1024)
