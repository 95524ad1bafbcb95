"""Graph breaks of the compiled debug BLT forward (issue 31 item 3), counted with dynamo's explain
at tiny shapes (backend "eager": nothing is code-generated).

- the single-document check of the sdpa masks comes from the host when the caller hands the
  forward ``model.host_documents(batch)``: no break;
- the hash n-gram lookups run eagerly on CPU (one break, documented in bytelatent/archs/blt/hashing.py:
  the traceable alternative, plain nn.Embedding lookups with dense gradients, costs more than the
  break); with ``HASH_GRAD_BUFFER = False`` the forward is one graph.
"""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch
import yaml

from bytelatent.archs.blt import hashing
from bytelatent.archs.blt.args import ByteLatentTransformerArgs
from bytelatent.archs.blt.model import ByteLatentTransformer

REPO_ROOT = Path(__file__).resolve().parents[2]


def debug_blt() -> ByteLatentTransformer:
    """configs/debug.yaml's BLT (cross-attention, hash n-grams, block_causal) at tiny dims."""
    model = yaml.safe_load((REPO_ROOT / "configs" / "debug.yaml").read_text())["model"]
    model.update(
        dim=32,
        n_heads=2,
        dim_local_encoder=16,
        dim_local_decoder=16,
        n_heads_local_encoder=2,
        n_heads_local_decoder=2,
        cross_attn_nheads=2,
        encoder_hash_byte_group_vocab=67,
        max_encoder_seq_length=64,
        max_seqlen=32,
        local_attention_window_len=64,
    )
    with torch.device("meta"):
        blt = ByteLatentTransformer(ByteLatentTransformerArgs(**model))
    blt.to_empty(device="cpu")
    torch.manual_seed(0)
    blt.init_weights()
    return blt


def explain(model: ByteLatentTransformer, host: object | None) -> torch._dynamo.ExplainOutput:
    bsz, seq_len, patch = 2, 32, 4
    tokens = torch.randint(4, 260, (bsz, seq_len), generator=torch.Generator().manual_seed(0))
    tokens[:, 0] = 1
    tokens[0, 10] = model.args.eos_id  # row 0 holds two documents, row 1 one
    lengths = torch.tensor([[1] + [patch] * (seq_len // patch)] * bsz)
    lengths[:, -1] -= 1  # rows sum to N
    if host is not None:
        host = model.host_documents(
            types.SimpleNamespace(x=tokens.numpy(), patch_lengths=lengths.numpy())
        )
    torch._dynamo.reset()
    try:
        return torch._dynamo.explain(lambda t, pl: model(t, pl, host=host))(tokens, lengths)
    finally:
        torch._dynamo.reset()


def break_sites(out: torch._dynamo.ExplainOutput) -> set[str]:
    """file:function of the innermost user frame of each break."""
    return {
        f"{r.user_stack[-1].filename.rsplit('/', 1)[-1]}:{r.user_stack[-1].name}"
        for r in out.break_reasons
    }


def test_compiled_forward_breaks_only_at_the_hash_lookups() -> None:
    out = explain(debug_blt(), host=True)
    assert break_sites(out) == {"hashing.py:compute_hash_embeddings"}, out.break_reasons


def test_compiled_forward_is_one_graph_without_the_hash_grad_buffer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(hashing, "HASH_GRAD_BUFFER", False)
    out = explain(debug_blt(), host=True)
    assert out.graph_break_count == 0, out.break_reasons
    assert out.graph_count == 1
