"""KV caches that run an existing stack of ``TransformerBlock`` weights a few positions at a time.

Nothing here owns weights: ``CachedStack`` calls the blocks' own submodules (norms, ``wq``/``wk``/
``wv``/``wo``, ``feed_forward``) and ``apply_rotary_emb``, so the function is the one the model
computes on a whole sequence (same masks: causal, document-causal by EOS, sliding window).

Rows of a batch sit at different positions: each row has its own length; a step writes the new
keys/values at that row's length and only rows marked ``advance`` keep them (a finished row is
recomputed but never grows). The RoPE position of a cached entry is its index in the cache.

Host and device: the bookkeeping (lengths, documents, which keys a step may skip) lives on the
host and is driven by host values the caller already has (the tokens it sampled), so a step
never waits for the device; per-row positions reach the device by non-blocking copies.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from bytelatent.model.layers import TransformerBlock

LayerHook = Callable[[int, torch.Tensor], torch.Tensor] | None


def to_device(values: list, device: torch.device) -> torch.Tensor:
    """A host list as a tensor on ``device`` without waiting for the device (non-blocking copy)."""
    return torch.tensor(values).to(device, non_blocking=True)


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
        fuse: bool = False,
    ) -> None:
        self.layers = list(layers)
        # ``fuse``: one matmul for wq/wk/wv and one for w1/w3 per step (a copy of those weights:
        # worth it for the small stacks that run once per byte, not for the global model)
        self.fused = [_fused_weights(layer) for layer in self.layers] if fuse else None
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
        self.device = like.device
        # bookkeeping on the host (one-byte steps are bound by per-op overhead, not FLOPs)
        self.length = [0] * batch
        self.next_doc = [0] * batch
        self.doc_start = [0] * batch  # first position of each row's current document
        self.doc = torch.zeros(batch, capacity + 1, dtype=torch.long, device=self.device)
        self.rows = torch.arange(batch, device=self.device)
        # RoPE rows as complex cos + i sin (angle 0 without RoPE: multiplying by 1 changes nothing)
        if rope is None:
            self.rotation_table = torch.ones(
                capacity + 1, self.head_dim // 2, dtype=torch.complex64, device=self.device
            )
        else:
            self.rotation_table = torch.complex(rope[..., 0, 0].float(), rope[..., 1, 0].float())

    def reset_rows(self, rows: list[int]) -> None:
        """Empty the cache of ``rows`` (a new context)."""
        for row in rows:
            self.length[row] = 0
            self.next_doc[row] = 0
            self.doc_start[row] = 0

    def _rotation(self, first: int, last: int, positions: torch.Tensor) -> torch.Tensor:
        if last >= self.rotation_table.shape[0]:
            raise ValueError(
                f"position {last} exceeds the RoPE table (max_seqlen={self.rotation_table.shape[0]})"
            )
        return self.rotation_table[positions]

    @torch.no_grad()
    def prefill(
        self, row: int, x: torch.Tensor, is_eos: torch.Tensor, before_layer: LayerHook = None
    ) -> list[torch.Tensor]:
        """Append T positions x [1,T,dim] to row ``row``; returns every layer's output [1,T,dim].

        ``before_layer(i, h) -> h`` runs before layer i (the BLT decoder's cross-attention).
        """
        start = self.length[row]
        steps = x.shape[1]
        if start + steps > self.capacity:
            raise ValueError(f"cache of {self.capacity} positions is full")
        positions = torch.arange(start, start + steps, device=x.device)
        eos = is_eos[0].long()
        docs = self.next_doc[row] + torch.cumsum(eos, 0) - eos
        self.doc[row, start : start + steps] = docs
        eos_at = torch.nonzero(is_eos[0]).flatten().tolist()  # once per prompt
        self.next_doc[row] += len(eos_at)
        if eos_at:
            self.doc_start[row] = start + eos_at[-1] + 1
        rotation = self._rotation(start, start + steps - 1, positions)[None, :, None, :]
        mask = self._mask(positions[None], docs[None], 0, start + steps, self.doc[row : row + 1])
        h, outputs = x, []
        for i, (layer, keys, values) in enumerate(zip(self.layers, self.keys, self.values)):
            if before_layer is not None:
                h = before_layer(i, h)
            h = self._block(
                layer,
                h,
                rotation,
                start,
                keys[row : row + 1],
                values[row : row + 1],
                positions[None],
                mask,
                (0, start + steps),
            )
            outputs.append(h)
        self.length[row] = start + steps
        return outputs

    @torch.no_grad()
    def step(
        self,
        x: torch.Tensor,
        is_eos: list[bool],
        advance: list[bool],
        before_layer: LayerHook = None,
    ) -> list[torch.Tensor]:
        """One new position per row: x [B,1,dim], is_eos/advance host lists of B bools -> layer
        outputs."""
        if any(n >= self.capacity and on for n, on in zip(self.length, advance)):
            raise ValueError(f"cache of {self.capacity} positions is full")
        positions = to_device(self.length, self.device)
        docs = None
        if self.kind in ("block_causal", "local_block_causal"):
            docs = to_device(self.next_doc, self.device)
            self.doc[self.rows, positions] = docs
        first, last = min(self.length), max(self.length)
        rotation = self._rotation(first, last, positions)[:, None, None, :]
        key_len = last + 1
        # keys before every row's window cannot be attended: leave them out (O(window) per step)
        key_start = 0 if self.window is None else max(0, first - self.window + 1)
        mask = None  # every key in the slice is allowed for every row: sdpa's unmasked kernel
        if not self._all_keys_allowed(key_start, key_len):
            q_docs = None if docs is None else docs[:, None]
            mask = self._mask(positions[:, None], q_docs, key_start, key_len, self.doc)
        h, outputs = x, []
        for i, (layer, keys, values) in enumerate(zip(self.layers, self.keys, self.values)):
            if before_layer is not None:
                h = before_layer(i, h)
            h = self._block(
                layer,
                h,
                rotation,
                None,
                keys,
                values,
                positions[:, None],
                mask,
                (key_start, key_len),
            )
            outputs.append(h)
        for b, on in enumerate(advance):
            if on:
                self.length[b] += 1
                if docs is not None and is_eos[b]:
                    self.next_doc[b] += 1
                    self.doc_start[b] = self.length[b]
        return outputs

    def _all_keys_allowed(self, key_start: int, key_len: int) -> bool:
        """Whether every row's new position may attend every key in key_start..key_len-1 (decided
        from the host bookkeeping: the row is at the last position, its window and its current
        document cover the slice)."""
        documents = self.kind in ("block_causal", "local_block_causal")
        for length, doc_start in zip(self.length, self.doc_start):
            if length != key_len - 1:
                return False
            if self.window is not None and key_start <= length - self.window:
                return False
            if documents and doc_start > key_start:
                return False
        return True

    def _mask(
        self,
        q_pos: torch.Tensor,
        q_doc: torch.Tensor | None,
        key_start: int,
        key_len: int,
        doc: torch.Tensor,
    ) -> torch.Tensor | None:
        """Bool [B,1,T,keys] over keys key_start..key_len-1: causal, same document (EOS-closed),
        inside the window."""
        k_pos = torch.arange(key_start, key_len, device=q_pos.device)
        allowed = k_pos[None, None, :] <= q_pos[:, :, None]
        if self.window is not None:
            allowed = allowed & (k_pos[None, None, :] > q_pos[:, :, None] - self.window)
        if q_doc is not None:
            allowed = allowed & (doc[:, None, key_start:key_len] == q_doc[:, :, None])
        return allowed[:, None]

    def _block(
        self,
        layer: TransformerBlock,
        x: torch.Tensor,
        rotation: torch.Tensor,
        start: int | None,
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor | None,
        key_range: tuple[int, int],
    ) -> torch.Tensor:
        """The block's forward on the new positions (same ops as TransformerBlock/Attention, called
        on their weights directly: per-call module overhead dominates one-byte steps). New keys
        and values go to ``start`` onwards (prefill) or, with ``start`` None, to each row's
        ``positions`` (step)."""
        attn, ffn = layer.attention, layer.feed_forward
        bsz, steps, _ = x.shape
        normed = _rms_norm(layer.attention_norm, x)
        heads, kv_heads, head_dim = attn.n_heads, attn.n_kv_heads, attn.head_dim
        fused = None if self.fused is None else self.fused[self.layers.index(layer)]
        if fused is not None:
            qkv = F.linear(normed, fused[0]).split(
                [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1
            )
            xq, xk, xv = (t.reshape(bsz, steps, -1, head_dim) for t in qkv)
        else:
            xq = F.linear(normed, attn.wq.weight).view(bsz, steps, heads, head_dim)
            xk = F.linear(normed, attn.wk.weight).view(bsz, steps, kv_heads, head_dim)
            xv = F.linear(normed, attn.wv.weight).view(bsz, steps, kv_heads, head_dim)
        xq, xk = _rotate(torch.cat([xq, xk], dim=2), rotation).split([heads, kv_heads], dim=2)
        if start is None:
            rows = torch.arange(bsz, device=x.device)
            keys[rows, :, positions[:, 0]] = xk[:, 0]
            values[rows, :, positions[:, 0]] = xv[:, 0]
        else:
            keys[:, :, start : start + steps] = xk.transpose(1, 2)
            values[:, :, start : start + steps] = xv.transpose(1, 2)
        key_start, key_len = key_range
        out = F.scaled_dot_product_attention(
            xq.transpose(1, 2),
            keys[:, :, key_start:key_len],
            values[:, :, key_start:key_len],
            attn_mask=mask,
            enable_gqa=heads != kv_heads,
        )
        out = out.transpose(1, 2).reshape(bsz, steps, heads * head_dim)
        h = x + F.linear(out, attn.wo.weight)
        normed = _rms_norm(layer.ffn_norm, h)
        if fused is not None:
            gate, up = F.linear(normed, fused[1]).chunk(2, dim=-1)
            hidden = F.silu(gate) * up
        else:
            hidden = F.silu(F.linear(normed, ffn.w1.weight)) * F.linear(normed, ffn.w3.weight)
        return h + F.linear(hidden, ffn.w2.weight)


def _fused_weights(layer: TransformerBlock) -> tuple[torch.Tensor, torch.Tensor]:
    attn, ffn = layer.attention, layer.feed_forward
    qkv = torch.cat([attn.wq.weight, attn.wk.weight, attn.wv.weight]).detach()
    return qkv, torch.cat([ffn.w1.weight, ffn.w3.weight]).detach()


def _rms_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if x.dtype != norm.weight.dtype:
        return norm(x)
    return F.rms_norm(x, norm.normalized_shape, norm.weight, norm.eps)


def _rotate(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """``layers.apply_rotary_emb``'s eager computation (interleaved pairs times cos + i sin)."""
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)).contiguous())
    return torch.view_as_real(pairs * rotation).flatten(-2).type_as(x)
