"""Graph breaks of the compiled debug BLT forward (issue 31 item 3), counted with dynamo's explain
at tiny shapes (backend "eager": nothing is code-generated).

- the single-document check of the sdpa masks comes from the host when the caller hands the
  forward ``model.host_documents(batch)``: no break;
- the hash n-gram lookups run eagerly on CPU (one break, documented in bytelatent/archs/blt/hashing.py:
  the traceable alternative, plain nn.Embedding lookups with dense gradients, costs more than the
  break); with ``HASH_GRAD_BUFFER = False`` the forward is one graph;
- training compiles per block (``apply_compile``) with the masks built eagerly: at the debug
  config's real row length (512 bytes, window 256) the local models' document masks get the CPU
  chunk plan, whose op (``bytelatent::chunked_attention``) the blocks trace without a break
  (issue 39 item 6: it used to break at every call).
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


def debug_blt(real_rows: bool = False) -> ByteLatentTransformer:
    """configs/debug.yaml's BLT (cross-attention, hash n-grams, block_causal) at tiny dims;
    `real_rows`: its own row length and window (512 bytes, 256), else 64 and 64."""
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
    )
    if not real_rows:
        model.update(max_encoder_seq_length=64, max_seqlen=32, local_attention_window_len=64)
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


def test_blocks_compiled_as_in_training_trace_the_chunk_plan_without_a_break(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Per-block compile (what distributed.compile=true does) of the debug BLT at its real row
    length: the chunk plan runs (the op is called), no block breaks its graph, and forward and
    backward match the eager model."""
    from torch._dynamo.utils import counters

    from bytelatent.distributed.parallelize import apply_compile
    from bytelatent.model.attention import chunked

    eager, compiled = debug_blt(real_rows=True), debug_blt(real_rows=True)
    seq_len = eager.args.max_encoder_seq_length
    assert seq_len > chunked.SDPA_CHUNK  # the length at which the CPU plan applies
    calls = []
    op = chunked.chunked_attention
    monkeypatch.setattr(chunked, "chunked_attention", lambda *a: calls.append(1) or op(*a))
    tokens = torch.randint(4, 260, (2, seq_len), generator=torch.Generator().manual_seed(1))
    tokens[:, 0] = 1
    tokens[0, 100] = tokens[1, 300] = eager.args.eos_id  # documents: a plan, not plain causal
    lengths = torch.tensor([[1] + [8] * (seq_len // 8)] * 2)
    lengths[:, -1] -= 1
    torch._dynamo.reset()
    counters.clear()
    try:
        apply_compile(compiled, backend="eager")
        outs = []
        for model in (eager, compiled):
            logits = model(tokens, lengths)
            logits.float().square().mean().backward()
            outs.append((logits, [p.grad for p in model.parameters()]))
        breaks = dict(counters["graph_break"])
    finally:
        torch._dynamo.reset()
    assert calls, "the chunk plan did not run: rows too short for it?"
    assert not breaks, breaks
    torch.testing.assert_close(outs[1][0], outs[0][0])
    for got, want in zip(outs[1][1], outs[0][1]):
        torch.testing.assert_close(got, want)
