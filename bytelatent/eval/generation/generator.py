"""``Generator``: continue byte prompts with a BLT, an H-Net (arch: hnet), a byte LM (arch: lm)
or an entropy model checkpoint (the architecture registry says which engine runs it).

Prompts are encoded as the reference does (BOS, the UTF-8 bytes + 4, no EOS). Rows of a batch
may have different lengths: the byte LM prefills them in one right-padded forward (the BLT and
the H-Net one row at a time), then all rows advance one byte per step; a row's output does not
depend on its batch. ``use_cache=False`` re-runs the whole model every step (the correctness oracle).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from bytelatent.checkpoint.pretrained import load_any_checkpoint, load_entropy_checkpoint
from bytelatent.data.patcher import PatcherArgs, PatchingMode
from bytelatent.errors import CheckpointError, ConfigError, DataError
from bytelatent.eval.generation.engines import CachedEngine, RecomputeEngine, model_spec
from bytelatent.eval.generation.patching import refuse_offline_patching
from bytelatent.eval.generation.sampling import GenerationArgs, sample_rows
from bytelatent.eval.generation.speculative import SpeculativeEngine, SpeculativeStats
from bytelatent.model.registry import arch_name_from_params, get_arch
from bytelatent.tokenizers.constants import BOS_ID, EOS_ID, OFFSET

logger = logging.getLogger("bytelatent")


@dataclass
class GenerationResult:
    """One continuation: its token ids, bytes, text (invalid UTF-8 replaced) and why it ended."""

    prompt_tokens: list[int]
    tokens: list[int]
    finish_reason: str  # "eos", "stop", "length" (max_new_bytes), "context_limit" (model's max)
    patch_lengths: list[int] | None = None  # BLT: patches of prompt + continuation
    data: bytes = field(default=b"")

    @property
    def text(self) -> str:
        return self.data.decode("utf-8", errors="replace")


def encode_prompt(prompt: str | bytes) -> list[int]:
    data = prompt.encode("utf-8") if isinstance(prompt, str) else bytes(prompt)
    return [BOS_ID] + [b + OFFSET for b in data]


def token_bytes(tokens: Iterable[int]) -> bytes:
    """The bytes of byte tokens (special ids < OFFSET are dropped)."""
    return bytes(t - OFFSET for t in tokens if OFFSET <= t < OFFSET + 256)


def cast_parameters(model: nn.Module, dtype: torch.dtype) -> None:
    """Parameters to ``dtype`` in place (buffers such as RoPE tables keep theirs, as under FSDP
    mixed precision, which casts parameters only)."""
    for param in model.parameters():
        param.data = param.data.to(dtype)


class Generator:
    """Generation for a loaded model; ``entropy_model`` is needed for entropy-patched BLTs.

    Generation computes in the models' parameter dtype (caches and activations follow it;
    logits and entropies are float32); ``dtype`` (e.g. torch.bfloat16) casts the parameters first.
    """

    def __init__(
        self,
        model: nn.Module,
        patcher_args: PatcherArgs | None = None,
        entropy_model: nn.Module | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        if dtype is not None:
            for module in (model, entropy_model):
                if module is not None:
                    cast_parameters(module, dtype)
        self.model = model.eval()
        self.is_blt = model_spec(model).patched  # a patched architecture (the BLT)
        self.patcher_args = patcher_args
        self.entropy_model = entropy_model
        self._warned_context_limit = False
        # SpeculativeStats summed over the batches of the last `generate` (speculative_k > 0)
        self.speculative_stats: SpeculativeStats | None = None
        if self.is_blt:
            if patcher_args is None:
                raise ConfigError("a BLT needs patcher settings (data.patcher_args)")
            refuse_offline_patching(patcher_args)
            if patcher_args.patching_mode in (PatchingMode.entropy, PatchingMode.bpe_patcher) and (
                entropy_model is None
            ):
                raise ConfigError(
                    f"patching_mode={patcher_args.patching_mode.value} needs the entropy model: "
                    "pass entropy_ckpt=DIR"
                )
            if entropy_model is not None:
                entropy_model.eval().requires_grad_(False)
        model.requires_grad_(False)

    @property
    def max_tokens(self) -> int:
        """Longest row (BOS + bytes) the model takes."""
        args = self.model.args
        return args.max_encoder_seq_length if self.is_blt else args.max_seqlen

    def encode(
        self, prompts: list[str | bytes], truncate: bool = False, allow_empty: bool = False
    ) -> list[list[int]]:
        """Token rows; a too-long prompt is a DataError unless ``truncate`` keeps its end; an
        empty prompt is one unless ``allow_empty`` (the row is then just BOS)."""
        rows = []
        for index, prompt in enumerate(prompts):
            row = encode_prompt(prompt)
            if len(row) == 1 and not allow_empty:
                raise DataError(f"prompt {index} is empty; give at least one byte")
            if len(row) > self.max_tokens - 1:
                if not truncate:
                    raise DataError(
                        f"prompt {index} has {len(row) - 1} bytes; the model takes at most "
                        f"{self.max_tokens - 2} prompt bytes (BOS + prompt + 1 new byte)"
                    )
                row = [BOS_ID] + row[-(self.max_tokens - 2) :]  # keep BOS and the end
            rows.append(row)
        return rows

    def generate(
        self,
        prompts: list[str | bytes],
        args: GenerationArgs | None = None,
        truncate: bool = False,
        allow_empty: bool = False,
    ) -> list[GenerationResult]:
        args = args or GenerationArgs()
        rows = self.encode(prompts, truncate, allow_empty)
        self.speculative_stats = None
        results: list[GenerationResult] = []
        for first in range(0, len(rows), args.batch_size):
            results += self.generate_tokens(rows[first : first + args.batch_size], args)
        return results

    def _engine(self, rows: list[list[int]], args: GenerationArgs):
        if not args.use_cache:
            return RecomputeEngine(self.model, self.patcher_args, self.entropy_model)
        capacity = min(self.max_tokens, max(len(r) for r in rows) + args.max_new_bytes)
        return CachedEngine(self.model, self.patcher_args, self.entropy_model, capacity)

    @torch.no_grad()
    def generate_tokens(
        self, rows: list[list[int]], args: GenerationArgs
    ) -> list[GenerationResult]:
        """Continue token rows (each starting with BOS) as one batch."""
        if args.speculative_k > 0:
            engine = SpeculativeEngine(self, args.speculative_k, self.speculative_stats)
            self.speculative_stats = engine.stats  # adds up until the next `generate`
            return engine.generate_tokens(rows, args)
        engine = self._engine(rows, args)
        generators = [torch.Generator().manual_seed(args.seed) for _ in rows]
        new: list[list[int]] = [[] for _ in rows]
        reasons: list[str | None] = [None] * len(rows)
        stops = [s.encode("utf-8") for s in args.stop]
        # a patched model's result holds the prompt's patches: its engine starts even for 0 bytes
        logits = engine.start(rows) if args.max_new_bytes > 0 or self.is_blt else None
        if args.max_new_bytes == 0:
            reasons = ["length"] * len(rows)
        while any(r is None for r in reasons):
            open_rows = [b for b in range(len(rows)) if reasons[b] is None]
            for b, token in sample_rows(logits, args, generators, open_rows).items():
                reasons[b] = self._finish(rows[b], new[b], token, args, stops)
            active = [r is None for r in reasons]
            if not any(active):
                break
            last = [seq[-1] if seq else 0 for seq in new]
            logits = engine.advance(last, active)
        return [
            self._result(engine, b, rows[b], new[b], reasons[b], stops) for b in range(len(rows))
        ]

    def _finish(
        self, row: list[int], new: list[int], token: int, args: GenerationArgs, stops: list[bytes]
    ) -> str | None:
        """Record ``token``; the reason the row ends now, or None."""
        if token == EOS_ID and args.stop_at_eos:
            return "eos"
        new.append(token)
        if token in args.stop_ids:
            return "stop"
        if stops:
            data = token_bytes(new[-max(len(s) for s in stops) - 8 :])
            if any(data.endswith(s) for s in stops):
                return "stop"
        if len(new) >= args.max_new_bytes:
            return "length"
        if len(row) + len(new) >= self.max_tokens:
            self._warn_context_limit(len(row) - 1, len(new), args.max_new_bytes)
            return "context_limit"
        return None

    def _warn_context_limit(self, prompt_bytes: int, new_bytes: int, max_new_bytes: int) -> None:
        """Once per Generator: rows end at the model's maximum before max_new_bytes."""
        if self._warned_context_limit:
            return
        self._warned_context_limit = True
        logger.warning(
            "generation stopped at the model's context limit of %d tokens (BOS + prompt + new "
            "bytes): %d prompt + %d new bytes, fewer than max_new_bytes=%d; finish_reason is "
            "context_limit (the model has no sliding generation window)",
            self.max_tokens,
            prompt_bytes,
            new_bytes,
            max_new_bytes,
        )

    def _result(self, engine, b, row, new, reason, stops) -> GenerationResult:
        lengths = engine.patch_lengths(b, row + new) if self.is_blt else None
        data = token_bytes(new)
        if reason == "stop":
            for stop in stops:
                if data.endswith(stop):
                    data = data[: -len(stop)]
                    break
        return GenerationResult(row, new, reason, lengths, data)


def patcher_args_from_params(params: dict) -> PatcherArgs:
    """The patcher a BLT checkpoint was trained with (our data.patcher_args, or the reference's
    model-section patching_* settings, which its BLT forward uses)."""
    data = (params.get("data") or {}).get("patcher_args") or {}
    fields = {k: v for k, v in data.items() if k in PatcherArgs.model_fields}
    try:
        spec = get_arch(arch_name_from_params(params))
    except ValueError:
        spec = None  # an arch this process has not registered: our layout only
    read = spec.adapters.patcher_settings if spec is not None else None
    if read is not None:  # e.g. a reference BLT layout: its model section carries the patcher
        fields.update(read(params))
    fields.update(patching_device="auto", device="auto", realtime_patching=False)
    try:
        return PatcherArgs.model_validate(fields)
    except ValueError as exc:
        raise CheckpointError(f"params.json: patcher settings invalid: {exc}") from None


def _entropy_dir(ckpt: str, patcher_args: PatcherArgs, entropy_ckpt: str | None) -> str:
    if entropy_ckpt:
        return entropy_ckpt
    if patcher_args.entropy_model_checkpoint_dir:
        return patcher_args.entropy_model_checkpoint_dir
    sibling = os.path.join(os.path.dirname(os.path.abspath(ckpt.rstrip("/"))), "entropy_model")
    if os.path.exists(os.path.join(sibling, "params.json")):
        return sibling  # the released layout: blt_1b/ next to entropy_model/
    raise ConfigError(f"{ckpt}: entropy patching needs the entropy model; pass entropy_ckpt=DIR")


def load_generator(
    ckpt: str,
    device: str | torch.device = "cpu",
    entropy_ckpt: str | None = None,
    patcher_overrides: dict | None = None,
    dtype: torch.dtype | None = None,
    allow_arch_import: bool = False,
) -> Generator:
    """A Generator for a DCP step folder, a consolidated folder or a released-layout folder;
    ``dtype`` casts the parameters (e.g. torch.bfloat16 on GPU), None keeps the stored ones;
    ``allow_arch_import``: import the module a ``"pkg.module:name"`` arch in params.json names."""
    model, _, params = load_any_checkpoint(ckpt, device, allow_arch_import=allow_arch_import)
    if not model_spec(model).patched:
        return Generator(model, dtype=dtype)
    patcher_args = patcher_args_from_params(params)
    if patcher_overrides:
        try:
            patcher_args = PatcherArgs.model_validate(
                {**patcher_args.model_dump(), **patcher_overrides}
            )
        except ValueError as exc:
            raise ConfigError(f"patcher overrides invalid: {exc}") from None
    entropy_model = None
    if patcher_args.patching_mode in (PatchingMode.entropy, PatchingMode.bpe_patcher):
        where = _entropy_dir(ckpt, patcher_args, entropy_ckpt)
        entropy_model = load_entropy_checkpoint(where, device)
    return Generator(model, patcher_args, entropy_model, dtype)
