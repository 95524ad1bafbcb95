"""Generation throughput on CPU: cached (incremental) vs use_cache=false (recompute every byte).

Models (random init, debug shapes from configs/debug.yaml and configs/entropy_debug.yaml):
  lm   the entropy model as a byte LM: dim 128, 2 layers, 4 heads, window 256
  blt  the debug BLT (global 128x2, local 64: encoder 1 layer, decoder 2 layers, cross-attention
       k=2 in encoder and decoder, hash n-grams 3..8) patched online by that entropy model, with
       the threshold set so that patches average ~4.5 bytes on random-init entropies

Output layers are scaled x6 after init (peaky predictions, as in shared/conformance). One
greedy prompt of 80 bytes, ``--lengths`` new bytes (EOS ignored). For each (model, length)
the cached and recompute runs alternate in the same process (the machine is shared: side by
side, after a warm-up); the table shows the median bytes/s over ``--repeats`` runs and the
speed-up. The two outputs are compared; a difference is reported (random-init models fall into
loops where two bytes can tie to ~1e-6).

    python bench/generation_cpu.py                          # lm + blt at 256 and 1024 bytes
    python bench/generation_cpu.py --models blt --lengths 1024 --repeats 1 --threads 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bytelatent.data.entropy import calculate_entropies  # noqa: E402
from bytelatent.data.patcher import PatcherArgs  # noqa: E402
from bytelatent.eval.generation import GenerationArgs, Generator  # noqa: E402
from bytelatent.model.args import LMTransformerArgs  # noqa: E402
from bytelatent.model.blt import ByteLatentTransformer  # noqa: E402
from bytelatent.model.blt_args import ByteLatentTransformerArgs  # noqa: E402
from bytelatent.model.transformer import LMTransformer  # noqa: E402

PROMPT = "def fibonacci(n):\n    # return the n-th Fibonacci number, iteratively\n    a, b ="


def build(cls, args, seed: int):
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = cls(args)
    model.to_empty(device="cpu")
    model.init_weights()
    output = model.output if cls is LMTransformer else model.local_decoder.output
    with torch.no_grad():  # peaky predictions like a trained model (as shared/conformance does)
        output.weight.mul_(6.0)
    return model.eval()


def entropy_model(max_seqlen: int) -> LMTransformer:
    args = LMTransformerArgs(
        dim=128,
        n_layers=2,
        n_heads=4,
        max_seqlen=max_seqlen,
        sliding_window=256,
        attn_bias_type="local_block_causal",
    )
    return build(LMTransformer, args, 0)


def debug_blt(max_bytes: int) -> ByteLatentTransformer:
    args = ByteLatentTransformerArgs(
        dim=128,
        n_layers=2,
        n_heads=4,
        max_seqlen=max_bytes,
        dim_local_encoder=64,
        dim_local_decoder=64,
        n_layers_local_encoder=1,
        n_layers_local_decoder=2,
        n_heads_local_encoder=4,
        n_heads_local_decoder=4,
        local_attention_window_len=256,
        max_encoder_seq_length=max_bytes,
        attn_bias_type="block_causal",
        rope_theta=5e5,
        cross_attn_encoder=True,
        cross_attn_decoder=True,
        cross_attn_k=2,
        cross_attn_nheads=4,
        cross_attn_all_layers_decoder=True,
        cross_attn_init_by_pooling=True,
        downsampling_by_pooling="max",
        encoder_hash_byte_group_size=[3, 4, 5, 6, 7, 8],
        encoder_hash_byte_group_vocab=4099,
        encoder_hash_byte_group_nb_functions=1,
    )
    return build(ByteLatentTransformer, args, 1)


def calibrated_threshold(model: LMTransformer, patch_size: float = 4.5) -> float:
    text = (PROMPT * 20).encode()
    tokens = torch.tensor([[1] + [b + 4 for b in text]])
    entropies = calculate_entropies(tokens, model, 1)[0]
    # halfway between two observed entropies: no entropy sits exactly on the threshold
    sorted_values = entropies.sort().values
    index = int((1 - 1 / patch_size) * (len(sorted_values) - 1))
    return float(sorted_values[index : index + 2].mean())


def timed(gen: Generator, n_bytes: int, use_cache: bool) -> tuple[float, list[int], int]:
    args = GenerationArgs(max_new_bytes=n_bytes, use_cache=use_cache, stop_at_eos=False)
    started = time.perf_counter()
    result = gen.generate([PROMPT], args)[0]
    seconds = time.perf_counter() - started
    patches = len(result.patch_lengths) if result.patch_lengths else 0
    return len(result.tokens) / seconds, result.tokens, patches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["lm", "blt"], choices=["lm", "blt"])
    parser.add_argument("--lengths", nargs="+", type=int, default=[256, 1024])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    max_bytes = 2048
    entropy = entropy_model(max_bytes)
    gens = {"lm": Generator(entropy)}
    if "blt" in args.models:
        threshold = calibrated_threshold(entropy)
        patcher = PatcherArgs(patching_mode="entropy", threshold=threshold)
        gens["blt"] = Generator(debug_blt(max_bytes), patcher, entropy)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, prompt {len(PROMPT)} B")
    print("| model | new bytes | cached B/s | use_cache=false B/s | speed-up | patches |")
    print("|---|---|---|---|---|---|")
    for name in args.models:
        gen = gens[name]
        timed(gen, 16, True), timed(gen, 16, False)  # warm-up
        for length in args.lengths:
            cached, recompute = [], []
            for _ in range(args.repeats):
                rate_c, tokens_c, patches = timed(gen, length, True)
                rate_r, tokens_r, _ = timed(gen, length, False)
                if tokens_c != tokens_r:  # random-init models loop, where near-ties happen
                    first = next(i for i, (a, b) in enumerate(zip(tokens_c, tokens_r)) if a != b)
                    print(f"note: {name} {length}: outputs differ from byte {first} on")
                cached.append(rate_c)
                recompute.append(rate_r)
            c, r = statistics.median(cached), statistics.median(recompute)
            print(
                f"| {name} | {length} | {c:.0f} | {r:.1f} | {c / r:.1f}x | {patches or '-'} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
