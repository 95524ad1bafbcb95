"""The longest time a command says nothing (stdout and stderr merged): run it, stamp each line.

    python bench/silence.py python -m bytelatent.train config=configs/debug.yaml steps=60

Prints the exit code, the total time and the longest gap between output lines (the start and the
exit count as lines), with the line the gap came after. Results: bench/RESULTS_silence.md.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time


def main(command: list[str]) -> int:
    start = time.monotonic()
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    last, worst, worst_after, previous = start, 0.0, "(start)", "(start)"
    for line in proc.stdout:
        now = time.monotonic()
        if now - last > worst:
            worst, worst_after = now - last, previous
        last, previous = now, line.strip()[:100]
    proc.wait()
    end = time.monotonic()
    if end - last > worst:
        worst, worst_after = end - last, f"{previous} (to the exit)"
    print(
        f"rc={proc.returncode} total={end - start:.1f}s longest silence={worst:.1f}s "
        f"after: {worst_after}"
    )
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
