"""Transformer building blocks shared by the entropy model and BLT (reference parameter layout)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from bytelatent.model.args import INIT_STD_FACTORS, BlockArgs, RopeScalingArgs, block_head_counts
from bytelatent.model.attention import AttnMask, attend
from bytelatent.model.cpu_bf16 import Linear
from bytelatent.model.rope_scaling import scale_frequencies


class RMSNorm(nn.RMSNorm):
    """Root-mean-square norm with a learnable ``weight`` (initialised to 1 by reset_parameters).

    Under autocast the norm is computed in float32 and its output is written in the autocast
    dtype (every consumer is a linear that would cast it anyway). On CPU in eager mode the work
    runs in ``_RMSNormFunction`` (same forward, bitwise; a backward in fewer passes than
    autograd's decomposition of ``F.rms_norm``); without grad mode, under torch.compile, on
    other devices and for DTensors the plain ops run.
    """

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__(dim, eps=eps)
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device_type = x.device.type
        out_dtype = x.dtype
        if torch.is_autocast_enabled(device_type) and x.is_floating_point():
            out_dtype = torch.get_autocast_dtype(device_type)
        # without autograd (generation, evaluation) the fused op is the same forward, bitwise,
        # without the autograd.Function's per-call overhead
        if torch.is_grad_enabled() and _use_rmsnorm_function(x, self.weight):
            return _RMSNormFunction.apply(x, self.weight, self._eps(x), out_dtype)
        if x.dtype == self.weight.dtype:
            return super().forward(x).to(out_dtype)
        # Under autocast the input may be bf16 and the weight fp32: normalise in fp32 (the fused
        # kernel needs matching dtypes; mixing them falls back to a slow path with a warning).
        return F.rms_norm(x.float(), self.normalized_shape, self.weight, self.eps).to(out_dtype)

    def _eps(self, x: torch.Tensor) -> float:
        return torch.finfo(x.dtype).eps if self.eps is None else self.eps


def _use_rmsnorm_function(x: torch.Tensor, weight: torch.Tensor | None) -> bool:
    return (
        x.device.type == "cpu"
        and weight is not None
        and type(x) is torch.Tensor
        and type(weight.data) is torch.Tensor
        and weight.dtype == torch.float32
        and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and not torch.compiler.is_compiling()
    )


class _RMSNormFunction(torch.autograd.Function):
    """y = x * rsqrt(mean(x², -1) + eps) * weight in float32, returned as ``out_dtype``.

    The forward is the op sequence of ``F.rms_norm``'s CPU decomposition (bitwise equal); the
    backward computes dx = rstd * (g·w - x̂ · mean(g·w·x̂)) and dw = Σ g·x̂ in float32.
    """

    @staticmethod
    def forward(  # noqa: ANN001
        ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype
    ) -> torch.Tensor:
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True).add_(eps))
        out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
        torch.mul(xf * rstd, weight, out=out)
        ctx.save_for_backward(x, weight, rstd)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # noqa: ANN001
        x, weight, rstd = ctx.saved_tensors
        normed = x.float() * rstd
        grad = grad.float()
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = (grad * normed).flatten(0, -2).sum(0)
        scaled = grad * weight
        mean_dot = torch.linalg.vecdot(scaled, normed, dim=-1).unsqueeze(-1).div_(x.shape[-1])
        grad_x = torch.addcmul(scaled, normed, mean_dot, value=-1).mul_(rstd)
        return grad_x.to(x.dtype), grad_weight, None, None


def precompute_freqs_cis(
    head_dim: int,
    end: int,
    theta: float = 10000.0,
    use_fp32_outer: bool = False,
    scaling: RopeScalingArgs | None = None,
) -> torch.Tensor:
    """RoPE rotation matrices [[cos,-sin],[sin,cos]] of shape [end, head_dim // 2, 2, 2] (fp32);
    ``scaling``: Llama 3 frequency scaling (rope_scaling.py)."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))
    freqs = scale_frequencies(freqs, scaling)
    positions = torch.arange(end, device=freqs.device)
    if use_fp32_outer:
        positions = positions.to(torch.float32)
    angles = torch.outer(positions, freqs).float()
    cos, sin = angles.cos(), angles.sin()
    return torch.stack((cos, -sin, sin, cos), dim=-1).view(*angles.shape, 2, 2)


class RotaryEmbedding(nn.Module):
    """Holds the RoPE table as a non-persistent buffer ``freqs_cis`` (recomputed, never saved)."""

    def __init__(
        self,
        theta: float,
        head_dim: int,
        max_seqlen: int,
        use_fp32_outer: bool = False,
        scaling: RopeScalingArgs | None = None,
    ) -> None:
        super().__init__()
        self.theta = theta
        self.head_dim = head_dim
        self.max_seqlen = max_seqlen
        self.use_fp32_outer = use_fp32_outer
        self.scaling = scaling
        self.register_buffer(
            "freqs_cis",
            precompute_freqs_cis(head_dim, max_seqlen, theta, use_fp32_outer, scaling),
            persistent=False,
        )

    def reset_parameters(self) -> None:
        """Recompute the table in place (after to_empty or loading a state dict)."""
        table = precompute_freqs_cis(
            self.head_dim, self.max_seqlen, self.theta, self.use_fp32_outer, self.scaling
        )
        with torch.no_grad():
            self.freqs_cis.copy_(table.to(self.freqs_cis.device))

    def forward(
        self, seqlen: int | None = None, tok_idx: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Rotation matrices for positions 0..seqlen-1, or for explicit positions ``tok_idx``."""
        if tok_idx is not None:
            return self.freqs_cis[tok_idx]
        if seqlen is None:
            raise ValueError("RotaryEmbedding needs seqlen or tok_idx")
        if seqlen > self.max_seqlen:
            raise ValueError(
                f"sequence length {seqlen} exceeds the RoPE table (max_seqlen={self.max_seqlen})"
            )
        return self.freqs_cis[:seqlen]


def apply_rotary_emb(
    xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate interleaved pairs (x[2i], x[2i+1]) of q/k [B,S,H,D] by freqs_cis [S,D/2,2,2].

    Computed in float32 like the reference, returned in the input dtypes. Eager mode treats a
    pair as the complex number x[2i] + i·x[2i+1] times cos + i·sin: the same products and sums
    as the reference's 2×2 matrix form (bitwise equal in fp32) in one kernel. Under
    torch.compile the real-valued form is used, which inductor fuses (it has no complex codegen).
    """
    cos = freqs_cis[..., 0, 0].float()[None, :, None, :]  # [1,S,1,D/2]
    sin = freqs_cis[..., 1, 0].float()[None, :, None, :]
    if torch.compiler.is_compiling():
        return _rotate_pairs_real(xq, cos, sin), _rotate_pairs_real(xk, cos, sin)
    rotation = torch.complex(cos, sin)
    return _rotate_pairs_complex(xq, rotation), _rotate_pairs_complex(xk, rotation)


def _rotate_pairs_complex(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)).contiguous())
    return torch.view_as_real(pairs * rotation).flatten(-2).type_as(x)


def _rotate_pairs_real(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    pairs = x.float().unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


def autocast_input(x: torch.Tensor) -> torch.Tensor:
    """Cast x once to the autocast dtype when autocast is on.

    Under autocast every linear casts its input itself; a tensor feeding several linears
    (wq/wk/wv, w1/w3) would be cast, and its gradient cast back, once per linear.
    """
    device_type = x.device.type
    if x.is_floating_point() and torch.is_autocast_enabled(device_type):
        return x.to(torch.get_autocast_dtype(device_type))
    return x


@dataclass
class CacheStep:
    """Where the positions of one incremental forward go (the same for every layer of a stack).

    ``positions`` [B,S] long: each new token's position (its cache slot, and the row of the
    module's RoPE table that rotates it). ``start``: the new keys/values go to slots
    start..start+S-1 of every row (a prefill), or, with None, to each row's ``positions[:, 0]``
    (one-token step) or, when ``slots`` [B,S] long is set, to each row's own slots (rows that
    append different numbers of positions: padding goes to a scratch slot). Queries attend the
    cached keys key_start..key_len-1 under ``mask`` (bool [B,1,S,keys]; None: all of them).
    """

    positions: torch.Tensor
    start: int | None
    key_start: int
    key_len: int
    mask: torch.Tensor | None
    _rotation: torch.Tensor | None = field(default=None, repr=False)
    slots: torch.Tensor | None = None
    _rows: torch.Tensor | None = field(default=None, repr=False)

    def rotation_for(self, freq_cis: torch.Tensor) -> torch.Tensor:
        """The RoPE rows of ``positions`` in ``freq_cis`` [L,D/2,2,2] as cos + i·sin
        [B,S,1,D/2], picked once per step for every layer of the stack."""
        if self._rotation is None:
            rows = freq_cis[self.positions]
            rotation = torch.complex(rows[..., 0, 0].float(), rows[..., 1, 0].float())
            self._rotation = rotation[:, :, None, :]
        return self._rotation

    def write(self, buffer: torch.Tensor, values: torch.Tensor, dim: int = 1) -> None:
        """Store ``values`` [B,S,...] at the step's positions of ``buffer`` (positions on ``dim``)."""
        if self.slots is not None:  # per-row slots [B,S] (advanced indices first: [B,S,...])
            rows = torch.arange(values.shape[0], device=values.device)[:, None]
            buffer[(rows, *([slice(None)] * (dim - 1)), self.slots)] = values
        elif self.start is None:
            if self._rows is None:  # once per step, for every layer
                self._rows = torch.arange(values.shape[0], device=values.device)
            index = (self._rows, *([slice(None)] * (dim - 1)), self.positions[:, 0])
            buffer[index] = values[:, 0]
        else:
            end = self.start + values.shape[1]
            index = (*([slice(None)] * dim), slice(self.start, end))
            buffer[index] = values.movedim(1, dim) if dim != 1 else values


@dataclass
class KVCache:
    """A self-attention's keys and values [B, n_kv_heads, capacity, head_dim] and the step that
    the next forward runs (set by the caller, e.g. ``eval.generation.cache.CachedStack``).

    ``outputs`` [B, capacity, dim] (optional): where the block's module keeps the block's output
    states of every cached position (the BLT encoder's byte states that later form patches)."""

    keys: torch.Tensor
    values: torch.Tensor
    step: CacheStep | None = None
    outputs: torch.Tensor | None = None

    def attend(self, xq: torch.Tensor, xk: torch.Tensor, xv: torch.Tensor) -> torch.Tensor:
        """Store the new (rotated) xk/xv [B,S,Hkv,D], attend xq [B,S,H,D] -> [B,H,S,D]."""
        step = self.step
        keys, values = self.keys, self.values
        step.write(keys, xk, dim=2)
        step.write(values, xv, dim=2)
        return cached_attention(
            xq.transpose(1, 2),
            keys[:, :, step.key_start : step.key_len],
            values[:, :, step.key_start : step.key_len],
            step.mask,
        )

    def keep_outputs(self, h: torch.Tensor) -> None:
        """Store the block's output h [B,S,dim] at the step's positions (when ``outputs`` is set)."""
        if self.outputs is not None:
            self.step.write(self.outputs, h)


def cached_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """sdpa of q [B,H,S,D] over cached k/v [B,Hkv,K,D] under ``mask`` (bool [B|1,1,S,K] or None).

    GQA with a mask never goes to sdpa as ``enable_gqa`` plus ``attn_mask``: only the math kernel
    takes both (on CUDA: the S x K scores of every head in memory, no fused kernel). The
    queries of each kv head are stacked instead, [B,Hkv,rep·S,D] over that head's keys, with the
    mask tiled to rep·S rows: a plain masked call that the efficient kernel runs, and no copy of
    the cache. Without a mask, ``enable_gqa`` (the flash kernel takes it)."""
    n_heads, n_kv_heads = q.shape[1], k.shape[1]
    if n_heads == n_kv_heads or mask is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, enable_gqa=n_heads != n_kv_heads
        )
    bsz, _, seqlen, head_dim = q.shape
    rep = n_heads // n_kv_heads
    grouped = q.reshape(bsz, n_kv_heads, rep * seqlen, head_dim)  # head h -> kv head h // rep
    out = F.scaled_dot_product_attention(grouped, k, v, attn_mask=mask.repeat(1, 1, rep, 1))
    return out.reshape(bsz, n_heads, seqlen, head_dim)


def _trunc_normal_(weight: torch.Tensor, std: float) -> None:
    nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-3 * std, b=3 * std)


class Attention(nn.Module):
    """Multi-head self-attention with RoPE and optional grouped-query heads."""

    def __init__(
        self, dim: int, head_dim: int, n_heads: int, n_kv_heads: int, rope_theta: float
    ) -> None:
        super().__init__()
        if n_heads % n_kv_heads != 0:
            raise ValueError(f"n_heads={n_heads} must be a multiple of n_kv_heads={n_kv_heads}")
        self.dim = dim
        self.head_dim = head_dim
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.rope_theta = rope_theta
        self.wq = Linear(dim, n_heads * head_dim, bias=False)
        self.wk = Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wv = Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wo = Linear(n_heads * head_dim, dim, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        freq_cis: torch.Tensor,
        mask: AttnMask | None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """x [B,S,dim] -> [B,S,dim]; freq_cis covers at least S positions.

        With ``cache`` (generation) the S new positions are ``cache.step.positions`` (rotated by
        the rows of ``freq_cis`` at those positions, as ``apply_rotary_emb`` in eager mode), their
        keys/values are stored in the cache and the queries attend the cached keys under the
        step's mask; ``mask`` is unused.
        """
        bsz, seqlen, _ = x.shape
        x = autocast_input(x)
        xq = self.wq(x).view(bsz, seqlen, self.n_heads, self.head_dim)
        xk = self.wk(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        xv = self.wv(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        if cache is None:
            xq, xk = apply_rotary_emb(xq, xk, freq_cis[:seqlen])
            out = attend(xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2), mask)
        else:
            rotation = cache.step.rotation_for(freq_cis)
            xq, xk = _rotate_pairs_complex(xq, rotation), _rotate_pairs_complex(xk, rotation)
            out = cache.attend(xq, xk, xv)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, self.n_heads * self.head_dim))

    def reset_parameters(self, init_std: float | None = None, factor: float = 1.0) -> None:
        """trunc_normal(σ) on wq/wk/wv/wo with σ = init_std or dim^-0.5 / factor."""
        std = init_std or (self.dim**-0.5) / factor
        for linear in (self.wq, self.wk, self.wv, self.wo):
            _trunc_normal_(linear.weight, std)


def ffn_hidden_dim(dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    """SwiGLU width: round_up(int(mult * int(2 * 4 * dim / 3)), multiple_of)."""
    hidden = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


class FeedForward(nn.Module):
    """SwiGLU feed-forward: w2(silu(w1 x) * w3 x)."""

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        multiple_of: int,
        ffn_dim_multiplier: float | None,
    ) -> None:
        """``hidden_dim`` is the pre-SwiGLU width (4 * dim in the reference); see ffn_hidden_dim."""
        super().__init__()
        hidden = int(2 * hidden_dim / 3)
        if ffn_dim_multiplier is not None:
            hidden = int(ffn_dim_multiplier * hidden)
        hidden = multiple_of * ((hidden + multiple_of - 1) // multiple_of)
        self.dim = dim
        self.hidden_dim = hidden
        self.w1 = Linear(dim, hidden, bias=False)
        self.w3 = Linear(dim, hidden, bias=False)
        self.w2 = Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = autocast_input(x)
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def reset_parameters(self, init_std: float | None = None, factor: float = 1.0) -> None:
        """w1/w3: σ = init_std or dim^-0.5/factor; w2: σ = init_std or hidden^-0.5/factor."""
        in_std = init_std or (self.dim**-0.5) / factor
        out_std = init_std or (self.hidden_dim**-0.5) / factor
        _trunc_normal_(self.w1.weight, in_std)
        _trunc_normal_(self.w3.weight, in_std)
        _trunc_normal_(self.w2.weight, out_std)


class TransformerBlock(nn.Module):
    """Pre-norm block: h = x + attn(norm(x)); out = h + ffn(norm(h))."""

    def __init__(self, args: BlockArgs) -> None:
        super().__init__()
        head_dim, n_heads, n_kv_heads = block_head_counts(args)
        self.attention = Attention(args.dim, head_dim, n_heads, n_kv_heads, args.rope_theta)
        self.feed_forward = FeedForward(
            args.dim, 4 * args.dim, args.multiple_of, args.ffn_dim_multiplier
        )
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        freq_cis: torch.Tensor,
        mask: AttnMask | None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """``cache``: the attention's KV cache (generation, see ``Attention.forward``); a keyword,
        so that tensor parallelism's input plan (three positional inputs) stays as it is."""
        h = x + self.attention(self.attention_norm(x), freq_cis, mask, cache=cache)
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self, init_std: float | None = None, factor: float = 1.0) -> None:
        self.attention.reset_parameters(init_std, factor)
        self.attention_norm.reset_parameters()
        self.feed_forward.reset_parameters(init_std, factor)
        self.ffn_norm.reset_parameters()


def init_std_factor(kind: str, depth: int, n_layers: int, dim: int) -> float:
    """Per-layer divisor of the init σ: disabled 1, current_depth √(2(depth+1)),
    global_depth √(2(n_layers+1)), dim_ratio dim/4096."""
    if kind == "disabled":
        return 1.0
    if kind == "current_depth":
        return (2 * (depth + 1)) ** 0.5
    if kind == "global_depth":
        return (2 * (n_layers + 1)) ** 0.5
    if kind == "dim_ratio":
        return dim / 4096
    raise ValueError(f"unknown init_std_factor {kind!r}; expected one of {INIT_STD_FACTORS}")
