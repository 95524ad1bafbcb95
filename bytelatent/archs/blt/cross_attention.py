"""Patch <-> byte cross-attention of the BLT local encoder and decoder (reference layout).

``CrossAttention.forward(x, kv, mask)`` returns ``x + attn(x, kv)`` and its callers add the result
to ``x`` again, so one cross-attention step maps ``x`` to ``2 * x + attn(x, kv)``. That double
residual is what the released weights were trained with (and what Hugging Face's port keeps), so it
is reproduced exactly. There is no RoPE: patches and bytes have no shared position axis.

Two ways to compute the same function (see ``patch_utils.PatchCrossMask``):

- structured (no window): every byte belongs to exactly one patch, so the encoder's softmax over
  "the bytes of my patch" is a segment softmax and the decoder's softmax over "the k slots of my
  patch" is a softmax over k gathered keys. Both cost O(N * k * dim) instead of the dense
  O(P * k * N * dim) and never materialise a [P*k, N] score matrix;
- masked: through ``attention.attend`` (any window): a dense bool mask on sdpa, a BlockMask from
  per-query key bounds on flex (CUDA), never a [P*k, N] tensor there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from bytelatent.archs.blt.patch_utils import PatchCrossMask
from bytelatent.model.attention import attend
from bytelatent.model.cpu_bf16 import Linear
from bytelatent.model.layers import RMSNorm


def _trunc_normal_(weight: torch.Tensor, std: float) -> None:
    nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-3 * std, b=3 * std)


@dataclass
class PatchStep:
    """Which patches one incremental decoder forward adds and reads (shared by its caches).

    ``write_at`` [B] long: the index at which each row's new patches (if any) are stored; rows
    that add none point at a scratch slot past the last real one. ``patch_ids`` [B,S] long: the
    patch each new byte reads (its last complete patch); with ``window`` w it also reads the
    w-1 patches before (indices < 0 are left out). ``slots`` [B,P_new] long (optional): each new
    patch's own index instead (rows adding different numbers of patches; padding at a scratch
    slot).
    """

    write_at: torch.Tensor
    patch_ids: torch.Tensor
    window: int = 1
    slots: torch.Tensor | None = None
    _read_index: tuple[torch.Tensor, ...] | None = field(default=None, repr=False)

    def store(self, buffer: torch.Tensor, new: torch.Tensor) -> None:
        """Write ``new`` [B,P_new,...] to ``buffer`` [B,patches,...] at ``write_at``.."""
        count = new.shape[1]
        if count == 0:
            return
        rows = torch.arange(new.shape[0], device=new.device)[:, None]
        slots = self.slots
        if slots is None:
            slots = self.write_at[:, None] + torch.arange(count, device=new.device)
        buffer[rows, slots] = new

    def read(self, buffer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each byte's window of patches from ``buffer`` [B,patches,...]: ([B,S,w,...], valid
        [B,S,w] bool)."""
        if self._read_index is None:  # once per step, for every layer's keys and values
            offsets = torch.arange(1 - self.window, 1, device=buffer.device)
            ids = self.patch_ids[:, :, None] + offsets
            rows = torch.arange(buffer.shape[0], device=buffer.device)[:, None, None]
            self._read_index = (rows, ids.clamp(min=0), ids >= 0)
        rows, ids, valid = self._read_index
        return buffer[rows, ids], valid


@dataclass
class SlotCache:
    """The keys and values [B, patches, k, n_kv_heads, head_dim] of every patch slot a decoder
    cross-attention has seen, and the step its next forward runs (set by the caller)."""

    keys: torch.Tensor
    values: torch.Tensor
    step: PatchStep | None = None


class CrossAttention(nn.Module):
    """Pre-norm multi-head cross-attention ``x`` (queries) -> ``kv``; returns ``x + out``."""

    def __init__(
        self, dim: int, head_dim: int, n_heads: int, n_kv_heads: int, norm_eps: float
    ) -> None:
        super().__init__()
        if n_heads % n_kv_heads:
            raise ValueError(
                f"cross-attention n_heads={n_heads} must be a multiple of n_kv_heads={n_kv_heads}"
            )
        self.dim = dim
        self.head_dim = head_dim
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.cross_attn_norm_q = RMSNorm(dim, eps=norm_eps)
        self.cross_attn_norm_kv = RMSNorm(dim, eps=norm_eps)
        self.wq = Linear(dim, n_heads * head_dim, bias=False)
        self.wk = Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wv = Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wo = Linear(n_heads * head_dim, dim, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        kv: torch.Tensor,
        mask: PatchCrossMask | None,
        cache: SlotCache | None = None,
    ) -> torch.Tensor:
        """x [B,Q,dim], kv [B,K,dim] -> x + attention output [B,Q,dim].

        ``cache`` (decoder side, generation): ``kv`` holds only the new patches' slots
        [B, P_new*k, dim]; their keys/values are stored at ``cache.step.write_at`` and each byte of
        ``x`` attends the slots of its patch (or window of patches) in the cache; ``mask`` is
        unused."""
        if cache is not None:
            return self._cached(x, kv, cache)
        bsz, q_len, _ = x.shape
        kv_len = kv.shape[1]
        kv_normed = self.cross_attn_norm_kv(kv)
        xq = self.wq(self.cross_attn_norm_q(x)).view(bsz, q_len, self.n_heads, self.head_dim)
        xk = self.wk(kv_normed).view(bsz, kv_len, self.n_kv_heads, self.head_dim)
        xv = self.wv(kv_normed).view(bsz, kv_len, self.n_kv_heads, self.head_dim)
        if mask.structured:
            if self.n_kv_heads != self.n_heads:
                repeats = self.n_heads // self.n_kv_heads
                xk = xk.repeat_interleave(repeats, dim=2)
                xv = xv.repeat_interleave(repeats, dim=2)
            if mask.side == "encoder":
                out = _segment_attention(xq, xk, xv, mask.patch_ids, mask.num_patches, mask.k)
            else:
                out = _slot_attention(xq, xk, xv, mask.patch_ids, mask.k)
        else:
            out = attend(
                xq.transpose(1, 2),
                xk.transpose(1, 2),
                xv.transpose(1, 2),
                mask.attn,
            )
            out = out.transpose(1, 2)
        return x + self.wo(out.reshape(bsz, q_len, self.n_heads * self.head_dim))

    def _cached(self, x: torch.Tensor, kv: torch.Tensor, cache: SlotCache) -> torch.Tensor:
        bsz, q_len, _ = x.shape
        slots = cache.keys.shape[2]
        new = kv.shape[1] // slots
        if new:  # patches closed in this step: their slots' keys/values, once
            kv_normed = self.cross_attn_norm_kv(kv)
            shape = (bsz, new, slots, self.n_kv_heads, self.head_dim)
            cache.step.store(cache.keys, self.wk(kv_normed).view(shape))
            cache.step.store(cache.values, self.wv(kv_normed).view(shape))
        xq = self.wq(self.cross_attn_norm_q(x)).view(bsz, q_len, self.n_heads, self.head_dim)
        keys, valid = cache.step.read(cache.keys)  # [B,S,w,k,Hkv,D]
        values, _ = cache.step.read(cache.values)
        keys, values = keys.flatten(2, 3), values.flatten(2, 3)  # [B,S,w*k,Hkv,D]
        if self.n_kv_heads != self.n_heads:
            repeats = self.n_heads // self.n_kv_heads
            keys = keys.repeat_interleave(repeats, dim=3)
            values = values.repeat_interleave(repeats, dim=3)
        scores = (xq[:, :, None] * keys).sum(-1).float() * self.head_dim**-0.5  # [B,S,w*k,H]
        if cache.step.window > 1:  # a byte's own patch (window 1) is always there
            allowed = valid.repeat_interleave(slots, dim=2)[..., None]
            scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=2).to(values.dtype)
        out = (probs[..., None] * values).sum(2)  # [B,S,H,D]
        return x + self.wo(out.reshape(bsz, q_len, self.n_heads * self.head_dim))

    @torch.no_grad()
    def init_weights(self, init_std: float | None = None, factor: float = 1.0) -> None:
        """wq/wk/wv/wo: trunc_normal σ = init_std or dim^-0.5 / factor; norms: 1."""
        std = init_std or (self.dim**-0.5) / factor
        for linear in (self.wq, self.wk, self.wv, self.wo):
            _trunc_normal_(linear.weight, std)
        self.cross_attn_norm_q.reset_parameters()
        self.cross_attn_norm_kv.reset_parameters()


def _segment_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    patch_ids: torch.Tensor,
    num_patches: int,
    slots: int,
) -> torch.Tensor:
    """Patch slots attend the bytes of their own patch.

    q [B, P*slots, H, D]; k, v [B, N, H, D]; patch_ids [B, N] -> [B, P*slots, H, D].
    A slot whose patch has no byte (right padding) gets zeros.
    """
    bsz, n_bytes, n_heads, head_dim = k.shape
    q = q.view(bsz, num_patches, slots, n_heads, head_dim)
    # flat (batch, patch) index of every byte, for index_add over B*P segments
    flat_ids = (
        patch_ids + torch.arange(bsz, device=patch_ids.device).unsqueeze(1) * num_patches
    ).reshape(-1)
    q_of_byte = q.reshape(bsz * num_patches, slots, n_heads, head_dim).index_select(0, flat_ids)
    k_flat = k.reshape(bsz * n_bytes, 1, n_heads, head_dim)
    scores = (q_of_byte * k_flat).sum(-1).float() * head_dim**-0.5  # [B*N, slots, H]
    with torch.no_grad():
        seg_max = scores.new_full((bsz * num_patches, slots, n_heads), float("-inf"))
        index = flat_ids.view(-1, 1, 1).expand_as(scores)
        seg_max = seg_max.scatter_reduce(0, index, scores, "amax", include_self=True)
    weights = torch.exp(scores - seg_max.index_select(0, flat_ids))
    denom = scores.new_zeros((bsz * num_patches, slots, n_heads)).index_add(0, flat_ids, weights)
    # empty segments have denom 0 and no contributions: divide by 1 to keep exact zeros
    denom = torch.where(denom > 0, denom, torch.ones_like(denom))
    probs = (weights / denom.index_select(0, flat_ids)).to(v.dtype)
    v_flat = v.reshape(bsz * n_bytes, 1, n_heads, head_dim)
    out = v.new_zeros((bsz * num_patches, slots, n_heads, head_dim)).index_add(
        0, flat_ids, probs.unsqueeze(-1) * v_flat
    )
    return out.view(bsz, num_patches * slots, n_heads, head_dim)


def _slot_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decoder_patch_ids: torch.Tensor,
    slots: int,
) -> torch.Tensor:
    """Bytes attend the ``slots`` key slots of their decoder patch.

    q [B, N, H, D]; k, v [B, P*slots, H, D]; decoder_patch_ids [B, N] -> [B, N, H, D].
    """
    bsz, n_bytes, n_heads, head_dim = q.shape
    num_patches = k.shape[1] // slots
    flat_ids = (
        decoder_patch_ids + torch.arange(bsz, device=q.device).unsqueeze(1) * num_patches
    ).reshape(-1)
    k_of_byte = k.reshape(bsz * num_patches, slots, n_heads, head_dim).index_select(0, flat_ids)
    v_of_byte = v.reshape(bsz * num_patches, slots, n_heads, head_dim).index_select(0, flat_ids)
    q_flat = q.reshape(bsz * n_bytes, 1, n_heads, head_dim)
    scores = (q_flat * k_of_byte).sum(-1).float() * head_dim**-0.5  # [B*N, slots, H]
    probs = torch.softmax(scores, dim=1).to(v.dtype)
    out = (probs.unsqueeze(-1) * v_of_byte).sum(1)
    return out.view(bsz, n_bytes, n_heads, head_dim)
