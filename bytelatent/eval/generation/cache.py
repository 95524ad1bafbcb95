"""KV caches that run an existing stack of ``TransformerBlock`` weights a few positions at a time.

Nothing here owns weights: ``CachedStack`` calls the blocks' own submodules (norms, ``wq``/``wk``/
``wv``/``wo``, ``feed_forward``) and ``apply_rotary_emb``, so the function is the one the model
computes on a whole sequence (same masks: causal, document-causal by EOS, sliding window).

Rows of a batch sit at different positions: each row has its own length; a step writes the new
keys/values at that row's length and only rows marked ``advance`` keep them (a finished row is
recomputed but never grows). The RoPE position of a cached entry is its index in the cache.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from bytelatent.model.layers import TransformerBlock, apply_rotary_emb

LayerHook = Callable[[int, torch.Tensor], torch.Tensor] | None


class CachedStack:
    """Per-row KV cache for ``layers`` (an iterable of TransformerBlock) of capacity positions.

    ``rope`` is the stack's RoPE table [max_seqlen, D/2, 2, 2] or None (no rotation, the local
    models with ``use_rope=False``). ``kind`` is the self-attention mask kind (None/"causal",
    "block_causal", "local_block_causal" with ``window``).
    """

    def __init__(
        self,
        layers: list[TransformerBlock] | nn.ModuleList,
        rope: torch.Tensor | None,
        batch: int,
        capacity: int,
        kind: str | None,
        window: int | None,
        like: torch.Tensor,
    ) -> None:
        self.layers = list(layers)
        first = self.layers[0].attention
        self.head_dim, self.n_heads, self.n_kv_heads = (
            first.head_dim,
            first.n_heads,
            first.n_kv_heads,
        )
        self.rope = rope
        self.kind = kind
        self.window = window if kind == "local_block_causal" else None
        self.capacity = capacity
        shape = (batch, self.n_kv_heads, capacity + 1, self.head_dim)  # +1: scratch for frozen rows
        self.keys = [like.new_zeros(shape) for _ in self.layers]
        self.values = [like.new_zeros(shape) for _ in self.layers]
        device = like.device
        self.length = torch.zeros(batch, dtype=torch.long, device=device)
        self.doc = torch.zeros(batch, capacity + 1, dtype=torch.long, device=device)
        self.next_doc = torch.zeros(batch, dtype=torch.long, device=device)

    def reset_rows(self, rows: torch.Tensor) -> None:
        """Empty the cache of the rows in the bool mask ``rows`` (a new context)."""
        self.length = torch.where(rows, 0, self.length)
        self.next_doc = torch.where(rows, 0, self.next_doc)

    def _freqs(self, positions: torch.Tensor) -> torch.Tensor:
        if self.rope is None:
            eye = torch.eye(2, dtype=torch.float32, device=positions.device)
            return eye.expand(*positions.shape, self.head_dim // 2, 2, 2)
        if int(positions.max()) >= self.rope.shape[0]:
            raise ValueError(
                f"position {int(positions.max())} exceeds the RoPE table "
                f"(max_seqlen={self.rope.shape[0]})"
            )
        return self.rope[positions]

    @torch.no_grad()
    def prefill(
        self, row: int, x: torch.Tensor, is_eos: torch.Tensor, before_layer: LayerHook = None
    ) -> list[torch.Tensor]:
        """Append T positions x [1,T,dim] to row ``row``; returns every layer's output [1,T,dim].

        ``before_layer(i, h) -> h`` runs before layer i (the BLT decoder's cross-attention).
        """
        start = int(self.length[row])
        steps = x.shape[1]
        if start + steps > self.capacity:
            raise ValueError(f"cache of {self.capacity} positions is full")
        positions = torch.arange(start, start + steps, device=x.device)
        docs = self.next_doc[row] + torch.cumsum(is_eos[0].long(), 0) - is_eos[0].long()
        self.doc[row, start : start + steps] = docs
        self.next_doc[row] = docs[-1] + is_eos[0, -1].long()
        freqs = self._freqs(positions)  # [T, D/2, 2, 2]: one row, positions along the sequence
        mask = self._mask(positions[None], docs[None], start + steps, self.doc[row : row + 1])
        h, outputs = x, []
        for i, (layer, keys, values) in enumerate(zip(self.layers, self.keys, self.values)):
            if before_layer is not None:
                h = before_layer(i, h)
            h = self._block(
                layer,
                h,
                freqs,
                False,
                keys[row : row + 1],
                values[row : row + 1],
                positions[None],
                mask,
                start + steps,
            )
            outputs.append(h)
        self.length[row] = start + steps
        return outputs

    @torch.no_grad()
    def step(
        self,
        x: torch.Tensor,
        is_eos: torch.Tensor,
        advance: torch.Tensor,
        before_layer: LayerHook = None,
    ) -> list[torch.Tensor]:
        """One new position per row: x [B,1,dim], is_eos/advance [B] bool -> layer outputs."""
        positions = self.length.clone()
        if bool(((positions >= self.capacity) & advance).any()):
            raise ValueError(f"cache of {self.capacity} positions is full")
        docs = self.next_doc
        rows = torch.arange(x.shape[0], device=x.device)
        self.doc[rows, positions] = docs
        freqs = self._freqs(positions)  # [B, D/2, 2, 2]: one position per row
        key_len = int(positions.max()) + 1
        mask = self._mask(positions[:, None], docs[:, None], key_len, self.doc)
        h, outputs = x, []
        for i, (layer, keys, values) in enumerate(zip(self.layers, self.keys, self.values)):
            if before_layer is not None:
                h = before_layer(i, h)
            h = self._block(layer, h, freqs, True, keys, values, positions[:, None], mask, key_len)
            outputs.append(h)
        self.next_doc = torch.where(advance, docs + is_eos.long(), docs)
        self.length = torch.where(advance, positions + 1, positions)
        return outputs

    def _mask(
        self, q_pos: torch.Tensor, q_doc: torch.Tensor, key_len: int, doc: torch.Tensor
    ) -> torch.Tensor:
        """Bool [B,1,T,key_len]: causal, same document (EOS-closed), inside the window."""
        k_pos = torch.arange(key_len, device=q_pos.device)
        allowed = k_pos[None, None, :] <= q_pos[:, :, None]
        if self.window is not None:
            allowed = allowed & (k_pos[None, None, :] > q_pos[:, :, None] - self.window)
        if self.kind in ("block_causal", "local_block_causal"):
            allowed = allowed & (doc[:, None, :key_len] == q_doc[:, :, None])
        return allowed[:, None]

    def _block(
        self,
        layer: TransformerBlock,
        x: torch.Tensor,
        freqs: torch.Tensor,
        per_row: bool,
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
        key_len: int,
    ) -> torch.Tensor:
        attn = layer.attention
        bsz, steps, _ = x.shape
        normed = layer.attention_norm(x)
        xq = attn.wq(normed).view(bsz, steps, attn.n_heads, attn.head_dim)
        xk = attn.wk(normed).view(bsz, steps, attn.n_kv_heads, attn.head_dim)
        xv = attn.wv(normed).view(bsz, steps, attn.n_kv_heads, attn.head_dim)
        if per_row:  # one position per row: lay rows along the sequence axis of the rotation
            xq, xk = apply_rotary_emb(xq.transpose(0, 1), xk.transpose(0, 1), freqs)
            xq, xk = xq.transpose(0, 1), xk.transpose(0, 1)
            rows = torch.arange(bsz, device=x.device)
            keys[rows, :, positions[:, 0]] = xk[:, 0]
            values[rows, :, positions[:, 0]] = xv[:, 0]
        else:
            xq, xk = apply_rotary_emb(xq, xk, freqs)
            start = int(positions[0, 0])
            keys[:, :, start : start + steps] = xk.transpose(1, 2)
            values[:, :, start : start + steps] = xv.transpose(1, 2)
        out = F.scaled_dot_product_attention(
            xq.transpose(1, 2),
            keys[:, :, :key_len],
            values[:, :, :key_len],
            attn_mask=mask,
            enable_gqa=attn.n_heads != attn.n_kv_heads,
        )
        h = x + attn.wo(out.transpose(1, 2).reshape(bsz, steps, attn.n_heads * attn.head_dim))
        return h + layer.feed_forward(layer.ffn_norm(h))
