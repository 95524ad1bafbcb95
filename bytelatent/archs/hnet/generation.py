"""An ``HNet`` run incrementally: each new byte goes through the model's own modules with caches.

Everything an H-Net computes at position t depends on positions <= t only: the encoder and decoder
attend causally in a window, routing reads the encoder states at t-1 and t, a chunk starts at a
boundary, the main network attends causally over chunks and the EMA that spreads chunk states back
to bytes runs forward. So a byte appended to a row changes nothing before it, and the state a
stage keeps per row is

* the KV caches of its encoder and decoder blocks (``cache.CachedStack``, the blocks' own
  ``forward`` with a cache: windowed, document-causal masks);
* its last encoder output (routing's x_{t-1});
* the EMA state z of its last chunk (the model's fp32 island) and the output its bytes read.

A new position whose router says "boundary" is a new chunk: it goes one position through the next
stage (or the main network, with its own KV caches) and one EMA step; otherwise the byte reads the
current chunk's EMA output. Document starts (the byte after an EOS) are forced boundaries, reset
the EMA and start a new document in every cache, as in the model's packed-row forward.

The prompt of a row is prefilled in one forward per stage (its chunks in one call of the next
stage); generation then steps every row by one byte.

Host syncs (tests/generation/test_device_syncs.py counts them on device-tagged tensors): one
device-to-host read per stage that runs, the new positions' boundary flags (which rows grow a
chunk: the inner caches' books and the chunk level's width and order come from them). A step
runs stage 0, and stage s + 1 only when stage s closed a chunk in some row: 1 to ``len(stages)``
reads per step, besides the caller's read of the sampled bytes (``sampling.sample_rows``); a
prefill reads as many per row. Document starts, positions and chunk orders reach the device by
non-blocking pinned copies (``cache.to_device``); prompts are given as host tensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bytelatent.archs.hnet.dc.chunking import boundaries_first, dechunk_step
from bytelatent.archs.hnet.dc.residual import merge_residual
from bytelatent.archs.hnet.model import _KERNEL_DTYPES, HNet, HNetStage
from bytelatent.data.chat import MARKER_IDS
from bytelatent.eval.generation.cache import CachedStack, to_device
from bytelatent.model.layers import KVCache


def _after_marker(last: int | None) -> bool:
    """Training forces a chunk start after each chat-template marker (data/chat.py)."""
    return last is not None and last in MARKER_SET


MARKER_SET = frozenset(MARKER_IDS.tolist())


class _Plan:
    """Which positions a stage call appends: ``row`` (prefill: T positions of one row) or, with
    ``row`` None, one position for every row of the batch, kept where ``advance`` is True."""

    def __init__(
        self,
        starts: torch.Tensor,
        row: int | None,
        advance: list[bool] | None,
        forced: torch.Tensor | None = None,
    ) -> None:
        self.starts = starts  # [N, T] bool on the host: the position starts a document
        # [N, T] bool: the position must start a chunk (a document start, or after a chat marker)
        self.forced = starts if forced is None else forced
        self.row = row
        self.advance = advance

    def caches(self, stack: CachedStack) -> list[KVCache]:
        if self.row is not None:
            if bool(self.starts[0, 0]):
                stack.begin_document(self.row)
            is_eos = torch.zeros_like(self.starts)
            is_eos[:, :-1] = self.starts[:, 1:]  # a document ends before the next one starts
            return stack.prefill_caches(self.row, is_eos)
        for b, on in enumerate(self.advance):
            if on and bool(self.starts[b, 0]):
                stack.begin_document(b)
        return stack.step_caches([False] * len(self.advance), self.advance)


class _StageState:
    """Per-row state of stage ``index`` (see the module doc)."""

    def __init__(
        self,
        stage: HNetStage,
        batch: int,
        capacity: int,
        like: torch.Tensor,
        window: int,
        max_seqlen: int,
    ) -> None:
        self.stage = stage

        def stack(blocks) -> CachedStack | None:
            if len(blocks) == 0:
                return None
            return CachedStack(
                blocks, batch, capacity, "local_block_causal", window, like, max_seqlen
            )

        self.encoder, self.decoder = stack(stage.encoder), stack(stage.decoder)
        dim = stage.block_args.dim
        self.prev = like.new_zeros(batch, dim)  # the last encoder output (routing's x_{t-1})
        # the EMA state (compute dtype: fp32 at least) and the output its bytes read
        self.ema = torch.zeros(
            batch, dim, dtype=torch.promote_types(like.dtype, torch.float32), device=like.device
        )
        self.spread = like.new_zeros(batch, dim)

    def run(self, stack: CachedStack | None, blocks, h: torch.Tensor, plan: _Plan) -> torch.Tensor:
        if stack is None:
            return h
        return self.stage.run_blocks_cached(blocks, h, plan.caches(stack))


class IncrementalHNet:
    """Prefill rows one at a time, then step every row by one byte (``CachedEngine``)."""

    def __init__(self, model: HNet, batch: int, capacity: int) -> None:
        args = model.args
        if capacity > args.max_seqlen:
            raise ValueError(f"{capacity} tokens exceed the model's max_seqlen={args.max_seqlen}")
        self.model = model
        self.eos_id = args.eos_id
        self.kernel_dtype = _KERNEL_DTYPES[args.kernel_dtype]
        like = next(model.parameters())  # the model's dtype and device
        self.device = like.device
        self.stages = [
            _StageState(stage, batch, capacity, like, stage_args.sliding_window, args.max_seqlen)
            for stage, stage_args in zip(model.stages, args.stages)
        ]
        glob = model.global_transformer
        self.main = CachedStack(
            glob.layers,
            batch,
            capacity,
            glob.args.attn_bias_type,
            None,
            like,
            args.max_seqlen,
        )
        self.last = [None] * batch  # the last token fed per row (a document starts after EOS)

    @classmethod
    def for_engine(cls, model, patcher_args, entropy_model, batch: int, capacity: int):
        """The hnet spec's generation engine (`ArchSpec.generation_engine`, `CachedEngine`)."""
        return cls(model, batch, capacity)

    def prefill_last(self, row: int, tokens: torch.Tensor) -> torch.Tensor:
        """`prefill`, returning the next token's logits [V] only."""
        return self.prefill(row, tokens)[-1]

    def patch_lengths(self, row: int, n_tokens: int) -> None:
        return None  # the chunks are the model's own business, not a patcher's

    @torch.no_grad()
    def prefill(self, row: int, tokens: torch.Tensor) -> torch.Tensor:
        """Append the 1-D ``tokens`` (host: a device tensor costs a read) to row ``row``; returns
        logits [T, V] for each of them."""
        host = tokens.tolist()
        previous = [self.last[row], *host[:-1]]
        starts = [self._starts_document(t) for t in previous]
        starts[1:] = [t == self.eos_id for t in host[:-1]]
        forced = [s or _after_marker(t) for s, t in zip(starts, previous)]
        self.last[row] = host[-1]
        plan = _Plan(torch.tensor([starts]), row, None, torch.tensor([forced]))
        h = self.model.embed(to_device([host], self.device))
        return self.model.head(self._stage(0, h, plan))[0]

    @torch.no_grad()
    def step(self, tokens: list[int], advance: list[bool]) -> torch.Tensor:
        """One token per row (host lists; frozen rows, advance False, keep their state) ->
        logits [B, V] on the model's device."""
        starts = [self._starts_document(last) for last in self.last]
        forced = [s or _after_marker(last) for s, last in zip(starts, self.last)]
        self.last = [t if on else last for t, on, last in zip(tokens, advance, self.last)]
        forced_tensor = torch.tensor(forced)[:, None]
        plan = _Plan(torch.tensor(starts)[:, None], None, list(advance), forced_tensor)
        h = self.model.embed(to_device(tokens, self.device)[:, None])
        return self.model.head(self._stage(0, h, plan))[:, 0]

    def _starts_document(self, last: int | None) -> bool:
        return last is None or last == self.eos_id

    def _stage(self, index: int, h: torch.Tensor, plan: _Plan) -> torch.Tensor:
        """Stage ``index`` on new positions h [N, T, D] -> its decoder output [N, T, D]."""
        state = self.stages[index]
        stage = state.stage
        h = state.run(state.encoder, stage.encoder, h, plan)
        rows = slice(None) if plan.row is None else slice(plan.row, plan.row + 1)
        with torch.autocast(h.device.type, enabled=False):
            residual = stage.residual_proj(h)
        # routing of each new position from (previous encoder output, its own)
        pairs = torch.cat((state.prev[rows, None].to(h.dtype), h), dim=1)
        starts = to_device(F.pad(plan.forced, (1, 0), value=True), self.device)
        routing = stage.routing_module(pairs, starts=starts)
        prob = routing.boundary_prob[:, 1:]
        selected = routing.selected_probs[:, 1:]
        boundary = routing.boundary_mask[:, 1:]
        if plan.row is None:
            on = to_device(plan.advance, self.device)
            boundary = boundary & on[:, None]
            state.prev = torch.where(on[:, None], h[:, -1], state.prev)
        else:
            state.prev[plan.row] = h[0, -1]
        spread = self._dechunk(index, h, boundary, prob, plan)
        with torch.autocast(h.device.type, enabled=False):
            merged = merge_residual(spread.float(), residual, selected)
        return state.run(state.decoder, stage.decoder, merged.to(h.dtype), plan)

    def _dechunk(
        self, index: int, h: torch.Tensor, boundary: torch.Tensor, prob: torch.Tensor, plan: _Plan
    ) -> torch.Tensor:
        """The EMA output each new position reads [N, T, D]: new chunks (boundaries) go through
        the main network and one EMA step each; other positions read their chunk's output."""
        state = self.stages[index]
        # the one read of the stage: which rows grow a chunk (the inner caches' books, the
        # chunk level's width)
        host_boundary = boundary.cpu()
        counts = host_boundary.sum(-1)
        if not bool(counts.any()):
            rows = slice(None) if plan.row is None else slice(plan.row, plan.row + 1)
            return state.spread[rows, None].expand_as(h)
        # ChunkLayer's padded gather, with the width and order from the host flags (the layer
        # itself would read the width back from the device)
        width = int(counts.max())
        order = boundaries_first(host_boundary)[:, :width]
        device_order = to_device(order, self.device)
        chunks = h.gather(1, device_order[..., None].expand(-1, -1, h.shape[-1]))
        real = torch.arange(width) < counts[:, None]
        inner_starts = plan.starts.gather(1, order) & real
        inner_forced = plan.forced.gather(1, order) & real
        if plan.row is None:
            inner_plan = _Plan(inner_starts, None, host_boundary[:, 0].tolist(), inner_forced)
        else:
            inner_plan = _Plan(inner_starts, plan.row, None, inner_forced)
        inner = self._main(index, state.stage.to_inner(chunks), inner_plan)
        inner = inner[..., : h.shape[-1]]
        chunk_prob = prob.gather(1, device_order[..., None].expand(-1, -1, 2))
        resets = to_device(inner_starts, self.device)
        with torch.autocast(h.device.type, enabled=False):
            if plan.row is None:
                ema, out = dechunk_step(
                    state.ema,
                    inner[:, 0],
                    chunk_prob[:, 0],
                    resets[:, 0],
                    kernel_dtype=self.kernel_dtype,
                )
                grew = boundary[:, 0, None]
                state.ema = torch.where(grew, ema, state.ema)
                state.spread = torch.where(grew, out, state.spread)
                return state.spread[:, None]
            # a prefill: the row's chunks one EMA step each, then every position reads the
            # output of the last chunk at or before it (the row's previous chunk before the first)
            outs = [state.spread[plan.row]]
            ema = state.ema[plan.row : plan.row + 1]
            for k in range(width):
                ema, out = dechunk_step(
                    ema,
                    inner[:, k],
                    chunk_prob[:, k],
                    resets[:, k],
                    kernel_dtype=self.kernel_dtype,
                )
                outs.append(out[0])
            state.ema[plan.row] = ema[0]
            state.spread[plan.row] = outs[-1]
            source = boundary[0].long().cumsum(0)  # 0: the previous chunk
            return torch.stack(outs)[source][None]

    def _main(self, index: int, chunks: torch.Tensor, plan: _Plan) -> torch.Tensor:
        """The main network of stage ``index`` on its new chunks: the next stage, or the global
        transformer with its KV caches."""
        if index + 1 < len(self.stages):
            return self._stage(index + 1, chunks, plan)
        return self.model.global_transformer(chunks, None, cache=plan.caches(self.main))
