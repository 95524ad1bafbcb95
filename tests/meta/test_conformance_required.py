"""Conformance tests skip on a machine without ../shared/conformance and fail under CI's env var."""

import os
import subprocess
import sys

from tests.limits import hang_limit
from tests.paths import REPO, REQUIRE_ENV

NODE = "tests/tokenizers/test_tokenizers.py::test_blt_tokenizer_matches_reference_cases"


def run_node(tmp_path, require: bool) -> subprocess.CompletedProcess:
    env = {**os.environ, "BYTELATENT_CONFORMANCE_DIR": str(tmp_path / "missing")}
    env.pop(REQUIRE_ENV, None)
    if require:
        env[REQUIRE_ENV] = "1"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", NODE]
    return subprocess.run(
        cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=hang_limit(300)
    )


def test_missing_fixtures_skip_locally_and_fail_in_ci(tmp_path):
    local = run_node(tmp_path, require=False)
    assert local.returncode == 0 and "1 skipped" in local.stdout, local.stdout[-2000:]
    assert "conformance fixtures not found" in local.stdout
    ci = run_node(tmp_path, require=True)
    assert ci.returncode == 1 and "1 error" in ci.stdout, ci.stdout[-2000:]  # fails in setup
    assert f"{REQUIRE_ENV}=1 requires them" in ci.stdout
