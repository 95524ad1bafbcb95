"""BLT training throughput on CPU: bytelatent vs Hugging Face transformers' BltForCausalLM.

Same architecture for both (about 101M parameters): local models 256d (encoder 1 layer, decoder
3 layers, 4 heads, FFN 704), global 512d x 6 layers (8 heads, FFN 1408), cross_attn_k=2 (encoder
cross-attention after its last layer, initialised by max pooling; decoder cross-attention before
every layer), hash n-grams n=3..8 x 50002 x 1 function, RoPE theta 5e5. Batch 4 x 1024 bytes,
static 4-byte patches passed as patch_lengths ([1, 4, ..., 4]: rows sum to N+1), AdamW.

Each (implementation, precision) runs in its own subprocess (clean peak RSS); the 2048^3 matmul
throughput is measured in the same run, and model FLOP/s (bytelatent.archs.blt.sizes.blt_flops_per_byte,
identical for both implementations) is reported as a fraction of the bf16 matmul throughput.

    python bench/blt_cpu.py                       # all rows
    python bench/blt_cpu.py --rows ours:bf16 hf:bf16 --steps 5

The headline is the ratio of process CPU seconds per step at 1 thread (--threads 1, the default),
one ratio per round of interleaved rows, printed as median (min-max) over --rounds, next to the
wall bytes/s ratio and the load average: on a shared machine wall-time ratios of the same code
moved between 1.33x and 2.05x, CPU s per step at 1 thread by about 3%. A compiled row that uses
more CPU s per step than eager is reported as a WARNING line.

transformers is NOT a bytelatent dependency: pip install 'transformers==4.57.*' to run the hf rows.

The train:bf16 / train:fp32 rows run the real training loop, `python -m bytelatent.train`, on the same
model shape: the stdlib corpus (prepared into a temporary directory), static 4-byte patches, batch 4 x
256 patches = 4 x 1024 bytes, the trainer's own AdamW (fused, clip 1.0, cosine schedule), metrics
every step (bytes_per_s from metrics.jsonl: packed input bytes over step + data time), synchronous
data loading (a prefetch process would take one of the 2 cores from the training threads).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from bytelatent.archs.blt.args import ByteLatentTransformerArgs

# run from a checkout without installing: the repository root holds the bytelatent package
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BATCH, SEQ_LEN, PATCH = 4, 1024, 4
LOCAL_DIM, GLOBAL_DIM, HEADS_LOCAL, HEADS_GLOBAL = 256, 512, 4, 8
ENC_LAYERS, DEC_LAYERS, GLOBAL_LAYERS, K = 1, 3, 6, 2
HASH_SIZES, HASH_VOCAB = [3, 4, 5, 6, 7, 8], 50002
ROWS = ("ours:fp32", "ours:bf16", "ours-compile:bf16", "hf:fp32", "hf:bf16", "train:bf16")


def blt_args() -> ByteLatentTransformerArgs:
    from bytelatent.archs.blt.args import ByteLatentTransformerArgs

    return ByteLatentTransformerArgs(
        dim=GLOBAL_DIM,
        n_layers=GLOBAL_LAYERS,
        n_heads=HEADS_GLOBAL,
        dim_local_encoder=LOCAL_DIM,
        dim_local_decoder=LOCAL_DIM,
        n_layers_local_encoder=ENC_LAYERS,
        n_layers_local_decoder=DEC_LAYERS,
        n_heads_local_encoder=HEADS_LOCAL,
        n_heads_local_decoder=HEADS_LOCAL,
        multiple_of=64,  # int(2*4*256/3)=682 -> 704, int(2*4*512/3)=1365 -> 1408
        ffn_dim_multiplier=1.0,
        rope_theta=500000.0,
        max_seqlen=SEQ_LEN // PATCH + 1,
        max_encoder_seq_length=SEQ_LEN,
        cross_attn_encoder=True,
        cross_attn_decoder=True,
        cross_attn_k=K,
        cross_attn_nheads=HEADS_LOCAL,
        cross_attn_all_layers_decoder=True,
        cross_attn_init_by_pooling=True,
        downsampling_by_pooling="max",
        encoder_hash_byte_group_size=HASH_SIZES,
        encoder_hash_byte_group_vocab=HASH_VOCAB,
        encoder_hash_byte_group_nb_functions=1,
    )


def build_ours(compile_model: bool) -> torch.nn.Module:
    from bytelatent.archs.blt.model import ByteLatentTransformer

    with torch.device("meta"):
        model = ByteLatentTransformer(blt_args())
    model.to_empty(device="cpu")
    model.init_weights()
    if compile_model:
        model = torch.compile(model)
    return model


def build_hf() -> torch.nn.Module:
    from transformers import BltConfig, BltForCausalLM

    local = {
        "hidden_size": LOCAL_DIM,
        "num_attention_heads": HEADS_LOCAL,
        "intermediate_size": 704,
        "hidden_size_global": GLOBAL_DIM,
        "cross_attn_k": K,
        "max_position_embeddings": SEQ_LEN,
        "rope_theta": 500000.0,
    }
    config = BltConfig(
        vocab_size=260,
        patch_in_forward=False,
        cross_attn_k=K,
        encoder_hash_byte_group_size=HASH_SIZES,
        encoder_hash_byte_group_vocab=HASH_VOCAB,
        encoder_hash_byte_group_nb_functions=1,
        encoder_config={**local, "num_hidden_layers": ENC_LAYERS, "cross_attn_all_layers": False},
        decoder_config={**local, "num_hidden_layers": DEC_LAYERS, "cross_attn_all_layers": True},
        global_config={
            "hidden_size": GLOBAL_DIM,
            "num_attention_heads": HEADS_GLOBAL,
            "num_hidden_layers": GLOBAL_LAYERS,
            "intermediate_size": 1408,
            "max_position_embeddings": SEQ_LEN,
            "rope_theta": 500000.0,
        },
        rope_theta=500000.0,
        attn_implementation="sdpa",
    )
    return BltForCausalLM(config)


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(4, 260, (BATCH, SEQ_LEN + 1), generator=gen)
    tokens[:, 0] = 1  # BOS
    lengths = torch.tensor([[1] + [PATCH] * (SEQ_LEN // PATCH)] * BATCH)  # sums to N + 1
    return tokens[:, :-1], tokens[:, 1:], lengths


def train_config(data_root: str, dump_dir: str, dtype: str, steps: int) -> dict:
    """A bytelatent.train config with the benchmark's model and batch shape."""
    model = blt_args().model_dump(exclude_unset=True)
    return {
        "name": "bench_blt_cpu",
        "dump_dir": dump_dir,
        "steps": steps,
        "seed": 0,
        "num_threads": torch.get_num_threads(),
        "model": model,
        "optim": {"lr": 1e-4, "warmup": 2, "scheduler": "cosine", "clip": 1.0},
        "data": {
            "root_dir": data_root,
            "sources": {"stdlib": 1.0},
            "batch_size": BATCH,
            "seq_len": SEQ_LEN // PATCH,
            "max_encoder_seq_length": SEQ_LEN,
            "load_async": False,
            "patcher_args": {"patching_mode": "static", "patch_size": PATCH},
        },
        "distributed": {"model_dtype": dtype},
        "checkpoint": {"dump": {"every": 10**6, "keep": 1}},
        "logging": {"freq": 1},
    }


def run_train_loop(dtype: str, steps: int, warmup: int) -> dict:
    """Run `python -m bytelatent.train` for warmup + steps steps; bytes/s from its metrics."""
    import tempfile

    import yaml

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with tempfile.TemporaryDirectory(prefix="blt_cpu_train_") as tmp:
        data_root = os.path.join(tmp, "data")
        prepare = [sys.executable, "-m", "bytelatent.data.prepare"]
        prepare += ["--out", os.path.join(data_root, "stdlib")]
        subprocess.run(prepare, check=True, capture_output=True, env=env)
        config = os.path.join(tmp, "config.yaml")
        dump_dir = os.path.join(tmp, "run")
        with open(config, "w") as f:
            yaml.safe_dump(train_config(data_root, dump_dir, dtype, warmup + steps), f)
        start = time.perf_counter()
        cmd = [sys.executable, "-m", "bytelatent.train", f"config={config}"]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            raise RuntimeError(f"bytelatent.train failed:\n{proc.stderr[-3000:]}")
        with open(os.path.join(dump_dir, "metrics.jsonl")) as f:
            metrics = [json.loads(line) for line in f if line.strip()]
    train = [m for m in metrics if "bytes_per_s" in m and "loss" in m][warmup:]
    times = [m["step_time_s"] + m["data_time_s"] for m in train]
    median = statistics.median(times)
    return {
        "impl": "train",
        "dtype": dtype,
        "params": None,
        "step_s_median": median,
        "step_s_all": times,
        "warmup_s": wall - sum(times),
        "bytes_per_s": statistics.median(m["bytes_per_s"] for m in train),
        "step_s_min": min(times),
        "bytes_per_s_best": max(m["bytes_per_s"] for m in train),
        "data_s_median": statistics.median(m["data_time_s"] for m in train),
        "cpu_s_median": float("nan"),
        "threads": torch.get_num_threads(),
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20,
        "losses": [m["loss"] for m in train],
    }


def make_train_step(impl: str, dtype: str) -> tuple[Callable[[], float], torch.nn.Module]:
    """(step, model): one forward + backward + fused AdamW step on batch 0, returning the loss.

    impl: "ours", "ours-compile" or "hf"; dtype: "bf16" (autocast) or "fp32".
    """
    torch.manual_seed(0)
    model = build_hf() if impl == "hf" else build_ours(compile_model=impl == "ours-compile")
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x, y, lengths = batch(0)
    # the batch's host documents, worked out before the (compiled) forward as the trainer's host
    # batch would be: the compiled graph then has no break for the single-document mask check
    host = (
        None
        if impl == "hf"
        else model.host_documents(SimpleNamespace(x=x.numpy(), patch_lengths=lengths.numpy()))
    )

    def step() -> float:
        autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16")
        with autocast:
            if impl == "hf":
                logits = model(input_ids=x, patch_lengths=lengths).logits
            else:
                logits = model(x, lengths, host=host)
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return loss.item()

    return step, model


def run_worker(impl: str, dtype: str, steps: int, warmup: int) -> dict:
    if impl == "train":
        return run_train_loop(dtype, steps, warmup)
    step, model = make_train_step(impl, dtype)
    n_params = sum(p.numel() for p in model.parameters())
    start = time.perf_counter()
    for _ in range(warmup):
        step()
    warmup_s = time.perf_counter() - start
    times, cpu_times, losses = [], [], []
    for _ in range(steps):
        start, cpu_start = time.perf_counter(), time.process_time()
        losses.append(step())
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
    median = statistics.median(times)
    return {
        "impl": impl,
        "dtype": dtype,
        "params": n_params,
        "step_s_median": median,
        "step_s_all": times,
        "warmup_s": warmup_s,
        "bytes_per_s": BATCH * SEQ_LEN / median,
        # the fastest step: the least disturbed by other processes on a shared machine
        "step_s_min": min(times),
        "bytes_per_s_best": BATCH * SEQ_LEN / min(times),
        # CPU seconds of this process per step: less sensitive to other processes on the machine
        "cpu_s_median": statistics.median(cpu_times),
        "threads": torch.get_num_threads(),
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "losses": losses,
    }


def matmul_flops(dtype: torch.dtype, size: int = 2048, repeats: int = 7) -> float:
    a = torch.randn(size, size, dtype=dtype)
    b = torch.randn(size, size, dtype=dtype)
    a @ b  # warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return 2 * size**3 / statistics.median(times)


def bf16_matmul_flops() -> float:
    """The bf16 peak, or NaN on a CPU without bf16 GEMMs: there a 2048^3 bf16 matmul runs a
    generic loop at ~1 GFLOP/s (minutes per row for a number no row's kernels use)."""
    from bytelatent.model.cpu_bf16 import cpu_has_bf16_matmul

    return matmul_flops(torch.bfloat16) if cpu_has_bf16_matmul() else float("nan")


RATIOS = (
    ("ours:bf16", "hf:bf16"),
    ("ours-compile:bf16", "hf:bf16"),
    ("ours-compile:bf16", "ours:bf16"),
    ("ours:fp32", "hf:fp32"),
    ("train:bf16", "ours:bf16"),
    ("train:fp32", "ours:fp32"),
)


def fmt_load(load: tuple[float, float, float]) -> str:
    return "/".join(f"{x:.2f}" for x in load)


def spread(values: list[float]) -> str:
    """median (min-max) of per-round values."""
    return f"{statistics.median(values):.2f}x ({min(values):.2f}-{max(values):.2f})"


def print_ratios(results: list[dict]) -> list[str]:
    """The headline: speed ratios of row pairs, one ratio per round (rows of a round run back to
    back), as median (min-max) over rounds; CPU s per step first (at 1 thread the work of a step,
    robust to other processes), wall bytes/s second. Returns the printed lines."""
    by_row: dict[str, dict[int, dict]] = {}
    for r in results:
        by_row.setdefault(f"{r['impl']}:{r['dtype']}", {})[r["round"]] = r
    lines = []
    for fast, slow in RATIOS:
        if fast not in by_row or slow not in by_row:
            continue
        rounds = sorted(set(by_row[fast]) & set(by_row[slow]))
        pairs = [(by_row[fast][i], by_row[slow][i]) for i in rounds]
        wall = [f["bytes_per_s"] / s["bytes_per_s"] for f, s in pairs]
        cpu = [s["cpu_s_median"] / f["cpu_s_median"] for f, s in pairs]
        cpu = [c for c in cpu if c == c]  # the train rows have no CPU s of their own (nan)
        text = f"{fast} / {slow}: "
        text += f"CPU s/step {spread(cpu)}, " if cpu else ""
        text += f"wall bytes/s {spread(wall)}; {len(pairs)} rounds"
        lines.append(text)
    compiled, eager = by_row.get("ours-compile:bf16", {}), by_row.get("ours:bf16", {})
    slower = [
        i
        for i in sorted(set(compiled) & set(eager))
        if compiled[i]["cpu_s_median"] > eager[i]["cpu_s_median"]
    ]
    if slower:
        lines.append(
            f"WARNING: the compiled row used more CPU s per step than eager in round(s) {slower}"
        )
    for line in lines:
        print(line)
    return lines


def parse_options() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", nargs="+", default=list(ROWS), help=f"impl:dtype among {ROWS}")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument(
        "--rounds", type=int, default=3, help="run the row list this many times, interleaved"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads per row (default 1: the cpu s column is then the work of a step, "
        "much less sensitive to other processes than wall time; 0: torch's default)",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    return parser.parse_args()


def measure_rows(opts: argparse.Namespace, flops_per_byte: float) -> list[dict]:
    """Every row once per round, each in a worker process, rows interleaved over the rounds."""
    results = []
    for round_nb, row in [(i, row) for i in range(opts.rounds) for row in opts.rows]:
        # measured right before each row: the machine's load changes while the rows run
        peak = {"fp32": matmul_flops(torch.float32), "bf16": bf16_matmul_flops()}
        cmd = [sys.executable, __file__, "--worker", row]
        cmd += ["--steps", str(opts.steps), "--warmup", str(opts.warmup)]
        cmd += ["--threads", str(opts.threads)] if opts.threads else []
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            print(f"{row}: failed\n{proc.stderr[-3000:]}", file=sys.stderr)
            continue
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        result["matmul_flops"] = peak
        result["round"] = round_nb
        result["load_after"] = os.getloadavg()
        for key, bytes_per_s in (
            ("", result["bytes_per_s"]),
            ("_best", result["bytes_per_s_best"]),
        ):
            result[f"model_flops_per_s{key}"] = flops_per_byte * bytes_per_s
            result[f"fraction_of_bf16_matmul{key}"] = flops_per_byte * bytes_per_s / peak["bf16"]
        results.append(result)
    return results


def print_table(results: list[dict]) -> None:
    header = (
        "row",
        "step s",
        "min s",
        "cpu s",
        "bytes/s",
        "best",
        "mm bf16",
        "MFU",
        "MFU best",
        "RSS",
        "load",
    )
    print("{:<19}{:>8}{:>7}{:>7}{:>9}{:>7}{:>9}{:>7}{:>9}{:>6}{:>6}".format(*header))
    for r in results:
        print(
            f"{r['impl'] + ':' + r['dtype']:<19}{r['step_s_median']:>8.2f}{r['step_s_min']:>7.2f}"
            f"{r['cpu_s_median']:>7.2f}{r['bytes_per_s']:>9.0f}{r['bytes_per_s_best']:>7.0f}"
            f"{r['matmul_flops']['bf16'] / 1e9:>9.0f}{r['fraction_of_bf16_matmul']:>7.1%}"
            f"{r['fraction_of_bf16_matmul_best']:>9.1%}{r['peak_rss_gib']:>6.2f}"
            f"{r['load_after'][0]:>6.2f}"
        )


def main() -> None:
    opts = parse_options()
    if opts.threads:
        torch.set_num_threads(opts.threads)
    if opts.worker:
        impl, dtype = opts.worker.split(":")
        print(json.dumps(run_worker(impl, dtype, opts.steps, opts.warmup)))
        return

    from bytelatent.archs.blt.sizes import blt_flops_per_byte
    from bytelatent.model.cpu_bf16 import cpu_has_bf16_matmul

    load_before = os.getloadavg()
    if not cpu_has_bf16_matmul():
        print(
            "this CPU has no bf16 GEMMs: the bf16 matmul peak (mm bf16, MFU) is not timed, hf:bf16"
            " runs a generic loop, and bytelatent's bf16 rows run fp32 kernels (BYTELATENT_CPU_BF16)"
        )
    flops_per_byte = blt_flops_per_byte(
        blt_args(), mean_patch_size=SEQ_LEN / (SEQ_LEN // PATCH + 1), seq_len=SEQ_LEN
    )
    results = measure_rows(opts, flops_per_byte)
    load_after = os.getloadavg()
    print(f"model FLOPs per byte (train): {flops_per_byte / 1e6:.1f} M")
    print_table(results)
    print(
        f"headline ({torch.get_num_threads()} thread(s), rows interleaved over {opts.rounds} "
        f"rounds; load average 1/5/15 min before {fmt_load(load_before)}, after "
        f"{fmt_load(load_after)}):"
    )
    headline = print_ratios(results)
    print("step s: median; min s: fastest step; cpu s: process CPU seconds per step (median);")
    print("load: 1-min load average when the row ended")
    print("mm bf16: 2048^3 bf16 matmul GFLOP/s measured before the row; MFU = model FLOP/s / that")
    if opts.out:
        summary = {
            "load_before": load_before,
            "load_after": load_after,
            "headline": headline,
            "flops_per_byte": flops_per_byte,
            "threads": torch.get_num_threads(),
            "params": results[0]["params"] if results else None,
            "results": results,
        }
        with open(opts.out, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
