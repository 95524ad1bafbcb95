"""The full suite's end under `pytest -n 3 --dist loadfile`: xdist's file scheduling simulated
for two file orders (tests/conftest.py: by test count, the order before 2026-12-04, and by
estimated cost, `file_cost`), on per-test seconds.

    python bench/suite_schedule.py [--durations FILE] [--workers 3] [--draws 300]

Per-test seconds: `--durations FILE` (the lines of a `pytest --durations=0` report, setup + call
+ teardown summed per test), else estimates: the measured slowest-20 table at the end of
bench/RESULTS_test_suite.md for those tests, and for the others random draws around the means
that the last full run implies (`--slow-mean`, `--fast-mean`; lognormal, the slow ones capped
below the 20th slowest). The simulation is xdist 3.8's LoadScopeScheduling (loadscope.py): each
worker gets one file, then another while it has at most 2 unfinished tests, checked at each test
report; a worker runs its files one after another. It ignores that the workers share 2 cores
(a test's seconds are taken as measured in a full `-n 3` run, contention included), so it
compares orders, not absolute times.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


class _Collect:
    def __init__(self) -> None:
        self.items: list[tuple[str, str, bool, bool]] = []

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        for item in session.items:
            path = str(item.path.relative_to(session.config.rootpath))
            slow, slurm = item.get_closest_marker("slow"), item.get_closest_marker("slurm")
            self.items.append((path, item.nodeid, slow is not None, slurm is not None))


def collect() -> list[tuple[str, str, bool, bool]]:
    plugin = _Collect()
    code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", str(REPO / "tests")],
                       plugins=[plugin])  # fmt: skip
    assert code == 0, f"collection failed ({code})"
    return plugin.items


def measured_table() -> dict[str, float]:
    """The last `| s | test |` table of bench/RESULTS_test_suite.md: nodeid -> seconds."""
    text = (REPO / "bench" / "RESULTS_test_suite.md").read_text()
    table = text.rsplit("| s | test |", 1)[1].split("\n\n", 1)[0]
    rows = re.findall(r"^\| ([0-9.]+) \| (\S+)", table, flags=re.M)
    return {nodeid: float(s) for s, nodeid in rows}


def durations_file(path: Path) -> dict[str, float]:
    out: dict[str, float] = {}
    for s, nodeid in re.findall(r"^([0-9.]+)s (?:setup|call|teardown)\s+(\S+)", path.read_text(),
                                flags=re.M):  # fmt: skip
        out[nodeid] = out.get(nodeid, 0.0) + float(s)
    return out


def simulate(files: list[tuple[str, list[float]]], workers: int) -> float:
    """xdist LoadScopeScheduling: when each worker finishes its last test."""
    queue = list(files)
    assigned: list[list[float]] = [[] for _ in range(workers)]  # unfinished tests, in order
    clock = [0.0] * workers

    def pending(w: int) -> int:
        return len(assigned[w])

    def give(w: int) -> None:
        if queue:
            assigned[w].extend(queue.pop(0)[1])

    for w in range(workers):
        give(w)
    for w in range(workers):
        if pending(w) <= 2:
            give(w)
    done = [0.0] * workers
    while any(assigned):
        w = min((w for w in range(workers) if assigned[w]), key=lambda w: clock[w] + assigned[w][0])
        clock[w] += assigned[w].pop(0)
        if pending(w) <= 2:
            give(w)
        if not assigned[w]:
            done[w] = clock[w]
    return max(done)


def orders(items, seconds) -> dict[str, list[tuple[str, list[float]]]]:
    by_file: OrderedDict[str, list] = OrderedDict()
    for path, nodeid, slow, slurm in items:
        by_file.setdefault(path, []).append((nodeid, slow, slurm))
    slurm = {p for p, its in by_file.items() if any(i[2] for i in its)}
    cost = {p: sum(20.0 if i[1] else 0.5 for i in its) for p, its in by_file.items()}
    units = {p: [seconds[i[0]] for i in its] for p, its in by_file.items()}
    by_count = sorted(by_file, key=lambda p: (p not in slurm, -len(by_file[p])))
    by_cost = sorted(by_file, key=lambda p: (p not in slurm, -cost[p]))
    oracle = sorted(by_file, key=lambda p: (p not in slurm, -sum(units[p])))
    return {"by test count (before)": [(p, units[p]) for p in by_count],
            "by file_cost (after)": [(p, units[p]) for p in by_cost],
            "by the seconds (oracle)": [(p, units[p]) for p in oracle]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--durations", type=Path)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--draws", type=int, default=300)
    parser.add_argument("--slow-mean", type=float, default=5.7)
    parser.add_argument("--fast-mean", type=float, default=0.53)
    parser.add_argument("--set", action="append", default=[], metavar="NODEID=S",
                        help="override one test's seconds (e.g. a test this branch shortened)")  # fmt: skip
    args = parser.parse_args()
    items = collect()
    overrides = {k: float(v) for k, v in (s.rsplit("=", 1) for s in args.set)}
    rng = np.random.default_rng(0)
    results: dict[str, list[float]] = {}
    for _ in range(1 if args.durations else args.draws):
        if args.durations:
            known = durations_file(args.durations)
            seconds = {n: known.get(n, 0.0) for _, n, _, _ in items}
        else:
            known = measured_table()
            cap = min(known.values())
            seconds = {}
            for _, nodeid, slow, _ in items:
                mean = args.slow_mean if slow else args.fast_mean
                draw = float(rng.lognormal(np.log(mean) - 0.5, 1.0))  # mean `mean`
                seconds[nodeid] = known.get(nodeid, min(draw, cap) if slow else draw)
        seconds.update(overrides)
        for name, files in orders(items, seconds).items():
            results.setdefault(name, []).append(simulate(files, args.workers))
    total = sum(seconds.values())
    print(f"{len(items)} tests, {args.workers} workers, {total:.0f} worker-s "
          f"(ideal end {total / args.workers:.0f} s); {len(results[next(iter(results))])} draws")  # fmt: skip
    for name, ends in results.items():
        q = np.percentile(ends, [10, 50, 90])
        print(f"{name:24s} end: median {q[1]:.0f} s (10%-90%: {q[0]:.0f}-{q[2]:.0f} s)")
    before, after, _ = results.values()
    diff = [b - a for b, a in zip(before, after, strict=True)]
    print(f"before - after: median {statistics.median(diff):.0f} s, "
          f"after shorter in {sum(d > 0 for d in diff)}/{len(diff)}")  # fmt: skip


if __name__ == "__main__":
    main()
