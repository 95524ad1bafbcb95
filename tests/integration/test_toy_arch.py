"""An architecture registered from the tests folder (`tests/toy_arch/__init__.py`) trains through
`python -m bytelatent.train`, resumes bitwise and runs on 2 FSDP ranks; its auxiliary loss term
is logged as `aux/act_l2` and is not part of `loss` / `bpb` (issue 28, items 1 and 6)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from harness import Runner, losses_by_step, metric_by_step, read_metrics
from test_resume import PREEMPT_AT, STEP_DELAY

CONFIG = Path(__file__).resolve().parents[1] / "toy_arch" / "toy_arch.yaml"


def toy_args(nproc: int, arch: str = "tests.toy_arch:toy") -> list[str]:
    # one global batch (2 rows) whatever the number of ranks
    return [f"config={CONFIG}", f"arch={arch}", f"data.batch_size={2 // nproc}",
            f"distributed.dp_shard={nproc}"]  # fmt: skip


@pytest.fixture(scope="module")
def toy_reference(data_root: Path, tmp_path_factory: pytest.TempPathFactory):
    """`reference(nproc)`: (dump_dir, console output) of the uninterrupted 20-step run on `nproc`
    ranks, run once for this file's tests (the resume tests and the auxiliary-loss test)."""
    runs: dict[int, tuple[Path, str]] = {}

    def reference(nproc: int) -> tuple[Path, str]:
        if nproc not in runs:
            runner = Runner(data_root, tmp_path_factory.mktemp(f"toy_reference_{nproc}"))
            try:
                run = runner.start("reference", toy_args(nproc), nproc=nproc)
                runs[nproc] = (run.dump_dir, run.wait_ok())
            finally:
                runner.cleanup()
        return runs[nproc]

    return reference


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2], ids=["1proc", "fsdp2"])
def test_toy_arch_trains_and_resumes_bitwise(runner, toy_reference, nproc: int) -> None:
    reference_dir, out = toy_reference(nproc)
    assert "model: ToyByteLM (arch tests.toy_arch:toy)" in out
    expected = losses_by_step(reference_dir)
    assert sorted(expected) == list(range(1, 21))
    aux = metric_by_step(reference_dir, "aux/act_l2")
    assert sorted(aux) == list(range(1, 21)), "aux/act_l2 is not logged at every step"
    assert all(v > 0 and math.isfinite(v) for v in aux.values()), aux
    for m in read_metrics(reference_dir):  # byte tokens: bpb is the LM loss in bits, only
        assert m["bpb"] == pytest.approx(m["loss"] / math.log(2), rel=1e-12), m

    first = runner.start("run", toy_args(nproc), nproc=nproc, env=STEP_DELAY)
    first.wait_for_step(PREEMPT_AT)
    first.signal_rank(nproc - 1)
    first.wait_ok()
    stopped = read_metrics(first.dump_dir)[-1]["global_step"]
    assert PREEMPT_AT <= stopped < 20, f"stopped at step {stopped}\n{first.describe()}"
    second = runner.start("run", toy_args(nproc), nproc=nproc)
    assert f"at step {stopped}" in second.wait_ok()

    got = losses_by_step(first.dump_dir)
    assert got == expected, "losses after the resume differ from the uninterrupted run"
    assert metric_by_step(first.dump_dir, "aux/act_l2") == aux


@pytest.mark.slow
def test_toy_aux_loss_is_trained_but_not_in_bpb(runner, toy_reference) -> None:
    """Weighted 0, the auxiliary term leaves the first step's loss and bpb exactly as they are
    (they never include it) but changes the losses after the first update (it is trained). With
    the term: the 1-process reference run; without it: the same 20 steps."""
    without = runner.start("zero", toy_args(1, "tests.toy_arch:toy_zero_aux"))
    without.wait_ok()
    a, z = read_metrics(toy_reference(1)[0]), read_metrics(without.dump_dir)
    assert [m["global_step"] for m in a] == [m["global_step"] for m in z] == list(range(1, 21))
    assert a[0]["bpb"] == z[0]["bpb"] and a[0]["loss"] == z[0]["loss"]
    assert a[0]["aux/act_l2"] == z[0]["aux/act_l2"]  # logged unweighted
    assert a[-1]["loss"] != z[-1]["loss"], "the auxiliary term did not change training"


def test_toy_folder_generates_cached_and_round_trips_an_hf_export(tmp_path: Path) -> None:
    """The same folder's cached engine and HF adapter, picked by the spec (issue 37): cached
    greedy generation equals re-running the model every byte, and export -> import gives the
    same weights back. Nothing under bytelatent/ names the toy."""
    import torch

    import tests.toy_arch as toy
    from bytelatent.checkpoint.hf_folder import export_hf, import_hf, write_consolidated
    from bytelatent.checkpoint.pretrained import load_any_checkpoint
    from bytelatent.eval.generation import GenerationArgs, Generator
    from bytelatent.model.registry import get_arch

    args = toy.ToyArgs(dim=8)
    with torch.device("meta"):
        model = get_arch("toy").build(args)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    ckpt = tmp_path / "ckpt"
    params = {"arch": "toy", "arch_args": args.model_dump(mode="json")}
    write_consolidated(ckpt, params, dict(model.state_dict()))
    loaded, _, _ = load_any_checkpoint(str(ckpt))
    prompts = ["abc", "hello, world"]
    texts = {
        cache: [r.tokens for r in Generator(loaded).generate(
            prompts, GenerationArgs(max_new_bytes=12, use_cache=cache, stop_at_eos=False)
        )]
        for cache in (True, False)
    }  # fmt: skip
    assert texts[True] == texts[False] and all(len(t) > 0 for t in texts[True])
    assert export_hf(str(ckpt), str(tmp_path / "hf")) == []
    import_hf(str(tmp_path / "hf"), str(tmp_path / "back"))
    back, _, _ = load_any_checkpoint(str(tmp_path / "back"))
    tokens = torch.randint(4, 260, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(back(tokens)[0], loaded(tokens)[0])
