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
