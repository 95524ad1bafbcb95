"""The H-Net model's configuration (`arch: hnet`, section `model`), torch-free.

An H-Net of S stages: byte embeddings (width ``stages[0].dim``) -> stage 0 encoder -> route ->
chunk -> [stage 1 encoder -> route -> chunk -> ...] -> main (global) transformer (width ``dim``)
-> ... dechunk -> + residual -> stage 0 decoder -> norm -> LM head (docs/hnet.md).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from bytelatent.model.args import BaseTransformerArgs, block_head_counts
from bytelatent.model.global_init import GlobalInitArgs
from bytelatent.tokenizers.constants import EOS_ID, VOCAB_SIZE


class HNetStageArgs(BaseModel):
    """One dynamic-chunking stage: its encoder and decoder stacks and its chunking target."""

    # inf passes `gt=1` and `ge=0` and gives NaN at step 1: every float must be finite
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    dim: int = Field(256, ge=2, description="width of this stage's encoder/decoder blocks")
    n_layers_encoder: int = Field(2, ge=0, description="encoder transformer blocks")
    n_layers_decoder: int = Field(2, ge=0, description="decoder transformer blocks")
    n_heads: int = Field(4, ge=1, description="attention heads of the encoder/decoder blocks")
    sliding_window: int = Field(
        256, ge=1, description="local attention window of the encoder/decoder (positions)"
    )
    target_ratio: float = Field(
        6.0,
        gt=1,
        description="N: the ratio loss's target of this stage's input positions per chunk",
    )
    ratio_loss_weight: float = Field(
        0.03, ge=0, description="alpha: weight of this stage's ratio loss (official 0.03)"
    )


class HNetArgs(BaseModel):
    """A byte-level H-Net (`arch: hnet`); the main network is the BLT's global transformer."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    seed: int = Field(42, description="seed of the weight initialisation")
    vocab_size: int = Field(VOCAB_SIZE, ge=1, description="token ids (260: 256 bytes + 4 special)")
    eos_id: int = Field(EOS_ID, description="token that ends a document (forced chunk starts)")
    stages: list[HNetStageArgs] = Field(
        default_factory=lambda: [HNetStageArgs()],
        min_length=1,
        description="outermost first; 2 entries make a 2-stage H-Net (stage 1 nests in stage 0)",
    )
    dim: int = Field(512, ge=2, description="width of the main (global) transformer")
    n_layers: int = Field(4, ge=1, description="main transformer blocks")
    n_heads: int = Field(8, ge=1, description="main transformer attention heads")
    n_kv_heads: int | None = Field(None, description="main transformer key/value heads (GQA)")
    max_seqlen: int = Field(
        1024, ge=1, description="longest row in bytes (RoPE tables; a stage has at most this many)"
    )
    multiple_of: int = Field(256, ge=1, description="SwiGLU hidden width rounding")
    ffn_dim_multiplier: float | None = Field(None, description="SwiGLU width multiplier")
    norm_eps: float = Field(1e-5, description="RMSNorm epsilon")
    rope_theta: float = Field(10000.0, description="RoPE base")
    init_base_std: float | None = Field(None, description="σ of block weights; null: dim^-0.5")
    init_std_factor: str = Field("disabled", description="as model.init_std_factor")
    attn_impl: str = Field("sdpa", description="sdpa, flex_attention or xformers")
    kernel_dtype: Literal["fp32", "bf16"] | None = Field(
        None,
        description="EMA (dechunk) numerics: null = fp32 recurrence (p h, 1 - p); bf16 = the "
        "official model's default Mamba2-kernel rounding",
    )
    ema_block_size: int = Field(64, ge=2, description="block size of the EMA's parallel scan")
    global_init: GlobalInitArgs | None = Field(
        None,
        description="pretrained decoder copied into the global transformer at a fresh start "
        "(docs/byteify.md, as model.global_init); null: random init",
    )

    @model_validator(mode="after")
    def _check(self) -> HNetArgs:
        widths = [s.dim for s in self.stages] + [self.dim]
        for i in range(len(self.stages)):
            if widths[i + 1] < widths[i]:
                inner = f"stages[{i + 1}].dim" if i + 1 < len(self.stages) else "dim"
                raise ValueError(
                    f"{inner}={widths[i + 1]} < stages[{i}].dim={widths[i]}: widths must not "
                    "shrink inward (the official code pads the chunks to the inner width)"
                )
        for i in range(len(self.stages)):
            self.stage_block_args(i)  # head checks raise a ValueError naming the stage
        self.global_block_args()
        return self

    def width(self, stage: int) -> int:
        """Width of stage ``stage`` (``len(stages)``: the main network)."""
        return self.dim if stage == len(self.stages) else self.stages[stage].dim

    def _common(self) -> dict:
        return {
            "multiple_of": self.multiple_of,
            "ffn_dim_multiplier": self.ffn_dim_multiplier,
            "norm_eps": self.norm_eps,
            "rope_theta": self.rope_theta,
            "init_base_std": self.init_base_std,
            "init_std_factor": self.init_std_factor,
            "max_seqlen": self.max_seqlen,
            "attn_impl": self.attn_impl,
            "eos_id": self.eos_id,
        }

    def stage_block_args(self, stage: int) -> BaseTransformerArgs:
        s = self.stages[stage]
        try:
            args = BaseTransformerArgs(
                dim=s.dim,
                n_layers=max(s.n_layers_encoder, s.n_layers_decoder, 1),
                n_heads=s.n_heads,
                attn_bias_type="local_block_causal",
                **self._common(),
            )
            block_head_counts(args)
        except ValueError as exc:
            raise ValueError(f"stages[{stage}]: {exc}") from None
        return args

    def global_block_args(self) -> BaseTransformerArgs:
        return BaseTransformerArgs(
            dim=self.dim,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            n_kv_heads=self.n_kv_heads,
            attn_bias_type="block_causal",
            **self._common(),
        )

    def cumulative_ratios(self) -> list[float]:
        """Target bytes per chunk after each stage (N_0, N_0 N_1, ...)."""
        out, ratio = [], 1.0
        for s in self.stages:
            ratio *= s.target_ratio
            out.append(ratio)
        return out
