"""The recipe's last step: rows from the runs' curves, the FLOPs and determinism checks, and
`compare.json`, `compare.md` and `compare.png` in `out_dir`."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from apps.compare.args import CompareArgs
from apps.compare.plot import write_png
from apps.compare.report import row_result, table
from apps.compare.runs import make_job


def _rows(args: CompareArgs, sized: dict, chosen: dict, curves: dict) -> list[dict]:
    rows = []
    for name, s in sized.items():

        def curve(lr: float, seed: int, _name=name, _s=s):
            return curves[make_job(args.out_dir, _s, lr, seed).dump_dir]

        sweep = [curve(lr, args.seeds[0]) for lr in args.row_lrs(name)]
        seeds = [curve(chosen[name], seed) for seed in args.seeds]
        rows.append(row_result(name, s, sweep, chosen[name], seeds))
    return rows


def checks(args: CompareArgs, sized: dict, rows: list[dict], curves: dict) -> list[str]:
    """The real FLOPs per byte against the reference's, and the repeated run's bpb."""
    ref = next(r for r in rows if r["row"] == args.reference)["flops_per_byte"]
    lines = []
    for r in rows:
        ratio = r["flops_per_byte"] / ref
        r["flops_ratio"] = ratio
        r["flops_matched"] = abs(ratio - 1) <= args.flops_tolerance
        if not r["flops_matched"]:
            lines.append(
                f"compare: WARNING: {r['row']} trained at {ratio:.3f}x the {args.reference}'s "
                f"FLOPs per byte (real counts), outside ±{args.flops_tolerance:.0%}: its "
                f"bytes per patch came out at {r['bytes_per_patch']:.2f}, sized for "
                f"{r['bytes_per_patch_target']:.2f}"
            )
    if args.repeat_check:
        s = sized[args.reference]
        lr = args.row_lrs(args.reference)[0]
        first = curves[make_job(args.out_dir, s, lr, args.seeds[0]).dump_dir]
        again = curves[make_job(args.out_dir, s, lr, args.seeds[0], "_repeat").dump_dir]
        diff = max(abs(a - b) for a, b in zip(first.bpb["test"], again.bpb["test"]))
        lines.append(
            f"determinism: {args.reference} lr={lr:g} seed={args.seeds[0]} trained twice: "
            f"largest test-bpb difference {diff:.2e} ({'same' if diff <= 1e-6 else 'DIFFERENT'}"
            " to 1e-6)"
        )
    return lines


def finish(args: CompareArgs, sized: dict, chosen: dict, curves: dict, sizing: list[str],
           context: dict) -> int:  # fmt: skip
    out = Path(args.out_dir)
    rows = _rows(args, sized, chosen, curves)
    notes = checks(args, sized, rows, curves)
    print("\n".join(notes))
    ref = next(r for r in rows if r["row"] == args.reference)["flops_per_byte"]
    command = shlex.join(["python", "-m", "apps.compare", *context["argv"]])
    train_bytes = rows[0]["train_bytes"]
    caption = (
        f"{len(args.seeds)} seeds {args.seeds} at each row's chosen rate (of {len(args.lrs)}+ "
        f"tried on the tune split); {args.source} corpus, {train_bytes:,} training bytes per run; "
        f"test = held-out {args.source} documents, ood = {', '.join(args.ood_files)}; "
        f"git {context['git_rev']}"
    )
    md = (
        f"# Byte LM vs BLT vs H-Net at matched training FLOPs per byte\n\n`{command}`\n\n"
        f"{caption}. Load average at the end {context['load']} (1/5/15 min): the runs shared "
        f"the machine ({args.parallel} at a time, other jobs besides), so seconds are noisy. "
        "bpb: mean ± std over the seeds (sample std). FLOPs/byte: the trainer's count on the "
        "run's real patches / chunks; ratio to the reference. Train s: the trainer's step time; "
        "data s (the BLT's on-the-fly entropy patching is there) apart. The BLT's entropy model "
        "is not counted in its row.\n\n"
        + table(rows, ref)
        + "\n```text\n" + "\n".join([*sizing, *notes]) + "\n```\n"
    )  # fmt: skip
    (out / "compare.md").write_text(md)
    result = {
        "command": command, "git_rev": context["git_rev"], "load": context["load"],
        "threshold": context["threshold"], "reference": args.reference, "checks": notes,
        "args": args.model_dump(), "rows": rows,
    }  # fmt: skip
    (out / "compare.json").write_text(json.dumps(result, indent=1) + "\n")
    print(table(rows, ref), end="")
    if write_png(out / "compare.png", rows, args, caption):
        print(f"compare: wrote {out / 'compare.md'}, {out / 'compare.json'}, {out / 'compare.png'}")
    else:
        print(f"compare: wrote {out / 'compare.md'} and {out / 'compare.json'}; no compare.png: "
              "matplotlib is not installed (pip install 'bytelatent[plot]')")  # fmt: skip
    return 0


def status(args: CompareArgs) -> int:
    """`status=true`: the finished runs of out_dir so far (an unfinished study's partial table),
    written to compare_partial.md; trains nothing."""
    from apps.compare.report import read_curve

    out = Path(args.out_dir)
    lines = [
        "| row | size | lr | seed | test bpb | ood bpb | tune bpb | FLOPs/byte (M) | bytes/patch "
        "| train s | wall s | CPU s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    found = 0
    for name in args.rows:
        for done in sorted((out / "runs" / name).glob("*/*/done.json")):
            run = done.parent
            lr_text, _, seed_text = run.name.partition("_seed")
            record = json.loads(done.read_text())
            c = read_curve(name, float(lr_text[2:]), int(seed_text.split("_")[0]), run, record)
            found += 1
            lines.append(
                f"| {name} | {run.parent.name} | {c.lr:g} | {seed_text} | {c.final('test'):.4f} | "
                f"{c.final('ood'):.4f} | {c.final('tune'):.4f} | {c.flops_per_byte / 1e6:.3f} | "
                f"{c.bytes_per_patch:.2f} | {c.step_s:.0f} | {c.wall_s:.0f} | {c.cpu_s:.0f} |"
            )
    text = "\n".join(lines) + "\n"
    (out / "compare_partial.md").write_text(text)
    print(text, end="")
    print(f"compare: {found} finished run(s) in {out} (written to {out / 'compare_partial.md'}); "
          "rerun without status=true to train the rest")  # fmt: skip
    return 0
