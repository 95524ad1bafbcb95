"""``ByteLatentTransformerArgs``: the BLT's shape and options, validated once, up front.

Every field changes the model; cross-field conflicts fail here, named by key, before any module
is built. The model (``model.py``) and its parts (``local_models.py``) both read this module.
"""

from __future__ import annotations

from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from bytelatent.model.args import (
    HASH_PRIMES,
    INIT_STD_FACTORS,
    BaseTransformerArgs,
    RopeScalingArgs,
    parse_pooling,
)
from bytelatent.model.global_init import GlobalInitArgs
from bytelatent.tokenizers.constants import EOS_ID, VOCAB_SIZE

GLOBAL_ATTN_BIAS_TYPES = (None, "causal", "block_causal")
_DEFAULT_DIM, _DEFAULT_N_LAYERS, _DEFAULT_N_HEADS = 512, 8, 8


class ByteLatentTransformerArgs(BaseModel):
    """BLT shape and options (reference field names; every field here changes the model).

    Size of the global (latent) transformer: ``dim``, ``n_layers`` and ``n_heads``.
    ``dim_global``, ``n_layers_global`` and ``n_heads_global`` are aliases kept so that reference
    configs read naturally: left at None they follow ``dim``/``n_layers``/``n_heads``; when set,
    ``dim`` etc. take their value, unless ``dim`` was also changed from its default (512) to a
    different value, which is a config error naming both keys.

    Local models: ``dim_local_encoder``/``dim_local_decoder``, ``n_layers_local_*``,
    ``n_heads_local_*``, ``n_kv_heads`` (local GQA), ``local_attention_window_len`` (sliding
    window of the local self-attention, which is always document-causal: ``local_block_causal``,
    or ``block_causal`` when the window is None), ``max_encoder_seq_length`` (bytes per row).
    ``head_dim``, when set, applies to every component, as in the reference.

    Patch representations for the global model: encoder cross-attention (``cross_attn_encoder``,
    k = ``cross_attn_k`` slots per patch, initialised by pooling with
    ``cross_attn_init_by_pooling`` or from learned slot queries otherwise), else pooling
    (``downsampling_by_pooling``: "avg"/"mean", "min", "max" or a comma list, concatenated in the
    order avg, min, max), else concatenation of the last ``patch_size`` byte states per patch.
    ``use_rope=False`` gives the local models learned absolute positions; the global model always
    uses RoPE.
    """

    model_config = ConfigDict(extra="forbid")

    seed: int = Field(42, description="seed of the weight initialisation")
    vocab_size: int = Field(VOCAB_SIZE, description="token ids (260: 256 bytes + 4 special)")
    pm_size: int = Field(
        0, description="extra ids after vocab_size in the byte embedding and the output layer"
    )
    # global transformer
    dim: int = Field(_DEFAULT_DIM, description="global (latent) transformer width")
    n_layers: int = Field(_DEFAULT_N_LAYERS, description="global transformer blocks")
    n_heads: int = Field(_DEFAULT_N_HEADS, description="global transformer attention heads")
    dim_global: int | None = Field(None, description="reference alias of dim; null: dim")
    n_layers_global: int | None = Field(
        None, description="reference alias of n_layers; null: n_layers"
    )
    n_heads_global: int | None = Field(
        None, description="reference alias of n_heads; null: n_heads"
    )
    n_kv_heads_global: int | None = Field(
        None, description="global key/value heads (GQA), dividing n_heads; null: n_heads"
    )
    attn_bias_type: str | None = Field(
        "causal",
        description="global mask over patches: causal (null too) or block_causal (causal within "
        "documents; a patch holding eos_id ends one)",
    )
    max_seqlen: int = Field(1024, description="most patches per row (the global RoPE table length)")
    init_base_std: float | None = Field(
        None,
        description="σ of global block weights (trunc normal ±3σ); null: fan_in ** -0.5 divided "
        "by the init_std_factor rule",
    )
    rope_scaling: RopeScalingArgs | None = Field(
        None, description="Llama 3 RoPE scaling of the global transformer only; null: none"
    )
    global_init: GlobalInitArgs | None = Field(
        None,
        description="pretrained decoder copied into the global transformer at a fresh start "
        "(docs/byteify.md); null: random init",
    )
    subword_vocab_size: int = Field(
        0,
        description="byteify: rows of the token model's embedding table added to each patch's "
        "representation (the longest token ending at its last byte; filled from "
        "global_init's folder, docs/byteify.md); 0: none",
    )
    subword_max_bytes: int = Field(
        32,
        description="longest token (bytes) the subword embeddings look up (at most 63; longer "
        "tokens are never matched)",
    )
    teacher_head: bool = Field(
        False,
        description="byteify: the token model's final norm and LM head, read one byte at a "
        "time, added to the output as a prior (needs subword_vocab_size and boundary_head; "
        "filled from global_init's folder, docs/byteify.md)",
    )
    boundary_head: bool = Field(
        False,
        description="the output layer also predicts 'this byte ends its patch' (256 more "
        "classes: byte b ending a patch is vocab_size + b); needs data.boundary_targets "
        "(docs/byteify.md)",
    )
    # local models
    dim_local_encoder: int = Field(
        512, description="local encoder width (must equal dim_local_decoder)"
    )
    dim_local_decoder: int = Field(512, description="local decoder width")
    n_layers_local_encoder: int = Field(8, description="local encoder blocks")
    n_layers_local_decoder: int = Field(8, description="local decoder blocks")
    n_heads_local_encoder: int = Field(8, description="local encoder attention heads")
    n_heads_local_decoder: int = Field(8, description="local decoder attention heads")
    n_kv_heads: int | None = Field(
        None, description="key/value heads of the local models (GQA); null: their n_heads"
    )
    local_attention_window_len: int | None = Field(
        None,
        description="local self-attention window in bytes (a byte sees itself and window - 1 "
        "before it, within its document); null: the whole document",
    )
    max_encoder_seq_length: int = Field(
        12288,
        description="most bytes per row of the local models; must equal "
        "data.max_encoder_seq_length",
    )
    use_rope: bool = Field(
        True,
        description="RoPE in the local models; false: learned absolute positions (the global "
        "model always uses RoPE)",
    )
    # shared block settings
    head_dim: int | None = Field(
        None,
        description="width of one attention head in every component; null: its dim // n_heads",
    )
    ffn_dim_multiplier: float | None = Field(
        1.0,
        description="SwiGLU width: int(this * int(8 * dim / 3)), rounded up to multiple_of "
        "(every component)",
    )
    multiple_of: int = Field(256, description="SwiGLU hidden width is rounded up to a multiple")
    norm_eps: float = Field(1e-5, description="RMSNorm epsilon")
    rope_theta: float = Field(10000.0, description="RoPE base")
    rope_use_fp32_in_outer_product: bool = Field(
        False, description="RoPE: positions in float32 before the outer product with frequencies"
    )
    init_std_factor: str = Field(
        "disabled",
        description="divisor of the default init σ: disabled (1), current_depth "
        "(sqrt(2(depth+1))), global_depth (sqrt(2(n_layers+1))), dim_ratio (dim/4096)",
    )
    attn_impl: str = Field(
        "sdpa",
        description="sdpa, flex_attention or xformers (the last two need CUDA, else sdpa runs)",
    )
    eos_id: int = Field(EOS_ID, description="token id that ends a document (document masks)")
    dropout: float = Field(
        0.0,
        description="dropout probability in [0, 1) on the encoder, global and decoder inputs and "
        "the decoder's last norm",
    )
    # patches
    patch_in_forward: bool = Field(
        False,
        description="forward may patch rows given without patch_lengths, with a Patcher "
        "attached by attach_patcher",
    )
    patch_size: float | None = Field(
        None,
        description="bytes per patch concatenated into the global input when neither "
        "cross_attn_encoder nor pooling is set (an integer then)",
    )
    downsampling_by_pooling: str | None = Field(
        "max",
        description="patch states by pooling byte states: avg (or mean), min, max or a comma "
        "list (concatenated avg, min, max); null: concatenation (the reference default)",
    )
    # cross-attention
    cross_attn_encoder: bool = Field(
        False,
        description="encoder makes cross_attn_k slot states per patch by cross-attending to "
        "the patch's bytes (instead of pooling)",
    )
    cross_attn_decoder: bool = Field(
        False,
        description="decoder bytes cross-attend to the global states (cross_attn_k slots per "
        "patch) instead of adding their patch's state",
    )
    cross_attn_k: int = Field(
        2, description="slots per patch of the cross-attentions (global input: k x encoder dim)"
    )
    cross_attn_nheads: int | None = Field(
        None, description="cross-attention heads; null: the local model's n_heads"
    )
    cross_attn_window_encoder: int | None = Field(
        None,
        description="encoder slots of patch p see the bytes of patches p-w+1..p; null: 1",
    )
    cross_attn_window_decoder: int | None = Field(
        None,
        description="decoder bytes see the slots of the w latest patches they may see; null: 1",
    )
    cross_attn_all_layers_encoder: bool = Field(
        False,
        description="a cross-attention after every encoder layer; false: after the last only",
    )
    cross_attn_all_layers_decoder: bool = Field(
        False,
        description="a cross-attention before every decoder layer; false: before the first only",
    )
    cross_attn_init_by_pooling: bool = Field(
        False,
        description="encoder slot queries start from the pooled patch (needs "
        "downsampling_by_pooling); false: from learned per-slot queries",
    )
    # byte n-gram embeddings
    encoder_hash_byte_group_size: list[int] | None = Field(
        None,
        description="n-gram sizes of the hash embeddings added to the byte embeddings, e.g. "
        "[3,4,5] or '3,4,5'; null: none",
    )
    encoder_hash_byte_group_vocab: int = Field(
        30000, description="rows of each hash embedding table (id = n-gram hash mod this)"
    )
    encoder_hash_byte_group_nb_functions: int = Field(
        3, description="hash functions per n-gram size, 1..11 (one table each)"
    )
    encoder_ngram_to_size_str: str | None = Field(
        None,
        description="frequency n-gram tables as 'n:size,...' (e.g. '2:38396'); forward then "
        "needs ngram_ids, which the data loader does not make; null: none",
    )

    @field_validator("encoder_hash_byte_group_size", mode="before")
    @classmethod
    def _parse_hash_sizes(cls, value: Any) -> Any:
        if isinstance(value, str):  # the reference accepts "3,4,5"
            return [int(part) for part in value.split(",") if part.strip()]
        if isinstance(value, int):
            return [value]
        return value

    @model_validator(mode="after")
    def _resolve_and_check(self) -> ByteLatentTransformerArgs:
        self._resolve_global_aliases()
        for name in (
            "vocab_size",
            "max_seqlen",
            "max_encoder_seq_length",
            "multiple_of",
            "cross_attn_k",
        ):
            _require(getattr(self, name) >= 1, f"{name}={getattr(self, name)} must be >= 1")
        _require(self.pm_size >= 0, f"pm_size={self.pm_size} must be >= 0")
        _require(
            self.subword_vocab_size >= 0,
            f"subword_vocab_size={self.subword_vocab_size} must be >= 0",
        )
        _require(
            1 <= self.subword_max_bytes <= 63,
            f"subword_max_bytes={self.subword_max_bytes} must be in [1, 63]",
        )
        _require(0.0 <= self.dropout < 1.0, f"dropout={self.dropout} must be in [0, 1)")
        _require(
            self.attn_bias_type in GLOBAL_ATTN_BIAS_TYPES,
            f"attn_bias_type={self.attn_bias_type!r} (the global model's mask) must be one of "
            f"{GLOBAL_ATTN_BIAS_TYPES}; local models are always document-causal",
        )
        _require(
            self.init_std_factor in INIT_STD_FACTORS,
            f"init_std_factor={self.init_std_factor!r} must be one of {INIT_STD_FACTORS}",
        )
        for name in (
            "local_attention_window_len",
            "cross_attn_window_encoder",
            "cross_attn_window_decoder",
        ):
            value = getattr(self, name)
            _require(value is None or value >= 1, f"{name}={value} must be >= 1 or null")
        _require(
            self.dim_local_decoder == self.dim_local_encoder,
            f"dim_local_decoder={self.dim_local_decoder} must equal dim_local_encoder="
            f"{self.dim_local_encoder}: the decoder's input is the encoder's byte states",
        )
        self.pooling_modes()  # raises on unknown pooling names
        self._check_patch_representation()
        self._check_embeddings()
        for side in ("encoder", "decoder", "global"):
            self._block_args(side)  # shape errors now, named by component
        self._check_cross_heads()
        return self

    def _resolve_global_aliases(self) -> None:
        for canonical, alias, default in (
            ("dim", "dim_global", _DEFAULT_DIM),
            ("n_layers", "n_layers_global", _DEFAULT_N_LAYERS),
            ("n_heads", "n_heads_global", _DEFAULT_N_HEADS),
        ):
            alias_value, value = getattr(self, alias), getattr(self, canonical)
            if alias_value is None or alias_value == value:
                continue
            _require(
                value == default,
                f"model.{canonical}={value} and model.{alias}={alias_value} disagree: both set the "
                f"global transformer ({alias} is an alias of {canonical}); set only one",
            )
            setattr(self, canonical, alias_value)

    def _check_patch_representation(self) -> None:
        pooling = self.pooling_modes()
        _require(
            not self.teacher_head or (self.subword_vocab_size and self.boundary_head),
            "teacher_head needs subword_vocab_size (the token vocabulary) and boundary_head "
            "(its classes say where a token ends)",
        )
        if self.cross_attn_encoder and self.cross_attn_init_by_pooling:
            _require(
                bool(pooling),
                "cross_attn_init_by_pooling needs downsampling_by_pooling (e.g. 'max', as the released models)",
            )
        if not self.cross_attn_encoder and not pooling:
            size = self.patch_size
            _require(
                size is not None and size >= 1 and float(size).is_integer(),
                "without cross_attn_encoder or downsampling_by_pooling, patches are concatenations of "
                f"patch_size byte states: set an integer patch_size (got {size}) or a pooling",
            )
        if self.subword_vocab_size:  # after the patch_size check: the width needs it
            _require(
                self.global_input_dim() == self.dim,
                f"subword embeddings are added to the global transformer's input, which is "
                f"{self.global_input_dim()} wide for dim={self.dim}; make the patch "
                "representation dim wide (e.g. dim_local_encoder * cross_attn_k = dim)",
            )

    def _check_embeddings(self) -> None:
        sizes = self.encoder_hash_byte_group_size
        if sizes is not None:
            _require(
                all(size >= 1 for size in sizes),
                f"encoder_hash_byte_group_size={sizes}: sizes must be >= 1",
            )
            _require(
                self.encoder_hash_byte_group_vocab >= 1,
                "encoder_hash_byte_group_vocab must be >= 1",
            )
            nb = self.encoder_hash_byte_group_nb_functions
            _require(
                1 <= nb <= len(HASH_PRIMES),
                f"encoder_hash_byte_group_nb_functions={nb} must be in [1, {len(HASH_PRIMES)}]",
            )
        self.ngram_sizes()  # raises on a malformed encoder_ngram_to_size_str

    def _check_cross_heads(self) -> None:
        heads = self.cross_attn_nheads
        for enabled, dim, own_heads, side in (
            (
                self.cross_attn_encoder,
                self.dim_local_encoder,
                self.n_heads_local_encoder,
                "encoder",
            ),
            (
                self.cross_attn_decoder,
                self.dim_local_decoder,
                self.n_heads_local_decoder,
                "decoder",
            ),
        ):
            count = heads or own_heads
            if enabled:
                _require(
                    count >= 1 and dim % count == 0,
                    f"cross_attn_nheads={count} must divide dim_local_{side}={dim}",
                )

    def pooling_modes(self) -> tuple[str, ...]:
        """Pooling ops in concatenation order (empty when downsampling_by_pooling is unset)."""
        try:
            return parse_pooling(self.downsampling_by_pooling)
        except ValueError as err:
            raise ValueError(
                f"downsampling_by_pooling={self.downsampling_by_pooling!r}: {err}"
            ) from None

    def ngram_sizes(self) -> dict[int, int]:
        """{n: table size} of the frequency n-gram tables (empty when unset)."""
        text = self.encoder_ngram_to_size_str
        if not text:
            return {}
        sizes = {}
        for entry in text.split(","):
            parts = entry.split(":")
            ok = len(parts) == 2 and parts[0].strip().isdigit() and parts[1].strip().isdigit()
            _require(
                ok,
                f"encoder_ngram_to_size_str={text!r}: entries must look like '2:38396'",
            )
            n, size = int(parts[0]), int(parts[1])
            _require(
                n >= 2 and size >= 1,
                f"encoder_ngram_to_size_str={text!r}: n must be >= 2, sizes >= 1",
            )
            sizes[n] = size
        return sizes

    def global_input_dim(self) -> int:
        """Width of the patch representation fed to the global model."""
        if self.cross_attn_encoder:
            return self.dim_local_encoder * self.cross_attn_k
        pooling = self.pooling_modes()
        if pooling:
            return self.dim_local_encoder * len(pooling)
        return self.dim_local_encoder * int(self.patch_size)

    def n_cross_attn_layers(self, side: str) -> int:
        """Cross-attention layers of the local ``side`` ("encoder" or "decoder")."""
        return sum(index is not None for index in self.cross_attn_pairing(side))

    def cross_attn_pairing(self, side: str) -> list[int | None]:
        """Per local layer of ``side``, the index of its cross-attention layer (or None).

        The one rule for which cross-attention goes with local layer i: with
        ``cross_attn_all_layers_<side>`` layer i has cross-attention i; otherwise only the
        encoder's last layer (cross-attention after it) and the decoder's first layer
        (cross-attention before it) have one, index 0. The encoder runs a layer's
        cross-attention after the layer, the decoder before it.
        """
        if side not in ("encoder", "decoder"):
            raise ValueError(f"side must be 'encoder' or 'decoder', got {side!r}")
        n_layers = getattr(self, f"n_layers_local_{side}")
        if not getattr(self, f"cross_attn_{side}"):
            return [None] * n_layers
        if getattr(self, f"cross_attn_all_layers_{side}"):
            return list(range(n_layers))
        single = n_layers - 1 if side == "encoder" else 0
        return [0 if i == single else None for i in range(n_layers)]

    def local_attn_kind(self) -> str:
        return "block_causal" if self.local_attention_window_len is None else "local_block_causal"

    def encoder_block_args(self) -> BaseTransformerArgs:
        return self._block_args("encoder")

    def decoder_block_args(self) -> BaseTransformerArgs:
        return self._block_args("decoder")

    def global_block_args(self) -> BaseTransformerArgs:
        return self._block_args("global")

    def _block_args(self, side: str) -> BaseTransformerArgs:
        if side == "global":
            shape = {
                "dim": self.dim,
                "n_layers": self.n_layers,
                "n_heads": self.n_heads,
                "n_kv_heads": self.n_kv_heads_global,
            }
            extra = {
                "max_seqlen": self.max_seqlen,
                "attn_bias_type": self.attn_bias_type,
                "init_base_std": self.init_base_std,
                "rope_scaling": self.rope_scaling,
            }
            keys = "dim/n_layers/n_heads/n_kv_heads_global"
        else:
            shape = {
                "dim": getattr(self, f"dim_local_{side}"),
                "n_layers": getattr(self, f"n_layers_local_{side}"),
                "n_heads": getattr(self, f"n_heads_local_{side}"),
                "n_kv_heads": self.n_kv_heads,
            }
            extra = {
                "max_seqlen": self.max_encoder_seq_length,
                "attn_bias_type": self.local_attn_kind(),
            }
            keys = f"dim_local_{side}/n_layers_local_{side}/n_heads_local_{side}/n_kv_heads"
        try:
            return BaseTransformerArgs(
                **shape,
                **extra,
                head_dim=self.head_dim,
                ffn_dim_multiplier=self.ffn_dim_multiplier,
                multiple_of=self.multiple_of,
                norm_eps=self.norm_eps,
                rope_theta=self.rope_theta,
                rope_use_fp32_in_outer_product=self.rope_use_fp32_in_outer_product,
                init_std_factor=self.init_std_factor,
                attn_impl=self.attn_impl,
                eos_id=self.eos_id,
            )
        except ValidationError as err:
            messages = "; ".join(e["msg"].removeprefix("Value error, ") for e in err.errors())
            raise ValueError(f"{side} model ({keys}, head_dim): {messages}") from None


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)
