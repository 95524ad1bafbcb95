"""The distillation term `aux/distill`: a frozen token-level teacher in the training process and
the KL from its byte-level next-byte distribution to the student's (byteify, issue 42).

How the student's next-byte distribution meets the teacher's 257-class targets
(`distill.TokenByteTrie`: 256 bytes + END, "the token ends here"): the student keeps its own
LM head (no END class), and the target is the teacher's distribution over the *next byte*:

- at the first byte of token i (i >= 2), exactly: the previous token t extended by byte b, plus
  t ending (END) times the first byte of token i under the teacher's next distribution:
  `P(b) = row(t)[b] + row(t)[END] * first_byte_i[b]`;
- inside a token, the teacher's distribution given that the token continues (END dropped,
  renormalised): the probability of the tokenizations that end the token early is not known
  without running the teacher on them, and the teacher's own tokenizer never produces them.

The student's CE trains the same next-byte distribution, so the two terms agree. A training row
is a window of bytes cut anywhere: the teacher re-tokenizes each run of bytes between document
markers (trimmed to whole UTF-8 characters); the first token of a run has no teacher context
and the first byte of the second token no END row before it, so neither gets a target.
The teacher runs in fp32 without gradients; under FSDP every rank holds a full copy (it is not
sharded), and its FLOPs are not in MFU.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from bytelatent.errors import ConfigError
from bytelatent.model.spec import AuxLoss
from bytelatent.tokenizers.constants import OFFSET, VOCAB_SIZE
from bytelatent.tokenizers.hf_bpe import byte_level_vocab
from bytelatent.trainer.distill import END, JOINT_CLASSES, N_BYTES, TokenByteTrie
from bytelatent.trainer.distill_args import DistillArgs

logger = logging.getLogger("bytelatent")

NAME = "distill"


def byte_runs(ids: np.ndarray, valid: np.ndarray) -> list[tuple[int, int]]:
    """[a, b) ranges of consecutive positions holding bytes (not BOS/EOS/padding) where valid."""
    is_byte = valid & (ids >= OFFSET) & (ids < OFFSET + N_BYTES)
    edges = np.flatnonzero(np.diff(np.concatenate([[0], is_byte.astype(np.int8), [0]])))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist()))


def whole_characters(data: bytes) -> tuple[int, int]:
    """[start, end) of `data` without the partial UTF-8 characters a cut left at either end."""
    start = 0
    while start < min(len(data), 3) and 0x80 <= data[start] < 0xC0:
        start += 1  # continuation bytes of a character that began before the window
    end = len(data)
    for back in range(1, min(4, end - start) + 1):
        lead = data[end - back]
        if lead < 0x80:
            break
        if lead >= 0xC0:  # a lead byte: its character needs 2, 3 or 4 bytes
            need = 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4
            if back < need:
                end -= back
            break
    return start, end


class TeacherDistillation:
    """Called on each micro-batch with the student's logits: the mean KL(teacher || student)
    over the distilled bytes (a scalar with the student's graph)."""

    def __init__(self, args: DistillArgs, device: torch.device, joint: bool = False) -> None:
        try:
            from tokenizers import Tokenizer
            from transformers import LlamaForCausalLM
        except ImportError as exc:
            raise ConfigError(
                f"distill needs tokenizers and transformers ({exc}); pip install -e '.[hf]'"
            ) from None
        self.spec = AuxLoss(NAME, args.weight)
        self.name = NAME
        self.temperature = args.temperature
        self.tokenizer = Tokenizer.from_file(f"{args.teacher}/tokenizer.json")
        try:
            self.vocab = byte_level_vocab(self.tokenizer)
        except ValueError as exc:
            raise ConfigError(f"distill.teacher={args.teacher}: {exc}") from None
        self.trie = TokenByteTrie(self.vocab)
        self.device = device
        # a boundary-head student (model.boundary_head) predicts (byte, token ends after it)
        self.joint = joint
        teacher = LlamaForCausalLM.from_pretrained(args.teacher, dtype=torch.float32)
        self.teacher = teacher.to(device).eval().requires_grad_(False)

    def tokenize(self, data: bytes) -> tuple[int, list[int]] | None:
        """(offset of the first whole character, teacher token ids covering the rest exactly),
        or None when the bytes are not UTF-8 text the teacher tokenizer can reproduce."""
        start, end = whole_characters(data)
        try:
            text = data[start:end].decode("utf-8")
        except UnicodeDecodeError:
            return None
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if b"".join(self.vocab[i] for i in ids) != data[start:end]:
            return None  # a normalizer changed the text: its tokens are not these bytes
        return start, ids

    @torch.no_grad()
    def teacher_probs(self, ids: list[int]) -> torch.Tensor:
        """[T - 1, V]: the teacher's distribution for tokens 1..T-1 given the tokens before."""
        logits = self.teacher(torch.tensor([ids], device=self.device)).logits[0, :-1]
        logits = logits[:, : len(self.vocab)].double() / self.temperature
        return torch.softmax(logits, -1)

    def run_targets(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(byte offsets within the run's text, next-byte targets [N, 256]) for one run."""
        tail = torch.tensor(ids[1:], dtype=torch.long)
        rows = self.trie.token_rows(self.teacher_probs(ids), tail, end_rows=True)
        lengths = self.trie.token_len[tail]
        first = (torch.cumsum(lengths + 1, 0) - lengths - 1).to(rows.device)
        byte_rows = torch.ones(rows.shape[0], dtype=torch.bool, device=rows.device)
        byte_rows[first + lengths.to(rows.device)] = False  # the end rows are not byte targets
        targets = rows[:, :N_BYTES] / rows[:, :N_BYTES].sum(-1, keepdim=True).clamp_min(1e-30)
        # first byte of token i >= 2: the previous token extended, or ended then token i's byte
        prev_end = rows[first[1:] - 1]
        targets[first[1:]] = prev_end[:, :N_BYTES] + prev_end[:, END : END + 1] * targets[first[1:]]
        keep = byte_rows
        keep[first[0]] = False  # token 1's first byte: token 0 has no teacher distribution
        token_of_row = torch.repeat_interleave(torch.arange(len(tail)), lengths + 1)
        depth = torch.arange(rows.shape[0]) - first.cpu()[token_of_row]
        starts = torch.cumsum(lengths, 0) - lengths  # each token's offset after token 0
        offsets = len(self.vocab[ids[0]]) + starts[token_of_row] + depth
        return offsets[keep.cpu()], targets[keep]

    def run_joint_targets(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(byte offsets within the run's text, 512-class targets [N, 512]) for one run: every
        byte of tokens 1..T-1 (`TokenByteTrie.joint_rows`; token 0 has no teacher context)."""
        tail = torch.tensor(ids[1:], dtype=torch.long)
        rows = self.trie.joint_rows(self.teacher_probs(ids), tail)
        offsets = len(self.vocab[ids[0]]) + torch.arange(rows.shape[0])
        return offsets, rows

    def targets(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(flat indices into [B * L] student positions, next-byte targets [N, 256])."""
        positions, targets = [], []
        width = batch.y.shape[1]
        mask = batch.target_mask
        for row in range(batch.y.shape[0]):
            seq = np.concatenate([batch.x[row, :1], batch.y[row]])  # position q: byte q
            if self.joint:  # boundary classes (data.boundary_targets) back to byte ids
                seq = np.where(seq >= VOCAB_SIZE, seq - (VOCAB_SIZE - OFFSET), seq)
            valid = np.concatenate([[True], batch.mask[row]])
            for a, b in byte_runs(seq, valid):
                data = bytes((seq[a:b] - OFFSET).tolist())
                found = self.tokenize(data)
                if found is None or len(found[1]) < 2:
                    continue
                start, ids = found
                offsets, run = (self.run_joint_targets if self.joint else self.run_targets)(ids)
                q = a + start + offsets.cpu().numpy()  # the byte's sequence position
                scored = mask[row, q - 1]  # the student predicts byte q at position q - 1
                positions.append(row * width + q[scored] - 1)
                targets.append(run[torch.from_numpy(scored).to(run.device)])
        if not positions:
            classes = JOINT_CLASSES if self.joint else N_BYTES
            return torch.zeros(0, dtype=torch.long), torch.zeros((0, classes))
        return torch.from_numpy(np.concatenate(positions)), torch.cat(targets)

    def __call__(self, batch, logits: torch.Tensor) -> torch.Tensor:
        positions, target = self.targets(batch)
        if positions.numel() == 0:
            return logits.sum() * 0.0  # nothing to distill in this micro-batch
        flat = logits.flatten(0, 1)[positions.to(logits.device)].float()
        log_all = torch.log_softmax(flat, -1)
        log_q = log_all[:, OFFSET : OFFSET + N_BYTES]
        if self.joint:  # the "byte ends its token" half sits after the vocabulary
            log_q = torch.cat([log_q, log_all[:, -N_BYTES:]], -1)
        target = target.to(log_q.device, torch.float32)
        kl = torch.xlogy(target, target) - target * log_q
        return kl.sum() / positions.numel()


def build_extra_losses(args, device: torch.device) -> list[TeacherDistillation]:
    """Loss terms computed from the student's logits outside the model (the `distill` section).
    A teacher that does not fit the student is a ConfigError (one line) before anything loads."""
    if args.distill is None:
        return []
    # byteify keeps the teacher's backbone: the student's global transformer (`model.dim` in
    # every built-in architecture) must be the teacher's width
    width = getattr(args.model, "dim", None)
    if problems := args.distill.mismatches(width):
        raise ConfigError(f"distill.teacher={args.distill.teacher}: {'; '.join(problems)}")
    joint = bool(getattr(args.model, "boundary_head", False))
    return [TeacherDistillation(args.distill, device, joint=joint)]
