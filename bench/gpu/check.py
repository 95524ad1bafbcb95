"""The GPU validation in one call: every step in its own forked process, under its own time limit.

    python bench/gpu/check.py                          # on the lent GPU (see bench/gpu/README.md)
    python bench/gpu/check.py --device cpu --quick     # CI and local: the same code, tiny shapes

Each step runs in a child forked from this driver (which imports torch and the package once)
and appends its entry to ``<out>/summary.json`` as it finishes (written atomically), so a
kill loses nothing done before it; a step that overruns its limit or dies is recorded by this
driver as ``timeout`` / ``error`` with the end of its output. Every step's output goes to
``<out>/log.txt``. At most 8 files are written to ``--out`` (default ``$OUT``, else
``bench/gpu/out``): summary.json, log.txt, and from the profiler step trace.json.gz and (CUDA)
memory_snapshot.pickle. The steps themselves are in ``bench/gpu/steps.py``.

Statuses: ok, fail (a check did not hold: ``error`` says which), skip (``reason`` says why),
timeout, error (the step crashed).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))

# (name, seconds on a GPU, seconds with --quick or None to skip it there); the order is the order
# of importance: with a total budget, later steps get what is left.
STEPS = [
    ("env", 60, 60),
    ("attention", 120, 90),
    ("train_step", 90, 60),
    ("fsdp_dcp", 90, 60),
    ("deterministic", 90, 60),
    ("blt_1b", 180, 60),
    ("throughput", 90, 60),
    ("profiler", 60, 60),
    ("generation", 60, 60),
    ("throughput_compiled", 180, None),  # None: not run with --quick
]
MAX_OUT_FILES = 8


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--quick", action="store_true", help="tiny shapes, few steps (CI)")
    p.add_argument("--out", default=os.environ.get("OUT") or str(HERE / "out"))
    p.add_argument("--work", default=None, help="scratch folder (default: a temporary one)")
    p.add_argument("--only", default=None, help="comma-separated step names")
    p.add_argument(
        "--budget", type=float, default=None, help="total seconds (default 540 GPU, 280 quick)"
    )
    return p.parse_args(argv)


def record(out: Path, entry: dict) -> None:
    """Append `entry` to summary.json (read, append, write to a temporary file, rename)."""
    path = out / "summary.json"
    summary = json.loads(path.read_text()) if path.exists() else {"steps": []}
    summary["steps"].append(entry)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(summary, indent=1, default=str))
    os.replace(tmp, path)


def recorded(out: Path, name: str) -> bool:
    path = out / "summary.json"
    if not path.exists():
        return False
    return any(s.get("step") == name for s in json.loads(path.read_text())["steps"])


def run_child(args: argparse.Namespace) -> int:
    """Run step `args.step` in this process and record its entry (status from the step)."""
    import steps

    out = Path(args.out)
    started = time.perf_counter()
    try:
        entry = steps.run(
            args.step, device=args.device, quick=args.quick, out=out, work=Path(args.work)
        )
    except steps.CheckFailed as e:
        entry = {"status": "fail", "error": str(e)}
    except steps.Skip as e:
        entry = {"status": "skip", "reason": str(e)}
    entry = {"step": args.step, **entry, "seconds": round(time.perf_counter() - started, 2)}
    entry.setdefault("status", "ok")
    record(out, entry)
    print(f"[check] {args.step}: {entry['status']}", flush=True)
    return 0


def preload() -> None:
    """Import torch and the package once in the driver: each step is forked from it and starts at
    once (a fresh interpreter per step spent ~4 s of imports, on the GPU machine's clock too).
    CUDA must not be initialised here: a forked child could not use it."""
    import torch

    import bytelatent.eval.generation  # noqa: F401
    import bytelatent.train  # noqa: F401
    import steps  # noqa: F401

    if torch.cuda.is_initialized():
        raise RuntimeError("CUDA was initialised before forking the steps")


def run_step(args: argparse.Namespace, name: str, limit: float, log) -> dict | None:
    """Fork a child that runs step `name` in a session of its own (so that a timeout kills all
    it started), its output in `log`; record a crash or a timeout that the child could not."""
    sys.stdout.flush()  # what the driver buffered must not be written again by the child
    sys.stderr.flush()
    log.write(f"\n===== {name} (limit {limit:.0f} s)\n")
    log.flush()
    started = time.perf_counter()
    pid = os.fork()
    if pid == 0:  # the step
        code = 1
        try:
            os.setsid()
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
            code = run_child(argparse.Namespace(**{**vars(args), "step": name}))
        except BaseException:  # noqa: BLE001 - a crash: its traceback goes to the log
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    rc = wait_for(pid, limit)
    seconds = round(time.perf_counter() - started, 2)
    if recorded(Path(args.out), name):
        return None
    status = "timeout" if rc is None else "error"
    return {
        "step": name,
        "status": status,
        "rc": rc,
        "seconds": seconds,
        "error": tail(Path(args.out) / "log.txt"),
    }


def wait_for(pid: int, limit: float) -> int | None:
    """The exit code of child `pid`, or None after killing its session when it outlives `limit`."""
    deadline = time.monotonic() + limit
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return None
        time.sleep(0.05)


def tail(path: Path, n: int = 1500) -> str:
    text = path.read_text(errors="replace")
    return text[text.rfind("=====") :][-n:]


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.work is None:
        args.work = tempfile.mkdtemp(prefix="bytelatent_gpu_check_")
    names = args.only.split(",") if args.only else [s[0] for s in STEPS]
    unknown = set(names) - {s[0] for s in STEPS}
    if unknown:
        print(f"usage error: unknown step(s) {sorted(unknown)}", file=sys.stderr)
        return 2
    (out / "summary.json").unlink(missing_ok=True)
    (out / "summary.json").write_text(
        json.dumps(
            {
                "device": args.device,
                "quick": args.quick,
                "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "steps": [],
            },
            indent=1,
        )
    )
    budget = args.budget or (280.0 if args.quick else 540.0)
    deadline = time.monotonic() + budget
    preload()
    with open(out / "log.txt", "w") as log:
        for name, gpu_s, quick_s in STEPS:
            if name not in names:
                continue
            left = deadline - time.monotonic()
            if args.quick and quick_s is None:
                record(out, {"step": name, "status": "skip", "reason": "GPU run only"})
                continue
            if left < 5:
                record(out, {"step": name, "status": "skip", "reason": "total budget spent"})
                continue
            entry = run_step(args, name, min(quick_s if args.quick else gpu_s, left), log)
            if entry is not None:
                record(out, entry)
    files = sorted(p.name for p in out.iterdir() if p.is_file())
    assert len(files) <= MAX_OUT_FILES, files
    summary = json.loads((out / "summary.json").read_text())
    for s in summary["steps"]:
        print(f"{s['step']:<14} {s['status']:<8} {s.get('seconds', 0):>7} s  {brief(s)}")
    bad = [s["step"] for s in summary["steps"] if s["status"] in ("fail", "error", "timeout")]
    return 1 if bad else 0


def brief(entry: dict) -> str:
    skip = {"step", "status", "seconds", "rc"}
    text = json.dumps({k: v for k, v in entry.items() if k not in skip}, default=str)
    return text[:160]


if __name__ == "__main__":
    sys.exit(main())
