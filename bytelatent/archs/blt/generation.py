"""A ``ByteLatentTransformer`` run a few bytes at a time, with caches in every component.

Why this is the same function as ``ByteLatentTransformer.forward`` on the whole row (patched with
``include_next_token=True``, as the reference ``generate_blt`` does at every step):

- local encoder byte states are causal over bytes (document-causal, optional window) and never
  depend on patches: ``LocalEncoder.forward`` with a KV cache per layer, which also keeps the
  byte states of the layers that ``ByteLatentTransformer.patch_inputs`` reads;
- a patch's representation (pooling / concatenation / encoder cross-attention from its bytes, or
  its window of patches) is only read once the patch is complete: byte i reads the global output
  of the last patch ending at or before i+1 (``decoder_patch_ids``), and whether position i+1
  starts a patch is known after byte i (it depends on H[i] or on bytes i, i-1). So when a patch
  closes, ``patch_inputs`` (the training code) runs on its bytes, and the global transformer
  takes one cached step;
- the local decoder is causal over bytes; its cross-attention (or added patch state) for byte i
  reads only that patch (or its window): ``LocalDecoder.forward`` with a KV cache per layer and,
  per cross-attention, the keys/values of every closed patch's slots (computed once per patch).

Each new byte therefore costs one entropy-model step, one encoder step, one decoder step and,
when a patch closes, one global step: work proportional to one byte, not to the sequence. No
code here reads a weight or a buffer of the model: it only plans caches and calls modules.

Tolerance (tests/generation/test_generation_cache_api.py): in fp32 the cached logits equal the
training forward's within 2e-6 * max|logit| (measured <= 7.5e-7, a few ulps at the scale of
logits sharpened 20x: sdpa over a cache slice and the gathered slot attention sum in another order
than the whole-row kernels); greedy bytes and patch starts are identical. With bf16 parameters
the bound is 3e-2 * max|logit| (measured <= 1.2e-2); greedy bytes may then differ where two
bytes' logits are within that of each other.

``extend_rows`` appends different numbers of bytes to several rows in one call: the rows run
right-padded through the encoder and decoder (``CachedStack.extend_rows_caches``: per-row
positions, masks and write slots; padding writes to scratch slots), patch decisions stay per row
on the host, and every row's new patches go to the global transformer in one call (padded over
patches). Each row computes what ``extend`` computes on it alone (tests/generation/
test_extend_rows.py). The batched prefill (``prefill_rows``) is one ``extend_rows``.

Speculative decoding (``speculative.py``) uses ``step(..., close_patches=False)`` for drafts,
then ``truncate`` to the accepted prefix and ``extend_rows`` with every row's bytes to check.

Host syncs (tests/generation/test_device_syncs.py counts them on device-tagged tensors): patch
decisions, EOS flags, patch bounds and cache books come from the host tokens; what the device
needs goes there by non-blocking copies from pinned memory (``cache.to_device``), and the hash
n-grams' constants live on the device. The reads that remain:

* ``step``: one per step with entropy patching (the new bytes' entropies, which decide the patch
  starts); none otherwise, and none in a draft step (``close_patches=False``). The caller's
  sampling reads the next bytes (one read per step, ``sampling.sample_rows``);
* ``extend_rows`` (a batched prefill, a speculative verification): one per call with entropy
  patching (every row's entropies at once); none otherwise. Token tensors are given on the host
  (a device tensor costs one read each).
"""

from __future__ import annotations

import bisect

import torch

from bytelatent.archs.blt.cross_attention import PatchStep, SlotCache
from bytelatent.archs.blt.local_models import DecoderCache
from bytelatent.archs.blt.model import ByteLatentTransformer
from bytelatent.archs.lm.generation import IncrementalLM
from bytelatent.data.entropy import entropy as entropy_of
from bytelatent.data.entropy import model_max_length
from bytelatent.errors import ConfigError
from bytelatent.eval.generation.cache import CachedStack, to_device
from bytelatent.eval.generation.patching import OnlinePatcher


class IncrementalBLT:
    """Rows of bytes fed to a BLT's modules with caches: ``prefill`` / ``extend`` append bytes to
    one row, ``step`` appends one byte to every row, ``truncate`` rolls a row back. Keeps the
    patch starts chosen online and ``global_steps`` (global-transformer calls so far)."""

    def __init__(
        self,
        model: ByteLatentTransformer,
        patcher: OnlinePatcher,
        entropy_model: IncrementalLM | None,
        batch: int,
        capacity: int,
    ) -> None:
        args = model.args
        if model.encoder_ngram_embedding is not None:
            raise ConfigError("generation does not support encoder_ngram_to_size_str (n-gram ids)")
        if args.subword_vocab_size or args.boundary_head:
            raise ConfigError(
                "generation does not support model.subword_vocab_size or model.boundary_head "
                "yet (a byteified BLT is scored, not sampled; docs/byteify.md)"
            )
        if patcher.needs_entropies and entropy_model is None:
            raise ConfigError("entropy patching needs the entropy model (entropy_ckpt=DIR)")
        self.model, self.args = model, args
        self.patcher, self.entropy_model = patcher, entropy_model
        enc, dec, glob = model.local_encoder, model.local_decoder, model.global_transformer
        self.enc, self.dec, self.glob = enc, dec, glob
        like = next(model.parameters())
        self.device = like.device
        kind, window = args.local_attn_kind(), args.local_attention_window_len
        self.enc_stack = CachedStack(
            enc.layers,
            batch,
            capacity,
            kind,
            window,
            like,
            enc.max_positions,
            keep_outputs=tuple(model.patch_input_layers()),
        )
        self.dec_stack = CachedStack(
            dec.layers, batch, capacity, kind, window, like, dec.max_positions
        )
        self.glob_stack = CachedStack(
            glob.layers,
            batch,
            min(capacity, args.max_seqlen),
            glob.args.attn_bias_type,
            None,
            like,
            glob.args.max_seqlen,
        )
        # per patch (+1 scratch slot for rows that add none in a step): the decoder's patch
        # states (no cross-attention) or its cross-attention keys/values of every slot
        patches = capacity + 2
        self.scratch = patches - 1
        self.patch_states = None
        self.slot_caches = None
        if dec.cross_attn_decoder:
            self.slot_caches = []
            for cross in dec.cross_attn_layers:
                shape = (batch, patches, dec.slots, cross.n_kv_heads, cross.head_dim)
                self.slot_caches.append((like.new_zeros(shape), like.new_zeros(shape)))
        else:
            self.patch_states = like.new_zeros(batch, patches, dec.dim)
        self.tokens = torch.zeros(batch, capacity + 1, dtype=torch.long, device=self.device)
        # the same tokens on the host: patch decisions and EOS flags never wait for the device
        self.host_tokens: list[list[int]] = [[] for _ in range(batch)]
        self.entropies = torch.zeros(batch, capacity + 1, dtype=torch.float32)
        self.starts: list[list[int]] = [[] for _ in range(batch)]
        self.closed = [0] * batch  # number of complete patches per row
        self.drafted = [0] * batch  # bytes appended by draft steps since the last decided one
        self.global_steps = 0

    @classmethod
    def for_engine(cls, model, patcher_args, entropy_model, batch: int, capacity: int):
        """The BLT spec's generation engine (`ArchSpec.generation_engine`, `CachedEngine`): the
        online patcher of `patcher_args`, and the entropy model's own cache when it patches by
        entropy."""
        online = OnlinePatcher(patcher_args)
        entropy = None
        if online.needs_entropies:
            window = model_max_length(entropy_model)
            entropy = IncrementalLM(entropy_model, batch, capacity, window)
        return cls(model, online, entropy, batch, capacity)

    @property
    def length(self) -> list[int]:
        """Bytes held per row."""
        return [len(tokens) for tokens in self.host_tokens]

    def patch_lengths(self, row: int, n_tokens: int) -> list[int]:
        """Patch lengths of the row's first ``n_tokens`` tokens, from the starts chosen online."""
        starts = [s for s in self.starts[row] if s < n_tokens] + [n_tokens]
        return [b - a for a, b in zip(starts, starts[1:])]

    def prefill_last(self, row: int, tokens: torch.Tensor) -> torch.Tensor:
        """`prefill` (its logits are the next byte's already)."""
        return self.prefill(row, tokens)

    # -- patches --------------------------------------------------------------------------------

    def _decide_starts(self, row: int, first: int, end: int) -> None:
        """Record which of the positions first..end (decided by the bytes before each) start a
        patch: the patcher's rules on the whole prefix for a new row, online after that."""
        if first == 1:
            tokens = torch.tensor(self.host_tokens[row][:end])
            entropies = self.entropies[row, :end] if self.patcher.needs_entropies else None
            starts = self.patcher.prefix_starts(tokens, entropies)
            if len(starts) < 2 or starts[1] != 1:
                raise ConfigError(
                    "the patcher's first patch is longer than 1 byte; BLT needs length 1"
                )
            self.starts[row] = starts
            return
        for position in range(first, end + 1):
            if self.patcher.starts_here(
                self.host_tokens[row],
                self.entropies[row, :position],
                position,
                self.starts[row][-1],
            ):
                self.starts[row].append(position)

    def _patch_inputs(self, row: int, first: int, count: int) -> torch.Tensor:
        """The global model's inputs [count, in] of the row's complete patches first.., by
        ``patch_inputs`` on their bytes (and the bytes their window or concatenation reads)."""
        args, starts = self.args, self.starts[row]
        lo_patch = first
        if args.cross_attn_encoder and args.cross_attn_window_encoder is not None:
            lo_patch = max(0, first - args.cross_attn_window_encoder + 1)
        lo, end = starts[lo_patch], starts[first + count]
        bounds = starts[lo_patch : first + count + 1]
        if not args.cross_attn_encoder and not args.pooling_modes():
            lo = max(0, lo - int(args.patch_size))  # concatenation reads bytes before a patch
            bounds = sorted({lo, *bounds})
        lengths = to_device([b - a for a, b in zip(bounds, bounds[1:])], self.device)[None]
        outputs = self.enc_stack.outputs
        states = [
            outputs[i][row : row + 1, lo:end] if i in outputs else None
            for i in range(len(self.enc.layers))
        ]
        return self.model.patch_inputs(states, lengths)[0, -count:]

    def _patch_has_eos(self, row: int, first: int, count: int) -> list[bool]:
        tokens, starts = self.host_tokens[row], self.starts[row]
        return [
            self.args.eos_id in tokens[starts[p] : starts[p + 1]]
            for p in range(first, first + count)
        ]

    def _reading_patch(self, row: int, position: int) -> int:
        """The patch byte ``position`` reads: the last one ending at or before position+1."""
        return bisect.bisect_right(self.starts[row], position + 1) - 2

    def _decoder_cache(
        self,
        layers,
        write_at: torch.Tensor,
        patch_ids: torch.Tensor,
        rows: slice,
        slots: torch.Tensor | None = None,
    ) -> DecoderCache:
        window = self.args.cross_attn_window_decoder or 1
        step = PatchStep(write_at, patch_ids, window, slots)
        if self.slot_caches is None:
            return DecoderCache(layers, step, patch_states=self.patch_states[rows])
        cross = [SlotCache(keys[rows], values[rows], step) for keys, values in self.slot_caches]
        return DecoderCache(layers, step, cross=cross)

    # -- appending bytes ------------------------------------------------------------------------

    @torch.no_grad()
    def prefill(self, row: int, tokens: torch.Tensor) -> torch.Tensor:
        """Start row ``row`` with the 1-D prompt ``tokens``; returns the next byte's logits [V]."""
        self.truncate(row, 0)
        return self.extend(row, tokens)[-1]

    @torch.no_grad()
    def extend(self, row: int, tokens: torch.Tensor) -> torch.Tensor:
        """Append the 1-D ``tokens`` (T bytes) to row ``row``, which may hold some already;
        returns the logits [T, V] after each of them (the patcher decides the new starts)."""
        return self.extend_rows([row], [tokens])[0]

    @torch.no_grad()
    def prefill_rows(self, rows: list[torch.Tensor]) -> torch.Tensor:
        """Start every row (1-D prompts, one per cache row) with one ``extend_rows`` -> the next
        byte's logits [B, V]."""
        for row in range(len(rows)):
            self.truncate(row, 0)
        return torch.stack([logits[-1] for logits in self.extend_rows(range(len(rows)), rows)])

    @torch.no_grad()
    def extend_rows(self, rows, tokens: list[torch.Tensor]) -> list[torch.Tensor]:
        """``extend`` several distinct rows at once: row ``rows[i]`` gets the 1-D ``tokens[i]``
        (any length, 0 included) -> the logits [T_i, V] after each of them.

        The rows lo..hi they span run together, right-padded (a row in between that is not
        given appends nothing): one entropy-model forward (rows whose entropy window restarts
        within their bytes run alone), one encoder forward, patch decisions per row on the host,
        ONE global-transformer call for every patch that closes in any row (right-padded over
        patches), one decoder forward.
        """
        rows = list(rows)
        if len(set(rows)) != len(rows) or len(rows) != len(tokens):
            raise ValueError("extend_rows takes distinct rows, one token tensor each")
        tokens = [t.cpu() for t in tokens]  # host tokens (a device tensor would cost a read)
        for row in rows:
            if self.drafted[row]:
                raise ValueError(f"row {row} holds draft bytes: truncate it before extending")
        lo, hi = min(rows), max(rows) + 1
        new_tokens = dict(zip(rows, tokens))
        held = {row: len(self.host_tokens[row]) for row in rows}
        counts = [new_tokens[r].numel() if r in new_tokens else 0 for r in range(lo, hi)]
        if max(counts) == 0:
            return [t.new_zeros(0, self.dec.output.out_features) for t in tokens]
        ids, eos = self._append_bytes(new_tokens, held, lo, hi, max(counts))
        self._decide_new_starts(new_tokens, held)
        window = self.model.hash_window
        embeds = self.model.byte_embeddings(ids)[:, window - 1 :]
        h = self.enc(embeds, None, cache=self.enc_stack.extend_rows_caches(lo, counts, eos))[-1]
        first = [self.closed[row] if row in new_tokens else 0 for row in range(lo, hi)]
        g, patch_slots = self._close_new_patches(rows, lo, hi, h)
        reading = torch.zeros(hi - lo, max(counts), dtype=torch.long)
        for row, new in new_tokens.items():
            n = held[row]
            positions = range(n, n + new.numel())
            reading[row - lo, : new.numel()] = torch.tensor(
                [self._reading_patch(row, p) for p in positions], dtype=torch.long
            )
        cache = self._decoder_cache(
            self.dec_stack.extend_rows_caches(lo, counts, eos),
            to_device(first, self.device),
            to_device(reading, self.device),
            slice(lo, hi),
            slots=to_device(patch_slots, self.device),
        )
        logits = self.dec(h, g, None, None, None, cache=cache)
        return [logits[row - lo, : new_tokens[row].numel()] for row in rows]

    def _append_bytes(
        self, new_tokens, held, lo: int, hi: int, steps: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Record each row's new bytes (host tensors): the rows lo..hi's new bytes with the hash
        n-grams' context before them (0 before a row's start), right-padded, on the device
        [hi-lo, W-1+steps], and which new bytes are EOS (host [hi-lo, steps])."""
        window = self.model.hash_window
        padded = torch.zeros(hi - lo, steps, dtype=torch.long)
        for row, new in new_tokens.items():
            padded[row - lo, : new.numel()] = new
        on_device = to_device(padded, self.device)  # one copy for every row
        ids = torch.zeros(hi - lo, window - 1 + steps, dtype=torch.long, device=self.device)
        for row, new in new_tokens.items():
            n, count = held[row], new.numel()
            self.tokens[row, n : n + count] = on_device[row - lo, :count]
            self.host_tokens[row] += new.tolist()
            start = max(0, n - window + 1)
            context = window - 1 - (n - start)
            ids[row - lo, context : window - 1 + count] = self.tokens[row, start : n + count]
        return ids, padded == self.args.eos_id

    def _decide_new_starts(self, new_tokens, held) -> None:
        """Entropies of the new bytes (one entropy-model call for all rows) and the patch starts
        they decide, per row on the host."""
        rows = list(new_tokens)
        if self.patcher.needs_entropies:
            extended = self.entropy_model.extend_rows(rows, list(new_tokens.values()))
            # every row's entropies in one read
            entropies = torch.cat([entropy_of(logits) for logits in extended]).cpu()
            offset = 0
            for row in rows:
                n, count = held[row], new_tokens[row].numel()
                self.entropies[row, n : n + count] = entropies[offset : offset + count]
                offset += count
        for row, new in new_tokens.items():
            if new.numel():
                self._decide_starts(row, held[row] + 1, held[row] + new.numel())

    def _close_new_patches(
        self, rows: list[int], lo: int, hi: int, h: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One global call for the patches the new bytes closed in rows lo..hi (right-padded
        over patches) -> (global states [hi-lo, most, d], each one's patch slot [hi-lo, most];
        padding at the scratch slot)."""
        first = {row: self.closed[row] for row in rows}
        new_patches = {row: len(self.starts[row]) - 1 - self.closed[row] for row in rows}
        most = max(new_patches.values())
        patch_slots = torch.full((hi - lo, most), self.scratch, dtype=torch.long)
        if not most:
            return h.new_zeros(hi - lo, 0, self.glob.dim), patch_slots
        reps = h.new_zeros(hi - lo, most, self.args.global_input_dim())
        patch_eos = torch.zeros(hi - lo, most, dtype=torch.bool)
        patch_counts = [0] * (hi - lo)
        for row, count in new_patches.items():
            if count:
                reps[row - lo, :count] = self._patch_inputs(row, first[row], count)
                patch_eos[row - lo, :count] = torch.tensor(
                    self._patch_has_eos(row, first[row], count)
                )
                patch_slots[row - lo, :count] = torch.arange(first[row], first[row] + count)
                patch_counts[row - lo] = count
                self.closed[row] += count
        caches = self.glob_stack.extend_rows_caches(lo, patch_counts, patch_eos)
        self.global_steps += 1
        return self.glob(reps, None, cache=caches), patch_slots

    @torch.no_grad()
    def step(
        self, tokens: list[int], advance: list[bool], close_patches: bool = True
    ) -> torch.Tensor:
        """Append one byte per row (host lists: tokens, advance) -> next-byte logits [B, V].

        One device-to-host read per step at most (the new entropies, when patching needs them):
        patch decisions, EOS flags and cache bookkeeping use the host tokens, and the step's
        positions, tokens and patch slots reach the device by non-blocking pinned copies.
        ``close_patches=False`` (a draft): no patch start is decided and the global model does
        not run; each byte reads the last closed patch. Roll drafts back with ``truncate``.
        """
        bsz = len(tokens)
        rows = [b for b in range(bsz) if advance[b]]
        if close_patches and any(self.drafted[b] for b in rows):
            raise ValueError("rows hold draft bytes: truncate them before a non-draft step")
        pos, ids, advancing = to_device([self.length, tokens, advance], self.device).unbind(0)
        advancing = advancing.bool()
        batch_rows = torch.arange(bsz, device=self.device)
        self.tokens[batch_rows, pos] = torch.where(advancing, ids, self.tokens[batch_rows, pos])
        for b in rows:
            self.host_tokens[b].append(tokens[b])
        closing = []
        if close_patches:
            if self.patcher.needs_entropies:
                entropies = entropy_of(self.entropy_model.step(tokens, advance)).cpu()
                for b in rows:
                    self.entropies[b, len(self.host_tokens[b]) - 1] = entropies[b]
            for b in rows:
                before = len(self.starts[b])
                position = len(self.host_tokens[b])
                self._decide_starts(b, position, position)
                if len(self.starts[b]) > before:
                    closing.append(b)
        else:
            for b in rows:
                self.drafted[b] += 1
        eos = [t == self.args.eos_id for t in tokens]
        window = self.model.hash_window
        recent_ids = pos[:, None] - window + 1 + torch.arange(window, device=self.device)
        recent = torch.where(recent_ids >= 0, self.tokens.gather(1, recent_ids.clamp(min=0)), 0)
        embeds = self.model.last_byte_embeddings(recent)
        h = self.enc(embeds, None, cache=self.enc_stack.step_caches(eos, advance))[-1]
        g = self._close_patches(closing, bsz, h)
        write_at = [self.closed[b] - 1 if b in closing else self.scratch for b in range(bsz)]
        reading = [max(0, c - 1) for c in self.closed]
        write_at, reading = to_device([write_at, reading], self.device).unbind(0)
        cache = self._decoder_cache(
            self.dec_stack.step_caches(eos, advance), write_at, reading[:, None], slice(None)
        )
        return self.dec(h, g, None, None, None, cache=cache)[:, 0]

    def _close_patches(self, closing: list[int], bsz: int, like: torch.Tensor) -> torch.Tensor:
        """One global step for the rows whose open patch just closed: their global states
        [B,1,dim] (other rows' are unused), or [B,0,dim] when no row closes a patch."""
        if not closing:
            return like.new_zeros(bsz, 0, self.glob.dim)
        x = like.new_zeros(bsz, 1, self.args.global_input_dim())
        patch_eos = [False] * bsz
        for b in closing:
            x[b, 0] = self._patch_inputs(b, self.closed[b], 1)[0]
            patch_eos[b] = self._patch_has_eos(b, self.closed[b], 1)[0]
            self.closed[b] += 1
        advance = [b in closing for b in range(bsz)]
        self.global_steps += 1
        return self.glob(x, None, cache=self.glob_stack.step_caches(patch_eos, advance))

    # -- rolling back ---------------------------------------------------------------------------

    @torch.no_grad()
    def truncate(self, row: int, n_tokens: int) -> None:
        """Roll row ``row`` back to its first ``n_tokens`` bytes (drafts included): KV caches,
        patch starts, closed patches, the entropy model's cache and the host tokens."""
        held = len(self.host_tokens[row])
        if not 0 <= n_tokens <= held:
            raise ValueError(f"cannot truncate a row of {held} bytes to {n_tokens}")
        self.host_tokens[row] = self.host_tokens[row][:n_tokens]
        self.drafted[row] = max(0, self.drafted[row] - (held - n_tokens))
        # starts at positions <= n are decided by bytes < n (include_next_token)
        self.starts[row] = [s for s in self.starts[row] if s <= n_tokens] if n_tokens else []
        self.closed[row] = max(0, len(self.starts[row]) - 1)
        for stack in (self.enc_stack, self.dec_stack):
            stack.truncate(row, min(n_tokens, stack.length[row]))
        self.glob_stack.truncate(row, self.closed[row])
        if self.entropy_model is not None:
            held_entropy = len(self.entropy_model.tokens[row])
            self.entropy_model.truncate(row, min(n_tokens, held_entropy))
