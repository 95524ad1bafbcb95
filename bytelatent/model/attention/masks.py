"""What a mask means, independent of any backend: the mask specs and the math they share.

Mask semantics (reference BLT, xformers masks; see docs/architecture.md):

- ``Causal``: query i sees keys j <= i.
- ``BlockCausal``: rows are packed documents. A document ends at and including an EOS token; the
  token after an EOS starts a new document. Query i sees keys j <= i of its own document (and the
  end of a row also ends a document, so rows never see each other).
- ``LocalBlockCausal``: BlockCausal and additionally j > i - window, i.e. a query sees itself
  plus the ``window - 1`` previous positions. This is xformers'
  ``BlockDiagonalCausalMask.make_local_attention(window)`` (its mask keeps
  ``triu(diagonal=1 - window)`` of the causal mask), which the reference uses.
- ``KeyIntervals``: query q of row b sees keys ``lo[b,q] <= j < hi[b,q]``; the BLT's windowed patch
  cross-attention masks are of this form (``patch_utils.cross_attn_key_bounds``).
- ``Dense``: an explicit bool tensor [B|1, 1, Q, K] (True = attend).

``MaskSpec`` is the union of these. A spec is cheap (it holds the tensors it was given); a backend
turns it into the representation it runs (``AttentionBackend.build``), once per forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

SELF_ATTN_KINDS = (None, "causal", "block_causal", "local_block_causal")


class MaskCache:
    """A mask's derived forms by dtype (additive 0 / -inf masks and biases), in a plain object.

    Masks travel as forward inputs, and FSDP2 casts a module's floating forward inputs through
    dicts and dataclass fields (`torch.distributed.utils._apply_to_tensors`): a dict field would
    come back rebuilt, holding a bf16 copy under the fp32 key, and lose what later layers add.
    An object that is neither passes through as it is, shared by every layer of the forward."""

    def __init__(self) -> None:
        self.masks: dict[torch.dtype, torch.Tensor] = {}


@dataclass(frozen=True, eq=False)
class Causal:
    """Plain causal attention (query i sees keys j <= i, aligned at the top-left).

    ``tokens`` [B,S], when given, are the rows: flex needs their shape for its BlockMask."""

    tokens: torch.Tensor | None = None


@dataclass(frozen=True, eq=False)
class BlockCausal:
    """Causal within the documents of packed rows ``tokens`` [B,S] (each ends at an EOS).

    ``docs`` is the batch's host copy of the document ends, for backends that need host integers
    (xformers); without it they read ``tokens`` (one device-to-host copy)."""

    tokens: torch.Tensor
    eos_id: int
    docs: HostDocuments | None = None


@dataclass(frozen=True, eq=False)
class LocalBlockCausal:
    """BlockCausal and a sliding window: a query sees itself and ``window - 1`` earlier keys."""

    tokens: torch.Tensor
    eos_id: int
    window: int
    docs: HostDocuments | None = None


@dataclass(frozen=True, eq=False)
class KeyIntervals:
    """Query q of row b sees keys ``lo[b,q] <= j < hi[b,q]`` (``lo``, ``hi`` [B, Q] long).

    Cross-attention patch masks: both bounds never decrease with q and chain
    (``lo[b,q+1] <= hi[b,q]``). A query with ``hi <= lo`` sees nothing and gets zeros."""

    lo: torch.Tensor
    hi: torch.Tensor
    kv_len: int

    def allowed(self) -> torch.Tensor:
        """The bool mask [B,1,Q,K] (True = attend)."""
        key = torch.arange(self.kv_len, device=self.lo.device)
        return ((key >= self.lo[..., None]) & (key < self.hi[..., None]))[:, None]


@dataclass(frozen=True, eq=False)
class Dense:
    """An explicit bool mask [B|1, 1, Q, K] (True = attend).

    With ``may_have_empty_rows`` (e.g. cross-attention to padded patches) query rows that allow
    no key produce exact zeros (and zero gradients) instead of NaN."""

    allowed: torch.Tensor
    may_have_empty_rows: bool = True

    def __post_init__(self) -> None:
        if self.allowed.dtype != torch.bool:
            raise ValueError(f"mask must be bool, got {self.allowed.dtype}")
        if self.allowed.dim() != 4:
            raise ValueError(
                f"mask must have 4 dims [B,1,Q,K], got shape {tuple(self.allowed.shape)}"
            )

    def opened(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(mask, query_has_key): rows without a key opened up so that no kernel sees an empty
        row (some produce NaN for one); ``attend`` zeroes them through ``query_has_key``."""
        if not self.may_have_empty_rows:
            return self.allowed, None
        has_key = self.allowed.any(dim=-1, keepdim=True)
        return self.allowed | ~has_key, has_key


MaskSpec = Causal | BlockCausal | LocalBlockCausal | KeyIntervals | Dense


def self_attn_spec(
    kind: str | None,
    tokens: torch.Tensor,
    eos_id: int = 2,
    window: int | None = None,
    docs: HostDocuments | None = None,
) -> Causal | BlockCausal | LocalBlockCausal:
    """The spec of a config's ``attn_bias_type`` (None/"causal", "block_causal",
    "local_block_causal") for packed rows ``tokens`` [B,S]."""
    check_kind(kind, window)
    if docs is not None:
        docs.check_shape(tokens)
    if kind in (None, "causal"):
        return Causal(tokens)
    if kind == "block_causal":
        return BlockCausal(tokens, eos_id, docs)
    return LocalBlockCausal(tokens, eos_id, window, docs)


def check_kind(kind: str | None, window: int | None) -> None:
    if kind not in SELF_ATTN_KINDS:
        raise ValueError(f"unknown attention mask kind {kind!r}; expected one of {SELF_ATTN_KINDS}")
    if kind == "local_block_causal" and (window is None or window < 1):
        raise ValueError(f"local_block_causal needs a sliding window >= 1, got {window!r}")


def document_ids(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Per-position document index within each row; a document ends at and including EOS."""
    is_eos = (tokens == eos_id).to(torch.int32)
    # exclusive cumulative sum: the EOS itself still belongs to the document it closes
    return torch.cumsum(is_eos, dim=1) - is_eos


def first_visible_key(tokens: torch.Tensor, eos_id: int, window: int | None) -> torch.Tensor:
    """[B,S]: the earliest key position query i may see (its document start, or the window)."""
    bsz, seqlen = tokens.shape
    pos = torch.arange(seqlen, device=tokens.device).expand(bsz, seqlen)
    starts = torch.zeros_like(tokens, dtype=torch.bool)
    starts[:, 0] = True
    starts[:, 1:] = tokens[:, :-1] == eos_id  # the token after an EOS starts a document
    first = torch.where(starts, pos, 0).cummax(dim=1).values
    if window is not None:
        first = torch.maximum(first, pos - (window - 1))
    return first


def dense_self_attn_mask(
    kind: str | None, tokens: torch.Tensor, eos_id: int = 2, window: int | None = None
) -> torch.Tensor:
    """The bool mask [B,1,S,S] (True = attend) of a self-attention mask kind."""
    check_kind(kind, window)
    seqlen = tokens.shape[1]
    pos = torch.arange(seqlen, device=tokens.device)
    allowed = pos[None, :] <= pos[:, None]  # [S(q), S(k)] causal
    if kind == "local_block_causal":
        allowed = allowed & (pos[None, :] > pos[:, None] - window)
    allowed = allowed[None, None]
    if kind in ("block_causal", "local_block_causal"):
        doc = document_ids(tokens, eos_id)
        allowed = allowed & (doc[:, None, :, None] == doc[:, None, None, :])
    return allowed


def document_lengths(tokens: torch.Tensor, eos_id: int) -> list[int]:
    """Lengths of the documents of the flattened batch (row ends also end a document).

    xformers' block-diagonal biases take these as host integers: this costs one device-to-host
    copy of the [B*S] end flags (none for CPU tokens). The training forward avoids it by handing
    the model the batch's host tokens (see HostDocuments).
    """
    ends = tokens == eos_id
    ends[:, -1] = True
    flat_ends = ends.reshape(-1).cpu().nonzero().flatten()
    return torch.diff(flat_ends, prepend=flat_ends.new_full((1,), -1)).tolist()


class HostBatch(Protocol):
    """The host (numpy) arrays of a batch, as the data pipeline produced them before the copy to
    the device (``bytelatent.data.batch.Batch`` is one). Models read them for masks that need host
    integers (see HostDocuments)."""

    x: np.ndarray  # tokens [B, S]
    patch_lengths: np.ndarray | None  # [B, P] (BLT patch mode)


class HostDocuments:
    """Where the documents of each row of a batch end, known on the host.

    ``ends`` is a numpy bool [B, S] (True where a document ends; the end of a row always ends one),
    e.g. ``tokens == eos_id`` of the numpy tokens the data pipeline produced before they went to the
    device. xformers' block-diagonal biases need document lengths as host integers; reading them
    here instead of from the device tokens costs no device-to-host copy. Only the shape can be
    checked against the device tokens (the contents would need a copy): the caller promises they
    are the same rows. A plain object, not a tensor, so that no wrapper moves it to the device.
    """

    def __init__(self, ends: np.ndarray) -> None:
        ends = np.array(ends, dtype=bool)  # a copy: the caller's array is left alone
        if ends.ndim != 2 or ends.shape[1] == 0:
            raise ValueError(f"document ends must be [batch, positions], got shape {ends.shape}")
        ends[:, -1] = True
        self.ends = ends
        self._single: bool | None = None

    @property
    def single_document(self) -> bool:
        """Every row is one document (no end before the last position): a Python bool, computed
        once; a compiled forward handed documents built before the trace branches on it with a
        guard instead of a graph break."""
        if self._single is None:
            self._single = not bool(self.ends[:, :-1].any())
        return self._single

    @classmethod
    def from_tokens(cls, tokens: np.ndarray, eos_id: int) -> HostDocuments:
        """Documents of host tokens [B, S]: each ends at and including an EOS."""
        return cls(np.asarray(tokens) == eos_id)

    def lengths(self) -> list[int]:
        """Lengths of the documents of the flattened batch (xformers' ``seqlens``)."""
        flat_ends = np.flatnonzero(self.ends.reshape(-1))
        return np.diff(flat_ends, prepend=-1).tolist()

    def check_shape(self, tokens: torch.Tensor) -> None:
        if self.ends.shape != tuple(tokens.shape):
            raise ValueError(
                f"host documents are for rows of shape {self.ends.shape}, the tokens have "
                f"{tuple(tokens.shape)}: pass the host copy of these tokens"
            )
