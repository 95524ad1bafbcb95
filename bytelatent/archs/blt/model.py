"""The Byte Latent Transformer: local byte encoder -> global patch transformer -> local byte decoder.

``ByteLatentTransformer(args)(tokens [B,N], patch_lengths [B,P]) -> logits [B,N,V]`` float32,
the same function as the reference (facebookresearch/blt) for every configuration the reference
can run (checked against its outputs in ``tests/model/test_blt_conformance.py``), and a defined,
trainable function for the others (see ``local_models``). Document/window masks hold on every
backend, training works on CPU, cross-attention without a window runs in O(N*k*dim) without
dense masks, ``init_weights`` works for every option, and ``model.dim`` sizes the global model
(docs/differences.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from bytelatent.archs.blt.args import ByteLatentTransformerArgs
from bytelatent.archs.blt.hashing import (
    compute_hash_embeddings,
    hash_table_specs,
    last_position_hash_embeddings,
)
from bytelatent.archs.blt.local_models import (
    LocalDecoder,
    LocalEncoder,
    PatchQueries,
)
from bytelatent.archs.blt.patch_utils import (
    PatchCrossMask,
    build_cross_mask,
    check_patch_lengths,
    concat_patches,
    decoder_patch_ids_from_lengths,
    host_patch_has_eos,
    patch_ids_from_lengths,
    pool_patches,
)
from bytelatent.archs.blt.subword import SubwordEmbedding, TeacherHead
from bytelatent.distributed.tp_plan import TPPlan
from bytelatent.errors import ConfigError
from bytelatent.model.attention import (
    HostBatch,
    HostDocuments,
    resolve_backend,
    self_attn_mask,
)
from bytelatent.model.global_transformer import GlobalTransformer
from bytelatent.model.patch_lengths import first_token_alone
from bytelatent.tokenizers.constants import OFFSET

# ByteLatentTransformerArgs lives in blt_args.py; importing it from here keeps working
__all__ = ["BltHostDocuments", "ByteLatentTransformer", "ByteLatentTransformerArgs", "Patcher"]


@dataclass(frozen=True, eq=False)
class BltHostDocuments:
    """A host batch with its documents worked out (``ByteLatentTransformer.host_documents``):
    a ``HostBatch`` that also holds the byte and patch documents. Built before a compiled forward
    (torch.compile of the whole model), the forward reads Python values from it (e.g. "every row
    is one document") instead of tracing numpy, so the mask choice is a guard, not a graph
    break. The eager forward builds one from a plain host batch itself."""

    x: np.ndarray
    patch_lengths: np.ndarray | None
    eos_id: int
    tokens: HostDocuments
    patches: HostDocuments | None


class Patcher(Protocol):
    """What ``patch_in_forward`` needs from a patcher (bytelatent.data.patcher.Patcher)."""

    def patch(
        self, tokens: torch.Tensor, include_next_token: bool = True
    ) -> tuple[torch.Tensor, Any]: ...


class ByteLatentTransformer(nn.Module):
    """tokens [B,N] long (+ patch_lengths [B,P]) -> logits [B,N,vocab+pm_size] float32.

    Build on the meta device, ``to_empty``, then ``init_weights()``. ``patch_lengths`` rows sum to
    N or N+1, start with a patch of length 1 and are right-padded with zeros. With
    ``patch_in_forward`` and a patcher (constructor argument or ``attach_patcher``),
    ``patch_lengths`` may be omitted and is computed with ``patcher.patch(tokens, include_next_token=True)``.
    The patcher is not a submodule: its weights never enter this model's state dict or optimizer.
    """

    def __init__(self, args: ByteLatentTransformerArgs, patcher: Patcher | None = None) -> None:
        super().__init__()
        self.args = args
        # False forces the dense-mask cross-attention path (same function; used by tests/benchmarks)
        self.structured_cross_attn = True
        self.local_encoder = LocalEncoder(args)
        self.global_transformer = GlobalTransformer(
            args.global_block_args(), args.global_input_dim(), args.eos_id, args.dropout
        )
        self.local_decoder = LocalDecoder(args)
        self.subword = (
            SubwordEmbedding(args.subword_vocab_size, args.dim, args.subword_max_bytes)
            if args.subword_vocab_size
            else None
        )
        self.teacher_head = (
            TeacherHead(args.subword_vocab_size, args.dim, args.subword_max_bytes, args.norm_eps)
            if args.teacher_head
            else None
        )
        dim_enc = args.dim_local_encoder
        self.encoder_hash_tok_embedding = None
        if args.encoder_hash_byte_group_size:
            n_tables = len(
                hash_table_specs(
                    args.encoder_hash_byte_group_size,
                    args.encoder_hash_byte_group_nb_functions,
                )
            )
            self.encoder_hash_tok_embedding = nn.ModuleList(
                nn.Embedding(args.encoder_hash_byte_group_vocab, dim_enc) for _ in range(n_tables)
            )
        ngram_sizes = args.ngram_sizes()
        self.encoder_ngram_embedding = (
            nn.ModuleList(nn.Embedding(size + OFFSET, dim_enc) for size in ngram_sizes.values())
            if ngram_sizes
            else None
        )
        self._patcher: Patcher | None = None
        if patcher is not None:
            self.attach_patcher(patcher)

    def attach_patcher(self, patcher: Patcher) -> None:
        """Use ``patcher`` when forward gets no patch_lengths (needs ``patch_in_forward``)."""
        if not self.args.patch_in_forward:
            raise ConfigError(
                "a patcher was attached but model.patch_in_forward is false; set it to true"
            )
        object.__setattr__(self, "_patcher", patcher)  # not a submodule on purpose

    def forward(
        self,
        tokens: torch.Tensor,
        patch_lengths: torch.Tensor | None = None,
        ngram_ids: torch.Tensor | None = None,
        host: HostBatch | None = None,
    ) -> torch.Tensor:
        """``host``: the batch's host arrays (tokens, and patch lengths when those were passed),
        from which xformers masks take their document lengths without a device sync."""
        args = self.args
        seq_len = tokens.shape[1]
        patch_lengths = self._checked_patch_lengths(tokens, patch_lengths)
        num_patches = patch_lengths.shape[1]
        backend = resolve_backend(args.attn_impl, tokens.device)
        docs = self.host_documents(host)
        patch_ids = patch_ids_from_lengths(patch_lengths, seq_len)
        local_mask = self_attn_mask(
            args.local_attn_kind(),
            tokens,
            eos_id=args.eos_id,
            window=args.local_attention_window_len,
            backend=backend,
            docs=None if docs is None else docs.tokens,
        )
        # local encoder: bytes -> byte states of every layer, and the global model's input
        embeds = self.byte_embeddings(tokens, ngram_ids)
        if args.cross_attn_encoder:
            cross_mask = self._cross_mask("encoder", patch_ids, num_patches, backend)
            patches = PatchQueries(patch_ids, num_patches, cross_mask)
            states = self.local_encoder(embeds, local_mask, patches=patches)
            h = patches.embeds.reshape(tokens.shape[0], num_patches, -1)
        else:
            states = self.local_encoder(embeds, local_mask)
            h = self.patch_inputs(states, patch_lengths, patch_ids, backend)
        if self.subword is not None:  # byteify: the token model's embedding of each patch
            h = self.subword(h, tokens, patch_lengths)
        # global transformer: one state per patch
        h = self.global_transformer(
            h,
            self._patch_has_eos(tokens, patch_ids, num_patches),
            None if docs is None else docs.patches,
        )
        # local decoder: byte states + the state of the last complete patch -> logits
        decoder_patch_ids = decoder_patch_ids_from_lengths(patch_lengths, seq_len)
        dec_cross = self._cross_mask("decoder", decoder_patch_ids, num_patches, backend)
        logits = self.local_decoder(states[-1], h, decoder_patch_ids, local_mask, dec_cross)
        if self.teacher_head is not None:  # byteify: the token model's head, byte by byte
            logits = self.teacher_head.add_prior(logits, h, tokens, patch_lengths)
        return logits

    def patch_inputs(
        self,
        states: list[torch.Tensor | None],
        patch_lengths: torch.Tensor,
        patch_ids: torch.Tensor | None = None,
        backend: str | None = None,
    ) -> torch.Tensor:
        """The global model's input [B,P,in] of the patches ``patch_lengths`` [B,P] (no padding
        patch past the bytes) from the encoder's byte states ``states`` (one [B,N,d] per layer,
        N = the bytes the patches cover; only the layers in ``patch_input_layers`` are read):
        encoder cross-attention slots, pooled byte states, or the concatenated last bytes of each
        patch. Training runs it on whole rows; generation on the bytes of a closing patch (and
        of the patches its window reads)."""
        args = self.args
        bsz, num_patches = patch_lengths.shape
        h_bytes = states[-1]
        if patch_ids is None:
            n_bytes = next(s for s in states if s is not None).shape[1]
            patch_ids = patch_ids_from_lengths(patch_lengths, n_bytes)
        if args.cross_attn_encoder:
            backend = backend or resolve_backend(args.attn_impl, patch_lengths.device)
            cross_mask = self._cross_mask("encoder", patch_ids, num_patches, backend)
            h_cross = self.local_encoder.encode_patches(states, patch_ids, num_patches, cross_mask)
            return h_cross.reshape(bsz, num_patches, -1)
        if args.pooling_modes():
            return pool_patches(h_bytes, patch_ids, num_patches, args.pooling_modes())
        return concat_patches(h_bytes, patch_lengths, int(args.patch_size))

    def patch_input_layers(self) -> list[int]:
        """The encoder layers whose byte states ``patch_inputs`` reads."""
        enc = self.local_encoder
        if self.args.cross_attn_encoder:
            return [i for i, c in enumerate(enc.cross_for_layer) if c is not None]
        return [len(enc.layers) - 1]

    def _checked_patch_lengths(
        self, tokens: torch.Tensor, patch_lengths: torch.Tensor | None
    ) -> torch.Tensor:
        seq_len = tokens.shape[1]
        if patch_lengths is None:
            patch_lengths = self._patch(tokens)
        patch_lengths = patch_lengths.to(device=tokens.device, dtype=torch.long)
        if not torch.compiler.is_compiling():  # data-dependent checks would break the graph
            check_patch_lengths(patch_lengths, seq_len)
        self._check_lengths(seq_len, patch_lengths.shape[1])
        return patch_lengths

    def _cross_mask(
        self, side: str, ids: torch.Tensor, num_patches: int, backend: str
    ) -> PatchCrossMask | None:
        """The cross-attention mask of ``side`` (None without cross-attention there)."""
        args = self.args
        if not getattr(args, f"cross_attn_{side}"):
            return None
        window = getattr(args, f"cross_attn_window_{side}")
        return build_cross_mask(
            side, ids, num_patches, args.cross_attn_k, window, backend, self.structured_cross_attn
        )

    def _patch_has_eos(
        self, tokens: torch.Tensor, patch_ids: torch.Tensor, num_patches: int
    ) -> torch.Tensor | None:
        """[B, P] bool for the global model's block_causal mask (None for other masks)."""
        if self.args.attn_bias_type != "block_causal":
            return None
        eos_count = torch.zeros(
            tokens.shape[0], num_patches, dtype=torch.long, device=tokens.device
        )
        return eos_count.scatter_add(1, patch_ids, (tokens == self.args.eos_id).long()) > 0

    def host_documents(self, host: HostBatch | None) -> BltHostDocuments | None:
        """The documents of a host batch (``host`` itself when it already is a BltHostDocuments
        for this model's eos_id). Call it before a compiled forward and pass the result as
        ``host``: the compiled graph then has no break for the single-document check."""
        if host is None:
            return None
        if isinstance(host, BltHostDocuments) and host.eos_id == self.args.eos_id:
            return host
        patches = self._patch_documents(host)
        docs = HostDocuments.from_tokens(host.x, self.args.eos_id)
        if not torch.compiler.is_compiling():
            # the Python facts the masks branch on, read now (traced, they would break the graph)
            for d in (docs, patches):
                if d is not None:
                    d.single_document  # noqa: B018
        return BltHostDocuments(host.x, host.patch_lengths, self.args.eos_id, docs, patches)

    def _patch_documents(self, host: HostBatch | None) -> HostDocuments | None:
        """The global model's documents from the host arrays (None: they come from the device)."""
        if host is None or host.patch_lengths is None or self.args.attn_bias_type != "block_causal":
            return None
        return HostDocuments(host_patch_has_eos(host.x, host.patch_lengths, self.args.eos_id))

    def _check_lengths(self, seq_len: int, num_patches: int) -> None:
        args = self.args
        if seq_len > args.max_encoder_seq_length:
            raise ConfigError(
                f"rows of {seq_len} bytes exceed model.max_encoder_seq_length="
                f"{args.max_encoder_seq_length}; raise it (it sizes the local position tables)"
            )
        if num_patches > args.max_seqlen:
            raise ConfigError(
                f"{num_patches} patches per row exceed model.max_seqlen={args.max_seqlen} "
                "(the global model's position table); raise it"
            )

    def _patch(self, tokens: torch.Tensor) -> torch.Tensor:
        if self._patcher is None:
            hint = (
                "attach a patcher (attach_patcher)"
                if self.args.patch_in_forward
                else "set model.patch_in_forward=true and attach a patcher"
            )
            raise ConfigError(
                f"forward got no patch_lengths and the model has no patcher: pass patch_lengths or {hint}"
            )
        patch_lengths, _ = self._patcher.patch(tokens, include_next_token=True)
        # static patches start at 0 and patch_size: the first token alone, as in training
        return first_token_alone(patch_lengths)

    @property
    def hash_window(self) -> int:
        """Bytes that the embedding of the last byte depends on (its longest hash n-gram)."""
        return max(self.args.encoder_hash_byte_group_size or [1])

    def last_byte_embeddings(self, recent: torch.Tensor) -> torch.Tensor:
        """Embeddings [B,1,d] of the last byte of ``recent`` [B, hash_window] (the row's last
        bytes, 0 before its start: the hash n-grams' own padding), as ``byte_embeddings`` gives
        them on the whole row."""
        if self.encoder_ngram_embedding is not None:
            raise ConfigError("byte embeddings of one byte need no encoder_ngram_to_size_str")
        args = self.args
        return last_position_hash_embeddings(
            recent,
            self.local_encoder.tok_embeddings,
            self.encoder_hash_tok_embedding,
            args.encoder_hash_byte_group_size,
            args.encoder_hash_byte_group_nb_functions,
            args.encoder_hash_byte_group_vocab,
        )

    def byte_embeddings(
        self, tokens: torch.Tensor, ngram_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Byte + hash n-gram (+ n-gram id) embeddings of tokens [B,N]: the encoder's input."""
        args = self.args
        embeds = compute_hash_embeddings(
            tokens,
            self.local_encoder.tok_embeddings,
            self.encoder_hash_tok_embedding,
            args.encoder_hash_byte_group_size,
            args.encoder_hash_byte_group_nb_functions,
            args.encoder_hash_byte_group_vocab,
        )
        if self.encoder_ngram_embedding is None:
            return embeds
        expected = (len(self.encoder_ngram_embedding), *tokens.shape)
        if ngram_ids is None or tuple(ngram_ids.shape) != expected:
            got = None if ngram_ids is None else tuple(ngram_ids.shape)
            raise ValueError(
                f"model.encoder_ngram_to_size_str is set: forward needs ngram_ids of shape {expected}, got {got}"
            )
        for table, ids in zip(self.encoder_ngram_embedding, ngram_ids):
            embeds = embeds + table(ids)
        return embeds

    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialise every parameter in place and recompute the RoPE tables (reference σ, §3.10)."""
        self.local_encoder.init_weights()
        self.global_transformer.init_weights()
        self.local_decoder.init_weights()
        if self.subword is not None:
            self.subword.init_weights(self.args.dim**-0.5)
        if self.teacher_head is not None:
            self.teacher_head.init_weights(self.args.dim**-0.5)
            # the decoder starts silent: the prior alone is the first prediction
            self.local_decoder.output.weight.zero_()
        std = self.args.dim_local_encoder**-0.5
        for table in [
            *(self.encoder_hash_tok_embedding or ()),
            *(self.encoder_ngram_embedding or ()),
        ]:
            nn.init.trunc_normal_(table.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)

    def fsdp_units(self) -> list[nn.Module]:
        """Modules to shard as separate FSDP units, in forward order.

        Hash/n-gram tables (each its own unit: they are the largest tensors), local encoder layers
        each followed by its cross-attention, global layers, local decoder cross-attention
        interleaved with its layers. Embedding, projections, norm and output stay with the root.
        """
        units: list[nn.Module] = [
            *(self.encoder_hash_tok_embedding or ()),
            *(self.encoder_ngram_embedding or ()),
        ]
        return units + self.ac_units()

    def ac_units(self) -> list[nn.Module]:
        """Blocks to activation-checkpoint and compile, in forward order: every local and global
        transformer layer and every cross-attention layer."""
        return [
            *_interleave(self.local_encoder, cross_after=True),
            *self.global_transformer.layers,
            *_interleave(self.local_decoder, cross_after=False),
        ]

    def tp_plan(self, tp_size: int) -> TPPlan:
        """Tensor parallelism (`distributed.parallelize.apply_tp`): only the global transformer's
        blocks are split (replicated in and out); the byte-level local models are small and stay
        replicated over the TP group."""
        return TPPlan(blocks=[self.global_transformer.layers])

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Number of parameters; ``exclude_embeddings`` drops the lookup tables (byte, hash, n-gram,
        learned positions), which cost no FLOPs."""
        total = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            total -= sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Embedding))
        return total


def _interleave(local: nn.Module, cross_after: bool) -> list[nn.Module]:
    """Layers and cross-attention layers in execution order: the encoder runs each layer's
    cross-attention just after the layer, the decoder just before it."""
    units: list[nn.Module] = []
    for layer, index in zip(local.layers, local.cross_for_layer):
        pair = None if index is None else local.cross_attn_layers[index]
        if pair is not None and not cross_after:
            units.append(pair)
        units.append(layer)
        if pair is not None and cross_after:
            units.append(pair)
    return units
