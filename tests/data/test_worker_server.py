"""The data loader's fork server is started before the trainer's imports, only when it will be used."""

import subprocess
import sys

import pytest

from bytelatent.data.worker_server import patches_with_torch, will_load_async
from tests.limits import hang_limit
from tests.tiny import BLT_CONFIG, ENTROPY_CONFIG


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ([f"config={BLT_CONFIG}"], True),
        ([f"config={ENTROPY_CONFIG}", "data.load_async=true"], True),
        ([f"config={BLT_CONFIG}", "data.load_async=false"], False),
        ([f"config={BLT_CONFIG}", "dry_run=true"], False),
        (["--help"], False),
        ([], False),  # the usage line
        (["steps=3"], True),  # no config file: DataArgs' default (load_async=true)
        (["config=/nonexistent.yaml"], False),
        ([f"config={BLT_CONFIG}", "data.load_async"], False),  # a malformed override
    ],
)
def test_will_load_async(argv, expected):
    assert will_load_async(argv) is expected


def run_python(code: str) -> str:
    """stdout of `python -c code` in a fresh interpreter (which must exit 0)."""
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=hang_limit(120)
    )
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout


def test_starting_early_imports_no_torch_and_starts_the_server():
    code = (
        "import sys\n"
        "from multiprocessing import forkserver\n"
        "from bytelatent.data.worker_server import start_early\n"
        f"started = start_early(['config={BLT_CONFIG}'])\n"
        "print(started, 'torch' in sys.modules, forkserver._forkserver._forkserver_pid is not None)\n"
    )
    assert run_python(code).split() == ["True", "False", "True"]


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({}, False),  # DataArgs' defaults: entropy mode with a threshold, entropies from the data
        ({"patcher_args": {"patching_mode": "space"}}, False),  # numpy rules (patch_rules.py)
        ({"patcher_args": {"threshold": None}}, True),  # top-k: torch.topk
        (
            {
                "patcher_args": {
                    "patching_mode": "entropy",
                    "realtime_patching": True,
                    "entropy_model_checkpoint_dir": "m",
                }
            },
            True,
        ),  # a model
        ({"patcher_args": {"patching_mode": "byte"}}, False),
        ({"add_patches": False}, False),  # entropy-model configs
        ({"patcher_args": {"patching_mode": "nope"}}, False),  # the real parse says it
    ],
)
def test_patches_with_torch(data, expected):
    """Whether the fork server preloads the patcher and torch: only when patching needs torch."""
    assert patches_with_torch(data) is expected


def test_worker_and_trainer_imports_stay_lean():
    """Each run starts two interpreters (trainer, fork server). The worker module imports no
    torch (the patcher brings it, for runs that patch), the patcher not the model/checkpoint
    stack (DCP) that only realtime patching loads; the trainer no torch._dynamo (~1 s) unless
    something compiles."""
    code = (
        "import sys\n"
        "import bytelatent.data.iterators.multiprocess\n"
        "print('torch' in sys.modules)\n"
        "import bytelatent.data.patcher\n"
        "heavy = ('torch._dynamo', 'torch.distributed.checkpoint', 'bytelatent.model', 'bytelatent.checkpoint')\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
        "import bytelatent.train\n"
        "print('torch._dynamo' in sys.modules, 'torch.distributed.checkpoint' in sys.modules)\n"
    )
    assert run_python(code).splitlines() == ["False", "[]", "False True"]


@pytest.mark.parametrize(
    ("argv", "torch_loaded"),
    [
        ([f"config={ENTROPY_CONFIG}"], False),
        ([f"config={BLT_CONFIG}"], False),  # space patching: numpy rules
        ([f"config={BLT_CONFIG}", "data.patcher_args.patching_mode=entropy",
          "data.patcher_args.threshold=null"], True),  # top-k entropy patching: torch
    ],
)  # fmt: skip
def test_the_fork_server_loads_torch_only_for_runs_that_patch_with_it(argv, torch_loaded):
    """The real fork server of `start_early`, after it forked a worker: is libtorch mapped in it?"""
    code = (
        "import os\n"
        "from multiprocessing import forkserver\n"
        "from bytelatent.data.worker_server import start_early, worker_context\n"
        "if __name__ == '__main__':\n"
        f"    assert start_early({argv!r})\n"
        "    p = worker_context('forkserver').Process(target=os.getpid)\n"
        "    p.start(); p.join()\n"
        "    maps = open(f'/proc/{forkserver._forkserver._forkserver_pid}/maps').read()\n"
        "    print(p.exitcode, 'libtorch' in maps)\n"
    )
    assert run_python(code).split() == ["0", str(torch_loaded)]


@pytest.mark.parametrize("config", [ENTROPY_CONFIG, BLT_CONFIG])
def test_the_worker_does_not_rerun_the_trainers_main_module(tmp_path, corpus_root, config):
    """multiprocessing re-runs the parent's `__main__` in a forkserver child; for the trainer that
    was torch and the whole stack in every worker (~3 CPU-s, seconds before the first batch).
    Here a main module that imports torch starts the loader of an entropy-model run (no
    patching) and of the debug BLT (space patching, numpy): no worker has libtorch mapped."""
    script = tmp_path / "main_with_torch.py"
    script.write_text(
        "import torch  # like bytelatent.train's main module\n"
        "from bytelatent.args import TrainArgs\n"
        "from bytelatent.config import parse_args\n"
        "if __name__ == '__main__':\n"
        f"    args = parse_args(TrainArgs, ['config={config}', 'data.root_dir={corpus_root}',\n"
        f"                                  'dump_dir={tmp_path}', 'data.load_async=true'])\n"
        "    loader = args.data.build_from_rank(0, 1)\n"
        "    next(loader)\n"
        "    maps = open(f'/proc/{loader.worker_pid}/maps').read()\n"
        "    loader.close()\n"
        "    print('libtorch' in maps)\n"
    )
    res = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=hang_limit(120)
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() == ["False"]
