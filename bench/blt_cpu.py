"""BLT training throughput on CPU: bytelatent vs Hugging Face transformers' BltForCausalLM.

Same architecture for both (about 101M parameters): local models 256d (encoder 1 layer, decoder
3 layers, 4 heads, FFN 704), global 512d x 6 layers (8 heads, FFN 1408), cross_attn_k=2 (encoder
cross-attention after its last layer, initialised by max pooling; decoder cross-attention before
every layer), hash n-grams n=3..8 x 50002 x 1 function, RoPE theta 5e5. Batch 4 x 1024 bytes,
static 4-byte patches passed as patch_lengths ([1, 4, ..., 4]: rows sum to N+1), AdamW.

Each (implementation, precision) runs in its own subprocess (clean peak RSS); the 2048^3 matmul
throughput is measured in the same run, and model FLOP/s (bytelatent.model.flops.blt_flops_per_byte,
identical for both implementations) is reported as a fraction of the bf16 matmul throughput.

    python bench/blt_cpu.py                       # all rows
    python bench/blt_cpu.py --rows ours:bf16 hf:bf16 --steps 5

transformers is NOT a bytelatent dependency: pip install 'transformers==4.57.*' to run the hf rows.
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
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from bytelatent.model.blt import ByteLatentTransformerArgs

# run from a checkout without installing: the repository root holds the bytelatent package
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BATCH, SEQ_LEN, PATCH = 4, 1024, 4
LOCAL_DIM, GLOBAL_DIM, HEADS_LOCAL, HEADS_GLOBAL = 256, 512, 4, 8
ENC_LAYERS, DEC_LAYERS, GLOBAL_LAYERS, K = 1, 3, 6, 2
HASH_SIZES, HASH_VOCAB = [3, 4, 5, 6, 7, 8], 50002
ROWS = ("ours:fp32", "ours:bf16", "ours-compile:bf16", "hf:fp32", "hf:bf16")


def blt_args() -> ByteLatentTransformerArgs:
    from bytelatent.model.blt import ByteLatentTransformerArgs

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
    from bytelatent.model.blt import ByteLatentTransformer

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


def run_worker(impl: str, dtype: str, steps: int, warmup: int) -> dict:
    torch.manual_seed(0)
    model = build_hf() if impl == "hf" else build_ours(compile_model=impl == "ours-compile")
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x, y, lengths = batch(0)

    def step() -> float:
        autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16")
        with autocast:
            if impl == "hf":
                logits = model(input_ids=x, patch_lengths=lengths).logits
            else:
                logits = model(x, lengths)
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return loss.item()

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


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", nargs="+", default=list(ROWS), help=f"impl:dtype among {ROWS}")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.worker:
        impl, dtype = opts.worker.split(":")
        print(json.dumps(run_worker(impl, dtype, opts.steps, opts.warmup)))
        return

    from bytelatent.model.flops import blt_flops_per_byte

    load_before = os.getloadavg()
    flops_per_byte = blt_flops_per_byte(
        blt_args(), mean_patch_size=SEQ_LEN / (SEQ_LEN // PATCH + 1), seq_len=SEQ_LEN
    )
    results = []
    for row in opts.rows:
        # measured right before each row: the machine's load changes while the rows run
        peak = {"fp32": matmul_flops(torch.float32), "bf16": matmul_flops(torch.bfloat16)}
        cmd = [sys.executable, __file__, "--worker", row]
        cmd += ["--steps", str(opts.steps), "--warmup", str(opts.warmup)]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            print(f"{row}: failed\n{proc.stderr[-3000:]}", file=sys.stderr)
            continue
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        result["matmul_flops"] = peak
        result["load_after"] = os.getloadavg()
        for key, bytes_per_s in (
            ("", result["bytes_per_s"]),
            ("_best", result["bytes_per_s_best"]),
        ):
            result[f"model_flops_per_s{key}"] = flops_per_byte * bytes_per_s
            result[f"fraction_of_bf16_matmul{key}"] = flops_per_byte * bytes_per_s / peak["bf16"]
        results.append(result)
    print(f"load average before {load_before}, after {os.getloadavg()}")
    print(f"model FLOPs per byte (train): {flops_per_byte / 1e6:.1f} M")
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
    )
    print("{:<19}{:>8}{:>7}{:>7}{:>9}{:>7}{:>9}{:>7}{:>9}{:>6}".format(*header))
    for r in results:
        print(
            f"{r['impl'] + ':' + r['dtype']:<19}{r['step_s_median']:>8.2f}{r['step_s_min']:>7.2f}"
            f"{r['cpu_s_median']:>7.2f}{r['bytes_per_s']:>9.0f}{r['bytes_per_s_best']:>7.0f}"
            f"{r['matmul_flops']['bf16'] / 1e9:>9.0f}{r['fraction_of_bf16_matmul']:>7.1%}"
            f"{r['fraction_of_bf16_matmul_best']:>9.1%}{r['peak_rss_gib']:>6.2f}"
        )
    print("step s: median; min s: fastest step; cpu s: process CPU seconds per step (median);")
    print("mm bf16: 2048^3 bf16 matmul GFLOP/s measured before the row; MFU = model FLOP/s / that")
    if opts.out:
        summary = {
            "load_before": load_before,
            "flops_per_byte": flops_per_byte,
            "threads": torch.get_num_threads(),
            "params": results[0]["params"] if results else None,
            "results": results,
        }
        with open(opts.out, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
