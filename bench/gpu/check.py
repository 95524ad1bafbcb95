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

# torch.cuda.is_available() (run() asks it in every step) poisons fork unless it asks NVML: the
# deterministic step forks a clean child from its step, which then could not use CUDA ("Cannot
# re-initialize CUDA in forked subprocess", the first GPU run, 2026-12-04).
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))

# The lent GPU gives 15 minutes of device time in all and at most ~10 per command, and starting
# the machine costs minutes of it: the whole check must fit one call with time to spare for a
# rerun. Each step's limit is a share of the total budget (the shares add up to at most 1, so the
# limits add up to at most the budget); with --quick the shares of the CPU run apply.
DEFAULT_BUDGET_S = 400.0
DEFAULT_QUICK_BUDGET_S = 280.0
# The 1-rank NCCL probe that decides whether single-device FSDP can start here.
PROBE_SHARE = 0.06
# (name, share of the budget on a GPU, share with --quick or None to skip it there); the order
# is the order of importance: with a total budget, later steps get what is left.
STEPS = [
    ("env", 0.04, 0.05),
    ("blt_1b", 0.15, 0.10),  # the headline (MFU, HFU): right after the environment
    ("attention", 0.17, 0.18),  # flex compiles once per dtype and mask structure on a GPU
    ("train_step", 0.07, 0.07),
    ("fsdp_dcp", 0.06, 0.08),
    ("deterministic", 0.06, 0.10),
    ("throughput", 0.06, 0.08),
    ("profiler", 0.04, 0.06),
    ("generation", 0.07, 0.12),
    ("hnet_flex", 0.06, 0.12),
    ("throughput_compiled", 0.12, None),  # None: not run with --quick
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
        "--budget",
        type=float,
        default=None,
        help=f"total seconds (default {DEFAULT_BUDGET_S:.0f} GPU, {DEFAULT_QUICK_BUDGET_S:.0f} quick)",
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
            args.step,
            device=args.device,
            quick=args.quick,
            out=out,
            work=Path(args.work),
            no_fsdp=getattr(args, "no_fsdp", False),
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
    import steps  # noqa: F401
    import torch

    import bytelatent.eval.generation  # noqa: F401
    import bytelatent.train  # noqa: F401

    if torch.cuda.is_initialized():
        raise RuntimeError("CUDA was initialised before forking the steps")


def run_step(args: argparse.Namespace, name: str, limit: float, log) -> dict | None:
    """Fork a child that runs step `name` in a session of its own (so that a timeout kills all
    it started), its output in `log`; record a crash or a timeout that the child could not."""
    log.write(f"\n===== {name} (limit {limit:.0f} s)\n")
    log.flush()
    started = time.perf_counter()
    rc = fork_call(
        lambda: run_child(argparse.Namespace(**{**vars(args), "step": name})), log, limit
    )
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


def fork_call(fn, log, limit: float) -> int | None:
    """Run `fn()` (its return value: the exit code) in a forked child in a session of its own,
    stdout and stderr into `log`; its exit code, or None when it outlived `limit` (killed)."""
    sys.stdout.flush()  # what the driver buffered must not be written again by the child
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setsid()
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
            code = fn()
        except BaseException:  # noqa: BLE001 - a crash: its traceback goes to the log
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    return wait_for(pid, limit)


def probe_nccl(log, limit: float) -> str | None:
    """Whether a 1-rank NCCL group starts here (what single-device FSDP, the CUDA default, needs):
    None if it does, else why not. Runs the package's own set-up and one all-reduce in a forked
    child, so that a hang or an abort costs `limit` at most and the driver never touches CUDA."""

    def child() -> int:
        import torch
        import torch.distributed as dist

        from bytelatent.distributed.args import DistributedArgs
        from bytelatent.distributed.env import setup_distributed

        env = setup_distributed(DistributedArgs(single_device_fsdp=True))
        x = torch.ones(1, device=env.device)
        dist.all_reduce(x)
        ok = float(x) == 1.0
        dist.destroy_process_group()
        print(f"[check] nccl probe: all_reduce {'ok' if ok else 'wrong'}", flush=True)
        return 0 if ok else 1

    log.write(f"\n===== nccl_probe (limit {limit:.0f} s)\n")
    log.flush()
    rc = fork_call(child, log, limit)
    if rc == 0:
        return None
    why = f"timed out after {limit:.0f} s" if rc is None else f"exit code {rc}"
    return f"1-rank NCCL group did not start ({why}): {tail(Path(log.name), 300)!r}"


def resolve_fsdp(args: argparse.Namespace, log, limit: float, probe=None) -> dict | None:
    """On CUDA, probe NCCL; if it cannot start, every step trains without single-device FSDP
    (`args.no_fsdp`) and the summary says so. None when nothing changes (CPU: gloo)."""
    args.no_fsdp = False
    if args.device != "cuda":
        return None
    started = time.perf_counter()
    failure = (probe or probe_nccl)(log, limit)
    seconds = round(time.perf_counter() - started, 2)
    if failure is None:
        return {"nccl_probe": "ok", "seconds": seconds}
    args.no_fsdp = True
    return {
        "nccl_probe": failure,
        "seconds": seconds,
        "fallback": "distributed.single_device_fsdp=false in every step (fsdp_dcp skipped)",
    }


def step_limits(budget: float, quick: bool) -> dict[str, float | None]:
    """Each step's limit in seconds (None: not run), its share of `budget`."""
    return {name: None if (q if quick else g) is None else budget * (q if quick else g)
            for name, g, q in STEPS}  # fmt: skip


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
    # every line reaches log.txt as it is printed (a killed step loses nothing it said), and
    # the subprocesses a step starts (data preparation) inherit it
    os.environ["PYTHONUNBUFFERED"] = "1"
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.work is None:
        args.work = tempfile.mkdtemp(prefix="bytelatent_gpu_check_")
    names = args.only.split(",") if args.only else [s[0] for s in STEPS]
    unknown = set(names) - {s[0] for s in STEPS}
    if unknown:
        print(f"usage error: unknown step(s) {sorted(unknown)}", file=sys.stderr)
        return 2
    budget = args.budget or (DEFAULT_QUICK_BUDGET_S if args.quick else DEFAULT_BUDGET_S)
    limits = step_limits(budget, args.quick)
    deadline = time.monotonic() + budget
    (out / "summary.json").unlink(missing_ok=True)
    (out / "summary.json").write_text(
        json.dumps(
            {
                "device": args.device,
                "quick": args.quick,
                "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "budget_s": budget,
                "limits_s": {n: None if v is None else round(v, 1) for n, v in limits.items()},
                "steps": [],
            },
            indent=1,
        )
    )
    print(f"[check] budget {budget:.0f} s; step limits (s): "
          + ", ".join(f"{n} {v:.0f}" for n, v in limits.items() if v is not None), flush=True)  # fmt: skip
    preload()
    with open(out / "log.txt", "w") as log:
        fsdp = resolve_fsdp(args, log, PROBE_SHARE * budget)
        if fsdp is not None:
            set_summary(out, "single_device_fsdp", fsdp)
            print(f"[check] single-device FSDP: {json.dumps(fsdp)}", flush=True)
        to_run = [s[0] for s in STEPS if s[0] in names and limits[s[0]] is not None]
        for name in (s[0] for s in STEPS):
            if name not in names:
                continue
            left = deadline - time.monotonic()
            if len(to_run) > 1 and name == to_run[-1]:  # the last gets what the others left
                limits[name] = max(limits[name], left)
            if limits[name] is None:
                record(out, {"step": name, "status": "skip", "reason": "GPU run only"})
                continue
            if left < 5:
                record(out, {"step": name, "status": "skip", "reason": "total budget spent"})
                continue
            entry = run_step(args, name, min(limits[name], left), log)
            if entry is not None:
                record(out, entry)
    files = sorted(p.name for p in out.iterdir() if p.is_file())
    assert len(files) <= MAX_OUT_FILES, files
    summary = json.loads((out / "summary.json").read_text())
    print(summary_table(summary))
    bad = [s["step"] for s in summary["steps"] if s["status"] in ("fail", "error", "timeout")]
    return 1 if bad else 0


def set_summary(out: Path, key: str, value) -> None:
    """Set a top-level key of summary.json (atomically, as `record`)."""
    path = out / "summary.json"
    summary = json.loads(path.read_text())
    summary[key] = value
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(summary, indent=1, default=str))
    os.replace(tmp, path)


def summary_table(summary: dict) -> str:
    """The printed table: the budget, a line on single-device FSDP if it changed, one row a step
    (its seconds against its limit), and the total."""
    limits = summary.get("limits_s", {})
    lines = [f"budget {summary['budget_s']:.0f} s (device {summary['device']}"
             + (", quick)" if summary["quick"] else ")")]  # fmt: skip
    fsdp = summary.get("single_device_fsdp")
    if fsdp and "fallback" in fsdp:
        lines.append(f"single-device FSDP off: {fsdp['nccl_probe'][:200]}")
    total = 0.0
    for s in summary["steps"]:
        limit = limits.get(s["step"])
        total += s.get("seconds", 0)
        of = f"/{limit:>5.0f}" if limit is not None else "/    -"
        lines.append(f"{s['step']:<20} {s['status']:<8} {s.get('seconds', 0):>7}{of} s  {brief(s)}")
    lines.append(f"{'total':<29} {total:>7.1f}/{summary['budget_s']:>5.0f} s")
    lines += utilisation_lines(summary)
    return "\n".join(lines)


def utilisation_lines(summary: dict) -> list[str]:
    """The BLT-1B step's MFU and HFU, each on its own line, against the measured matmul."""
    step = next((s for s in summary["steps"] if s["step"] == "blt_1b" and "mfu" in s), None)
    if step is None:
        return []
    peak = step["matmul_tflops"]
    against = f"of the measured {peak['n']}^3 {peak['dtype']} matmul, {peak['tflops']} TFLOP/s"
    return [
        f"MFU {step['mfu']:.2%} (model FLOPs of the real bytes and patches, analytic) {against}",
        f"HFU {step['hfu']:.2%} (FLOPs FlopCounterMode counted: padding and recompute "
        f"included) {against}",
    ]


def brief(entry: dict) -> str:
    skip = {"step", "status", "seconds", "rc"}
    text = json.dumps({k: v for k, v in entry.items() if k not in skip}, default=str)
    return text[:160]


if __name__ == "__main__":
    sys.exit(main())
