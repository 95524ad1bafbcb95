"""CPU seconds a fresh interpreter spends importing what each kind of process imports, for two
source trees side by side (rows interleaved, median of --rounds).

    python bench/import_cpu.py --tree new=. --tree old=/path/to/older/checkout --rounds 7

Processes: the trainer (`import bytelatent.train`); the data-loader fork server of a run that
does not patch (entropy model: the worker module) and of one that does (BLT: + the patcher,
which the older tree imported with the worker module anyway). CPU is user + system time of the
child (`resource.getrusage(RUSAGE_CHILDREN)`), which load on the machine inflates much less than
wall time; each child ends with `os._exit(0)`, as the trainer does.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys

KINDS = {
    "trainer": ["bytelatent.train"],
    "worker (entropy run)": ["bytelatent.data.iterators.multiprocess"],
    "worker (BLT run)": ["bytelatent.data.iterators.multiprocess", "bytelatent.data.patcher"],
}


def cpu_of(tree: str, modules: list[str]) -> float:
    code = (
        "import importlib, os\n"
        + "".join(f"importlib.import_module({m!r})\n" for m in modules)
        + "os._exit(0)\n"
    )
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree), OMP_NUM_THREADS="1")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-c", code], env=env, check=True, cwd=tree)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tree", action="append", required=True, help="NAME=PATH")
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    trees = dict(t.split("=", 1) for t in args.tree)
    samples = {(kind, name): [] for kind in KINDS for name in trees}
    for modules in KINDS.values():  # warm-up: page cache, .pyc files
        for tree in trees.values():
            cpu_of(tree, modules)
    for _ in range(args.rounds):
        for kind, modules in KINDS.items():
            for name, tree in trees.items():
                samples[kind, name].append(cpu_of(tree, modules))
    print(f"load average before the last round: {os.getloadavg()[0]:.2f}; {args.rounds} rounds\n")
    print("| process | " + " | ".join(f"{n} CPU s (median)" for n in trees) + " |")
    print("|---|" + "---|" * len(trees))
    for kind in KINDS:
        cells = [f"{statistics.median(samples[kind, n]):.2f}" for n in trees]
        print(f"| {kind} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
