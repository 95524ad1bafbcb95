"""H-Net (Hwang, Wang, Gu 2025) over our transformer blocks: dynamic chunking, 1 or more stages.

``HNet(args)(tokens [B, L]) -> (logits [B, L, V] float32, aux)``. Stage s (outermost s = 0):

    h   = encoder_s(h)                               local_block_causal blocks (sliding window)
    r   = residual_proj_s(fp32 h)                    fp32 skip path
    p   = routing_s(h)                               boundary probabilities (cosine of neighbours)
    c   = chunk(h, p > 0.5)                          [B, M, D_s] chunk states, right-padded
    c   = main_s(pad(c, D_{s+1}))[..., :D_s]         stage s+1, or the global transformer
    h   = decoder_s(dechunk(c, p) * STE(p) + r)      EMA of chunk states back to positions

Rows are fixed-length and hold packed documents (a document ends at ``eos_id``); the padded
layout of ``bytelatent.archs.hnet.dc`` is used with every document start forced to be a chunk
start (p = 1) and the EMA restarted there, which is the official packed (varlen) semantics.
Attention never crosses a document (block-causal masks per stage from the document starts).

``aux``: ``ratio_loss`` (Σ_s α_s · ratio loss_s, the term the trainer adds to the objective) and
metrics-only statistics ``ratio_loss/stage{s}`` (unweighted), ``chunk_len_mean/stage{s}`` (input
positions of stage s per chunk; compare with N_s) and ``bytes_per_chunk/stage{s}`` (bytes per
chunk of stage s).
"""

from __future__ import annotations

import torch
from torch import nn

from bytelatent.archs.hnet.args import HNetArgs
from bytelatent.archs.hnet.dc.chunking import ChunkLayer, boundaries_first, dechunk
from bytelatent.archs.hnet.dc.ratio_loss import loss_from_statistics
from bytelatent.archs.hnet.dc.residual import ResidualProjection, merge_residual
from bytelatent.archs.hnet.dc.routing import RoutingModule
from bytelatent.data.chat import MARKER_IDS
from bytelatent.distributed.tp_plan import TPPlan
from bytelatent.model.attention import resolve_backend, self_attn_mask
from bytelatent.model.cpu_bf16 import Linear
from bytelatent.model.global_transformer import GlobalTransformer
from bytelatent.model.layers import (
    KVCache,
    RMSNorm,
    RotaryEmbedding,
    TransformerBlock,
    init_std_factor,
)

_KERNEL_DTYPES = {None: None, "fp32": torch.float32, "bf16": torch.bfloat16}
NO_EOS = -1  # a token id no position holds (chunk-level document ends are marked eos_id)


class HNetStage(nn.Module):
    """Encoder, router, residual projection and decoder of one stage (its main network is the
    next stage or the global transformer, called by `HNet`)."""

    def __init__(self, args: HNetArgs, index: int) -> None:
        super().__init__()
        stage = args.stages[index]
        block_args = args.stage_block_args(index)
        self.block_args = block_args
        self.window = stage.sliding_window
        self.encoder = nn.ModuleList(
            TransformerBlock(block_args) for _ in range(stage.n_layers_encoder)
        )
        self.decoder = nn.ModuleList(
            TransformerBlock(block_args) for _ in range(stage.n_layers_decoder)
        )
        self.rope_embeddings = RotaryEmbedding(
            theta=args.rope_theta, head_dim=stage.dim // stage.n_heads, max_seqlen=args.max_seqlen
        )
        self.routing_module = RoutingModule(stage.dim)
        self.chunk_layer = ChunkLayer()
        self.residual_proj = ResidualProjection(stage.dim)
        extra = args.width(index + 1) - stage.dim
        # the official code pads the chunk states to the inner width with a learned vector
        self.pad_dimension = nn.Parameter(torch.zeros(extra)) if extra > 0 else None

    def run_blocks(
        self, blocks: nn.ModuleList, h: torch.Tensor, doc_ends: torch.Tensor, backend: str
    ) -> torch.Tensor:
        if len(blocks) == 0:
            return h
        tokens = doc_ends.long() * self.block_args.eos_id
        mask = self_attn_mask(
            "local_block_causal", tokens, self.block_args.eos_id, self.window, backend
        )
        freqs = self.rope_embeddings(seqlen=h.shape[1])
        for block in blocks:
            h = block(h, freqs, mask)
        return h

    def run_blocks_cached(
        self, blocks: nn.ModuleList, h: torch.Tensor, caches: list[KVCache]
    ) -> torch.Tensor:
        """``run_blocks`` for positions that follow cached ones (generation): one KV cache per
        block, whose step (``eval.generation.cache.CachedStack``) gives positions and masks."""
        for block, cache in zip(blocks, caches, strict=True):
            h = block(h, self.rope_embeddings.freqs_cis, None, cache=cache)
        return h

    def to_inner(self, chunks: torch.Tensor) -> torch.Tensor:
        """Chunk states ``[B, M, D_s]`` padded to the main network's width with the learned
        pad vector (the main network's output is cut back to ``D_s``)."""
        if self.pad_dimension is None:
            return chunks
        pad = self.pad_dimension.to(chunks.dtype).expand(*chunks.shape[:-1], -1)
        return torch.cat((chunks, pad), dim=-1)

    @torch.no_grad()
    def init_weights(self, args: HNetArgs) -> None:
        b = self.block_args
        self.rope_embeddings.reset_parameters()
        for blocks in (self.encoder, self.decoder):
            for depth, block in enumerate(blocks):
                factor = init_std_factor(b.init_std_factor, depth, len(blocks), b.dim)
                block.init_weights(b.init_base_std, factor)
        self.routing_module.init_weights()
        self.residual_proj.init_weights()
        if self.pad_dimension is not None:
            self.pad_dimension.zero_()


class HNet(nn.Module):
    """tokens [B, L] -> (logits [B, L, V] float32, {aux name: scalar}); see the module doc."""

    def __init__(self, args: HNetArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.stages[0].dim)
        self.stages = nn.ModuleList(HNetStage(args, i) for i in range(len(args.stages)))
        # the stage pads its chunks to the global width: no input projection
        block_args = args.global_block_args()
        self.global_transformer = GlobalTransformer(block_args, block_args.dim, args.eos_id)
        self.norm = RMSNorm(args.stages[0].dim, eps=args.norm_eps)
        self.output = Linear(args.stages[0].dim, args.vocab_size, bias=False)

    def forward(
        self, tokens: torch.Tensor, host: object | None = None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``host`` (the batch's host arrays) is accepted and unused: chunk-level documents
        exist only on the device."""
        starts = torch.zeros_like(tokens, dtype=torch.bool)
        starts[:, 0] = True
        starts[:, 1:] = tokens[:, :-1] == self.args.eos_id  # the byte after an EOS
        # a chunk also starts after each chat-template marker (data/chat.py): none spans a turn
        forced = starts.clone()
        forced[:, 1:] |= torch.isin(
            tokens[:, :-1], torch.as_tensor(MARKER_IDS, device=tokens.device)
        )
        backend = resolve_backend(self.args.attn_impl, tokens.device)
        stats: list[dict[str, torch.Tensor]] = []
        h = self.embed(tokens)
        h = self._stage(0, h, torch.ones_like(starts), (starts, forced), backend, stats)
        return self.head(h), self._aux(stats, tokens.numel())

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token ids ``[...]`` -> stage-0 inputs ``[..., D_0]``."""
        return self.tok_embeddings(tokens)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Byte states ``[..., D_0]`` -> logits ``[..., V]`` float32 (final norm, output)."""
        return self.output(self.norm(h)).float()

    def _stage(
        self,
        index: int,
        h: torch.Tensor,
        mask: torch.Tensor,
        starts_forced: tuple[torch.Tensor, torch.Tensor],
        backend: str,
        stats: list[dict[str, torch.Tensor]],
    ) -> torch.Tensor:
        """``starts_forced``: document starts (attention, EMA resets) and forced chunk starts
        (document starts and turn starts)."""
        starts, forced = starts_forced
        stage = self.stages[index]
        doc_ends = _document_ends(starts, mask)
        h = stage.run_blocks(stage.encoder, h, doc_ends, backend)
        device_type = h.device.type
        with torch.autocast(device_type, enabled=False):
            residual = stage.residual_proj(h)  # fp32, as the official "residual in fp32"
        routing = stage.routing_module(h, mask=mask, starts=forced)
        chunks = stage.chunk_layer(h, routing.boundary_mask, mask=mask)
        width = chunks.hidden_states.shape[1]
        order = boundaries_first(routing.boundary_mask)[:, :width]
        inner_starts = starts.gather(1, order) & chunks.mask
        inner_forced = forced.gather(1, order) & chunks.mask
        stats.append(_stage_stats(self.args.stages[index].target_ratio, routing, mask))
        inner = stage.to_inner(chunks.hidden_states)
        if index + 1 < len(self.stages):
            inner_pair = (inner_starts, inner_forced)
            inner = self._stage(index + 1, inner, chunks.mask, inner_pair, backend, stats)
        else:
            inner = self.global_transformer(inner, _document_ends(inner_starts, chunks.mask))
        inner = inner[..., : h.shape[-1]]
        with torch.autocast(device_type, enabled=False):
            spread = dechunk(
                inner,
                routing.boundary_mask,
                routing.boundary_prob,
                kernel_dtype=_KERNEL_DTYPES[self.args.kernel_dtype],
                block_size=self.args.ema_block_size,
                starts=starts,
            )
            merged = merge_residual(spread.float(), residual, routing.selected_probs)
        return stage.run_blocks(stage.decoder, merged.to(h.dtype), doc_ends, backend)

    def _aux(self, stats: list[dict[str, torch.Tensor]], n_bytes: int) -> dict[str, torch.Tensor]:
        aux: dict[str, torch.Tensor] = {}
        total = torch.zeros((), dtype=torch.float32, device=stats[0]["loss"].device)
        for s, (stage_args, st) in enumerate(zip(self.args.stages, stats)):
            total = total + stage_args.ratio_loss_weight * st["loss"]
            aux[f"ratio_loss/stage{s}"] = st["loss"].detach()
            aux[f"chunk_len_mean/stage{s}"] = st["positions"] / st["chunks"].clamp(min=1)
            aux[f"bytes_per_chunk/stage{s}"] = n_bytes / st["chunks"].clamp(min=1)
        aux["ratio_loss"] = total
        return aux

    @torch.no_grad()
    def init_weights(self) -> None:
        """Blocks: trunc normal ±3σ (σ = init_base_std or dim^-0.5 / the init_std_factor rule);
        routers W_q = W_k = I, residual projections W = 0 (official); embedding and output
        σ = dim^-0.5; norms 1; pad vectors 0."""
        for stage in self.stages:
            stage.init_weights(self.args)
        self.global_transformer.init_weights()
        self.norm.reset_parameters()
        std = self.args.stages[0].dim ** -0.5
        for weight in (self.tok_embeddings.weight, self.output.weight):
            nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-3 * std, b=3 * std)

    def ac_units(self) -> list[nn.Module]:
        """Every transformer block, in forward order (encoders outside-in, global, decoders)."""
        encoders = [block for stage in self.stages for block in stage.encoder]
        decoders = [block for stage in reversed(self.stages) for block in stage.decoder]
        return [*encoders, *self.global_transformer.layers, *decoders]

    def fsdp_units(self) -> list[nn.Module]:
        """The embedding, every block (`ac_units`), the residual projections (units of their
        own, gathered in fp32: `ResidualProjection.fsdp_param_dtype`) and the output head;
        routers, pad vectors and the final norm stay with the root."""
        residuals = [stage.residual_proj for stage in self.stages]
        return [self.tok_embeddings, *self.ac_units(), *residuals, self.output]

    def tp_plan(self, tp_size: int) -> TPPlan:
        """Tensor parallelism (`distributed.parallelize.apply_tp`): every transformer block
        (each stage's encoder and decoder, the global transformer) splits its heads and FFN
        width, replicated in and out. Routing, chunking, the EMA, the residual projections, the
        embedding and the head act on full hidden states and stay replicated over the TP group
        (`check_hnet_run` checks that tp_size divides every block's heads)."""
        stage_blocks = [
            blocks for stage in self.stages for blocks in (stage.encoder, stage.decoder)
        ]
        return TPPlan(blocks=[*stage_blocks, self.global_transformer.layers])

    def num_params(self, exclude_embeddings: bool = False) -> int:
        total = sum(p.numel() for p in self.parameters())
        return total - (self.tok_embeddings.weight.numel() if exclude_embeddings else 0)


def _document_ends(starts: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, M] bool: the position before each document start (and the last valid position)."""
    ends = torch.zeros_like(starts)
    ends[:, :-1] = starts[:, 1:]
    return ends & mask


def _stage_stats(target_ratio: float, routing, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """The stage's ratio loss over its valid positions (the official packed form: padding,
    which only inner stages have, is not counted) and its chunk counts."""
    # masked sums, not boolean indexing: no host sync (the selected count would be data-dependent)
    valid = mask.float()
    positions = valid.sum()
    chunks = (routing.boundary_mask & mask).float().sum()
    mean_prob = (routing.boundary_prob[..., 1].float() * valid).sum() / positions.clamp(min=1)
    loss = loss_from_statistics(chunks / positions.clamp(min=1), mean_prob, target_ratio)
    return {"loss": loss, "positions": positions, "chunks": chunks}
