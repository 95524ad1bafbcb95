"""A ``ByteLatentTransformer`` run one byte at a time, with caches in every component.

Why this is the same function as ``ByteLatentTransformer.forward`` on the whole row (patched with
``include_next_token=True``, as the reference ``generate_blt`` does at every step):

- local encoder byte states are causal over bytes (document-causal, optional window) and never
  depend on patches: a KV cache per layer;
- a patch's representation (pooling / concatenation / encoder cross-attention from its bytes, or
  its window of patches) is only read once the patch is complete: byte i reads the global output
  of the last patch ending at or before i+1 (``decoder_patch_ids``), and whether position i+1
  starts a patch is known after byte i (it depends on H[i] or on bytes i, i-1). So when a patch
  closes its representation is computed once and the global transformer takes one cached step;
- the local decoder is causal over bytes; its cross-attention (or added patch state) for byte i
  reads only that patch (or its window): a KV cache per layer.

Each new byte therefore costs one entropy-model step, one encoder step, one decoder step and,
when a patch closes, one global step: work proportional to one byte, not to the sequence.
"""

from __future__ import annotations

import torch
from torch import nn

from bytelatent.data.entropy import entropy as entropy_of
from bytelatent.data.entropy import model_max_length
from bytelatent.errors import ConfigError
from bytelatent.eval.generation.cache import CachedStack, to_device
from bytelatent.eval.generation.lm import IncrementalLM
from bytelatent.eval.generation.patching import OnlinePatcher
from bytelatent.model.args import HASH_PRIMES
from bytelatent.model.attention import AttnMask
from bytelatent.model.blt import ByteLatentTransformer
from bytelatent.model.hashing import compute_hash_embeddings, hash_table_specs
from bytelatent.model.patch_utils import (
    PatchCrossMask,
    build_cross_mask,
    decoder_patch_ids_from_lengths,
    pool_patches,
)


def _last_position_hash_powers(args, window: int) -> torch.Tensor:
    """[n_tables, window] int64: prime**j of each table's n-gram, aligned to the window's end."""
    specs = hash_table_specs(
        args.encoder_hash_byte_group_size or [], args.encoder_hash_byte_group_nb_functions
    )
    powers = torch.zeros(len(specs), window, dtype=torch.long)
    for index, (func_nb, size) in enumerate(specs):
        for j in range(size):  # w_0 (exponent 0) is the oldest byte of the n-gram
            value = pow(HASH_PRIMES[func_nb], j, 1 << 64)
            powers[index, window - size + j] = value - (1 << 64) if value >= 1 << 63 else value
    return powers


def _local_stack(local: nn.Module, args, batch: int, capacity: int) -> CachedStack:
    rope = local.rope.freqs_cis if local.rope is not None else None
    return CachedStack(
        local.layers,
        rope,
        batch,
        capacity,
        args.local_attn_kind(),
        args.local_attention_window_len,
        like=next(local.parameters()),
    )


class IncrementalBLT:
    """Prefill rows one at a time, then step all rows by one byte; keeps the chosen patch starts."""

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
        if patcher.needs_entropies and entropy_model is None:
            raise ConfigError("entropy patching needs the entropy model (entropy_ckpt=DIR)")
        self.model, self.args, self.patcher, self.entropy_model = (
            model,
            args,
            patcher,
            entropy_model,
        )
        enc, dec, glob = model.local_encoder, model.local_decoder, model.global_transformer
        self.enc, self.dec, self.glob = enc, dec, glob
        self.enc_stack = _local_stack(enc, args, batch, capacity)
        self.dec_stack = _local_stack(dec, args, batch, capacity)
        self.glob_stack = CachedStack(
            glob.layers,
            glob.rope_embeddings.freqs_cis,
            batch,
            min(capacity, args.max_seqlen),
            glob.args.attn_bias_type,
            None,
            like=next(glob.parameters()),
        )
        like = enc.tok_embeddings.weight
        device = like.device
        self.device = device
        d = enc.dim
        n_enc = len(enc.layers)
        # encoder layers followed by a cross-attention (the model's pairing rule)
        self.cross_layers = [i for i, c in enumerate(enc.cross_for_layer) if c is not None]
        kept = set(self.cross_layers) | {n_enc - 1}
        self.enc_states = {i: like.new_zeros(batch, capacity + 1, d) for i in kept}
        self.patch_out = like.new_zeros(batch, capacity + 1, dec.slots * dec.dim)
        # decoder cross-attention keys/values of every closed patch, per cross layer: a patch's
        # slots are read by all of its bytes (window None: the structured slot attention)
        self.slot_kv = None
        if dec.cross_attn_decoder and args.cross_attn_window_decoder is None:
            first = dec.cross_attn_layers[0]
            shape = (batch, capacity + 1, dec.slots, first.n_heads, first.head_dim)
            self.slot_kv = [
                (like.new_zeros(shape), like.new_zeros(shape)) for _ in dec.cross_attn_layers
            ]
        self.tokens = torch.zeros(batch, capacity + 1, dtype=torch.long, device=device)
        # the same tokens on the host: patch decisions and EOS flags never wait for the device
        self.host_tokens: list[list[int]] = [[] for _ in range(batch)]
        self.entropies = torch.zeros(batch, capacity + 1, dtype=torch.float32)
        self.length = [0] * batch
        self.starts: list[list[int]] = [[] for _ in range(batch)]
        self.closed = [0] * batch  # number of complete patches per row
        self.hash_window = max(args.encoder_hash_byte_group_size or [1])
        self.hash_powers = _last_position_hash_powers(args, self.hash_window).to(device)
        self.global_steps = 0  # calls of the global transformer (prefill, closing steps, extend)

    # -- embeddings -----------------------------------------------------------------------------

    def _byte_embeds(self, window: torch.Tensor) -> torch.Tensor:
        args = self.args
        return compute_hash_embeddings(
            window,
            self.enc.tok_embeddings,
            self.model.encoder_hash_tok_embedding,
            args.encoder_hash_byte_group_size,
            args.encoder_hash_byte_group_nb_functions,
            args.encoder_hash_byte_group_vocab,
        )

    def _last_byte_embeds(self, window: torch.Tensor) -> torch.Tensor:
        """``_byte_embeds(window)[:, -1:]`` for windows [B, hash_window], in a few ops.

        Hash ids of the n-grams ending at the last position, for every table at once:
        ``sum_j w_j * prime**j`` (int64 wrap-around, as ``hashing.byte_group_hash``) mod vocab;
        tests check it against the model's ``compute_hash_embeddings``.
        """
        embeds = self.enc.tok_embeddings(window[:, -1:])
        tables = self.model.encoder_hash_tok_embedding
        if tables is None:
            return embeds
        hashes = (window[:, None, :] * self.hash_powers[None]).sum(-1)
        ids = torch.remainder(hashes, self.args.encoder_hash_byte_group_vocab)
        for index, table in enumerate(tables):
            embeds = embeds + table(ids[:, index : index + 1])
        return embeds

    def _positions(
        self, local: nn.Module, h: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        if local.pos_embeddings is None:
            return h
        return h + local.pos_embeddings(positions).view(h.shape)

    # -- patches --------------------------------------------------------------------------------

    def _patch_input(self, row: int, start: int, end: int, patch: int) -> torch.Tensor:
        """The global model's input for the complete patch [start, end) of ``row``: [in_dim]."""
        args, enc = self.args, self.enc
        last = self.enc_states[len(enc.layers) - 1][row]
        if not args.cross_attn_encoder:
            if args.pooling_modes():
                ids = torch.zeros(1, end - start, dtype=torch.long, device=self.device)
                return pool_patches(last[None, start:end], ids, 1, args.pooling_modes()).reshape(-1)
            size = int(args.patch_size)
            ids = (end - torch.arange(size, 0, -1, device=self.device)).clamp(min=0)
            return last[ids].reshape(-1)
        first = self.cross_layers[0]
        states = self.enc_states[first][row, start:end][None]
        if enc.patch_queries is not None:
            queries = enc.patch_queries[None]
        else:
            ids = torch.zeros(1, end - start, dtype=torch.long, device=self.device)
            pooled = pool_patches(states, ids, 1, enc.pooling)
            queries = enc.patch_embedding_projection(pooled).reshape(1, enc.cross_attn_k, enc.dim)
        kv_start = start
        window = args.cross_attn_window_encoder
        if window is not None:  # slots attend the bytes of the last `window` patches
            kv_start = self.starts[row][max(0, patch - window + 1)]
        ids = torch.zeros(1, end - kv_start, dtype=torch.long, device=self.device)
        mask = PatchCrossMask("encoder", ids, 1, enc.cross_attn_k)
        for i in self.cross_layers:
            cross = enc.cross_attn_layers[enc.cross_for_layer[i]]
            kv = self.enc_states[i][row, kv_start:end][None]
            queries = queries + cross(queries, kv, mask)  # double residual, as the model
        return queries.reshape(-1)

    def _global_input(
        self, row: int, patches: list[tuple[int, int, int]]
    ) -> tuple[torch.Tensor, list[bool]]:
        """The global model's inputs [P, in_dim] (before its projection) of ``patches`` (start, end, index) and whether each
        holds an EOS (from the host tokens)."""
        reps = torch.stack([self._patch_input(row, s, e, p) for s, e, p in patches])
        tokens = self.host_tokens[row]
        eos = [self.args.eos_id in tokens[s:e] for s, e, _ in patches]
        return reps, eos

    def _decoder_patch_state(self, g: torch.Tensor) -> torch.Tensor:
        proj = self.dec.patch_embedding_projection
        return proj(g) if proj is not None else g

    def _store_slot_kv(self, row: int, first: int, states: torch.Tensor) -> None:
        """Keys/values of patches first.. (decoder patch states [P, slots*d]) for each layer."""
        if self.slot_kv is None:
            return
        dec = self.dec
        slots = states.view(-1, dec.slots, dec.dim)
        for cross, (keys, values) in zip(dec.cross_attn_layers, self.slot_kv):
            normed = cross.cross_attn_norm_kv(slots)
            count = slots.shape[0]
            keys[row, first : first + count] = cross.wk(normed).view(count, *keys.shape[2:])
            values[row, first : first + count] = cross.wv(normed).view(count, *values.shape[2:])

    def _slot_hook(self, dpid: torch.Tensor):
        """Decoder cross-attention of one byte per row from the cached slot keys/values: the
        ops of ``CrossAttention`` + ``cross_attention._slot_attention``, minus the per-byte
        key/value projections."""
        dec, bsz = self.dec, dpid.shape[0]
        rows = torch.arange(bsz, device=self.device)

        def hook(i: int, h: torch.Tensor) -> torch.Tensor:
            index = dec.cross_for_layer[i]
            if index is None:
                return h
            cross, (keys, values) = dec.cross_attn_layers[index], self.slot_kv[index]
            heads, head_dim = cross.n_heads, cross.head_dim
            q = cross.wq(cross.cross_attn_norm_q(h)).view(bsz, 1, heads, head_dim)
            scores = (q * keys[rows, dpid]).sum(-1).float() * head_dim**-0.5  # [B, slots, H]
            probs = torch.softmax(scores, dim=1).to(values.dtype)
            out = (probs.unsqueeze(-1) * values[rows, dpid]).sum(1)
            attended = h + cross.wo(out.reshape(bsz, 1, heads * head_dim))
            return h + attended  # double residual, as the model

        return hook

    # -- decoder cross-attention hooks ----------------------------------------------------------

    def _cross_hook(self, kv: torch.Tensor, mask: PatchCrossMask):
        dec = self.dec

        def hook(i: int, h: torch.Tensor) -> torch.Tensor:
            index = dec.cross_for_layer[i]
            if index is None:
                return h
            cross = dec.cross_attn_layers[index]
            return h + cross(h, kv, mask)  # double residual, as the model

        return hook if dec.cross_attn_decoder else None

    def _step_cross_inputs(self, dpid: torch.Tensor) -> tuple[torch.Tensor, PatchCrossMask]:
        """kv slots [B, w*k, d] and mask for one byte per row reading patch ``dpid`` (or window)."""
        dec, bsz = self.dec, dpid.shape[0]
        rows = torch.arange(bsz, device=self.device)
        zeros = torch.zeros(bsz, 1, dtype=torch.long, device=self.device)
        window = self.args.cross_attn_window_decoder
        if window is None:
            kv = self.patch_out[rows, dpid].view(bsz, dec.slots, dec.dim)
            return kv, PatchCrossMask("decoder", zeros, 1, dec.slots)
        ids = dpid[:, None] - window + 1 + torch.arange(window, device=self.device)
        kv = self.patch_out[rows[:, None], ids.clamp(min=0)].view(bsz, window * dec.slots, dec.dim)
        allowed = (ids >= 0).repeat_interleave(dec.slots, dim=1)[:, None, None, :]
        return kv, PatchCrossMask("decoder", zeros, window, dec.slots, AttnMask.from_dense(allowed))

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.dec.output(self.dec.norm(h)).float()

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

    def prefill_last(self, row: int, tokens: torch.Tensor) -> torch.Tensor:
        """`prefill` (its logits are the next byte's already)."""
        return self.prefill(row, tokens)

    # -- prefill and step -----------------------------------------------------------------------

    @torch.no_grad()
    def prefill(self, row: int, tokens: torch.Tensor) -> torch.Tensor:
        """Feed the 1-D prompt ``tokens`` to row ``row``; returns the next byte's logits [V]."""
        n, eos = tokens.numel(), tokens[None] == self.args.eos_id
        self.tokens[row, :n] = tokens
        self.host_tokens[row] = tokens.tolist()  # once per prompt
        entropies = None
        if self.patcher.needs_entropies:
            entropies = entropy_of(self.entropy_model.prefill(row, tokens)).cpu()
            self.entropies[row, :n] = entropies
        starts = self.patcher.prefix_starts(tokens, entropies)
        if len(starts) < 2 or starts[1] != 1:
            raise ConfigError("the patcher's first patch is longer than 1 byte; BLT needs length 1")
        self.starts[row], self.length[row] = starts, n
        positions = torch.arange(n, device=self.device)
        h = self._positions(self.enc, self._byte_embeds(tokens[None]), positions)
        outs = self.enc_stack.prefill(row, h, eos)
        for i, states in self.enc_states.items():
            states[row, :n] = outs[i][0]
        patches = [(starts[j], starts[j + 1], j) for j in range(len(starts) - 1)]
        reps, patch_eos = self._global_input(row, patches)
        patch_eos = torch.tensor(patch_eos, device=self.device)[None]
        g = self.glob(reps[None], None, cache=self.glob_stack.prefill_caches(row, patch_eos))[0]
        self.global_steps += 1
        count = len(patches)
        self.patch_out[row, :count] = self._decoder_patch_state(g)
        self._store_slot_kv(row, 0, self.patch_out[row, :count])
        self.closed[row] = count
        lengths = torch.tensor(starts + [n + 1], device=self.device).diff()[None]
        dpid = decoder_patch_ids_from_lengths(lengths, n)
        h = outs[-1]
        if not self.dec.cross_attn_decoder:
            h = h + self.patch_out[row, dpid[0]][None]
        h = self._positions(self.dec, h, positions)
        kv = self.patch_out[row, :count].reshape(1, count * self.dec.slots, self.dec.dim)
        mask = build_cross_mask(
            "decoder", dpid, count, self.dec.slots, self.args.cross_attn_window_decoder
        )
        out = self.dec_stack.prefill(row, h, eos, self._cross_hook(kv, mask))[-1]
        return self._logits(out[0, -1])

    @torch.no_grad()
    def step(
        self, tokens: list[int], advance: list[bool], close_patches: bool = True
    ) -> torch.Tensor:
        """Append one byte per row (host lists: tokens, advance) -> next-byte logits [B, V].

        ``close_patches=False`` drafts (speculative decoding): a patch that the new byte closes
        is recorded but not sent to the global transformer, so the decoder keeps reading the
        last closed patch's state; ``truncate`` to before the draft must follow.

        One device-to-host copy per step at most (the new entropies, when patching needs them):
        patch decisions, EOS flags and cache bookkeeping use the host tokens.
        """
        bsz = len(tokens)
        rows = [b for b in range(bsz) if advance[b]]
        if close_patches and any(self.closed[b] != len(self.starts[b]) - 1 for b in rows):
            raise ValueError("a drafted row must be truncated before it steps with its patches")
        for b in rows:
            self.host_tokens[b].append(tokens[b])
        ids, advancing = to_device(tokens, self.device), to_device(advance, self.device)
        pos = to_device(self.length, self.device)
        batch_rows = torch.arange(bsz, device=self.device)
        self.tokens[batch_rows, pos] = torch.where(advancing, ids, self.tokens[batch_rows, pos])
        if self.patcher.needs_entropies:
            entropies = entropy_of(self.entropy_model.step(tokens, advance)).cpu()
            for b in rows:
                self.entropies[b, self.length[b]] = entropies[b]
        closing = [b for b in rows if self._closes(b)]
        eos = [t == self.args.eos_id for t in tokens]
        window = self.hash_window
        ids = pos[:, None] - window + 1 + torch.arange(window, device=self.device)
        recent = torch.where(ids >= 0, self.tokens.gather(1, ids.clamp(min=0)), 0)
        h = self._positions(self.enc, self._last_byte_embeds(recent), pos)
        outs = self.enc_stack.step(h, eos, advance)
        for i, states in self.enc_states.items():
            states[batch_rows, pos] = outs[i][:, 0]
        if closing and close_patches:
            self._close_patches(closing, bsz)
        dpid = to_device([max(0, c - 1) for c in self.closed], self.device)
        h = outs[-1]
        if not self.dec.cross_attn_decoder:
            h = h + self.patch_out[batch_rows, dpid][:, None]
        h = self._positions(self.dec, h, pos)
        hook = None
        if self.slot_kv is not None:
            hook = self._slot_hook(dpid)
        elif self.dec.cross_attn_decoder:
            hook = self._cross_hook(*self._step_cross_inputs(dpid))
        out = self.dec_stack.step(h, eos, advance, hook)[-1]
        for b in rows:
            self.length[b] += 1
        return self._logits(out[:, 0])

    def _closes(self, row: int) -> bool:
        """Decide (and record) whether the position after the new byte of ``row`` starts a patch."""
        position = self.length[row] + 1
        start = self.patcher.starts_here(
            self.host_tokens[row],
            self.entropies[row, :position],
            position,
            self.starts[row][-1],
        )
        if start:
            self.starts[row].append(position)
        return start

    def _close_patches(self, closing: list[int], bsz: int) -> None:
        """One global step for the rows whose open patch just closed."""
        x = self.patch_out.new_zeros(bsz, 1, self.args.global_input_dim())
        patch_eos = [False] * bsz
        for b in closing:
            starts = self.starts[b]
            reps, eos = self._global_input(b, [(starts[-2], starts[-1], self.closed[b])])
            x[b, 0], patch_eos[b] = reps[0], eos[0]
        advance = [b in closing for b in range(bsz)]
        g = self.glob(x, None, cache=self.glob_stack.step_caches(patch_eos, advance))[:, 0]
        self.global_steps += 1
        state = self._decoder_patch_state(g)
        for b in closing:
            self.patch_out[b, self.closed[b]] = state[b]
            self._store_slot_kv(b, self.closed[b], state[b : b + 1])
            self.closed[b] += 1

    def patch_lengths(self, row: int, n_tokens: int) -> list[int]:
        """Patch lengths of the row's first ``n_tokens`` tokens, from the starts chosen online."""
        starts = [s for s in self.starts[row] if s < n_tokens] + [n_tokens]
        return [b - a for a, b in zip(starts, starts[1:])]

    # -- rollback and extension (speculative decoding) ------------------------------------------

    @torch.no_grad()
    def extend(self, row: int, tokens: torch.Tensor) -> torch.Tensor:
        """Append the 1-D ``tokens`` (T of them) to the prefilled row ``row``; the patches they
        close go to the global transformer in one call. Returns the next-byte logits after each
        of them [T, V]: the function of T ``step``s, in one call per module."""
        n, end = self.length[row], self.length[row] + tokens.numel()
        if n == 0:
            raise ValueError(f"row {row} is empty: prefill it before extending it")
        if self.closed[row] != len(self.starts[row]) - 1:
            raise ValueError(f"row {row} holds a draft: truncate it before extending it")
        self.tokens[row, n:end] = tokens
        self.host_tokens[row] += tokens.tolist()
        if self.patcher.needs_entropies:
            self.entropies[row, n:end] = entropy_of(self.entropy_model.extend(row, tokens)).cpu()
        starts = self.starts[row]
        for position in range(n + 1, end + 1):  # whether each next position starts a patch
            if self.patcher.starts_here(
                self.host_tokens[row], self.entropies[row, :position], position, starts[-1]
            ):
                starts.append(position)
        # local encoder: the new bytes with their hash n-grams' context
        first = max(0, n - self.hash_window + 1)
        embeds = self._byte_embeds(self.tokens[row : row + 1, first:end])[:, n - first :]
        positions = torch.arange(n, end, device=self.device)
        eos = tokens[None] == self.args.eos_id
        outs = self.enc_stack.prefill(row, self._positions(self.enc, embeds, positions), eos)
        for i, states in self.enc_states.items():
            states[row, n:end] = outs[i][0]
        # the patches closed among the new bytes: one global call
        done = self.closed[row]
        patches = [(starts[j], starts[j + 1], j) for j in range(done, len(starts) - 1)]
        if patches:
            reps, patch_eos = self._global_input(row, patches)
            patch_eos = torch.tensor(patch_eos, device=self.device)[None]
            cache = self.glob_stack.prefill_caches(row, patch_eos)
            state = self._decoder_patch_state(self.glob(reps[None], None, cache=cache)[0])
            self.global_steps += 1
            self.patch_out[row, done : done + len(patches)] = state
            self._store_slot_kv(row, done, state)
            self.closed[row] = done = done + len(patches)
        # local decoder: byte i reads the last patch ending at or before i + 1
        bounds = torch.tensor(starts, device=self.device)
        dpid = torch.searchsorted(bounds, positions + 1, right=True)[None] - 2
        h = outs[-1]
        if not self.dec.cross_attn_decoder:
            h = h + self.patch_out[row, dpid[0]][None]
        h = self._positions(self.dec, h, positions)
        kv = self.patch_out[row, :done].reshape(1, done * self.dec.slots, self.dec.dim)
        window = self.args.cross_attn_window_decoder
        mask = build_cross_mask("decoder", dpid, done, self.dec.slots, window)
        out = self.dec_stack.prefill(row, h, eos, self._cross_hook(kv, mask))[-1]
        self.length[row] = end
        return self._logits(out[0])

    def truncate(self, row: int, n_tokens: int) -> None:
        """Keep the first ``n_tokens`` tokens of ``row`` (at least BOS), as if the rest had never
        been fed: every cache, the patch starts and the entropy model's cache roll back."""
        n = n_tokens
        if not 1 <= n <= self.length[row]:
            raise ValueError(f"cannot truncate row {row} of {self.length[row]} tokens to {n}")
        starts = [s for s in self.starts[row] if s <= n]
        if len(starts) - 1 > self.closed[row]:
            raise ValueError(
                f"row {row}: patches of its first {n} tokens were drafted, never closed; "
                "truncate to before the draft"
            )
        tokens = self.host_tokens[row][:n]
        self.host_tokens[row], self.starts[row] = tokens, starts
        self.closed[row], self.length[row] = len(starts) - 1, n
        eos = [t == self.args.eos_id for t in tokens]
        self.enc_stack.truncate(row, n, eos)
        self.dec_stack.truncate(row, n, eos)
        self.glob_stack.truncate(
            row, len(starts) - 1, [any(eos[s:e]) for s, e in zip(starts, starts[1:])]
        )
        if self.entropy_model is not None:
            self.entropy_model.truncate(row, tokens)
