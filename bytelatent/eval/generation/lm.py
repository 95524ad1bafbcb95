"""An ``LMTransformer`` (the entropy model, or a byte LM) run incrementally with a KV cache: the
model's own forward with one ``KVCache`` per layer (``cache.CachedStack`` plans each step)."""

from __future__ import annotations

import torch

from bytelatent.eval.generation.cache import CachedStack, to_device
from bytelatent.model.transformer import LMTransformer


class IncrementalLM:
    """Prefill rows one at a time, then step every row by one token.

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
            model.rope_embeddings.freqs_cis,
            batch,
            capacity,
            args.attn_bias_type,
            args.sliding_window,
            like=model.tok_embeddings.weight,
        )
        self.eos_id = args.eos_id
        self.position = [0] * batch  # tokens fed per row (absolute, across restarts)

    @classmethod
    def for_engine(cls, model, patcher_args, entropy_model, batch: int, capacity: int):
        """The byte LM spec's generation engine (`ArchSpec.generation_engine`, `CachedEngine`)."""
        return cls(model, batch, capacity)

    def prefill_last(self, row: int, tokens: torch.Tensor) -> torch.Tensor:
        """`prefill`, returning the next token's logits [V] only."""
        return self.prefill(row, tokens)[-1]

    def patch_lengths(self, row: int, n_tokens: int) -> None:
        return None  # a byte LM has no patches

    @torch.no_grad()
    def prefill(self, row: int, tokens: torch.Tensor) -> torch.Tensor:
        """Feed the 1-D ``tokens`` to row ``row``; returns logits [T, V] for each of them."""
        outputs = []
        start = self.position[row]
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
            outputs.append(self.model(chunk, cache=caches)[0])
            offset = end
        self.position[row] = start + tokens.numel()
        return torch.cat(outputs)

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
                    if on and self.position[b] % window == 0 and self.position[b] > 0
                ]
            )
        ids = to_device(tokens, self.stack.device)
        caches = self.stack.step_caches([t == self.eos_id for t in tokens], advance)
        logits = self.model(ids[:, None], cache=caches)
        self.position = [n + int(on) for n, on in zip(self.position, advance)]
        return logits[:, 0]

    # -- rollback and extension (speculative decoding) ------------------------------------------

    def extend(self, row: int, tokens: torch.Tensor) -> torch.Tensor:
        """Append the 1-D ``tokens`` to row ``row`` (which may hold some): logits [T, V]."""
        return self.prefill(row, tokens)

    def truncate(self, row: int, tokens: list[int]) -> None:
        """Keep the row's first ``len(tokens)`` tokens, which are ``tokens`` (host ids: the EOS
        flags of the kept positions, and the tokens to re-feed when the kept part ends in a
        window the cache has already restarted past)."""
        n = len(tokens)
        if n > self.position[row]:
            raise ValueError(f"cannot truncate row {row} of {self.position[row]} tokens to {n}")
        window = self.restart_every
        if window is None:
            self.stack.truncate(row, n, [t == self.eos_id for t in tokens])
            self.position[row] = n
            return
        held_from = (self.position[row] - 1) // window * window  # first position in the cache
        keep_from = (n - 1) // window * window if n > 0 else 0
        if n % window == 0:  # the next token restarts the cache anyway
            self.stack.reset_rows([row])
            self.position[row] = n
        elif keep_from == held_from:
            kept = tokens[keep_from:]
            self.stack.truncate(row, len(kept), [t == self.eos_id for t in kept])
            self.position[row] = n
        else:  # the cache moved on to a later window: re-feed the kept part of this one
            self.stack.reset_rows([row])
            self.position[row] = keep_from
            ids = torch.tensor(tokens[keep_from:], dtype=torch.long, device=self.stack.device)
            self.prefill(row, ids)
