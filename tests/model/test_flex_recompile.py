"""flex_attention under data-dependent shapes (issue 39 item 1): H-Net's inner widths change with
the routing, validation runs another length and a short last batch. Compiled as the backend
compiles it (``flex.compile_flex``, here with ``aot_eager``: no code generation; flex has no CPU
backward, so forward only), flex must compile a bounded number of times and never run eagerly;
at the recompile limit it raises instead of falling back to the unfused kernel."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from bytelatent.archs.hnet.args import HNetArgs
from bytelatent.archs.hnet.dc import chunking
from bytelatent.archs.hnet.model import HNet
from bytelatent.model.attention import flex

STAGES = [
    dict(dim=32, n_heads=2, sliding_window=16, target_ratio=3.0),
    dict(dim=48, n_heads=2, n_layers_encoder=1, n_layers_decoder=1, sliding_window=8,
         target_ratio=2.0),
]  # fmt: skip


def hnet(attn_impl: str) -> HNet:
    args = HNetArgs(stages=STAGES, dim=64, n_layers=1, n_heads=4, max_seqlen=256,
                    multiple_of=16, attn_impl=attn_impl)  # fmt: skip
    with torch.device("meta"):
        model = HNet(args)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    return model


def batch(seed: int, bsz: int = 2, length: int = 128) -> torch.Tensor:
    """Rows of about 6 * seed documents: every document start is a chunk start at each stage,
    so the chunk levels widen with `seed`."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(4, 260, (bsz, length), generator=gen)
    x[:, torch.randperm(length - 1, generator=gen)[: 6 * seed]] = 2  # document ends
    return x


@pytest.fixture
def flex_on_cpu(monkeypatch: pytest.MonkeyPatch):
    """flex selected on CPU (forward only) and compiled with aot_eager, a clean dynamo cache."""
    monkeypatch.setattr(flex.FlexBackend, "unavailable_reason", lambda self, device: None)
    monkeypatch.setattr(flex, "_require_cuda", lambda q: None)
    torch._dynamo.reset()
    monkeypatch.setattr(flex, "_flex_fn", flex.compile_flex("aot_eager"))
    yield
    torch._dynamo.reset()


def widths_seen(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    seen: list[int] = []
    original = chunking.padded_width

    def recording(num_tokens: torch.Tensor, limit: int) -> int:
        seen.append(original(num_tokens, limit))
        return seen[-1]

    monkeypatch.setattr(chunking, "padded_width", recording)
    return seen


@pytest.mark.slow  # ~5 s of CPU (14 H-Net forwards, 3 flex compiles): over a minute under load
def test_hnet_flex_compiles_a_bounded_number_of_times(flex_on_cpu, monkeypatch) -> None:
    """12 batches of changing inner widths, then a validation length and a short last batch:
    a few graphs in all (one per head layout, static then dynamic), no eager flex call, and the
    same logits as sdpa."""
    model, reference = hnet("flex_attention"), hnet("sdpa")
    widths = widths_seen(monkeypatch)
    inputs = [batch(seed) for seed in range(12)] + [batch(3, length=96), batch(5, bsz=1)]
    graphs = counters["stats"]["unique_graphs"]
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        logits = [model(x)[0] for x in inputs]
    compiled = counters["stats"]["unique_graphs"] - graphs
    assert len(set(widths[:24:2])) >= 12, widths  # stage 0's chunk level, then stage 1's
    assert 1 <= compiled <= 8, compiled  # 3 head layouts here: static, then dynamic
    fallbacks = [w for w in caught if "without torch.compile" in str(w.message)]
    assert not fallbacks, fallbacks[0].message
    with torch.no_grad():
        for x, got in zip(inputs[::6], logits[::6]):
            torch.testing.assert_close(got, reference(x)[0], atol=2e-5, rtol=1e-4)


def test_recompile_limit_raises_instead_of_running_unfused(flex_on_cpu) -> None:
    """At the limit (1 here: the second shape needs a recompile) flex raises a one-line error
    naming the shapes and the setting, never the silent eager fallback."""
    model = hnet("flex_attention")
    with torch._dynamo.config.patch(recompile_limit=1), torch.no_grad():
        with pytest.raises(RuntimeError, match="recompile limit.*compile_cache_size_limit"):
            for seed in range(4):
                model(batch(seed))
