"""No test holds a fixed wall-clock limit: every limit goes through `tests.limits.hang_limit`.

On a busy machine (load 10 on 2 cores) fixed limits such as a subprocess's `timeout=300` failed
tests whose behaviour was right (issue 29). This scans the test sources for a literal limit of
5 s or more that is not scaled.
"""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
_LITERAL_LIMIT = re.compile(
    r"\btimeout=(\d+(?:\.\d+)?)\b"  # subprocess.run(..., timeout=300), proc.wait(timeout=60)
    r"|(?:monotonic|time)\(\) \+ (\d+(?:\.\d+)?)\b"  # deadline = time.monotonic() + 120
    r"|^\s*[A-Z_]*TIMEOUT[A-Z_]* = (\d+(?:\.\d+)?)\s*$"  # TIMEOUT_S = 240
    r"|\b(?:timeout|seconds): (?:float|int) = (\d+(?:\.\d+)?)\b"  # def wait(timeout: float = 300)
    r"|(?:monotonic|time|perf_counter)\(\) - \w+ < (\d+(?:\.\d+)?)\b",  # a speed assertion
    re.MULTILINE,
)
# Limits that are behaviour under test, not a guard for the test itself.
ALLOWED = {
    ("integration/test_peer_faults.py", "3"),  # distributed.timeout_s the run is given
}


def literal_limits(text: str) -> list[str]:
    found = []
    for match in _LITERAL_LIMIT.finditer(text):
        value = next(group for group in match.groups() if group is not None)
        if float(value) >= 5:
            found.append(value)
    return found


def test_the_scan_finds_literal_limits():
    text = (
        "subprocess.run(c, timeout=300)\ndeadline = time.monotonic() + 120\nTIMEOUT_S = 240\n"
        "def wait(timeout: float = 30):\nassert time.monotonic() - start < 60\n"
    )
    assert literal_limits(text) == ["300", "120", "240", "30", "60"]
    scaled = (
        "run(c, timeout=hang_limit(300))\nx = time.monotonic() + hang_limit(9)\nsock(timeout=0.5)"
    )
    assert literal_limits(scaled) == []


def test_no_test_has_a_fixed_wall_clock_limit():
    offenders = []
    for path in sorted(TESTS.rglob("*.py")):
        rel = path.relative_to(TESTS).as_posix()
        if rel == "meta/test_time_limits.py":  # its own examples
            continue
        for value in literal_limits(path.read_text()):
            if (rel, value) not in ALLOWED:
                offenders.append(f"{rel}: {value} s")
    assert not offenders, (
        "fixed wall-clock limits (wrap them in tests.limits.hang_limit): " + ", ".join(offenders)
    )
