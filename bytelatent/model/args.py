"""The model's configuration, torch-free (a config is checked before torch loads): the args of a
transformer stack and of the byte LM (the entropy model), RoPE scaling, and the names and
constants their validation needs. ``blt_args.py`` builds the BLT's args on these."""

from __future__ import annotations

from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, model_validator

from bytelatent.tokenizers.constants import EOS_ID, VOCAB_SIZE

# attention implementations (attention.py), weight-init depth rules (layers.py), patch pooling
# ops in output order (patch_utils.py)
BACKENDS = ("sdpa", "flex_attention", "xformers")
INIT_STD_FACTORS = ("disabled", "current_depth", "global_depth", "dim_ratio")
POOLING_MODES = ("avg", "min", "max")
# the hash functions of the n-gram embeddings (hashing.py): one prime per function, indexed by
# function number (reference values)
HASH_PRIMES = (
    1000000007,
    5915587277,
    1500450271,
    3267000013,
    5754853343,
    4093082899,
    9576890767,
    3628273133,
    2860486313,
    5463458053,
    3367900313,
)


class RopeScalingArgs(BaseModel):
    """HF ``rope_scaling`` of ``rope_type: llama3`` (field names as in HF's config.json)."""

    model_config = ConfigDict(extra="forbid")

    rope_type: Literal["llama3"] = Field("llama3", description="only llama3 is supported")
    factor: float = Field(
        8.0,
        description="frequencies of wavelength > original / low_freq_factor are divided by this",
    )
    low_freq_factor: float = Field(
        1.0, description="wavelengths above original / this are scaled by factor"
    )
    high_freq_factor: float = Field(
        4.0, description="wavelengths below original / this are kept (between: interpolated)"
    )
    original_max_position_embeddings: int = Field(
        8192, description="context length the checkpoint was pretrained on (positions)"
    )

    @model_validator(mode="after")
    def _check(self) -> RopeScalingArgs:
        if self.factor <= 0 or self.original_max_position_embeddings < 1:
            raise ValueError(
                "rope_scaling: factor and original_max_position_embeddings must be > 0"
            )
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(
                f"rope_scaling: need 0 < low_freq_factor ({self.low_freq_factor}) < "
                f"high_freq_factor ({self.high_freq_factor})"
            )
        return self


ATTN_BIAS_TYPES = (None, "causal", "block_causal", "local_block_causal")


class BaseTransformerArgs(BaseModel):
    """Shape and attention settings of a stack of TransformerBlocks (reference field names)."""

    model_config = ConfigDict(extra="forbid")

    dim: int = Field(512, description="model width (hidden size)")
    n_layers: int = Field(8, description="transformer blocks")
    head_dim: int | None = Field(
        None, description="width of one attention head (even); null: dim // n_heads"
    )
    n_heads: int | None = Field(
        None, description="attention heads; null: dim // head_dim (set one of the two)"
    )
    n_kv_heads: int | None = Field(
        None, description="key/value heads (GQA), dividing n_heads; null: n_heads"
    )
    ffn_dim_multiplier: float | None = Field(
        None, description="SwiGLU width: int(this * int(8 * dim / 3)), rounded up to multiple_of"
    )
    multiple_of: int = Field(256, description="SwiGLU hidden width is rounded up to a multiple")
    norm_eps: float = Field(1e-5, description="RMSNorm epsilon")
    rope_theta: float = Field(10000.0, description="RoPE base")
    rope_use_fp32_in_outer_product: bool = Field(
        False, description="RoPE: positions in float32 before the outer product with frequencies"
    )
    rope_scaling: RopeScalingArgs | None = Field(
        None, description="Llama 3 RoPE frequency scaling (rope_scaling.py); null: none"
    )
    init_base_std: float | None = Field(
        None,
        description="σ of block weights (trunc normal ±3σ); null: fan_in ** -0.5 divided by "
        "the init_std_factor rule",
    )
    init_std_factor: str = Field(
        "disabled",
        description="divisor of the default init σ: disabled (1), current_depth "
        "(sqrt(2(depth+1))), global_depth (sqrt(2(n_layers+1))), dim_ratio (dim/4096)",
    )
    max_seqlen: int = Field(1024, description="longest row in tokens (RoPE table length)")
    attn_impl: str = Field(
        "sdpa",
        description="sdpa, flex_attention or xformers (the last two need CUDA, else sdpa runs)",
    )
    attn_bias_type: str | None = Field(
        None,
        description="self-attention mask: null/causal, block_causal (causal within documents, "
        "which end at eos_id) or local_block_causal (also a sliding window)",
    )
    eos_id: int = Field(EOS_ID, description="token id that ends a document (document masks)")

    @model_validator(mode="after")
    def _check_base(self) -> BaseTransformerArgs:
        _check_positive(self, ("dim", "n_layers", "multiple_of", "max_seqlen"))
        _check_positive(self, ("head_dim", "n_heads", "n_kv_heads"), optional=True)
        if self.attn_impl == "fmha":
            raise ValueError(
                "attn_impl='fmha' attends without any mask in the reference (every token sees the "
                "whole row, future included); use sdpa, flex_attention or xformers"
            )
        if self.attn_impl not in BACKENDS:
            raise ValueError(f"attn_impl={self.attn_impl!r} is unknown; expected one of {BACKENDS}")
        if self.attn_bias_type not in ATTN_BIAS_TYPES:
            raise ValueError(
                f"attn_bias_type={self.attn_bias_type!r} is unknown; expected one of {ATTN_BIAS_TYPES}"
            )
        if self.init_std_factor not in INIT_STD_FACTORS:
            raise ValueError(
                f"init_std_factor={self.init_std_factor!r} is unknown; "
                f"expected one of {INIT_STD_FACTORS}"
            )
        self._check_heads()
        return self

    def _check_heads(self) -> None:
        if self.n_heads is not None and self.head_dim is None and self.dim % self.n_heads:
            raise ValueError(
                f"dim={self.dim} is not divisible by n_heads={self.n_heads}; "
                "change one of them or set head_dim"
            )
        if self.head_dim is not None and self.n_heads is None and self.dim % self.head_dim:
            raise ValueError(f"dim={self.dim} is not divisible by head_dim={self.head_dim}")
        if self.n_heads is None and self.head_dim is None:
            return
        head_dim, n_heads, n_kv_heads = block_head_counts(self)
        if head_dim % 2:
            raise ValueError(f"head_dim={head_dim} must be even for rotary embeddings")
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads={n_heads} must be a multiple of n_kv_heads={n_kv_heads}")


class LMTransformerArgs(BaseTransformerArgs):
    """A byte LM: embedding, TransformerBlocks, norm, output (the BLT entropy model)."""

    seed: int = Field(42, description="seed of the weight initialisation")
    vocab_size: int = Field(VOCAB_SIZE, description="token ids (260: 256 bytes + 4 special)")
    weight_tying: bool = Field(False, description="share the token embedding with the output layer")
    sliding_window: int | None = Field(
        None,
        description="local_block_causal window: a token sees itself and the window - 1 before it",
    )

    @model_validator(mode="after")
    def _check_lm(self) -> LMTransformerArgs:
        if self.n_heads is None and self.head_dim is None:
            raise ValueError("set n_heads (or head_dim) for the transformer")
        _check_positive(self, ("vocab_size",))
        _check_positive(self, ("sliding_window",), optional=True)
        if self.attn_bias_type == "local_block_causal" and self.sliding_window is None:
            raise ValueError("attn_bias_type='local_block_causal' needs sliding_window (e.g. 512)")
        return self


def _check_positive(args: BaseModel, names: tuple[str, ...], optional: bool = False) -> None:
    for name in names:
        value = getattr(args, name)
        if value is None and optional:
            continue
        if value is None or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")


class BlockArgs(Protocol):
    """The fields TransformerBlock reads (BaseTransformerArgs satisfies it)."""

    dim: int
    head_dim: int | None
    n_heads: int | None
    n_kv_heads: int | None
    ffn_dim_multiplier: float | None
    multiple_of: int
    norm_eps: float
    rope_theta: float


def block_head_counts(args: BlockArgs) -> tuple[int, int, int]:
    """(head_dim, n_heads, n_kv_heads) resolved the reference way from dim/head_dim/n_heads."""
    if args.head_dim is None and args.n_heads is None:
        raise ValueError("set at least one of head_dim or n_heads")
    head_dim = args.head_dim or args.dim // args.n_heads
    n_heads = args.n_heads or args.dim // args.head_dim
    n_kv_heads = args.n_kv_heads or n_heads
    return head_dim, n_heads, n_kv_heads


def parse_pooling(pooling: str | None) -> tuple[str, ...]:
    """Pooling ops of a ``downsampling_by_pooling`` string, in the reference order avg, min, max.

    "avg" / "mean" pool by mean; several ops are separated by commas ("avg,max") and their outputs
    are concatenated along the feature dimension in the order avg, min, max.
    """
    if pooling is None or pooling.strip() == "":
        return ()
    names = [name.strip() for name in pooling.split(",") if name.strip()]
    unknown = [name for name in names if name not in ("avg", "mean", "min", "max")]
    if unknown:
        raise ValueError(
            f"unknown pooling {unknown[0]!r}; use avg (or mean), min, max or a comma list"
        )
    chosen = {"avg" if name == "mean" else name for name in names}
    return tuple(mode for mode in POOLING_MODES if mode in chosen)
