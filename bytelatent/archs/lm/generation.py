"""An ``LMTransformer`` (the entropy model, or a byte LM) run incrementally with a KV cache: the
model's own forward with one ``KVCache`` per layer (``cache.CachedStack`` plans each step).

Host syncs: none. ``step`` takes host lists and returns logits on the device (the caller's
sampling reads them: one read per byte, ``sampling.sample_rows``); ``prefill_rows``, ``extend``
and ``extend_rows`` take 1-D token tensors on the host (a device tensor costs one read each) and
copy them to the device from pinned memory; EOS flags and cache books come from the host tokens
(tests/generation/test_device_syncs.py)."""

from __future__ import annotations

import torch

from bytelatent.archs.lm.model import LMTransformer
from bytelatent.eval.generation.cache import CachedStack, to_device


class IncrementalLM:
    """Prefill rows (together: `prefill_rows`, or one at a time), then step every row by one
    token.

    ``restart_every`` (the entropy patcher's window, see ``data.entropy``) empties a row's cache
    at every multiple of that many tokens, exactly as ``calculate_entropies`` runs consecutive
    windows independently. Without it a row may hold up to the model's ``max_seqlen`` tokens.
    """

    def __init__(
        self, model: LMTransformer, batch: int, capacity: int, restart_every: int | None = None
    ) -> None:
        args = model.args
        self.model = model
        self.restart_every = restart_every
        if restart_every is not None:
            capacity = min(capacity, restart_every)
        if capacity > args.max_seqlen:
            raise ValueError(f"{capacity} tokens exceed the model's max_seqlen={args.max_seqlen}")
        self.stack = CachedStack(
            model.layers,
            batch,
            capacity,
            args.attn_bias_type,
            args.sliding_window,
            like=next(model.parameters()),
            max_positions=args.max_seqlen,
        )
        self.eos_id = args.eos_id
        self.tokens: list[list[int]] = [[] for _ in range(batch)]  # every row's tokens (host)

    @classmethod
    def for_engine(cls, model, patcher_args, entropy_model, batch: int, capacity: int):
        """The byte LM spec's generation engine (`ArchSpec.generation_engine`, `CachedEngine`)."""
        return cls(model, batch, capacity)

    def prefill_last(self, row: int, tokens: torch.Tensor) -> torch.Tensor:
        """`prefill`, returning the next token's logits [V] only."""
        return self.prefill(row, tokens)[-1]

    @torch.no_grad()
    def prefill_rows(self, rows: list[torch.Tensor]) -> torch.Tensor:
        """Prefill every row (1-D token tensors, one per cache row) in one forward over the
        right-padded batch -> the next token's logits [B, V]. A cache whose context restarts
        (``restart_every``) or rows already fed are prefilled one row at a time."""
        if self.restart_every is not None or any(self.tokens) or len(rows) != len(self.tokens):
            return torch.stack([self.prefill_last(b, row) for b, row in enumerate(rows)])
        rows = [row.cpu() for row in rows]  # host tokens (a device row would cost a read)
        lengths = [row.numel() for row in rows]
        tokens = torch.zeros(len(rows), max(lengths), dtype=torch.long)  # pads never count
        for b, row in enumerate(rows):
            tokens[b, : lengths[b]] = row
        caches = self.stack.prefill_rows_caches(tokens == self.eos_id, lengths)
        logits = self.model(to_device(tokens, self.stack.device), cache=caches)
        self.tokens = [row.tolist() for row in rows]
        last = to_device([n - 1 for n in lengths], logits.device)
        return logits[torch.arange(len(rows), device=logits.device), last]

    def patch_lengths(self, row: int, n_tokens: int) -> None:
        return None  # a byte LM has no patches

    def _segment_start(self, n_tokens: int) -> int:
        """First token the cache holds when a row has ``n_tokens`` (restarts at multiples)."""
        if self.restart_every is None or n_tokens == 0:
            return 0
        return (n_tokens - 1) // self.restart_every * self.restart_every

    @torch.no_grad()
    def prefill(self, row: int, tokens: torch.Tensor) -> torch.Tensor:
        """Start row ``row`` with the 1-D ``tokens``; returns logits [T, V] for each of them."""
        self.truncate(row, 0)
        return self.extend(row, tokens)

    @torch.no_grad()
    def extend(self, row: int, tokens: torch.Tensor) -> torch.Tensor:
        """Append the 1-D ``tokens`` to row ``row`` (which may hold some); logits [T, V]."""
        tokens = tokens.cpu()  # host tokens (a device tensor would cost a read)
        on_device = to_device(tokens, self.stack.device)
        outputs = []
        start = len(self.tokens[row])
        offset = 0
        while offset < tokens.numel():
            position = start + offset
            end = tokens.numel()
            if self.restart_every is not None:
                window = self.restart_every
                if position % window == 0 and position > 0:
                    self.stack.reset_rows([row])
                end = min(end, offset + window - position % window)
            chunk = tokens[offset:end][None]
            caches = self.stack.prefill_caches(row, chunk == self.eos_id)
            outputs.append(self.model(on_device[offset:end][None], cache=caches)[0])
            offset = end
        self.tokens[row] += tokens.tolist()
        return torch.cat(outputs)

    def _restarts_within(self, row: int, count: int) -> bool:
        """Whether appending ``count`` tokens to ``row`` empties its cache on the way."""
        if self.restart_every is None or count == 0:
            return False
        window, held = self.restart_every, len(self.tokens[row])
        first = max(window, -(-held // window) * window)  # first restart at or after held
        return first < held + count

    @torch.no_grad()
    def extend_rows(self, rows: list[int], tokens: list[torch.Tensor]) -> list[torch.Tensor]:
        """``extend`` several rows (distinct; 1-D token tensors of any lengths) -> logits [T_i, V]
        per row. Rows whose cache restarts within their new tokens are extended alone; the
        others in one forward over the right-padded rows lo..hi (rows in between that are not
        given append nothing)."""
        out: dict[int, torch.Tensor] = {}
        batched = {}
        for row, new in zip(rows, tokens, strict=True):
            new = new.cpu()  # host tokens (a device tensor would cost a read)
            if new.numel() == 0:
                out[row] = torch.zeros(0, self.model.args.vocab_size, device=self.stack.device)
            elif self._restarts_within(row, new.numel()):
                out[row] = self.extend(row, new)
            else:
                batched[row] = new
        if len(batched) == 1:
            ((row, new),) = batched.items()
            out[row] = self.extend(row, new)
        elif batched:
            lo, hi = min(batched), max(batched) + 1
            counts = [batched[r].numel() if r in batched else 0 for r in range(lo, hi)]
            ids = torch.zeros(hi - lo, max(counts), dtype=torch.long)
            for r, new in batched.items():
                ids[r - lo, : new.numel()] = new
            caches = self.stack.extend_rows_caches(lo, counts, ids == self.eos_id)
            logits = self.model(to_device(ids, self.stack.device), cache=caches)
            for r, new in batched.items():
                out[r] = logits[r - lo, : new.numel()]
                self.tokens[r] += new.tolist()
        return [out[row] for row in rows]

    @torch.no_grad()
    def truncate(self, row: int, n_tokens: int) -> None:
        """Roll row ``row`` back to its first ``n_tokens`` tokens."""
        kept = self.tokens[row]
        if not 0 <= n_tokens <= len(kept):
            raise ValueError(f"cannot truncate a row of {len(kept)} tokens to {n_tokens}")
        segment = self._segment_start(n_tokens)
        if segment == self._segment_start(len(kept)):
            self.stack.truncate(row, n_tokens - segment)
            self.tokens[row] = kept[:n_tokens]
            return
        # the cache restarted after n_tokens: rebuild the window n_tokens falls in
        self.stack.reset_rows([row])
        self.tokens[row] = kept[:segment]
        if n_tokens > segment:
            self.extend(row, torch.tensor(kept[segment:n_tokens]))

    @torch.no_grad()
    def step(self, tokens: list[int], advance: list[bool]) -> torch.Tensor:
        """One token per row (host lists; frozen rows, advance False, keep their state) ->
        logits [B, V] on the model's device."""
        if self.restart_every is not None:
            window = self.restart_every
            self.stack.reset_rows(
                [
                    b
                    for b, on in enumerate(advance)
                    if on and len(self.tokens[b]) % window == 0 and len(self.tokens[b]) > 0
                ]
            )
        ids = to_device(tokens, self.stack.device)
        caches = self.stack.step_caches([t == self.eos_id for t in tokens], advance)
        logits = self.model(ids[:, None], cache=caches)
        for b, on in enumerate(advance):
            if on:
                self.tokens[b].append(tokens[b])
        return logits[:, 0]
