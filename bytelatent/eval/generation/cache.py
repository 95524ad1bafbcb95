"""KV caches with which an existing stack of ``TransformerBlock``s runs a few positions at a time.

Nothing here owns weights or computes a layer: the blocks run their own training ``forward`` with a
``layers.KVCache`` argument (keys/values plus the step's positions and mask), so the function is
the one the model computes on a whole sequence (same masks: causal, document-causal by EOS,
sliding window). ``CachedStack`` keeps the caches and decides each step's positions and mask.

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
from torch import nn

from bytelatent.model.layers import CacheStep, KVCache, TransformerBlock

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
        self.device = like.device
        # bookkeeping on the host (one-byte steps are bound by per-op overhead, not FLOPs)
        self.length = [0] * batch
        self.next_doc = [0] * batch
        self.doc_start = [0] * batch  # first position of each row's current document
        self.doc = torch.zeros(batch, capacity + 1, dtype=torch.long, device=self.device)
        self.rows = torch.arange(batch, device=self.device)
        # the blocks' RoPE table (angle 0 without RoPE, as the local models' training forward)
        if rope is None:
            eye = torch.eye(2, dtype=torch.float32, device=self.device)
            rope = eye.expand(capacity + 1, self.head_dim // 2, 2, 2)
        self.freq_cis = rope
        # its rows as cos + i·sin, indexed once per step for every layer
        self.rotation_table = torch.complex(rope[..., 0, 0].float(), rope[..., 1, 0].float())
        self.caches = [KVCache(k, v) for k, v in zip(self.keys, self.values)]

    def reset_rows(self, rows: list[int]) -> None:
        """Empty the cache of ``rows`` (a new context)."""
        for row in rows:
            self.length[row] = 0
            self.next_doc[row] = 0
            self.doc_start[row] = 0

    def _check_rope(self, last: int) -> None:
        if last >= self.freq_cis.shape[0]:
            raise ValueError(
                f"position {last} exceeds the RoPE table (max_seqlen={self.freq_cis.shape[0]})"
            )

    def prefill_caches(self, row: int, is_eos: torch.Tensor) -> list[KVCache]:
        """Plan appending T positions (is_eos [1,T] bool) to row ``row``: every layer's cache
        (a view of that row) for the forward that runs them."""
        start = self.length[row]
        steps = is_eos.shape[1]
        if start + steps > self.capacity:
            raise ValueError(f"cache of {self.capacity} positions is full")
        self._check_rope(start + steps - 1)
        positions = torch.arange(start, start + steps, device=self.device)
        eos = is_eos[0].long()
        docs = self.next_doc[row] + torch.cumsum(eos, 0) - eos
        self.doc[row, start : start + steps] = docs
        eos_at = torch.nonzero(is_eos[0]).flatten().tolist()  # once per prompt
        self.next_doc[row] += len(eos_at)
        if eos_at:
            self.doc_start[row] = start + eos_at[-1] + 1
        # plain causal attention ignores documents (as the training mask): no document test
        q_docs = docs[None] if self.kind in ("block_causal", "local_block_causal") else None
        mask = self._mask(positions[None], q_docs, 0, start + steps, self.doc[row : row + 1])
        rotation = self.rotation_table[positions][None, :, None, :]
        step = CacheStep(positions[None], rotation, start, 0, start + steps, mask)
        self.length[row] = start + steps
        return [
            KVCache(keys[row : row + 1], values[row : row + 1], step)
            for keys, values in zip(self.keys, self.values)
        ]

    def prefill_rows_caches(self, is_eos: torch.Tensor, lengths: list[int]) -> list[KVCache]:
        """Plan one forward that fills every (empty) row at once: ``is_eos`` [B,T] bool of
        right-padded rows, row b's tokens being its first ``lengths[b]`` positions.

        The mask is the training one per row (causal, same document, window); a padded position
        only feeds queries at padded positions (causality), so the real positions compute what a
        row prefilled alone computes. Padded slots hold junk that the row's next step overwrites:
        every later mask stops at the row's own length.
        """
        batch, steps = is_eos.shape
        if batch != len(self.length) or any(self.length):
            raise ValueError("a batched prefill fills every row of an empty cache")
        if steps > self.capacity:
            raise ValueError(f"cache of {self.capacity} positions is full")
        self._check_rope(steps - 1)
        positions = torch.arange(steps, device=self.device)
        real = positions[None] < to_device(lengths, self.device)[:, None]
        eos = (is_eos & real).long()
        docs = torch.cumsum(eos, 1) - eos  # [B,T]: a pad stays in its row's last document
        self.doc[:, :steps] = docs
        # host books as `prefill_caches` keeps them: EOS count and first position after the last
        self.next_doc = eos.sum(1).tolist()  # one copy per prompt batch
        self.doc_start = (torch.where(eos.bool(), positions[None], -1).amax(1) + 1).tolist()
        documents = self.kind in ("block_causal", "local_block_causal")
        mask = self._mask(positions[None], docs if documents else None, 0, steps, self.doc)
        rotation = self.rotation_table[positions][None, :, None, :]
        step = CacheStep(positions[None].expand(batch, steps), rotation, 0, 0, steps, mask)
        for cache in self.caches:
            cache.step = step
        self.length = list(lengths)
        return self.caches

    def step_caches(self, is_eos: list[bool], advance: list[bool]) -> list[KVCache]:
        """Plan one new position per row (is_eos/advance host lists of B bools): every layer's
        cache for the forward that runs it (rows with ``advance`` False do not keep it)."""
        if any(n >= self.capacity and on for n, on in zip(self.length, advance)):
            raise ValueError(f"cache of {self.capacity} positions is full")
        positions = to_device(self.length, self.device)
        docs = None
        if self.kind in ("block_causal", "local_block_causal"):
            docs = to_device(self.next_doc, self.device)
            self.doc[self.rows, positions] = docs
        first, last = min(self.length), max(self.length)
        self._check_rope(last)
        key_len = last + 1
        # keys before every row's window cannot be attended: leave them out (O(window) per step)
        key_start = 0 if self.window is None else max(0, first - self.window + 1)
        mask = None  # every key in the slice is allowed for every row: sdpa's unmasked kernel
        if not self._all_keys_allowed(key_start, key_len):
            q_docs = None if docs is None else docs[:, None]
            mask = self._mask(positions[:, None], q_docs, key_start, key_len, self.doc)
        rotation = self.rotation_table[positions][:, None, None, :]
        step = CacheStep(positions[:, None], rotation, None, key_start, key_len, mask)
        for cache in self.caches:
            cache.step = step
        for b, on in enumerate(advance):
            if on:
                self.length[b] += 1
                if docs is not None and is_eos[b]:
                    self.next_doc[b] += 1
                    self.doc_start[b] = self.length[b]
        return self.caches

    @torch.no_grad()
    def prefill(
        self, row: int, x: torch.Tensor, is_eos: torch.Tensor, before_layer: LayerHook = None
    ) -> list[torch.Tensor]:
        """Append T positions x [1,T,dim] to row ``row``; returns every layer's output [1,T,dim].

        ``before_layer(i, h) -> h`` runs before layer i (the BLT decoder's cross-attention).
        """
        return self._run(x, self.prefill_caches(row, is_eos), before_layer)

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
        return self._run(x, self.step_caches(is_eos, advance), before_layer)

    def _run(
        self, x: torch.Tensor, caches: list[KVCache], before_layer: LayerHook
    ) -> list[torch.Tensor]:
        h, outputs = x, []
        for i, (layer, cache) in enumerate(zip(self.layers, caches)):
            if before_layer is not None:
                h = before_layer(i, h)
            h = layer(h, self.freq_cis, None, cache)
            outputs.append(h)
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
