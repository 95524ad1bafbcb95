"""Paths the tests share: the conformance fixtures live in `../shared/conformance` beside the
clone (CI lays shared/ there), or wherever $BYTELATENT_CONFORMANCE_DIR points (e.g. a worktree)."""

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFORMANCE = Path(
    os.environ.get("BYTELATENT_CONFORMANCE_DIR", REPO.parent / "shared" / "conformance")
)
