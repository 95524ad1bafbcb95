"""The table and plot of bench/RESULTS_byteify_distill_cpu.md from the runs of the CPU recipe
(docs/byteify.md, "Two-stage byteify with distillation"):

    python bench/byteify_distill_report.py --runs runs --teacher hf/stdlib-teacher --png bench/byteify_distill_cpu.png

Reads each run's metrics.jsonl (training bpb per logged step) and metrics.eval.jsonl (validation
bpb), and the teacher's teacher_eval.json (scripts/train_token_teacher.py). The x axis of the plot
is training bytes, stage 2 placed after stage 1.
"""

from __future__ import annotations

import argparse
import json
import os

VARIANTS_BOLMO = {  # --set bolmo: configs/byteify_distill_stage*_bolmo.yaml (causal bpb)
    "byteify, teacher head (stage 2 plain)": ("byteify_stage1_bolmo", "byteify_stage2_bolmo"),
    "byteify, teacher head (stage 2 + distill)": (
        "byteify_stage1_bolmo",
        "byteify_stage2kd_bolmo",
    ),
    "byteify, learned decoder (Bolmo), lr 1e-2": (
        "byteify_nohead_stage1_bolmo",
        "byteify_nohead_stage2_bolmo",
    ),
    "BLT from scratch, lr 2e-3": ("byteify_scratch_bolmo", None),
    "BLT from scratch, lr 1e-2": ("byteify_scratch_lr1e-2_bolmo", None),
}

VARIANTS = {  # label: (stage 1 run, stage 2 run or None)
    "byteify + distill": ("byteify_stage1", "byteify_stage2"),
    "byteify, no distill": ("byteify_nodistill_stage1", "byteify_nodistill_stage2"),
    "BLT from scratch": ("byteify_scratch", None),
    # patching_mode=tokenizer (the teacher's token starts): configs/byteify_distill_stage*_tok.yaml
    "byteify + distill, token patches": ("byteify_stage1_tok", "byteify_stage2_tok"),
    "byteify, no distill, token patches": (
        "byteify_nodistill_stage1_tok",
        "byteify_nodistill_stage2_tok",
    ),
    "BLT from scratch, token patches": ("byteify_scratch_tok", None),
}


def records(path: str) -> list[dict]:
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def curve(run: str, offset: float) -> tuple[list[float], list[float], float]:
    xs, ys, seen = [], [], offset
    for row in records(os.path.join(run, "metrics.jsonl")):
        seen = offset + row["tokens_seen"]
        xs.append(seen)
        ys.append(row["bpb"])
    return xs, ys, seen


def val_points(run: str, offset: float, bytes_per_step: float) -> list[tuple[int, float, float]]:
    return [
        (r["global_step"], offset + r["global_step"] * bytes_per_step, r["val/bpb"])
        for r in records(os.path.join(run, "metrics.eval.jsonl"))
        if "val/bpb" in r
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", default="runs")
    parser.add_argument("--teacher", default="hf/stdlib-teacher")
    parser.add_argument("--png", default=None)
    parser.add_argument(
        "--set",
        choices=("patches", "bolmo"),
        default="patches",
        help="patches: space / token patches (the first two tables); bolmo: subword embeddings "
        "and the boundary head",
    )
    args = parser.parse_args()
    variants = VARIANTS_BOLMO if args.set == "bolmo" else VARIANTS
    with open(os.path.join(args.teacher, "teacher_eval.json")) as f:
        teacher = json.load(f)
    print(
        f"teacher: {teacher['val_bpb']:.4f} bpb on {teacher['val_bytes']} validation bytes, "
        f"trained on {teacher['train_bytes']:,} bytes"
    )
    print("| model | stage | steps | training bytes | validation bpb | vs teacher |")
    print("|---|---|---|---|---|---|")
    curves, vals = {}, {}
    for label, stages in variants.items():
        offset, xs_all, ys_all = 0.0, [], []
        vals[label] = []
        for number, name in enumerate(s for s in stages if s):
            run = os.path.join(args.runs, name)
            xs, ys, end = curve(run, offset)
            rows = records(os.path.join(run, "metrics.jsonl"))
            per_step = rows[-1]["tokens_seen"] / rows[-1]["global_step"] if rows else 0.0
            for step, seen, bpb in val_points(run, offset, per_step):
                ratio = bpb / teacher["val_bpb"] - 1
                stage = f"{number + 1}" if stages[1] else "-"
                print(f"| {label} | {stage} | {step} | {seen:,.0f} | {bpb:.4f} | {ratio:+.1%} |")
                vals[label].append((seen, bpb))
            xs_all += xs
            ys_all += ys
            offset = end
        curves[label] = (xs_all, ys_all)
    if args.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (train_ax, val_ax) = plt.subplots(1, 2, figsize=(11, 4))
        for label, (xs, ys) in curves.items():
            if not xs:
                continue  # a variant whose runs are not there
            style = "--" if "token patches" in label or "scratch" in label else "-"
            train_ax.plot(xs, ys, style, label=label)
            val_ax.plot(*zip(*vals[label]), style, marker="o", label=label)
        for ax in (train_ax, val_ax):
            ax.axhline(teacher["val_bpb"], color="k", ls="--", label="teacher (validation)")
            ax.set_xlabel("training bytes")
        train_ax.set_ylim(top=4.0)
        train_ax.set_ylabel("training bpb (per log interval)")
        train_ax.set_title("training (stage 2 reads another stream)", fontsize=10)
        val_ax.set_ylabel("validation bpb (51 kB)")
        val_ax.set_title("validation, end of each stage", fontsize=10)
        val_ax.legend(fontsize=8)
        fig.suptitle(
            "byteify a 128d x 2 Llama token teacher on the stdlib corpus (CPU)"
            + (": subword embeddings + boundary head" if args.set == "bolmo" else "")
        )
        fig.tight_layout()
        fig.savefig(args.png, dpi=100)
        print(f"plot: {args.png}")


if __name__ == "__main__":
    main()
