"""Train a small token-level teacher for byteify on the stdlib corpus (docs/byteify.md, issue 42):
a byte-level BPE tokenizer (`tokenizers`) and a Hugging Face `LlamaForCausalLM` whose decoder
layers fit configs/debug.yaml's global transformer, saved as one folder (config.json,
model.safetensors, tokenizer.json). Needs transformers (`pip install -e .[hf]`).

    python scripts/train_token_teacher.py --data data/stdlib --out hf/stdlib-teacher --steps 300

It prints (and writes to OUT/teacher_eval.json) the teacher's bits per byte on the validation
file: its token NLL over the bytes of the tokens it scores.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import time

HIDDEN, LAYERS, HEADS, KV_HEADS, INTERMEDIATE = 128, 2, 4, 2, 384  # scripts/tiny_llama.py's shape


def read_texts(pattern: str) -> list[str]:
    texts = []
    for path in sorted(glob.glob(pattern)):
        with open(path, encoding="utf-8") as f:
            texts.extend(json.loads(line)["text"] for line in f)
    return texts


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def token_stream(tok, texts: list[str]) -> list[int]:
    bos = tok.token_to_id("<s>")
    ids: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.append(bos)
        ids.extend(enc.ids)
    return ids


def held_out_bpb(model, tok, texts: list[str], seq_len: int, max_bytes: int) -> tuple[float, int]:
    """Bits per byte of the validation text: Σ token NLL / Σ bytes of the scored tokens (each
    window's first token has no context and is not scored)."""
    import torch

    from bytelatent.tokenizers.hf_bpe import byte_level_vocab

    vocab = byte_level_vocab(tok)
    ids = token_stream(tok, texts)
    nll, n_bytes = 0.0, 0
    model.eval()
    with torch.no_grad():
        for start in range(0, len(ids) - 1, seq_len):
            window = torch.tensor([ids[start : start + seq_len + 1]])
            if window.shape[1] < 2 or n_bytes >= max_bytes:
                break
            logits = model(window[:, :-1]).logits.double()
            targets = window[0, 1:]
            lp = torch.log_softmax(logits[0], -1).gather(1, targets[:, None])[:, 0]
            nll -= float(lp.sum())
            n_bytes += sum(len(vocab[int(t)]) for t in targets)
    return nll / max(n_bytes, 1) / 0.6931471805599453, n_bytes


def evaluate_saved(args: argparse.Namespace) -> None:
    from tokenizers import Tokenizer
    from transformers import LlamaForCausalLM

    tok = Tokenizer.from_file(os.path.join(args.out, "tokenizer.json"))
    model = LlamaForCausalLM.from_pretrained(args.out)
    val_texts = read_texts(os.path.join(args.data, "*.val.jsonl"))
    bpb, scored = held_out_bpb(model, tok, val_texts, args.seq_len, args.eval_bytes)
    print(f"teacher {args.out}: {bpb:.4f} bits/byte on {scored} validation bytes")
    path = os.path.join(args.out, "teacher_eval.json")
    result = json.load(open(path)) if os.path.isfile(path) else {}
    with open(path, "w") as f:
        json.dump({**result, "val_bpb": bpb, "val_bytes": scored}, f, indent=1)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--data", default="data/stdlib", help="python -m bytelatent.data.prepare's folder"
    )
    parser.add_argument("--out", default="hf/stdlib-teacher")
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per training window")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument(
        "--eval-bytes",
        type=int,
        default=51200,
        help="validation bytes to score (51200: the BLT validator's 25 batches of 4 x 512 bytes)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--eval-only", action="store_true", help="score the teacher already in --out, no training"
    )
    return parser.parse_args()


def train(model, stream, vocab_len, args: argparse.Namespace) -> tuple[int, int]:  # noqa: ANN001
    """AdamW with linear warmup, then cosine to 0.1x, on random windows of `stream`: (tokens,
    bytes) trained on."""
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    warmup = max(1, args.steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: min(1.0, (s + 1) / warmup)
        * (0.1 + 0.45 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps))),
    )
    generator = torch.Generator().manual_seed(args.seed)
    t0, tokens, trained_bytes = time.time(), 0, 0
    for step in range(1, args.steps + 1):
        starts = torch.randint(
            0, len(stream) - args.seq_len - 1, (args.batch_size,), generator=generator
        )
        batch = torch.stack([stream[s : s + args.seq_len + 1] for s in starts.tolist()])
        loss = model(batch[:, :-1], labels=batch[:, :-1].clone()).loss  # HF shifts labels
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        tokens += batch[:, :-1].numel()
        trained_bytes += int(vocab_len[batch[:, :-1]].sum())
        if step % 50 == 0 or step == args.steps:
            print(
                f"step {step}/{args.steps} loss {loss.item():.3f} ({time.time() - t0:.0f} s)",
                flush=True,
            )
    return tokens, trained_bytes


def main() -> None:
    args = parse_args()
    if args.eval_only:
        evaluate_saved(args)
        return

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from bytelatent.tokenizers.hf_bpe import byte_level_vocab

    train_texts = read_texts(os.path.join(args.data, "*.chunk.*.jsonl"))
    val_texts = read_texts(os.path.join(args.data, "*.val.jsonl"))
    if not train_texts or not val_texts:
        raise SystemExit(
            f"error: no *.chunk.*.jsonl / *.val.jsonl in {args.data}; run python -m bytelatent.data.prepare --out {args.data}"
        )
    tok = train_tokenizer(train_texts, args.vocab_size)
    stream = torch.tensor(token_stream(tok, train_texts))
    torch.manual_seed(args.seed)
    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(with_added_tokens=True), hidden_size=HIDDEN,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        intermediate_size=INTERMEDIATE, rms_norm_eps=1e-5, rope_theta=500000.0,
        max_position_embeddings=512, tie_word_embeddings=False,
        bos_token_id=tok.token_to_id("<s>"), eos_token_id=tok.token_to_id("<s>"),
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    vocab_len = torch.tensor([len(b) for b in byte_level_vocab(tok)])
    tokens, trained_bytes = train(model, stream, vocab_len, args)
    bpb, scored = held_out_bpb(model, tok, val_texts, args.seq_len, args.eval_bytes)
    os.makedirs(args.out, exist_ok=True)
    model.save_pretrained(args.out)
    tok.save(os.path.join(args.out, "tokenizer.json"))
    result = {"val_bpb": bpb, "val_bytes": scored, "train_tokens": tokens, "train_bytes": trained_bytes,
              "steps": args.steps, "vocab_size": config.vocab_size}  # fmt: skip
    with open(os.path.join(args.out, "teacher_eval.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(
        f"teacher: {bpb:.4f} bits/byte on {scored} validation bytes; trained on {trained_bytes} bytes; saved to {args.out}"
    )


if __name__ == "__main__":
    main()
