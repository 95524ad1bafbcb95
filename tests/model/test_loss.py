"""The one forward/loss path: patch lengths reach a BLT only, and the loss is the masked CE sum."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from bytelatent.archs.blt.model import ByteLatentTransformer
from bytelatent.data.batch import Batch
from bytelatent.model.loss import batch_loss_sum, forward_logits


class Recorder(torch.nn.Module):
    """Logits of ones; remembers what forward received."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def forward(self, tokens, patch_lengths=None):
        self.calls.append(patch_lengths)
        return torch.zeros(*tokens.shape, 5) + tokens[..., None].float() * 0.1


class RecordingBLT(ByteLatentTransformer):
    def __init__(self):  # no layers: only the type and the call matter here
        torch.nn.Module.__init__(self)
        self.calls, self.hosts = [], []

    def forward(self, tokens, patch_lengths=None, ngram_ids=None, host=None):
        self.calls.append(patch_lengths)
        self.hosts.append(host)
        return torch.zeros(*tokens.shape, 5)


def batch() -> Batch:
    x = np.array([[1, 2, 3, 4]], dtype=np.int64)
    y = np.array([[2, 3, 4, 0]], dtype=np.int64)
    mask = np.array([[True, True, True, False]])
    return Batch(x, y, mask, np.array([[1, 2, 2]], dtype=np.int64))


def test_patch_lengths_go_to_a_blt_and_never_to_a_byte_lm():
    blt, lm, first = RecordingBLT(), Recorder(), batch()
    forward_logits(blt, first, torch.device("cpu"))
    forward_logits(lm, batch(), torch.device("cpu"))
    assert blt.calls[0].tolist() == [[1, 2, 2]]
    assert lm.calls == [None]
    no_patches = batch()
    no_patches.patch_lengths = None
    forward_logits(blt, no_patches, torch.device("cpu"))
    assert blt.calls[1] is None
    # the host arrays ride along (xformers masks read their document lengths there)
    assert blt.hosts[0] is first and blt.hosts[1] is no_patches


def test_loss_is_the_ce_sum_over_unmasked_targets():
    model, b = Recorder(), batch()
    logits = model(torch.from_numpy(b.x))
    ce = F.cross_entropy(logits[0], torch.from_numpy(b.y)[0], reduction="none")
    got = batch_loss_sum(model, b, torch.device("cpu"))
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ce[:3].sum())
