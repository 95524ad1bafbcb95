"""Entry point of `python -m apps.compare` (see apps/compare/__init__.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from apps.compare import __doc__ as DESCRIPTION
from apps.compare.args import CompareArgs
from apps.compare.outputs import finish, status
from apps.compare.report import read_curve
from apps.compare.runs import Job, corpus_files, entropy_model, make_job, pick_threshold, run_local
from apps.compare.sizing import Sized, size_rows, sizing_lines
from apps.compare.splits import write_splits
from bytelatent.config import parse_args
from bytelatent.errors import ConfigError, UserError

USAGE = "usage: python -m apps.compare config=configs/compare_cpu.yaml [key=value ...]"
# keys that change how the runs are scheduled, not what they compute: free to change on a rerun
SCHEDULING = {
    "parallel",
    "nice",
    "launcher",
    "slurm",
    "poll_s",
    "dry_run",
    "expected_flops_per_s",
    "status",
}


def load_average() -> str:
    try:
        return " / ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        return "n/a"


def git_rev() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, cwd=Path(__file__).parent, check=True)  # fmt: skip
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, cwd=Path(__file__).parent)  # fmt: skip
        return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def is_default(key: str, value: object) -> bool:
    """A key a newer recipe added, at its default: the old runs were trained as it says."""
    field = CompareArgs.model_fields.get(key)
    return field is not None and not field.is_required() and field.get_default(
        call_default_factory=True) == value  # fmt: skip


def check_config(args: CompareArgs, write: bool = True) -> None:
    """out_dir/config.json holds the config its runs were trained with; another is refused.
    `write=False`: only the check (before the sizing, which may still refuse the config)."""
    path = Path(args.out_dir) / "config.json"
    current = json.loads(json.dumps(args.model_dump(exclude=SCHEDULING)))
    if path.exists():
        old = json.loads(path.read_text())
        changed = sorted(
            k
            for k in set(old) | set(current)
            if old.get(k) != current.get(k) and not (k not in old and is_default(k, current[k]))
        )
        if changed:
            k = changed[0]
            raise ConfigError(
                f"{args.out_dir} holds runs of another config ({k}: {old.get(k)} -> "
                f"{current.get(k)}{', ...' if len(changed) > 1 else ''}); choose another out_dir "
                "or delete it"
            )
    elif write:
        path.write_text(json.dumps(current, indent=1) + "\n")


def middle_first(lrs: list[float]) -> list[float]:
    mid = len(lrs) // 2
    return [lrs[mid], *lrs[:mid], *lrs[mid + 1 :]]


def plan(args: CompareArgs, sized: dict[str, Sized], rows: list[str] | None = None) -> list[Job]:
    """The sweep at seeds[0] of `rows` (default: all), and the repeat run of the reference."""
    # each row's middle rate first, row after row: a partial sweep compares every row
    ordered = {n: middle_first(args.row_lrs(n)) for n in sized if rows is None or n in rows}
    sweep = [
        make_job(args.out_dir, sized[name], lrs[i], args.seeds[0])
        for i in range(max(map(len, ordered.values())))
        for name, lrs in ordered.items()
        if i < len(lrs)
    ]
    if args.repeat_check and rows is None:
        ref = sized[args.reference]
        lr = args.row_lrs(args.reference)[0]
        sweep.append(make_job(args.out_dir, ref, lr, args.seeds[0], "_repeat"))
    return sweep


def chosen_lrs(args: CompareArgs, sized: dict[str, Sized], curves: dict) -> dict[str, float]:
    """Each row's rate with the lowest final tune bpb in its sweep (seeds[0])."""
    return {
        name: min(args.row_lrs(name), key=lambda lr: curves[
            make_job(args.out_dir, s, lr, args.seeds[0]).dump_dir].final("tune"))
        for name, s in sized.items()
    }  # fmt: skip


def calibrate(args, splits, entropy_dir, threshold, sized, curves):
    """Phase 2: a row whose best sweep run (the one its seeds will repeat) trained off the
    reference's real FLOPs per byte is sized again from that run's counts (apps/compare/sizing.py)
    and swept again; up to `calibration_rounds` rounds, since a new size can move the counts (an
    H-Net's learned chunks) again."""
    lines: list[str] = []
    for round_ in range(1, args.calibration_rounds + 1):
        chosen = chosen_lrs(args, sized, curves)
        real = {
            n: curves[make_job(args.out_dir, s, chosen[n], args.seeds[0]).dump_dir].flops_per_byte
            for n, s in sized.items()
        }  # fmt: skip
        again = size_rows(args, splits, entropy_dir, threshold, sized, real)
        changed = [n for n in sized if again[n].size != sized[n].size]
        ref = real[args.reference]
        round_lines = [
            f"calibration {round_}: {n} trained at {real[n] / ref:.3f}x the {args.reference}'s "
            f"real FLOPs per byte with {sized[n].size or 'its config'}; "
            + (f"sized again: {again[n].size}" if n in changed else
               f"no size in size_values is predicted within ±{args.flops_tolerance:.0%} at its "
               "real counts: kept, reported off")
            for n in sized
            if abs(real[n] / ref - 1) > args.flops_tolerance
        ]  # fmt: skip
        print("\n".join(round_lines) or f"calibration {round_}: every row within "
              f"±{args.flops_tolerance:.0%} on its real counts", flush=True)  # fmt: skip
        lines += round_lines
        if not changed:
            break
        print(f"compare: phase 2/3, round {round_}/{args.calibration_rounds}: the sweep again "
              f"for the re-sized row(s) {', '.join(changed)}", flush=True)  # fmt: skip
        train_all(plan(args, again, changed), args, curves)
        sized = again
    return sized, lines


def dry_run(args: CompareArgs) -> int:
    """The sizing, the runs and the expected training time
    (no run is trained; without the corpus the validation paths are placeholders)."""
    try:
        corpus_files(args)
        splits = write_splits(args)
    except UserError as e:
        print(f"compare: dry run without the data ({e.one_line()})")
        splits = {s: Path(args.out_dir) / "splits" / f"{s}.jsonl" for s in ("tune", "test", "ood")}
    sized = size_rows(args, splits)
    print("\n".join(sizing_lines(args, sized)))
    n_runs = sum(len(args.row_lrs(n)) + len(args.seeds) - 1 for n in sized) + args.repeat_check
    train_bytes = args.steps * args.batch_size * args.row_bytes
    flops = sum(
        s.flops_per_byte * train_bytes * (len(args.row_lrs(n)) + len(args.seeds) - 1)
        for n, s in sized.items()
    )
    hours = flops / args.expected_flops_per_s / min(args.parallel, n_runs) / 3600
    print(
        f"compare: dry run: {n_runs} runs of {train_bytes:,} training bytes ({len(sized)} rows x "
        f"(sweep of lrs + {len(args.seeds) - 1} more seeds){' + 1 repeat' * args.repeat_check}), "
        f"{flops:.3g} training FLOPs in all; at expected_flops_per_s={args.expected_flops_per_s:.3g}"
        f" per run, {args.parallel} at a time: ~{hours:.2f} h of training (plus start-up, "
        "validation and, for the BLT's entropy row, the entropy model)"
    )
    return 0


def train_all(jobs: list[Job], args: CompareArgs, curves: dict) -> bool:
    """Train the jobs not done yet (saying how many are reused); True when any trained."""
    pending = [j for j in jobs if j.done() is None]
    if len(pending) < len(jobs):
        print(f"compare: reusing {len(jobs) - len(pending)} finished run(s) of {len(jobs)}")
    if pending:
        if args.launcher == "slurm":
            from apps.compare.slurm import run_slurm

            run_slurm(pending, args)
        else:

            def summary(job: Job) -> str:
                c = curves_of(job)
                return f"tune bpb {c.final('tune'):.4f}, test bpb {c.final('test'):.4f}"

            run_local(pending, args, summary)
    for job in jobs:
        curves[job.dump_dir] = curves_of(job)
    return bool(pending)


def curves_of(job: Job):
    return read_curve(job.row, job.lr, job.seed, job.dump_dir, job.done())


def compare(args: CompareArgs, argv: list[str]) -> int:
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if args.dry_run:
        return dry_run(args)
    if args.status:
        return status(args)
    corpus_files(args)  # a missing corpus and every config error before anything trains
    check_config(args, write=False)  # another config's out_dir: refused before the sizing
    splits = write_splits(args)
    sized = size_rows(args, splits)
    check_config(args)
    entropy_dir, threshold, ran = None, None, []
    if any(r.patching == "entropy" for r in args.rows.values()):
        entropy_dir, _, entropy_ran = entropy_model(args)
        threshold, threshold_ran = pick_threshold(args, entropy_dir)
        ran += [entropy_ran, threshold_ran]
        print(f"compare: threshold={threshold:.6f} for {args.bytes_per_patch:g} bytes per patch")
    sized = size_rows(args, splits, entropy_dir, threshold)
    lines = sizing_lines(args, sized)
    print("\n".join(lines), flush=True)

    curves: dict = {}
    sweep = plan(args, sized)
    print(f"compare: phase 1/3, the learning-rate sweep: {len(sweep)} runs", flush=True)
    ran.append(train_all(sweep, args, curves))
    sized, calibration = calibrate(args, splits, entropy_dir, threshold, sized, curves)
    lines += calibration
    chosen = chosen_lrs(args, sized, curves)
    print("compare: chosen on the tune split: "
          + ", ".join(f"{n} lr={lr:g}" for n, lr in chosen.items()), flush=True)  # fmt: skip
    seeds = [
        make_job(args.out_dir, s, chosen[name], seed)
        for name, s in sized.items()
        for seed in args.seeds[1:]
    ]
    print(f"compare: phase 3/3, more seeds at the chosen rates: {len(seeds)} runs", flush=True)
    ran.append(train_all(seeds, args, curves))
    if not any(ran):
        print(f"compare: nothing to do: every run in {out} is done (rewriting the report)")
    context = {"argv": argv, "git_rev": git_rev(), "load": load_average(), "threshold": threshold}
    return finish(args, sized, chosen, curves, lines, context)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(f"{USAGE}\n\n{DESCRIPTION}", file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    try:
        return compare(parse_args(CompareArgs, argv), argv)
    except UserError as e:
        print(e.one_line(), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
