"""Wall-clock limits in tests are hang guards, never speed checks.

A test asserts behaviour; how long the machine takes is not its business. Limits (a subprocess's
`timeout=`, a polling deadline) exist only so that a hung process fails the test with its output
instead of stalling the run. They are written as the idle-machine figure and pass through
`hang_limit`, which multiplies them by `BYTELATENT_TEST_TIME_SCALE` (default 5: on 2 cores at
load 10 a runnable process gets about a fifth of the core it has on an idle machine, and the idle
figures already carry a 2-5x margin over a typical run). Above them all stands pytest-timeout's
per-test guard (`timeout` in pytest.ini, 40 minutes): a real hang fails one test well inside
CI's 90 minutes.
"""

from __future__ import annotations

import os

DEFAULT_SCALE = 5.0


def time_scale() -> float:
    raw = os.environ.get("BYTELATENT_TEST_TIME_SCALE", "")
    try:
        return max(1.0, float(raw)) if raw else DEFAULT_SCALE
    except ValueError:
        return DEFAULT_SCALE


def hang_limit(seconds: float) -> float:
    """`seconds` (enough on an idle machine) scaled for a busy one."""
    return seconds * time_scale()
