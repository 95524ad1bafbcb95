"""Where the shared conformance fixtures are: ../shared/conformance beside the clone (as the model
conformance tests look), or $BYTELATENT_CONFORMANCE_DIR."""

import os
from pathlib import Path

CONFORMANCE = Path(
    os.environ.get(
        "BYTELATENT_CONFORMANCE_DIR",
        Path(__file__).resolve().parents[2].parent / "shared" / "conformance",
    )
)
