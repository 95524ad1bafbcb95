"""The distillation term (bytelatent/trainer/distill_loss.py) with a tiny BPE + random Llama
teacher: next-byte targets against the per-row reference (`next_byte_target`), their alignment
with the student's positions, a stage-1 run that logs aux/distill with its backbone frozen, the
stage-1 -> stage-2 recipe whose stage 2 resumes bitwise, and a teacher that does not fit."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from bytelatent.args import TrainArgs
from bytelatent.config import parse_args
from bytelatent.data.batch import Batch
from bytelatent.distributed.env import detect_env
from bytelatent.errors import ConfigError
from bytelatent.tokenizers.constants import BOS_ID, EOS_ID, OFFSET
from bytelatent.trainer.distill import END, N_BYTES
from bytelatent.trainer.distill_args import DistillArgs
from bytelatent.trainer.distill_loss import (
    TeacherDistillation,
    build_extra_losses,
    byte_runs,
    whole_characters,
)
from bytelatent.trainer.trainer import Trainer
from tests.extras import lazy_extra
from tests.trainer.test_cli import TINY_BLT

BACKBONE = "global_transformer.*"
WIDTH = 32  # TINY_BLT's model.dim: the teacher's hidden size must match it


def save_teacher(folder, corpus_root, hidden: int = WIDTH, vocab_size: int | None = None) -> None:
    """A byte-level BPE (320 tokens) trained on the corpus and a random 1-layer Llama."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = lazy_extra("transformers", reason="pip install 'bytelatent[hf]'")
    texts = []
    with open(next((corpus_root / "stdlib").glob("*.chunk.00.jsonl"))) as f:
        for line, _ in zip(f, range(40)):
            texts.append(json.loads(line)["text"])
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<s>"], show_progress=False,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tok.train_from_iterator(texts, trainer=trainer)
    config = transformers.LlamaConfig(
        vocab_size=vocab_size or tok.get_vocab_size(with_added_tokens=True), hidden_size=hidden,
        intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        max_position_embeddings=512, initializer_range=0.2,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    tok.save(str(folder / "tokenizer.json"))


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory, corpus_root):
    folder = tmp_path_factory.mktemp("teacher")
    save_teacher(folder, corpus_root)
    return folder


def test_whole_characters_and_byte_runs():
    snow = "\u2603".encode()  # 3 bytes
    assert whole_characters(snow[1:] + b"ab" + snow[:2]) == (2, 4)  # cut at both ends
    assert whole_characters(b"ab" + snow) == (0, 5)
    assert whole_characters(b"") == (0, 0)
    ids = np.array([BOS_ID, 10, 11, EOS_ID, BOS_ID, 12, 13, 14, 0])
    valid = np.array([True] * 7 + [False, True])
    assert byte_runs(ids, valid) == [(1, 3), (5, 7)]


def text_batch(text: str, cut: int) -> Batch:
    """One row: BOS then the text's bytes from `cut` (a window that starts inside a word)."""
    seq = np.array([BOS_ID, *(b + OFFSET for b in text.encode()[cut:])], dtype=np.int64)
    x, y = seq[None, :-1], seq[None, 1:]
    return Batch(x=x, y=y, mask=np.ones_like(x, dtype=bool))


def test_targets_are_the_teachers_next_byte_distribution(teacher_dir):
    distill = TeacherDistillation(DistillArgs(teacher=str(teacher_dir)), torch.device("cpu"))
    text = "import os\ndef join(a, b):\n    return os.path.join(a, b)  # caf\u00e9\n"
    batch = text_batch(text, cut=3)
    positions, targets = distill.targets(batch)
    torch.testing.assert_close(targets.sum(-1), torch.ones(len(positions), dtype=targets.dtype))
    # each target gives the byte the student must predict at its position a real probability
    next_bytes = torch.from_numpy(batch.y.reshape(-1)[positions.numpy()] - OFFSET)
    assert (targets.gather(1, next_bytes[:, None]) > 0).all()
    # the reference, row by row: the teacher tokenizes the bytes after the cut ("ort os...")
    data = text.encode()[3:]
    ids = distill.tokenizer.encode(data.decode(), add_special_tokens=False).ids
    sorted_probs = distill.trie.sorted_probs(distill.teacher_probs(ids))  # for tokens 1..T-1
    trie, vocab = distill.trie, distill.vocab
    expected, offset = {}, len(vocab[ids[0]]) + 1  # +1: BOS is position 0 of the sequence
    for i in range(1, len(ids)):
        token = vocab[ids[i]]
        for k in range(len(token)):
            row = trie.next_byte_target(sorted_probs[i - 1], token[:k])[:N_BYTES]
            if k == 0 and i >= 2:  # the previous token extended, or ended and this one starts
                prev = trie.next_byte_target(sorted_probs[i - 2], vocab[ids[i - 1]])
                row = prev[:N_BYTES] + prev[END] * row
            if k or i >= 2:
                expected[offset + k - 1] = row / row.sum()  # student position = byte position - 1
        offset += len(token)
    assert sorted(expected) == positions.tolist()
    got = dict(zip(positions.tolist(), targets))
    for position, row in expected.items():
        torch.testing.assert_close(got[position], row, rtol=1e-9, atol=1e-12)
    assert len(expected) >= len(data) - 8  # only the first token and one byte lost to the cut


def stage_args(dump, corpus_root, group: str, *extra: str) -> TrainArgs:
    return parse_args(
        TrainArgs,
        [
            *TINY_BLT,
            f"optim.groups=[{{params: '{BACKBONE}', {group}}}]",
            f"dump_dir={dump}",
            f"data.root_dir={corpus_root}",
            "distributed.model_dtype=fp32",
            "checkpoint.dump.every=2",
            *extra,
        ],
    )


def run(args: TrainArgs) -> Trainer:
    trainer = Trainer(args, detect_env())
    try:
        trainer.train()
    finally:
        trainer.close()
    return trainer


def test_stage_1_distills_with_the_backbone_frozen(tmp_path, corpus_root, teacher_dir):
    args = stage_args(
        tmp_path / "s1", corpus_root, "frozen: true", "steps=3", f"distill.teacher={teacher_dir}"
    )
    trainer = Trainer(args, detect_env())
    try:
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        trainer.train()
        last = trainer.last
    finally:
        trainer.close()
    assert 0 < last["aux/distill"] < 20, last  # nats per distilled byte, logged apart from bpb
    for name, param in trainer.model.named_parameters():
        frozen = name.startswith("global_transformer.")
        assert torch.equal(before[name], param) == frozen, name
    assert not any(p.requires_grad for p in trainer.logit_terms[0].teacher.parameters())


@pytest.mark.slow
def test_stage_2_killed_midway_resumes_bitwise(tmp_path, corpus_root, teacher_dir):
    stage1 = tmp_path / "s1"
    run(
        stage_args(stage1, corpus_root, "frozen: true", "steps=2", f"distill.teacher={teacher_dir}")
    )
    init = f"checkpoint.init_ckpt_path={stage1 / 'checkpoints' / '0000000002'}"
    stage2 = ("lr_scale: 0.1", "steps=6", init, f"distill.teacher={teacher_dir}")
    straight = run(stage_args(tmp_path / "straight", corpus_root, *stage2))
    run(stage_args(tmp_path / "killed", corpus_root, *stage2, "max_steps=3"))
    # killed after step 3, before its save: the restart finds step 2 and trains 3..6 again
    shutil.rmtree(tmp_path / "killed" / "checkpoints" / "0000000003")
    resumed = run(stage_args(tmp_path / "killed", corpus_root, *stage2))
    assert resumed.state.step == 6 and resumed._steps_run == 4  # resumed at 2, not restarted
    for (name, a), b in zip(straight.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(a, b), name
        state_a, state_b = straight.optimizer.state[a], resumed.optimizer.state[b]
        assert all(torch.equal(state_a[k], state_b[k]) for k in state_a), name
    assert straight.last["aux/distill"] == resumed.last["aux/distill"]


@pytest.mark.parametrize(
    "hidden, vocab_size, message",
    [
        (48, None, "hidden_size=48 but the student's global transformer is 32 wide"),
        (WIDTH, 100, "vocab_size=100 but tokenizer.json has 320 tokens"),
    ],
)
def test_a_teacher_that_does_not_fit_is_one_config_error(
    tmp_path, corpus_root, hidden, vocab_size, message
):
    save_teacher(tmp_path, corpus_root, hidden=hidden, vocab_size=vocab_size)
    args = stage_args(tmp_path / "run", corpus_root, "frozen: true", f"distill.teacher={tmp_path}")
    with pytest.raises(ConfigError) as info:
        build_extra_losses(args, torch.device("cpu"))
    line = info.value.one_line()
    assert message in line and "\n" not in line and line.startswith("config error: distill"), line


def test_a_missing_teacher_folder_is_one_config_error(tmp_path, corpus_root):
    args = stage_args(tmp_path / "run", corpus_root, "frozen: true", f"distill.teacher={tmp_path}")
    with pytest.raises(ConfigError, match="no config.json or tokenizer.json there"):
        build_extra_losses(args, torch.device("cpu"))


def test_a_teacher_tokenizer_that_is_not_byte_level_is_one_config_error(tmp_path, corpus_root):
    tokenizers = pytest.importorskip("tokenizers")
    save_teacher(tmp_path, corpus_root)
    tok = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    args = stage_args(tmp_path / "run", corpus_root, "frozen: true", f"distill.teacher={tmp_path}")
    with pytest.raises(ConfigError, match="is not byte-level BPE"):
        build_extra_losses(args, torch.device("cpu"))
