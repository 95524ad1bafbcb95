"""The backend protocol, the base of every backend's mask, the registry and the dispatch.

A backend (``AttentionBackend``) turns a mask spec (``masks.MaskSpec``) into the representation it
runs (a subclass of ``AttnMask`` defined in the backend's module), once per forward, and runs
attention under it. Each backend module registers one instance at import
(``register_backend``); the package imports every backend module (xformers itself is imported only
when a mask is built for it). A model picks its backend once (``select_backend``: the config's
``attn_impl``, or sdpa where that cannot run), builds each mask once per forward for it, and every
layer's ``attend`` runs the mask on the backend it was built for.
"""

from __future__ import annotations

import logging
from typing import ClassVar, Protocol

import torch

from bytelatent.model.args import BACKENDS
from bytelatent.model.attention.masks import (
    Causal,
    Dense,
    HostDocuments,
    MaskSpec,
    check_kind,
    self_attn_spec,
)

logger = logging.getLogger(__name__)


class AttnMask:
    """A mask in the representation of the backend that runs it; each backend's module defines
    its variants (sdpa: ``SdpaCausal``, ``SdpaDense``, ``SdpaBanded``, ...; flex: ``FlexMask``;
    xformers: ``XformersBlockDiagonal``, ...) and ``backend`` names the backend ``attend`` runs
    them on.

    ``query_has_key`` ([B,1,Q,1] bool, on variants that can have them) is set when some query
    rows may allow no key at all: those rows were opened up in the mask (so that no kernel sees an
    empty row, which some produce NaN for; a flex BlockMask leaves them empty) and ``attend``
    writes zeros to them.
    """

    backend: ClassVar[str]
    query_has_key: torch.Tensor | None = None

    @classmethod
    def causal(cls, backend: str = "sdpa") -> AttnMask:
        """Plain causal attention (query i sees keys j <= i, aligned at the top-left)."""
        return build_mask(Causal(), backend)

    @classmethod
    def from_dense(
        cls, allowed: torch.Tensor, may_have_empty_rows: bool = True, backend: str = "sdpa"
    ) -> AttnMask:
        """A bool tensor [B|1, 1, Q, K] (True = attend) as ``backend``'s mask (see ``Dense``)."""
        return build_mask(Dense(allowed, may_have_empty_rows), backend)


class AttentionBackend(Protocol):
    """What every attention backend provides (one instance per backend, registered by name)."""

    name: str  # the config's attn_impl (one of model.args.BACKENDS)

    def unavailable_reason(self, device: torch.device) -> str | None:
        """None when the backend runs on ``device``, else why not (``select_backend`` then
        falls back to sdpa, which runs the same masks)."""
        ...

    def build(self, spec: MaskSpec) -> AttnMask:
        """The representation of ``spec`` this backend runs; built once per forward and shared
        by every layer that uses the same mask."""
        ...

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttnMask
    ) -> torch.Tensor:
        """Softmax attention of q [B,H,Q,D] over k/v [B,H,K,D] (as many heads: ``attend`` has
        repeated GQA heads); rows flagged by ``mask.query_has_key`` may hold anything."""
        ...


_BACKENDS: dict[str, AttentionBackend] = {}
_warned_fallbacks: set[tuple[str, str]] = set()


def register_backend(backend: AttentionBackend) -> AttentionBackend:
    """Make ``backend`` reachable by its name (which a config must be able to name)."""
    if backend.name not in BACKENDS:
        raise ValueError(
            f"attention backend {backend.name!r} is not in bytelatent.model.args.BACKENDS "
            f"{BACKENDS}: add it there so that configs can select it"
        )
    _BACKENDS[backend.name] = backend
    return backend


def get_backend(name: str) -> AttentionBackend:
    """The registered backend called ``name``."""
    backend = _BACKENDS.get(name)
    if backend is None:
        hint = (
            " (fmha attends without any mask in the reference; use sdpa)" if name == "fmha" else ""
        )
        raise ValueError(f"unknown attention backend {name!r}; expected one of {BACKENDS}{hint}")
    return backend


def select_backend(attn_impl: str, device: torch.device | str) -> AttentionBackend:
    """The backend to actually run ``attn_impl`` on ``device``.

    flex_attention and xformers need CUDA (and xformers must be importable); elsewhere this logs
    once and falls back to sdpa, which runs exactly the same masks.
    """
    backend = get_backend(attn_impl)
    device = torch.device(device)
    reason = backend.unavailable_reason(device)
    if reason is None:
        return backend
    if (attn_impl, device.type) not in _warned_fallbacks:
        _warned_fallbacks.add((attn_impl, device.type))
        logger.warning("attn_impl=%s: %s; using sdpa with the same masks", attn_impl, reason)
    return get_backend("sdpa")


def resolve_backend(attn_impl: str, device: torch.device | str) -> str:
    """The name of ``select_backend(attn_impl, device)``."""
    return select_backend(attn_impl, device).name


def build_mask(spec: MaskSpec, backend: str = "sdpa") -> AttnMask:
    """``spec`` in ``backend``'s representation (once per forward; share it across layers)."""
    return get_backend(backend).build(spec)


def self_attn_mask(
    kind: str | None,
    tokens: torch.Tensor,
    eos_id: int = 2,
    window: int | None = None,
    backend: str = "sdpa",
    docs: HostDocuments | None = None,
) -> AttnMask:
    """Build the self-attention mask of ``kind`` for packed rows ``tokens`` [B,S] once per forward.

    kind: None/"causal", "block_causal" or "local_block_causal" (needs ``window``). Each backend
    gets only the representation it runs: sdpa a causal flag, a dense mask (plus a CPU plan) or,
    for a local mask over a row much longer than the window, a band (see ``SdpaBanded``); flex a
    BlockMask built from per-position document starts (never an S x S tensor); xformers a
    block-diagonal bias over the flattened batch, whose document lengths come from ``docs`` (the
    batch's host copy: no device sync) when given, else from ``tokens`` (one device-to-host copy).
    """
    check_kind(kind, window)
    runner = get_backend(backend)
    return runner.build(self_attn_spec(kind, tokens, eos_id, window, docs))


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: AttnMask,
    backend: str | None = None,
) -> torch.Tensor:
    """Softmax attention of q [B,H,Q,D] over k/v [B,Hkv,K,D] under ``mask``; returns [B,H,Q,D].

    Runs on ``mask.backend`` (``backend``, when given, overrides it: it must be able to run the
    mask, e.g. xformers runs sdpa's causal and dense masks; a mismatch raises). GQA: query head h
    uses kv head ``h // (n_heads // n_kv_heads)``, as the reference ``repeat_kv`` does.
    """
    runner = get_backend(mask.backend if backend is None else backend)
    n_heads, n_kv_heads = q.shape[1], k.shape[1]
    if n_heads != n_kv_heads:
        if n_heads % n_kv_heads != 0:
            raise ValueError(f"n_heads={n_heads} is not a multiple of n_kv_heads={n_kv_heads}")
        k = k.repeat_interleave(n_heads // n_kv_heads, dim=1)
        v = v.repeat_interleave(n_heads // n_kv_heads, dim=1)
    out = runner.attend(q, k, v, mask)
    if mask.query_has_key is not None:
        out = out * mask.query_has_key.to(out.dtype)
    return out


def wrong_backend(mask: AttnMask, backend: str) -> ValueError:
    """The error of a backend handed a mask it has no way to run."""
    return ValueError(
        f"a mask built for {mask.backend} ({type(mask).__name__}) cannot run on {backend}; "
        f"build it with backend={backend!r}"
    )
