"""Generation and validation on tensors tagged as cuda:0, with every host sync counted per phase.

    python scenarios.py SHIM.so '{"scenarios": [...], "plants": [...]}'

Run in a process of its own: the fake-CUDA shim (device guard, hooks, pinned host allocator) is
loaded before torch. Tiny random models (tests/generation/conftest.py, test_hnet_generation.py);
greedy unless a scenario says otherwise. Prints one line ``SYNCS <json>``:
``{scenario: {"units": {name: count}, "phases": {phase: [[kind, file, line, function, n], ...]}}}``
(``blt-space`` again as ``plant:NAME`` for each of ``plants``).

Scenarios (phase: what runs):

* ``blt-entropy`` / ``blt-space``: a BLT (entropy patching with its entropy model / space
  patching, windowed local models) through ``CachedEngine``: ``prefill`` (the batch's prompts),
  ``steps`` (``sample_rows`` + ``advance`` per step, as ``Generator.generate_tokens`` loops);
* ``speculative`` / ``speculative-sampled``: ``Generator.generate`` with ``speculative_k``, as
  phase ``generate``; units: ``rounds`` (verifications: one ``extend_rows`` for all open rows),
  ``draft_steps``, ``extends`` (every ``extend_rows`` call, the prefill's included);
* ``hnet``: a 2-stage H-Net through ``CachedEngine``: ``prefill``, ``steps``; units:
  ``prefill_stage_runs``, ``stage_runs`` (stage calls of the steps: a stage runs for a step
  only when the stage above it closed a chunk in some row);
* ``lm``: a byte LM through ``CachedEngine``: ``prefill``, ``steps``;
* ``validation``: ``validation_bpb`` over 3 batches of a tiny BLT.

A plant (tests/generation/device_syncs/plants.py) wraps the BLT's ``step`` with a bug first.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys

ctypes.CDLL(sys.argv[1], os.RTLD_GLOBAL | os.RTLD_NOW)  # before torch: its CUDA hooks are read once

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import plants  # noqa: E402
from plants import engine_module  # noqa: E402
from tagging import SyncTrace, fake_cuda_is_available, tag_module  # noqa: E402

torch.set_num_threads(1)
fake_cuda_is_available()

from bytelatent.data.patcher import PatcherArgs  # noqa: E402
from bytelatent.eval.generation import GenerationArgs, Generator, encode_prompt  # noqa: E402
from bytelatent.eval.generation.engines import CachedEngine  # noqa: E402
from bytelatent.eval.generation.sampling import sample_rows  # noqa: E402
from tests.generation.conftest import tiny_blt, tiny_lm  # noqa: E402

PROMPTS = ["Hello, world", "def f(x):\n    return", "The quick brown fox"]
STEPS = 8  # cached steps per scenario
GREEDY = GenerationArgs(temperature=0.0)


def _events(counter) -> list:
    return sorted([kind, s.file, s.line, s.function, n] for (kind, s), n in counter.items())


class _Counted:
    """Counts calls of ``cls.name`` while installed (the behaviour is unchanged)."""

    def __init__(self, cls: type, name: str) -> None:
        self.cls, self.name, self.calls = cls, name, []
        self.original = getattr(cls, name)

    def __enter__(self) -> _Counted:
        original, calls = self.original, self.calls

        def counted(*args, **kwargs):
            calls.append(kwargs)
            return original(*args, **kwargs)

        setattr(self.cls, self.name, counted)
        return self

    def __exit__(self, *exc: object) -> None:
        setattr(self.cls, self.name, self.original)


def cached_phases(model, patcher, entropy_model, trace, batch: int = 3, counted=()) -> dict:
    """Prefill of a batch, then STEPS cached steps (sampling included), each phase traced;
    ``counted`` (``_Counted``) count the steps' calls only (their prefill counts are returned
    as ``prefill_calls``)."""
    rows = [encode_prompt(p) for p in PROMPTS[:batch]]
    engine = CachedEngine(model, patcher, entropy_model, max(map(len, rows)) + STEPS + 2)
    trace.take()
    logits = engine.start(rows)
    prefill = trace.take()
    prefill_calls = [len(counter.calls) for counter in counted]
    for counter in counted:
        counter.calls.clear()
    generators = [torch.Generator().manual_seed(0) for _ in rows]
    for _ in range(STEPS):
        picks = sample_rows(logits, GREEDY, generators, list(range(batch)))
        logits = engine.advance([picks[b] for b in range(batch)], [True] * batch)
    steps = trace.take()
    return {"prefill": _events(prefill), "steps": _events(steps), "prefill_calls": prefill_calls}


def blt(variant: str, patcher: dict, entropy: bool, plant: str | None) -> dict:
    model = tiny_blt(variant)
    entropy_model = tiny_lm(max_seqlen=32, window=None, seed=3) if entropy else None
    undo = plants.plant(plant) if plant else None
    try:
        with SyncTrace() as trace:
            tag_module(model)
            if entropy_model is not None:
                tag_module(entropy_model)
            phases = cached_phases(model, PatcherArgs(**patcher), entropy_model, trace)
    finally:
        if undo is not None:
            undo()
    del phases["prefill_calls"]
    return {"units": {"steps": STEPS, "rows": 3}, "phases": phases}


def speculative(temperature: float) -> dict:
    IncrementalBLT = engine_module("blt").IncrementalBLT  # noqa: N806

    model = tiny_blt("released_flags")
    entropy_model = tiny_lm(max_seqlen=32, window=None, seed=3)
    args = GenerationArgs(
        max_new_bytes=12, speculative_k=3, temperature=temperature, stop_at_eos=False
    )
    with SyncTrace() as trace:
        tag_module(model)
        tag_module(entropy_model)
        gen = Generator(model, PatcherArgs(patching_mode="entropy", threshold=0.3), entropy_model)
        trace.take()
        with (
            _Counted(IncrementalBLT, "step") as steps,
            _Counted(IncrementalBLT, "extend_rows") as extends,
        ):
            gen.generate(PROMPTS, args)
        events = trace.take()
    drafts = sum(1 for kw in steps.calls if kw.get("close_patches") is False)
    # every step of a speculative generation is a draft: anything else would be a plain step
    units = {"rounds": len(extends.calls) - 1, "draft_steps": drafts,
             "plain_steps": len(steps.calls) - drafts, "extends": len(extends.calls)}  # fmt: skip
    return {"units": units, "phases": {"generate": _events(events)}}


def hnet() -> dict:
    IncrementalHNet = engine_module("hnet").IncrementalHNet  # noqa: N806
    from tests.generation.test_hnet_generation import TWO_STAGES, tiny_hnet

    model = tiny_hnet(TWO_STAGES, "perturbed")
    with SyncTrace() as trace:
        tag_module(model)
        with _Counted(IncrementalHNet, "_dechunk") as stages:
            phases = cached_phases(model, None, None, trace, batch=2, counted=[stages])
    (prefill_runs,) = phases.pop("prefill_calls")
    units = {"steps": STEPS, "rows": 2, "stages": len(TWO_STAGES),
             "prefill_stage_runs": prefill_runs, "stage_runs": len(stages.calls)}  # fmt: skip
    return {"units": units, "phases": phases}


def lm() -> dict:
    model = tiny_lm(max_seqlen=48, window=None, seed=5)
    with SyncTrace() as trace:
        tag_module(model)
        phases = cached_phases(model, None, None, trace)
    del phases["prefill_calls"]
    return {"units": {"steps": STEPS, "rows": 3}, "phases": phases}


def _batch(args, rng):
    """A batch shaped like the pipeline's: bytes, a padded tail, patch lengths summing to L + 1."""
    from bytelatent.data.batch import Batch

    bsz, length = args.data.batch_size, args.data.seq_len + 1
    x = rng.integers(4, 260, size=(bsz, length)).astype(np.int64)
    mask = np.ones((bsz, length), dtype=bool)
    mask[-1, length - length // 4 :] = False
    lengths = np.zeros((bsz, args.data.seq_len), dtype=np.int64)
    for row in range(bsz):
        parts, left = [1], length - 1
        while left > 0:
            parts.append(int(min(left, rng.integers(4, 9))))
            left -= parts[-1]
        parts[-1] += 1  # include_next_token: the lengths cover L + 1 positions
        lengths[row, : len(parts)] = parts
    return Batch(x=x, y=np.roll(x, -1, axis=1), mask=mask, patch_lengths=lengths)


def validation() -> dict:
    from bytelatent.args import TrainArgs
    from bytelatent.config import parse_args
    from bytelatent.distributed.parallelize import init_model_weights
    from bytelatent.eval import validate
    from bytelatent.eval.tasks import EvalContext
    from bytelatent.trainer.build import build_parallel_model
    from tests.tiny import TINY_BLT_MODEL

    argv = ["config=configs/debug.yaml", *TINY_BLT_MODEL, "data.seq_len=48",
            "data.batch_size=2", "distributed.model_dtype=bf16",
            "distributed.single_device_fsdp=false"]  # fmt: skip
    args = parse_args(TrainArgs, argv)
    model = build_parallel_model(args, mesh=None)
    model.to_empty(device="cpu")
    init_model_weights(model, seed=0)
    rng = np.random.default_rng(0)
    batches = [_batch(args, rng) for _ in range(3)]
    validate.rank_batches = lambda *a, **k: iter(batches)
    device = torch.device("cuda", 0)
    with SyncTrace() as trace:
        tag_module(model).eval()
        ctx = EvalContext(
            model=model, forward=validate.model_forward(model, None, args.distributed, device),
            step=1, eval_args=args.eval, data_args=args.data,
            tokenizer=args.data.tokenizer_args.build(), validation_sources={"val": ["x"]},
            device=device, dp_rank=0, dp_size=1, dp_group=None, fsdp=False, progress=False,
        )  # fmt: skip
        trace.take()
        with torch.no_grad():
            validate.validation_bpb(ctx)
        events = trace.take()
    return {"units": {"batches": len(batches)}, "phases": {"validate": _events(events)}}


SCENARIOS = {
    "blt-entropy": lambda plant: blt(
        "released_flags", {"patching_mode": "entropy", "threshold": 0.3}, True, plant
    ),
    "blt-space": lambda plant: blt(
        "all_layers_windows_norope", {"patching_mode": "space", "max_patch_length": 5}, False, plant
    ),
    "speculative": lambda plant: speculative(0.0),
    "speculative-sampled": lambda plant: speculative(0.8),
    "hnet": lambda plant: hnet(),
    "lm": lambda plant: lm(),
    "validation": lambda plant: validation(),
}


def main() -> None:
    case = json.loads(sys.argv[2])
    names = case.get("scenarios", list(SCENARIOS))
    out = {name: SCENARIOS[name](None) for name in names}
    for plant in case.get("plants", []):
        out[f"plant:{plant}"] = SCENARIOS["blt-space"](plant)
    print("SYNCS " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
