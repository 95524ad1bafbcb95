"""The optional extras import together in one process (setup.py pins one set that works).

`pip install -e ".[test]"` installs every extra; this fails when two of them disagree (e.g. a
huggingface-hub that breaks `import transformers`) or a pin drifts from what is installed.
"""

import importlib
import importlib.metadata
import re
import subprocess
import sys

import pytest

from tests.limits import hang_limit
from tests.paths import REPO

# extra -> modules its users import (apps.plot, export-hf, the lm-eval adapter, the wandb sink)
EXTRA_MODULES = {
    "hf": ["transformers", "safetensors.torch", "tokenizers", "huggingface_hub"],
    "eval": ["lm_eval", "lm_eval.api.model", "lm_eval.tasks", "datasets", "tqdm"],
    "wandb": ["wandb"],
    "plot": ["matplotlib.pyplot"],
    "s3": ["s3fs", "aiobotocore"],
}


def pinned(extra: str) -> dict[str, str]:
    """{distribution: version} of the exact (==) pins setup.py gives `extra`."""
    requires = importlib.metadata.requires("bytelatent") or []
    pins = {}
    for req in requires:
        match = re.match(
            rf"([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?==([^;\s]+)\s*;\s*extra\s*==\s*\"{extra}\"", req
        )
        if match:
            pins[match.group(1)] = match.group(2)
    return pins


@pytest.mark.parametrize("extra", sorted(EXTRA_MODULES))
def test_installed_versions_match_the_pins(extra):
    pins = pinned(extra)
    assert pins, f"setup.py pins nothing for [{extra}] (or bytelatent is not installed with -e)"
    for dist, version in pins.items():
        assert importlib.metadata.version(dist) == version, f"[{extra}] pins {dist}=={version}"


def test_every_extra_imports_in_one_process():
    """All extras at once, in a fresh interpreter (each alone is a subset of this import order)."""
    modules = [m for mods in EXTRA_MODULES.values() for m in mods]
    code = (
        "import importlib, matplotlib\nmatplotlib.use('Agg')\n"
        f"for m in {modules!r}:\n    importlib.import_module(m)\n"
        "from transformers import BltForCausalLM\nfrom bytelatent.eval.harness import BytelatentLM\n"
        "print('ok')"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=hang_limit(600),
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
