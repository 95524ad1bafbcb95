"""Save a tiny random LlamaForCausalLM whose decoder layers fit configs/debug.yaml's global
transformer (docs/byteify.md, "Byteify at CPU size"). Needs transformers (`pip install -e .[hf]`).

    python scripts/tiny_llama.py --out hf/tiny-llama

Shape: hidden 128, 2 layers, 4 heads / 2 kv heads, SwiGLU 384, RMSNorm eps 1e-5, RoPE theta 5e5.
The matching overrides: model.n_kv_heads_global=2 model.multiple_of=128 (round_up(int(8*128/3)=341,
128) = 384). The weights are random: this shows the plumbing, not a useful initialisation.
"""

from __future__ import annotations

import argparse

HIDDEN, LAYERS, HEADS, KV_HEADS, INTERMEDIATE = 128, 2, 4, 2, 384


def save_tiny_llama(out: str, seed: int = 0) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256,  # unused by byteify (embed_tokens / lm_head are not loaded)
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        intermediate_size=INTERMEDIATE,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=512,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", default="hf/tiny-llama", help="folder to write (config.json + safetensors)"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    save_tiny_llama(args.out, args.seed)
    print(
        f"saved a random {HIDDEN}d x {LAYERS} Llama ({HEADS} heads / {KV_HEADS} kv, SwiGLU {INTERMEDIATE}) to {args.out}"
    )


if __name__ == "__main__":
    main()
