"""Byteify with subword embeddings and a boundary head (docs/byteify.md, issue 42): the subword
lookup against a brute-force longest suffix, the boundary classes the data layer writes, the
teacher's 512-class targets whose product is the token's probability, a boundary-head BLT whose
logits never see a boundary it has not predicted, a warm-started student whose frozen global
transformer computes exactly the teacher's layer outputs on token patches, a stage-1 run that
keeps the teacher's table and layers bitwise, and the config mistakes as one line."""

from __future__ import annotations

import random
import shutil

import numpy as np
import pytest
import torch

from bytelatent.archs.blt.args import ByteLatentTransformerArgs
from bytelatent.archs.blt.model import ByteLatentTransformer
from bytelatent.archs.blt.subword import SubwordEmbedding
from bytelatent.args import TrainArgs
from bytelatent.config import parse_args
from bytelatent.data.iterators.packing import PackingArgs, pack_patches
from bytelatent.data.iterators.sequence import Sequence
from bytelatent.distributed.env import detect_env
from bytelatent.errors import ConfigError
from bytelatent.tokenizers.constants import OFFSET, VOCAB_SIZE
from bytelatent.trainer.build import build_model
from bytelatent.trainer.distill import TokenByteTrie
from bytelatent.trainer.trainer import Trainer
from tests.extras import lazy_extra
from tests.trainer.test_cli import TINY_BLT
from tests.trainer.test_distill_loss import run as run_args
from tests.trainer.test_distill_loss import save_teacher


def brute_longest(patch: bytes, vocab: list[bytes]) -> int:
    best = -1
    for k in range(1, len(patch) + 1):
        if patch[len(patch) - k :] in vocab:
            best = vocab.index(patch[len(patch) - k :])
    return best


def test_subword_ids_are_the_longest_token_ending_each_patch():
    rng = random.Random(0)
    alphabet = b"ab c\n"
    vocab = [b""] + [bytes([i]) for i in range(256)]
    while len(vocab) < 400:
        token = bytes(rng.choice(alphabet) for _ in range(rng.randint(2, 9)))
        if token not in vocab:
            vocab.append(token)
    table = SubwordEmbedding(512, 4, max_bytes=9)
    table.init_weights(0.02)
    assert (table.patch_token_ids(torch.tensor([[OFFSET + 97]]), torch.tensor([[1]])) == -1).all()
    table.set_vocabulary(vocab)
    rows, lengths = [], []
    for _ in range(3):
        text = bytes(rng.choice(alphabet) for _ in range(120))
        cuts = [1]
        while sum(cuts) < len(text):
            cuts.append(min(rng.randint(1, 12), len(text) - sum(cuts)))
        rows.append(text)
        lengths.append(cuts + [0] * (130 - len(cuts)))
    tokens = torch.tensor([[b + OFFSET for b in text] for text in rows])
    tokens[0, 50] = 2  # an EOS inside a patch: no token spans it
    got = table.patch_token_ids(tokens, torch.tensor(lengths))
    for r, text in enumerate(rows):
        data = [b if i != 50 or r else None for i, b in enumerate(text)]
        start = 0
        for p, n in enumerate(lengths[r]):
            if n == 0:
                assert got[r, p] == -1
                continue
            patch = data[start : start + n]
            tail = []
            for b in reversed(patch):  # bytes after the last special token
                if b is None:
                    break
                tail.insert(0, b)
            expected = brute_longest(bytes(tail), vocab) if tail else -1
            assert got[r, p].item() == expected, (r, p, bytes(tail))
            start += n


def test_tokens_longer_than_max_bytes_are_never_looked_up():
    table = SubwordEmbedding(8, 4, max_bytes=3)
    table.init_weights(0.02)
    assert table.set_vocabulary([b"", b"a", b"b", b"abcd", b"bcd"]) == 1
    tokens = torch.tensor([[OFFSET + c for c in b"xabcd"]])
    assert table.patch_token_ids(tokens, torch.tensor([[1, 4]])).tolist() == [[-1, 4]]
    with pytest.raises(ValueError, match="has 8 rows"):
        table.set_vocabulary([b"a"] * 9)


def test_boundary_targets_mark_the_bytes_that_end_a_patch():
    tokens = np.array([1, *(OFFSET + b for b in b"ab cd e"), 2, OFFSET + ord("x")])
    window = Sequence(tokens=tokens, patch_lengths=np.array([1, 2, 3, 2, 2]), loss_mask=None)
    args = PackingArgs(
        mode="patches", batch_size=1, seq_len=6, max_length=12, boundary_targets=True
    )
    batch = pack_patches([window], args)
    n = len(tokens) - 1
    plain = tokens[1:]
    ends = {2, 5, 7}  # window indices 2 ("b"), 5 ("d"), 7 ("e"): patch ends before the last
    expected = [t + (VOCAB_SIZE - OFFSET) if i + 1 in ends else t for i, t in enumerate(plain)]
    assert batch.y[0, :n].tolist() == expected
    assert batch.target_mask[0, : n - 1].all() and not batch.target_mask[0, n - 1 :].any()
    again = pack_patches([window], args.model_copy(update={"boundary_targets": False}))
    assert batch.y[0, n - 1] == again.y[0, n - 1] and again.target_mask[0, n - 1]


def test_joint_rows_multiply_to_the_token_probability():
    vocab = [b"", b"a", b"b", b"ab", b"abc", b"c", b"ba", b"abd", b"bb", b"bab"]
    trie = TokenByteTrie(vocab)
    generator = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(6, len(vocab), generator=generator, dtype=torch.float64), -1)
    probs[:, 0] = 0.0
    probs = probs / probs.sum(-1, keepdim=True)
    ids = [4, 1, 6, 3, 9, 8]
    rows = trie.joint_rows(probs, ids)
    classes = trie.joint_class(ids)
    torch.testing.assert_close(rows.sum(-1), torch.ones(len(rows), dtype=torch.float64))
    row = 0
    for i, token in enumerate(ids):
        product = torch.ones((), dtype=torch.float64)
        for _ in vocab[token]:
            product = product * rows[row, classes[row]]
            row += 1
        torch.testing.assert_close(product, probs[i, token], rtol=1e-5, atol=0)


def tiny_head_args(**extra) -> ByteLatentTransformerArgs:
    return ByteLatentTransformerArgs(
        dim=32, n_layers=1, n_heads=2, max_seqlen=32, dim_local_encoder=16,
        dim_local_decoder=16, n_layers_local_encoder=1, n_layers_local_decoder=2,
        n_heads_local_encoder=2, n_heads_local_decoder=2, cross_attn_encoder=True,
        cross_attn_decoder=True, cross_attn_k=2, cross_attn_nheads=2,
        cross_attn_all_layers_decoder=True, cross_attn_init_by_pooling=True,
        downsampling_by_pooling="max", local_attention_window_len=64,
        max_encoder_seq_length=64, encoder_hash_byte_group_size=[3, 4],
        encoder_hash_byte_group_vocab=64, boundary_head=True, **extra,
    )  # fmt: skip


@pytest.mark.parametrize("teacher", [False, True])
def test_a_boundary_head_never_sees_a_boundary_it_has_not_predicted(teacher):
    """Position q predicts byte q + 1 and whether a patch ends after it: its logits may depend on
    the patch boundaries after bytes 0..q, never on a later one (also with the subword
    embeddings and the teacher head over a small vocabulary)."""
    torch.manual_seed(0)
    extra = {"subword_vocab_size": 300, "teacher_head": True} if teacher else {}
    model = ByteLatentTransformer(tiny_head_args(**extra))
    model.init_weights()
    model.eval()
    tokens = torch.randint(OFFSET, OFFSET + 8, (1, 24))  # 8 byte values: tokens recur
    if teacher:
        alphabet = [bytes([b]) for b in range(8)]
        vocab = [b""] + alphabet + [a + b for a in alphabet for b in alphabet]
        vocab += [a + b + c for a in alphabet[:3] for b in alphabet[:3] for c in alphabet[:3]]
        model.subword.set_vocabulary(vocab)
        model.teacher_head.set_vocabulary(vocab)
        torch.nn.init.normal_(model.local_decoder.output.weight, std=0.1)
    a = torch.tensor([[1, 3, 2, 4, 5, 3, 7]])  # boundaries after bytes 0, 3, 5, 9, 14, 17
    b = torch.tensor([[1, 3, 2, 4, 1, 2, 4, 8]])  # the same up to 9, then 10, 12, 16
    assert model.local_decoder.output.out_features == VOCAB_SIZE + 256
    with torch.no_grad():
        la, lb = model(tokens, a), model(tokens, b)
    # positions 0..9 know the cuts after 0..9 only: equal up to rounding (the two rows have
    # different patch counts, so the GEMMs are blocked differently: ~1e-6 on an AVX2 CPU)
    torch.testing.assert_close(la[0, :10], lb[0, :10], rtol=0, atol=1e-4)
    assert (la[0, 10] - lb[0, 10]).abs().max() > 1e-2  # position 10 reads the cut after byte 10


def test_a_boundary_head_without_boundary_targets_is_one_line():
    with pytest.raises(ConfigError, match="set both") as info:
        parse_args(TrainArgs, [*TINY_BLT, "model.boundary_head=true"])
    assert "\n" not in info.value.one_line()
    with pytest.raises(ConfigError, match="is 64 wide for dim=32"):
        parse_args(TrainArgs, [*TINY_BLT, "model.subword_vocab_size=8"])
    with pytest.raises(ConfigError, match="teacher_head needs subword_vocab_size"):
        parse_args(TrainArgs, [*TINY_BLT, "model.teacher_head=true"])
    with pytest.raises(ConfigError, match="data.boundary_targets needs patches"):
        parse_args(TrainArgs, [*TINY_BLT, "data.boundary_targets=true", "data.add_patches=false"])


# -- a teacher whose layers, embeddings and tokenizer become the student's --------------------

transformers = lazy_extra("transformers", reason="pip install 'bytelatent[hf]'")


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory, corpus_root):
    """tests/trainer/test_distill_loss.py's tokenizer (320 tokens) and a random Llama of the
    student's global shape (dim 32, 1 layer, 2 heads / 1 kv head, SwiGLU 256)."""
    folder = tmp_path_factory.mktemp("teacher")
    save_teacher(folder, corpus_root)
    config = transformers.LlamaConfig(
        vocab_size=320, hidden_size=32, intermediate_size=256, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-5,
        rope_theta=500000.0, max_position_embeddings=64, initializer_range=0.2,
    )  # fmt: skip
    torch.manual_seed(1)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def bolmo_argv(dump, corpus_root, teacher, *extra) -> list[str]:
    return [
        *TINY_BLT,
        "model.n_kv_heads_global=1",
        "model.dim_local_encoder=16",
        "model.dim_local_decoder=16",
        f"model.global_init.path={teacher}",
        "model.subword_vocab_size=320",
        "model.boundary_head=true",
        "data.boundary_targets=true",
        "data.patcher_args.patching_mode=tokenizer",
        f"data.patcher_args.tokenizer_path={teacher}",
        f"dump_dir={dump}",
        f"data.root_dir={corpus_root}",
        "distributed.model_dtype=fp32",
        *extra,
    ]


def warm_student_on(text: str, tmp_path, corpus_root, teacher_dir, *extra: str):
    """A student warm-started from the teacher (`bolmo_argv` + `extra`), and `text` as the
    teacher tokenizes it: (model, token ids, byte lengths, tokens [1, N], patch_lengths [1, P]
    with one patch per token and the next byte in the last)."""
    from tokenizers import Tokenizer

    from bytelatent.checkpoint.hf_llama import warm_start_global

    args = parse_args(TrainArgs, bolmo_argv(tmp_path, corpus_root, teacher_dir, *extra))
    with torch.device("meta"):
        model = build_model(args)
    model.to_empty(device="cpu")
    model.init_weights()
    assert warm_start_global(model, args.model)
    tok = Tokenizer.from_file(str(teacher_dir / "tokenizer.json"))
    ids = tok.encode(text, add_special_tokens=False).ids
    lengths = [len(tok.decode([i]).encode()) for i in ids]
    assert lengths[0] == 1  # the BLT's first patch is one byte: the text starts with one
    tokens = torch.tensor([[OFFSET + b for b in text.encode()]])
    patch_lengths = torch.tensor([lengths[:-1] + [lengths[-1] + 1]])  # + the next byte
    return model, tok, ids, lengths, tokens, patch_lengths


def test_on_token_patches_the_frozen_layers_compute_the_teachers_outputs(
    tmp_path, corpus_root, teacher_dir
):
    text = "\ndef join(a, b):\n    return os.path.join(a, b)\n"
    model, _, ids, _, tokens, patch_lengths = warm_student_on(
        text, tmp_path, corpus_root, teacher_dir
    )
    seen = {}
    model.global_transformer.register_forward_hook(lambda m, i, o: seen.update(ours=o))
    teacher = transformers.LlamaForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32)
    teacher.model.layers[-1].register_forward_hook(
        lambda m, i, o: seen.update(teacher=o[0] if isinstance(o, tuple) else o)
    )
    with torch.no_grad():
        model(tokens, patch_lengths)
        teacher(torch.tensor([ids]))
    torch.testing.assert_close(seen["ours"], seen["teacher"], rtol=1e-4, atol=1e-5)


def test_with_the_teacher_head_a_fresh_student_scores_the_teachers_tokens(
    tmp_path, corpus_root, teacher_dir
):
    """model.teacher_head after the warm start: the student's log-probability of each token's
    bytes and its end (the boundary classes) is the teacher's log-probability of the token
    (renormalised without its special token, which spells no bytes)."""
    text = "\nclass Path(object):\n    def join(self, *parts):\n        return parts\n"
    model, tok, ids, lengths, tokens, patch_lengths = warm_student_on(
        text, tmp_path, corpus_root, teacher_dir, "model.teacher_head=true"
    )
    data = text.encode()
    teacher = transformers.LlamaForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32)
    with torch.no_grad():
        log_q = torch.log_softmax(model(tokens, patch_lengths)[0], -1)
        logits = teacher(torch.tensor([ids])).logits[0]
        logits[:, tok.token_to_id("<s>")] = -torch.inf  # a special token spells no bytes
        log_p = torch.log_softmax(logits, -1)
    start = lengths[0] + lengths[1]
    # patches 0 and 1 get no prior (a row's cut), the last token's end is the row's cut
    for i in range(2, len(ids) - 1):
        n = lengths[i]
        ours = 0.0
        for k in range(n):
            byte = data[start + k]
            cls = VOCAB_SIZE + byte if k == n - 1 else OFFSET + byte
            ours += log_q[start + k - 1, cls].item()
        # per byte: the 4 special classes (prior e^-10 each) take 1.8e-4 nats, the smoothing 1e-4
        assert abs(ours - log_p[i - 1, ids[i]].item()) < 4e-4 * n, (i, ours, log_p[i - 1, ids[i]])
        start += n


def test_stage_1_keeps_the_teachers_table_and_layers(tmp_path, corpus_root, teacher_dir):
    argv = bolmo_argv(
        tmp_path, corpus_root, teacher_dir, "steps=3", f"distill.teacher={teacher_dir}",
        "optim.groups=[{params: 'global_transformer.*', frozen: true}, "
        "{params: 'subword.table.*', frozen: true}]",
    )  # fmt: skip
    trainer = Trainer(parse_args(TrainArgs, argv), detect_env())
    try:
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        trainer.train()
        last = trainer.last
    finally:
        trainer.close()
    assert 0 < last["aux/distill"] < 20 and np.isfinite(last["bpb"]), last
    for name, param in trainer.model.named_parameters():
        frozen = name.startswith(("global_transformer.", "subword.table."))
        assert torch.equal(before[name], param) == frozen, name
    assert trainer.model.subword.sorted_keys.max() > 0  # the teacher's vocabulary is keyed


def test_a_fresh_student_with_the_teacher_head_is_already_distilled(
    tmp_path, corpus_root, teacher_dir
):
    """On real batches (token patches, boundary classes in y), the first step's aux/distill is
    the KL between the teacher's targets and a student that is the teacher: near 0 where the
    data, the targets and the prior line up (the row's cut patches aside)."""
    argv = bolmo_argv(
        tmp_path, corpus_root, teacher_dir, "steps=1", f"distill.teacher={teacher_dir}",
        "model.teacher_head=true",
    )  # fmt: skip
    trainer = Trainer(parse_args(TrainArgs, argv), detect_env())
    try:
        trainer.train()
        last = trainer.last
    finally:
        trainer.close()
    assert last["aux/distill"] < 0.3, last  # 0.09 here; 7.4 when y's boundary classes are misread


def run(argv: list[str]) -> Trainer:
    return run_args(parse_args(TrainArgs, argv))


@pytest.mark.slow
def test_stage_2_starts_from_stage_1_and_resumes_bitwise(tmp_path, corpus_root, teacher_dir):
    """The teacher's vocabulary keys and head travel in stage 1's checkpoint to stage 2 (a warm
    start with no global_init), and a stage 2 killed midway resumes bitwise."""
    head = ("model.teacher_head=true", "checkpoint.dump.every=2")
    stage1 = tmp_path / "s1"
    first = run(
        bolmo_argv(
            stage1, corpus_root, teacher_dir, *head, "steps=2", f"distill.teacher={teacher_dir}",
            "optim.groups=[{params: 'global_transformer.*', frozen: true}]",
        )
    )  # fmt: skip
    stage2 = [
        a for a in bolmo_argv(tmp_path, corpus_root, teacher_dir, *head) if "global_init" not in a
    ]
    init = f"checkpoint.init_ckpt_path={stage1 / 'checkpoints' / '0000000002'}"
    straight = run([*stage2, init, "steps=6", f"dump_dir={tmp_path / 'straight'}"])
    for name in ("subword.sorted_keys", "teacher_head.prefix_keys", "teacher_head.token_len"):
        a, b = first.model.get_buffer(name), straight.model.get_buffer(name)
        assert torch.equal(a, b) and (a > 0).any(), name
    killed = [*stage2, init, "steps=6", f"dump_dir={tmp_path / 'killed'}"]
    run([*killed, "max_steps=3"])
    shutil.rmtree(tmp_path / "killed" / "checkpoints" / "0000000003")
    resumed = run(killed)
    assert resumed.state.step == 6 and resumed._steps_run == 4
    for (name, a), b in zip(straight.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(a, b), name


def test_subword_embeddings_without_a_tokenizer_are_one_line(tmp_path, corpus_root):
    from bytelatent.checkpoint.hf_llama import load_subword_embeddings

    folder = tmp_path / "llama"
    folder.mkdir()
    args = parse_args(TrainArgs, bolmo_argv(tmp_path, corpus_root, folder))
    with torch.device("meta"):
        model = build_model(args)
    with pytest.raises(ConfigError, match="needs the token model's tokenizer.json"):
        load_subword_embeddings(model, args.model)
