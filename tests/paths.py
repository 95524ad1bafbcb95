"""Paths the tests share: the conformance fixtures live in `../shared/conformance` beside the
clone (CI lays shared/ there), or wherever $BYTELATENT_CONFORMANCE_DIR points (e.g. a worktree).

Tests that read them carry `@pytest.mark.conformance("file", ...)` (or call
`require_conformance`): skipped when a file is missing, failed instead when
BYTELATENT_REQUIRE_CONFORMANCE=1 (`.ci/run` sets it, so CI never passes without them).
"""

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CONFORMANCE = Path(
    os.environ.get("BYTELATENT_CONFORMANCE_DIR", REPO.parent / "shared" / "conformance")
)
REQUIRE_ENV = "BYTELATENT_REQUIRE_CONFORMANCE"


def conformance_missing(*names: str) -> str | None:
    """Why the fixtures `names` (paths under CONFORMANCE; none: the folder) are unusable, or None."""
    missing = [
        str(CONFORMANCE / name) for name in names or ("",) if not (CONFORMANCE / name).exists()
    ]
    if not missing:
        return None
    return (
        f"conformance fixtures not found: {', '.join(missing)} (expected ../shared/conformance "
        "beside the clone, or $BYTELATENT_CONFORMANCE_DIR)"
    )


def require_conformance(*names: str) -> None:
    """Skip the calling test when fixture files are missing; fail it under $BYTELATENT_REQUIRE_CONFORMANCE=1."""
    reason = conformance_missing(*names)
    if reason is None:
        return
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{reason}; {REQUIRE_ENV}=1 requires them")
    pytest.skip(reason)
