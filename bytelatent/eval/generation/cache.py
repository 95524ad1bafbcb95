"""KV caches with which an existing stack of ``TransformerBlock``s runs a few positions at a time.

Nothing here owns weights, reads them, or computes a layer: the model's modules run their own
training ``forward`` with a list of ``layers.KVCache`` (keys/values plus the step's positions and
mask; the modules pick their RoPE rows and learned positions from the step's positions), so the
function is the one the model computes on a whole sequence (same masks: causal, document-causal
by EOS, sliding window). ``CachedStack`` keeps the caches and decides each step's positions and
mask; a cache may also keep its block's output states (``KVCache.outputs``).

Rows of a batch sit at different positions: each row has its own length; a step writes the new
keys/values at that row's length and only rows marked ``advance`` keep them (a finished row is
recomputed but never grows). The RoPE position of a cached entry is its index in the cache.

Host and device: the bookkeeping (lengths, documents, which keys a step may skip) lives on the
host and is driven by host values the caller already has (the tokens it sampled: ``is_eos`` is
a host tensor or list), so planning a step or an append never waits for the device; per-row
positions and documents reach the device by non-blocking copies from pinned memory
(``to_device``). Nothing here reads the device.
"""

from __future__ import annotations

import torch
from torch import nn

from bytelatent.distributed.env import host_tensor_to_device
from bytelatent.model.layers import CacheStep, KVCache


def to_device(values: list | torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host list (or host tensor) as a tensor on ``device`` without waiting for the device:
    pinned staging and a non-blocking copy on CUDA (from pageable memory, ``non_blocking`` would
    wait). A host tensor already on ``device`` (the CPU) comes back as is."""
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values)
    return host_tensor_to_device(host, device)


class CachedStack:
    """Per-row KV caches for the blocks ``layers`` (TransformerBlocks) of capacity positions.

    ``kind`` is the self-attention mask kind (None/"causal", "block_causal",
    "local_block_causal" with ``window``); ``max_positions``: the module's position table length
    (RoPE or learned positions). ``keep_outputs``: layers whose output states are kept too.
    """

    def __init__(
        self,
        layers: nn.ModuleList,
        batch: int,
        capacity: int,
        kind: str | None,
        window: int | None,
        like: torch.Tensor,
        max_positions: int,
        keep_outputs: tuple[int, ...] = (),
    ) -> None:
        first = layers[0].attention
        self.kind = kind
        self.window = window if kind == "local_block_causal" else None
        self.capacity = capacity
        self.max_positions = max_positions
        shape = (batch, first.n_kv_heads, capacity + 1, first.head_dim)  # +1: scratch slot
        self.keys = [like.new_zeros(shape) for _ in layers]
        self.values = [like.new_zeros(shape) for _ in layers]
        self.outputs = {i: like.new_zeros(batch, capacity + 1, first.dim) for i in keep_outputs}
        self.device = like.device
        # bookkeeping on the host (one-byte steps are bound by per-op overhead, not FLOPs)
        self.length = [0] * batch
        self.eos_at: list[list[int]] = [[] for _ in range(batch)]  # EOS positions per row
        self.doc = torch.zeros(batch, capacity + 1, dtype=torch.long, device=self.device)
        self.rows = torch.arange(batch, device=self.device)
        self.caches = [
            KVCache(k, v, outputs=self.outputs.get(i))
            for i, (k, v) in enumerate(zip(self.keys, self.values))
        ]

    @property
    def _documents(self) -> bool:
        # plain causal attention ignores documents (as the training mask)
        return self.kind in ("block_causal", "local_block_causal")

    def _doc_start(self, row: int) -> int:
        """First position of the row's current document."""
        eos = self.eos_at[row]
        return eos[-1] + 1 if eos else 0

    def reset_rows(self, rows: list[int]) -> None:
        """Empty the cache of ``rows`` (a new context)."""
        for row in rows:
            self.truncate(row, 0)

    def begin_document(self, row: int) -> None:
        """The next position of ``row`` starts a new document: for a caller that learns where a
        document ends only when the next one starts (H-Net's chunk levels). The same books as an
        ``is_eos`` at the row's last position; a no-op at a row's start or after an EOS."""
        if self.length[row] > self._doc_start(row):
            self.eos_at[row].append(self.length[row] - 1)

    def truncate(self, row: int, n_positions: int) -> None:
        """Keep only the first ``n_positions`` positions of ``row`` (the rest is overwritten)."""
        if not 0 <= n_positions <= self.length[row]:
            raise ValueError(f"cannot truncate a row of {self.length[row]} to {n_positions}")
        self.length[row] = n_positions
        self.eos_at[row] = [p for p in self.eos_at[row] if p < n_positions]

    def _check_positions(self, last: int) -> None:
        if last >= self.max_positions:
            raise ValueError(
                f"position {last} exceeds the position table (max_seqlen={self.max_positions})"
            )

    def prefill_caches(self, row: int, is_eos: torch.Tensor) -> list[KVCache]:
        """Plan appending T positions (is_eos [1,T] bool, on the host) to row ``row``: every
        layer's cache (a view of that row) for the forward that runs them."""
        is_eos = is_eos.cpu()  # the caller's host flags (a device tensor would cost a read)
        start = self.length[row]
        steps = is_eos.shape[1]
        if start + steps > self.capacity:
            raise ValueError(f"cache of {self.capacity} positions is full")
        self._check_positions(start + steps - 1)
        positions = torch.arange(start, start + steps, device=self.device)
        eos = is_eos[0].long()
        docs = to_device(len(self.eos_at[row]) + torch.cumsum(eos, 0) - eos, self.device)
        self.doc[row, start : start + steps] = docs
        self.eos_at[row] += [start + p for p in torch.nonzero(is_eos[0]).flatten().tolist()]
        q_docs = docs[None] if self._documents else None
        mask = self._mask(positions[None], q_docs, 0, start + steps, self.doc[row : row + 1])
        step = CacheStep(positions[None], start, 0, start + steps, mask)
        self.length[row] = start + steps
        return [
            KVCache(
                keys[row : row + 1],
                values[row : row + 1],
                step,
                None if cache.outputs is None else cache.outputs[row : row + 1],
            )
            for keys, values, cache in zip(self.keys, self.values, self.caches)
        ]

    def prefill_rows_caches(self, is_eos: torch.Tensor, lengths: list[int]) -> list[KVCache]:
        """Plan one forward that fills every (empty) row at once: ``is_eos`` [B,T] bool (host) of
        right-padded rows, row b's tokens being its first ``lengths[b]`` positions.

        The mask is the training one per row (causal, same document, window); a padded position
        only feeds queries at padded positions (causality), so the real positions compute what a
        row prefilled alone computes. Padded slots hold junk that the row's next step overwrites:
        every later mask stops at the row's own length.
        """
        is_eos = is_eos.cpu()  # the caller's host flags (a device tensor would cost a read)
        batch, steps = is_eos.shape
        if batch != len(self.length) or any(self.length):
            raise ValueError("a batched prefill fills every row of an empty cache")
        if steps > self.capacity:
            raise ValueError(f"cache of {self.capacity} positions is full")
        self._check_positions(steps - 1)
        positions = torch.arange(steps, device=self.device)
        real = torch.arange(steps)[None] < torch.tensor(lengths)[:, None]
        eos = is_eos & real
        # [B,T]: a pad stays in its last document
        docs = to_device(torch.cumsum(eos.long(), 1) - eos.long(), self.device)
        self.doc[:, :steps] = docs
        self.eos_at = [[] for _ in lengths]  # host books as `prefill_caches` keeps them
        for row, position in torch.nonzero(eos).tolist():
            self.eos_at[row].append(position)
        mask = self._mask(positions[None], docs if self._documents else None, 0, steps, self.doc)
        step = CacheStep(positions[None].expand(batch, steps), 0, 0, steps, mask)
        for cache in self.caches:
            cache.step = step
        self.length = list(lengths)
        return self.caches

    def extend_rows_caches(self, lo: int, counts: list[int], is_eos: torch.Tensor) -> list[KVCache]:
        """Plan one forward that appends ``counts[i]`` positions to row ``lo + i`` of the rows
        lo..lo+R-1, each at its own length: ``is_eos`` [R,T] bool (host), right-padded (T = max
        count; a row may append none). Returns every layer's cache (a view of those rows).

        Each real position gets the mask ``prefill_caches`` would give it (causal, same document,
        window): it computes what the row appended alone computes. Padding writes its keys (and
        kept outputs) to the scratch slot past the capacity, uses position 0 for RoPE / learned
        positions, and attends every key in the slice (finite junk that nobody reads).
        """
        is_eos = is_eos.cpu()  # the caller's host flags (a device tensor would cost a read)
        rows, steps = len(counts), is_eos.shape[1]
        starts = self.length[lo : lo + rows]
        ends = [s + c for s, c in zip(starts, counts)]
        if any(e > self.capacity for e in ends):
            raise ValueError(f"cache of {self.capacity} positions is full")
        key_len = max(ends)
        if key_len:
            self._check_positions(key_len - 1)
        # the plan on the host (it knows every count and length), then one copy to the device
        offsets = torch.arange(steps)[None]
        real = offsets < torch.tensor(counts)[:, None]
        at = torch.tensor(starts)[:, None] + offsets  # [R,T] each new position
        slots = torch.where(real, at, self.capacity)
        eos = (is_eos & real).long()
        held = torch.tensor([len(self.eos_at[lo + i]) for i in range(rows)])
        docs = held[:, None] + torch.cumsum(eos, 1) - eos
        for i, position in torch.nonzero(eos).tolist():
            self.eos_at[lo + i].append(starts[i] + position)
        plan = torch.stack((at, slots, docs, torch.where(real, at, 0), real.long()))
        at, slots, docs, positions, real = to_device(plan, self.device).unbind(0)
        real = real.bool()
        doc = self.doc[lo : lo + rows]
        doc[torch.arange(rows, device=self.device)[:, None], slots] = docs
        key_start = 0
        if self.window is not None:
            first = min((s for s, c in zip(starts, counts) if c), default=0)
            key_start = max(0, first - self.window + 1)
        q_docs = docs if self._documents else None
        mask = self._mask(at, q_docs, key_start, key_len, doc)
        mask = mask | ~real[:, None, :, None]  # padding attends every key (no empty row)
        step = CacheStep(positions, None, key_start, key_len, mask, slots=slots)
        self.length[lo : lo + rows] = ends
        return [
            KVCache(
                keys[lo : lo + rows],
                values[lo : lo + rows],
                step,
                None if cache.outputs is None else cache.outputs[lo : lo + rows],
            )
            for keys, values, cache in zip(self.keys, self.values, self.caches)
        ]

    def step_caches(self, is_eos: list[bool], advance: list[bool]) -> list[KVCache]:
        """Plan one new position per row (is_eos/advance host lists of B bools): every layer's
        cache for the forward that runs it (rows with ``advance`` False do not keep it)."""
        if any(n >= self.capacity and on for n, on in zip(self.length, advance)):
            raise ValueError(f"cache of {self.capacity} positions is full")
        docs = None
        if self._documents:
            planned = to_device([self.length, [len(e) for e in self.eos_at]], self.device)
            positions, docs = planned.unbind(0)
            self.doc[self.rows, positions] = docs
        else:
            positions = to_device(self.length, self.device)
        first, last = min(self.length), max(self.length)
        self._check_positions(last)
        key_len = last + 1
        # keys before every row's window cannot be attended: leave them out (O(window) per step)
        key_start = 0 if self.window is None else max(0, first - self.window + 1)
        mask = None  # every key in the slice is allowed for every row: sdpa's unmasked kernel
        if not self._all_keys_allowed(key_start, key_len):
            q_docs = None if docs is None else docs[:, None]
            mask = self._mask(positions[:, None], q_docs, key_start, key_len, self.doc)
        step = CacheStep(positions[:, None], None, key_start, key_len, mask)
        for cache in self.caches:
            cache.step = step
        for b, on in enumerate(advance):
            if on:
                if is_eos[b]:
                    self.eos_at[b].append(self.length[b])
                self.length[b] += 1
        return self.caches

    def _all_keys_allowed(self, key_start: int, key_len: int) -> bool:
        """Whether every row's new position may attend every key in key_start..key_len-1 (decided
        from the host bookkeeping: the row is at the last position, its window and its current
        document cover the slice)."""
        for row, length in enumerate(self.length):
            if length != key_len - 1:
                return False
            if self.window is not None and key_start <= length - self.window:
                return False
            if self._documents and self._doc_start(row) > key_start:
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
