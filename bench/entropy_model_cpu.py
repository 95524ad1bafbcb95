"""Entropy-model training throughput on CPU (bytes/s and model FLOP/s vs matmul peak).

Trains LMTransformer (dim 512, 8 layers, 8 heads) on packed multi-document rows of bytes with the
real local_block_causal mask (window 512), AdamW, in fp32 and under bf16 autocast. The model
FLOP/s are compared with the fp32 / bf16 2048³ matmul throughput measured in the same run.

    python bench/entropy_model_cpu.py                 # print the table
    python bench/entropy_model_cpu.py --write         # also write bench/RESULTS_entropy_model_cpu.md

The headline is the ratio of process CPU seconds per step at 1 thread (--threads 1, the default)
between rows run back to back in one round (compiled vs eager; a mask vs the causal baseline),
as median (min-max) over --rounds interleaved rounds, next to the wall bytes/s ratio and the load
average: wall time on a shared machine moves with the other tenants, CPU s per step at 1 thread
by a few percent. A compiled row that uses more CPU s per step than eager gets a WARNING line.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

# run from a checkout without installing the package
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bytelatent.archs.lm.model import LMTransformer
from bytelatent.model.args import LMTransformerArgs
from bytelatent.model.attention import chunked as attention
from bytelatent.model.flops import lm_flops_per_token
from bytelatent.tokenizers.constants import EOS_ID, OFFSET

DEFAULT_CHUNK = attention.SDPA_CHUNK
RESULTS = Path(__file__).with_name("RESULTS_entropy_model_cpu.md")
# reference BLT (wrong plain causal mask), measured on the same kind of machine
REFERENCE = {"fp32": 799.0, "bf16": 1726.0}


def packed_batch(bsz: int, seqlen: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of random bytes cut into documents of 20..600 bytes, each ending with EOS."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(OFFSET, OFFSET + 256, (bsz, seqlen + 1), generator=gen)
    for row in range(bsz):
        pos = 0
        while pos < seqlen + 1:
            pos += int(torch.randint(20, 600, (1,), generator=gen))
            if pos < seqlen + 1:
                tokens[row, pos] = EOS_ID
    return tokens[:, :-1], tokens[:, 1:]


def matmul_gflops(dtype: torch.dtype, size: int = 2048, repeats: int = 5) -> float:
    """Median GFLOP/s of a size³ matmul."""
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    a @ b  # warm up the kernel choice
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return 2 * size**3 / statistics.median(times) / 1e9


def build_model(args: LMTransformerArgs, compile_blocks: bool) -> LMTransformer:
    with torch.device("meta"):
        model = LMTransformer(args)
    model.to_empty(device="cpu")
    torch.manual_seed(args.seed)
    model.init_weights()
    if compile_blocks:
        for layer in model.layers:
            layer.compile()
    return model


def train_throughput(
    model: LMTransformer, bsz: int, seqlen: int, precision: str, steps: int, warmup: int
) -> dict[str, float]:
    """Median bytes/s of forward+backward+AdamW steps, and the matmul GFLOP/s measured right
    after each step (the machine is shared: a step and its matmul see about the same load)."""
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    autocast = (
        torch.autocast("cpu", dtype=torch.bfloat16)
        if precision == "bf16"
        else contextlib.nullcontext()
    )
    bytes_per_s, peaks, cpu_s = [], [], []
    for step in range(warmup + steps):
        x, y = packed_batch(bsz, seqlen, seed=step)
        start, cpu_start = time.perf_counter(), time.process_time()
        with autocast:
            logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - start
        if step >= warmup:
            cpu_s.append(time.process_time() - cpu_start)
            bytes_per_s.append(bsz * seqlen / elapsed)
            peaks.append(matmul_gflops(dtype, repeats=3))
    return {
        "bytes_per_s": statistics.median(bytes_per_s),
        "peak": statistics.median(peaks),
        "ratios": [b / p for b, p in zip(bytes_per_s, peaks)],
        # process CPU seconds per step: with --threads=1 the work of a step, robust to load
        "cpu_s": statistics.median(cpu_s),
        "loss": loss.item(),
    }


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "bytelatent", "bench/entropy_model_cpu.py"],
            check=False,
            capture_output=True,
            text=True,
        )
        return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seqlen", type=int, default=1024)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--precision", choices=["fp32", "bf16", "both"], default="both")
    parser.add_argument(
        "--modes",
        default="eager,compile",
        help="comma list of eager (plain modules) and compile (torch.compile each block)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: CPU s per step is then the work of a step; 0: torch's)",
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="run all rows this many times, interleaved"
    )
    parser.add_argument(
        "--masks",
        default="local_block_causal",
        help="comma list: local_block_causal (correct) and/or causal (the reference's only CPU "
        "setting: wrong for packed documents, measured here as the same-machine baseline); "
        "local_block_causal:dense runs the correct mask without the block-sparse chunk plan",
    )
    parser.add_argument("--write", action="store_true", help=f"write {RESULTS.name}")
    return parser.parse_args()


def run_rounds(
    opts: argparse.Namespace, masks: list[str], modes: list[str], precisions: list[str]
) -> tuple[dict, list[str], LMTransformer, float]:
    """Every (mask, mode, precision) row once per round, interleaved; the results, the table's
    lines, and the last row's model and FLOPs per byte (for the description)."""
    base_args = dict(
        dim=opts.dim,
        n_layers=opts.layers,
        n_heads=opts.heads,
        max_seqlen=opts.seqlen,
        attn_impl="sdpa",
        sliding_window=opts.window,
        ffn_dim_multiplier=1.0,
    )
    lines = [
        "| round | mask | mode | precision | bytes/s | model GFLOP/s | matmul 2048³ GFLOP/s "
        "| fraction of matmul (median per step) | reference bytes/s | final loss | cpu s/step "
        "| load (1 min) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    # each (mask, mode) model is built once and trained on in every round (compiled once)
    models: dict[tuple[str, str], tuple[LMTransformer, float]] = {}
    results: dict[tuple[int, str, str, str], dict[str, float]] = {}
    rows = [(m, mo, p) for m in masks for mo in modes for p in precisions]
    for round_nb, (mask_name, mode, precision) in [
        (i, row) for i in range(opts.rounds) for row in rows
    ]:
        mask, _, plan = mask_name.partition(":")
        # "<mask>:dense" runs the dense-mask kernel without the CPU chunk plan (the old path)
        attention.SDPA_CHUNK = 10**9 if plan == "dense" else DEFAULT_CHUNK
        if (mask_name, mode) not in models:
            args = LMTransformerArgs(attn_bias_type=mask, **base_args)
            model = build_model(args, compile_blocks=mode == "compile")
            flops_per_byte = lm_flops_per_token(
                model.num_params(exclude_embeddings=True),
                args.n_layers,
                args.dim,
                opts.seqlen,
                opts.window,
            )
            models[mask_name, mode] = (model, flops_per_byte)
        model, flops_per_byte = models[mask_name, mode]
        result = train_throughput(
            model, opts.batch, opts.seqlen, precision, opts.steps, opts.warmup
        )
        results[round_nb, mask_name, mode, precision] = result
        gflops = result["bytes_per_s"] * flops_per_byte / 1e9
        fraction = statistics.median(result["ratios"]) * flops_per_byte / 1e9
        lines.append(
            f"| {round_nb} | {mask_name} | {mode} | {precision} | {result['bytes_per_s']:,.0f} "
            f"| {gflops:.1f} | {result['peak']:.0f} | {fraction:.1%} "
            f"| {REFERENCE[precision]:,.0f} | {result['loss']:.3f} | {result['cpu_s']:.2f} "
            f"| {os.getloadavg()[0]:.2f} |"
        )
        print(lines[-1], flush=True)
    return results, lines, model, flops_per_byte


def describe_run(
    opts: argparse.Namespace,
    headline: list[str],
    load_before: tuple[float, ...],
    load_after: tuple[float, ...],
    model: LMTransformer,
    flops_per_byte: float,
) -> str:
    """The RESULTS entry's bullet list: the headline, then the command, machine and model."""
    command = "python bench/entropy_model_cpu.py " + " ".join(
        f"--{k}={v}"
        for k, v in vars(opts).items()
        if v is not None and v is not False and k != "write"
    )
    details = (
        f"- command: `{command}`\n"
        f"- date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M UTC}; git {git_commit()}\n"
        f"- machine: {cpu_name()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads\n"
        f"- load average (1/5/15 min) before: {'/'.join(f'{x:.2f}' for x in load_before)}, "
        f"after: {'/'.join(f'{x:.2f}' for x in load_after)}\n"
        f"- model: {model.num_params():,} params ({model.num_params(exclude_embeddings=True):,} "
        f"non-embedding), batch {opts.batch} x {opts.seqlen} bytes, window {opts.window}; "
        f"{flops_per_byte / 1e6:.1f} MFLOP per byte (bytelatent.model.flops.lm_flops_per_token)\n"
        f"- bytes/s: median over {opts.steps} steps after {opts.warmup} warm-up steps (compile "
        "happens in the warm-up); fraction of matmul: median over steps of the step's model "
        "FLOP/s divided by a 2048³ matmul timed right after that step"
    )
    return (
        f"- **headline** ({torch.get_num_threads()} thread(s), {opts.rounds} interleaved rounds; "
        "ratio of CPU s per step, then of wall bytes/s, median (min-max) over rounds):\n"
        + "\n".join(f"  - {line}" for line in headline)
        + "\n"
        + details
    )


def main() -> None:
    opts = parse_args()
    if opts.threads:
        torch.set_num_threads(opts.threads)
    masks = opts.masks.split(",")
    modes = opts.modes.split(",")
    precisions = ["fp32", "bf16"] if opts.precision == "both" else [opts.precision]
    for mode in modes:
        if mode not in ("eager", "compile"):
            raise SystemExit(f"--modes: unknown mode {mode!r} (eager, compile)")
    load_before = os.getloadavg()
    results, lines, model, flops_per_byte = run_rounds(opts, masks, modes, precisions)
    headline = headline_ratios(results, opts.rounds, masks, modes, precisions)
    details = describe_run(opts, headline, load_before, os.getloadavg(), model, flops_per_byte)
    table = "\n".join(lines)
    print(table)
    print(details)
    if opts.write:
        write_results(table, details)


def headline_ratios(
    results: dict[tuple[int, str, str, str], dict[str, float]],
    rounds: int,
    masks: list[str],
    modes: list[str],
    precisions: list[str],
) -> list[str]:
    """Per-round ratios of rows run back to back: compile vs eager, and each mask vs causal."""
    pairs = []
    for mask in masks:
        for precision in precisions:
            if "compile" in modes and "eager" in modes:
                pairs.append(((mask, "compile", precision), (mask, "eager", precision)))
            if mask != "causal" and "causal" in masks:
                for mode in modes:
                    pairs.append(((mask, mode, precision), ("causal", mode, precision)))
    lines = []
    for fast, slow in pairs:
        both = [i for i in range(rounds) if (i, *fast) in results and (i, *slow) in results]
        if not both:
            continue
        cpu = [results[(i, *slow)]["cpu_s"] / results[(i, *fast)]["cpu_s"] for i in both]
        wall = [
            results[(i, *fast)]["bytes_per_s"] / results[(i, *slow)]["bytes_per_s"] for i in both
        ]
        lines.append(
            f"{'/'.join(fast)} vs {'/'.join(slow)}: CPU s/step {spread(cpu)}, "
            f"wall bytes/s {spread(wall)}; {len(both)} rounds"
        )
        if fast[1] == "compile" and slow[1] == "eager" and statistics.median(cpu) < 1:
            lines.append(
                f"WARNING: compiled {fast[0]}/{fast[2]} uses more CPU s per step than eager "
                f"(median ratio {statistics.median(cpu):.2f}x)"
            )
    for line in lines:
        print(line)
    return lines


def spread(values: list[float]) -> str:
    """median (min-max) of per-round values."""
    return f"{statistics.median(values):.2f}x ({min(values):.2f}-{max(values):.2f})"


def write_results(table: str, details: str) -> None:
    """Append this run to the results file (previous runs are kept below the header)."""
    header = (
        "# Entropy-model training throughput on CPU\n\n"
        "Produced by `bench/entropy_model_cpu.py`. Each section is one run; the newest is last.\n"
    )
    text = RESULTS.read_text() if RESULTS.exists() else header
    stamp = f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M UTC}"
    RESULTS.write_text(f"{text.rstrip()}\n\n## Run {stamp}\n\n{table}\n\n{details}\n")


if __name__ == "__main__":
    main()
