"""The lm-eval adapter: log-likelihoods from logits, and a real lm_eval run on a local task."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from bytelatent.data.patcher import Patcher, PatcherArgs
from bytelatent.errors import ConfigError
from bytelatent.model.patch_lengths import first_token_alone
from tests.generation.conftest import tiny_blt, tiny_lm
from tests.generation.test_hnet_generation import STAGES, tiny_hnet

pytest.importorskip("lm_eval")
from bytelatent.eval.harness import BytelatentLM, generation_args_from_lm_eval, main  # noqa: E402

REQUESTS = [("The capital of France is", " Paris"), ("", "x"), ("1 + 1 =", " 2, é")]


def _direct_logprob(model, patcher, context: str, continuation: str) -> float:
    """Independent computation: one forward over BOS + all bytes, sum the continuation's."""
    ids = [1] + [b + 4 for b in (context + continuation).encode()]
    n = len(continuation.encode())
    full = torch.tensor([ids])
    if patcher is None:
        logits = model(full[:, :-1])
        logits = logits[0] if isinstance(logits, tuple) else logits  # H-Net: (logits, aux)
    else:
        # the BLT sees the first token alone, as training's windows (static patching splits it)
        logits = model(full[:, :-1], first_token_alone(patcher.patch(full)[0]))
    log_probs = F.log_softmax(logits[0].double(), dim=-1)
    return sum(float(log_probs[i - 1, ids[i]]) for i in range(len(ids) - n, len(ids)))


@pytest.mark.parametrize("kind", ["lm", "blt_entropy", "blt_space", "blt_static", "hnet"])
def test_loglikelihood_equals_logprobs_from_logits(kind: str) -> None:
    patcher_args = entropy_model = None
    if kind == "lm":
        model = tiny_lm(max_seqlen=64)
    elif kind == "hnet":  # its forward returns (logits, aux): the adapter scores the logits
        model = tiny_hnet(STAGES["2stage"], "perturbed")
    else:
        model = tiny_blt()
        mode = kind.removeprefix("blt_")
        patcher_args = PatcherArgs(patching_mode=mode, threshold=0.3, patch_size=3)
        entropy_model = tiny_lm(max_seqlen=32, window=None, seed=3) if mode == "entropy" else None
    lm = BytelatentLM(model, patcher_args, entropy_model)
    got = lm.loglikelihood([SimpleNamespace(args=r) for r in REQUESTS])
    patcher = Patcher(patcher_args, entropy_model=entropy_model) if patcher_args else None
    with torch.no_grad():
        for (context, continuation), (logprob, _) in zip(REQUESTS, got):
            expected = _direct_logprob(model, patcher, context, continuation)
            assert abs(logprob - expected) <= 1e-5 * max(1.0, abs(expected)), (logprob, expected)
            assert logprob < 0
    # rolling log-likelihood of a short string is the loglikelihood of it after BOS
    text = "hello there"
    rolling = lm.loglikelihood_rolling([SimpleNamespace(args=(text,))])[0]
    assert rolling == pytest.approx(lm.loglikelihood([SimpleNamespace(args=("", text))])[0][0])
    # greedy generation through the adapter continues with the argmax bytes
    gen = lm.generate_until([SimpleNamespace(args=("ab", {"until": ["\n"], "max_gen_toks": 5}))])
    assert isinstance(gen[0], str) and len(gen[0].encode("utf-8", "replace")) <= 15


def test_rolling_windows_cover_long_strings() -> None:
    lm = BytelatentLM(tiny_lm(max_seqlen=16, window=None))
    text = "abcdefghijklmnopqrstuvwxyz0123456789"  # 36 bytes, windows of 16
    total = lm.loglikelihood_rolling([SimpleNamespace(args=(text,))])[0]
    assert total < 0
    ids = [b + 4 for b in text.encode()]
    expected = lm.score([1], ids[:16])[0] + lm.score(ids[15:16], ids[16:32])[0]
    expected += lm.score(ids[19:32], ids[32:])[0]  # the last window keeps a full context
    assert total == pytest.approx(expected, abs=1e-6)


def test_generation_kwargs() -> None:
    args = generation_args_from_lm_eval(
        {"until": "\n\n", "max_gen_toks": 7, "do_sample": False, "temperature": 0.7}
    )
    assert (args.stop, args.max_new_bytes, args.temperature) == (["\n\n"], 7, 0.0)


def _write_task(folder: Path) -> None:
    rows = [
        {"question": "Q: 2+2=", "choices": [" 4", " 5"], "label": 0},
        {"question": "Q: the sky is", "choices": [" blue", " green", " loud"], "label": 0},
        {"question": "Q: def f(x):", "choices": [" return x", " zzz"], "label": 1},
    ]
    data = folder / "toy.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (folder / "toy.yaml").write_text(
        "task: bytelatent_toy_mc\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  cache_dir: {folder / 'hf_cache'}\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        "doc_to_text: '{{question}}'\n"
        "doc_to_choice: choices\n"
        "doc_to_target: label\n"
        "metric_list:\n  - metric: acc\n"
    )


@pytest.mark.slow
def test_real_lm_eval_run_through_cli(tiny_blt_run, tmp_path, monkeypatch, capsys) -> None:
    """The CLI entry in-process (a subprocess would pay lm_eval's imports again)."""
    for key in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.setenv(key, "1")
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True, raising=False)
    _write_task(tmp_path)
    out = tmp_path / "results.json"
    ckpt = tiny_blt_run / "checkpoints" / "0000000020"
    argv = [
        f"ckpt={ckpt}",
        "tasks=[bytelatent_toy_mc]",
        f"include_path={tmp_path}",
        f"output={out}",
        "include_defaults=false",
    ]
    assert main(argv) == 0
    results = json.loads(out.read_text())["results"]["bytelatent_toy_mc"]
    assert 0.0 <= results["acc,none"] <= 1.0
    assert results["acc,none"] * 3 == pytest.approx(round(results["acc,none"] * 3))  # 3 docs
    assert capsys.readouterr().out.startswith("bytelatent_toy_mc: {")


def test_unknown_task_one_line(tmp_path, capsys) -> None:
    _write_task(tmp_path)
    code = main(
        [
            "ckpt=/does/not/matter",
            "tasks=[bytelatent_toy_mx]",
            f"include_path={tmp_path}",
            "include_defaults=false",
        ]
    )
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "config error: tasks: unknown task 'bytelatent_toy_mx' (did you mean bytelatent_toy_mc?)"
    ], err
    with pytest.raises(ConfigError):
        from bytelatent.eval.harness import run_harness

        run_harness(tiny_lm(), [], str(tmp_path))


@pytest.mark.slow
def test_harness_runs_as_a_task_of_the_standalone_eval(tiny_blt_run, tmp_path, monkeypatch) -> None:
    """`eval.tasks=[bpb,harness]`: what async evals run; lm-eval metrics land beside val/bpb."""
    from bytelatent.eval.__main__ import main as eval_main

    for key in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.setenv(key, "1")
    _write_task(tmp_path)
    out = tmp_path / "out"
    argv = [
        f"ckpt={tiny_blt_run / 'checkpoints' / '0000000020'}",
        f"dump_dir={out}",
        "eval.tasks=[bpb,harness]",
        "eval.validation.max_batches=2",
        "eval.task_args.harness.tasks=[bytelatent_toy_mc]",
        f"eval.task_args.harness.include_path={tmp_path}",
        "eval.task_args.harness.include_defaults=false",
    ]
    assert eval_main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["val/bpb"] > 0
    acc = results["harness/bytelatent_toy_mc/acc"]
    assert 0.0 <= acc <= 1.0 and acc * 3 == pytest.approx(round(acc * 3))


def test_harness_task_needs_its_task_list() -> None:
    from bytelatent.eval.args import EvalArgs
    from bytelatent.eval.tasks import get_task, task_args

    EvalArgs(tasks=["harness"])  # the name is known
    with pytest.raises(ConfigError, match="tasks"):
        task_args(get_task("harness"), {})
