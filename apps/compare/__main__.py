"""Entry point of `python -m apps.compare` (see apps/compare/__init__.py)."""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

from apps.compare import __doc__ as DESCRIPTION
from apps.compare.args import CompareArgs
from apps.compare.report import read_curve, table, write_json, write_png
from apps.compare.runs import corpus_files, entropy_model, pick_threshold, train
from apps.compare.sizing import size_runs, sizing_lines
from bytelatent.config import parse_args
from bytelatent.errors import UserError

USAGE = "usage: python -m apps.compare config=configs/compare_cpu.yaml [key=value ...]"


def load_average() -> str:
    try:
        return " / ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        return "n/a"


def markdown(args: CompareArgs, argv: list[str], threshold: float, curves, lines, entropy) -> str:
    command = shlex.join(["python", "-m", "apps.compare", *argv])
    return (
        f"# Byte LM vs BLT vs H-Net at matched FLOPs per byte\n\n`{command}`\n\n"
        f"Corpus `{args.data_root}/{args.source}`, {args.steps} steps of {args.batch_size} x "
        f"{args.row_bytes} bytes per run, N = {args.bytes_per_patch:g} (BLT entropy threshold "
        f"{threshold:.4f} from bytelatent.data.patch_size), load average at the end "
        f"{load_average()} (1/5/15 min). The BLT's entropy model ({entropy}) is not counted "
        "in the BLT's row.\n\n" + table(curves) + "\n```text\n" + "\n".join(lines) + "\n```\n"
    )


def compare(args: CompareArgs, argv: list[str]) -> int:
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    corpus_files(args)  # a missing corpus and every config error before anything trains
    size_runs(args)
    entropy_dir, entropy_s, entropy_ran = entropy_model(args)
    entropy = (
        f"reused {entropy_dir}"
        if args.entropy.checkpoint
        else f"{args.entropy.steps} steps of {args.entropy.config}, {entropy_s:.0f} s wall"
    )
    threshold, threshold_ran = pick_threshold(args, entropy_dir)
    print(f"compare: threshold={threshold:.6f} for {args.bytes_per_patch:g} bytes per patch")
    sized = size_runs(args, entropy_dir, threshold)
    lines = sizing_lines(args, sized)
    print("\n".join(lines), flush=True)
    curves, trained = [], [entropy_ran, threshold_ran]
    for name, run in sized.items():
        dump_dir = out / "runs" / name
        wall_s, ran = train(name, run.argv, dump_dir, args.threads)
        trained.append(ran)
        curves.append(read_curve(name, dump_dir, run.params, run.flops_per_byte, wall_s))
    if not any(trained):
        print(f"compare: nothing to do: every run in {out} is done (rewriting the report)")
    (out / "compare.md").write_text(markdown(args, argv, threshold, curves, lines, entropy))
    extra = {"threshold": threshold, "entropy_model": entropy_dir, "args": args.model_dump()}
    write_json(out / "compare.json", curves, extra)
    print(table(curves), end="")
    if write_png(out / "compare.png", curves):
        print(f"compare: wrote {out / 'compare.md'}, {out / 'compare.json'}, {out / 'compare.png'}")
    else:
        print(f"compare: wrote {out / 'compare.md'} and {out / 'compare.json'}; no compare.png: "
              "matplotlib is not installed (pip install 'bytelatent[plot]')")  # fmt: skip
    return 0


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
