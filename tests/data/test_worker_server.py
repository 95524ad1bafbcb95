"""The data loader's fork server is started before the trainer's imports, only when it will be used."""

import subprocess
import sys

import pytest

from bytelatent.data.worker_server import will_load_async
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


def test_starting_early_imports_no_torch_and_starts_the_server():
    code = (
        "import sys\n"
        "from multiprocessing import forkserver\n"
        "from bytelatent.data.worker_server import start_early\n"
        f"started = start_early(['config={BLT_CONFIG}'])\n"
        "print(started, 'torch' in sys.modules, forkserver._forkserver._forkserver_pid is not None)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() == ["True", "False", "True"]


def test_worker_and_trainer_imports_stay_lean():
    """Each run starts two interpreters (trainer, fork server): the fork server's preload is torch
    and the data modules, without the model/checkpoint stack (DCP) that only realtime patching
    loads; neither imports torch._dynamo (~1 s) unless something compiles."""
    code = (
        "import sys\n"
        "import bytelatent.data.iterators.multiprocess\n"
        "heavy = ('torch._dynamo', 'torch.distributed.checkpoint', 'bytelatent.model', 'bytelatent.checkpoint')\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
        "import bytelatent.train\n"
        "print('torch._dynamo' in sys.modules, 'torch.distributed.checkpoint' in sys.modules)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.splitlines() == ["[]", "False True"]
