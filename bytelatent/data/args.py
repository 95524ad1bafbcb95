"""`DataArgs`: where the data is and how it becomes batches; `build_from_rank` builds the chain

    per source: FileIterator -> LoopingIterator -> PreprocessIterator -> SequenceIterator
    -> SamplingIterator(sources, weights) -> PackingIterator -> [MultiprocessIterator if load_async]

Field names follow the reference `DataloaderArgs` where it has them. `seq_len` counts patches in
patch mode (the reference meaning) and target bytes in byte mode. Byte mode is used when
`add_patches` is false or `patcher_args.patching_mode` is `byte`.
"""

from __future__ import annotations

import zlib
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from bytelatent.data.empty_files import drop_empty
from bytelatent.data.iterators.base import StatefulIterator, numpy_rng_state
from bytelatent.data.iterators.file import (
    FileIteratorState,
    LoopingIteratorState,
    assign_shards,
)
from bytelatent.data.iterators.multiprocess import MultiprocessIteratorState
from bytelatent.data.iterators.packing import PackingArgs, PackingIteratorState
from bytelatent.data.iterators.preprocess import PreprocessIteratorState
from bytelatent.data.iterators.sampling import SamplingIteratorState
from bytelatent.data.iterators.sequence import SequenceArgs, SequenceIteratorState
from bytelatent.data.iterators.states import load_state
from bytelatent.data.patcher_args import PatcherArgs, PatchingMode
from bytelatent.data.readers import formats
from bytelatent.data.readers.base import DEFAULT_MAX_DOCUMENT_BYTES
from bytelatent.data.sources import file_formats, source_files
from bytelatent.errors import ConfigError, DataError
from bytelatent.tokenizers.args import TokenizerArgs

DATASET_FILES_SOURCE = "dataset_files"


class DataArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    root_dir: str | None = Field(
        None, description="directory (or s3:// prefix) that holds the sources"
    )
    sources: dict[str, float] = Field(default_factory=dict, description="source -> sampling weight")
    dataset_files: list[str] | None = Field(
        None, description="explicit files/globs, used instead of sources"
    )
    batch_size: int = Field(2, ge=1, description="rows per micro-batch on each data-parallel rank")
    seq_len: int = Field(
        2048,
        ge=1,
        description="patches per row (patch mode) or bytes per row (byte mode)",
    )
    seed: int = Field(
        42, description="seeds the file order, the shuffle buffers and the source sampling"
    )
    add_bos: bool = Field(
        True, description="start each document with BOS (unless tokenizer_args.init_kwargs sets it)"
    )
    add_eos: bool = Field(
        True, description="end each document with EOS (unless tokenizer_args.init_kwargs sets it)"
    )
    load_async: bool = Field(
        True, description="build batches in a background process that prefetches them"
    )
    async_persist_type: Literal["exact", "approximate"] = Field(
        "exact",
        description="accepted for reference configs; the state is always exact (and free)",
    )
    prefetch_size: int = Field(
        64, ge=1, description="batches the load_async process may queue ahead of training"
    )
    preprocess_dir: str | None = Field(
        None,
        description="read source S from {preprocess_dir}/S/{entropy_model_name}/*.arrow: shards "
        "with precomputed entropies, written by apps/preprocess_entropies",
    )
    entropy_model_name: str | None = Field(
        "transformer_100m", description="folder under preprocess_dir/{source}/ to read"
    )
    arrow_batch_size: int = Field(
        20, ge=1, description="Arrow/Parquet rows converted to Python at a time"
    )
    buffer_size: int = Field(
        64, ge=1, description="sequences shuffled together; 1 disables shuffling"
    )
    file_format: str = Field(
        "auto",
        description="auto: each file's reader from its suffix; jsonl or any registered format name "
        "(arrow, parquet, zst, gz, or one a user registered) forces that reader and picks those "
        "files when a folder holds several kinds",
    )
    text_field: str = Field(
        "text", description="column/key of the text (`text` also accepts `content`)"
    )
    shuffle_files: bool = Field(
        True, description="visit each stream's files in a seeded order that changes every epoch"
    )
    open_files: int = Field(2, ge=1, description="files each stream reads in turn")
    virtual_streams: int | None = Field(
        None,
        ge=1,
        description="data streams of a training run, fixed at its first start (docs/data.md); "
        "null: one per row of the global batch",
    )
    pad_to_max_length: bool = Field(
        True,
        description="patch mode: pad every row to max_encoder_seq_length bytes; false: to the "
        "longest row of the batch",
    )
    max_encoder_seq_length: int = Field(12288, ge=1, description="bytes per row in patch mode")
    enable_byte_ngrams: bool = Field(
        False, description="reference key; byte n-gram ids are not implemented, must stay false"
    )
    add_patches: bool = Field(
        True,
        description="put patch lengths in the batches (patch mode); false: byte mode, rows of "
        "seq_len bytes",
    )
    boundary_targets: bool = Field(
        False,
        description="patch mode: a byte target that ends its patch becomes class 256 + its id "
        "(a boundary-head model, model.boundary_head: it predicts the patch ends with the bytes, "
        "so token-patched bpb counts the boundaries; docs/byteify.md)",
    )
    tokenizer_args: TokenizerArgs = Field(
        default_factory=TokenizerArgs, description="tokenizer that turns text into token ids"
    )
    patcher_args: PatcherArgs = Field(
        default_factory=PatcherArgs, description="how byte rows are split into patches"
    )
    s3_profile: str | None = Field(
        None, description="AWS profile for s3:// data (a `profile` in storage_options wins)"
    )
    storage_options: dict[str, Any] | None = Field(
        None, description="extra fsspec options for URLs"
    )
    skip_bad_records: bool = Field(
        False, description="skip (and count) unreadable records instead of failing"
    )
    max_document_bytes: int | None = Field(
        DEFAULT_MAX_DOCUMENT_BYTES,
        ge=1,
        description="a record (JSONL line, table text) longer than this is a bad record: one "
        "error naming it, or skipped and counted with skip_bad_records; read without holding it "
        "whole; null: no limit (docs/data.md)",
    )
    chat_template: Literal["bytelatent-chat-v1"] | None = Field(
        None,
        description="records are conversations (messages, prompt/response or "
        "instruction/input/output), encoded with this chat template, loss on the answers only "
        "(docs/sft.md); stored with the run so generation and the harness use it too",
    )

    @field_validator("file_format")
    @classmethod
    def _known_format(cls, value: str) -> str:
        names = ["auto", "jsonl", *(f.name for f in formats())]
        if value not in names:
            raise ValueError(f"unknown format {value!r}; use one of {', '.join(names)}")
        return value

    @model_validator(mode="after")
    def _check(self) -> DataArgs:
        if self.enable_byte_ngrams:
            raise ValueError(
                "enable_byte_ngrams: byte n-gram ids are not implemented; set it to false"
            )
        if self.dataset_files is not None and self.sources:
            raise ValueError("set either sources (with root_dir) or dataset_files, not both")
        if any(w < 0 for w in self.sources.values()):
            raise ValueError(f"sources: weights must be >= 0, got {self.sources}")
        if self.sources and not any(w > 0 for w in self.sources.values()):
            raise ValueError(f"sources: at least one weight must be > 0, got {self.sources}")
        if self.packing_mode == "patches" and self.seq_len < 2:
            raise ValueError(f"seq_len={self.seq_len}: patch mode needs at least 2 patches per row")
        return self

    @model_validator(mode="after")
    def _check_boundary_targets(self) -> DataArgs:
        if self.boundary_targets and self.packing_mode != "patches":
            raise ValueError(
                "data.boundary_targets needs patches (add_patches and a patching_mode other than "
                "byte): it marks the bytes that end a patch"
            )
        return self

    @property
    def packing_mode(self) -> Literal["bytes", "patches"]:
        if self.add_patches and self.patcher_args.patching_mode != PatchingMode.byte:
            return "patches"
        return "bytes"

    def fsspec_options(self) -> dict[str, Any]:
        options = dict(self.storage_options or {})
        if self.s3_profile is not None:
            options.setdefault("profile", self.s3_profile)
        return options

    def tokenizer_for_data(self) -> TokenizerArgs:
        """tokenizer_args with data.add_bos/add_eos applied unless init_kwargs sets them."""
        kwargs = dict(self.tokenizer_args.init_kwargs or {})
        kwargs.setdefault("add_bos", self.add_bos)
        kwargs.setdefault("add_eos", self.add_eos)
        return self.tokenizer_args.model_copy(update={"init_kwargs": kwargs})

    def source_weights(self) -> dict[str, float]:
        if self.dataset_files is not None:
            return {DATASET_FILES_SOURCE: 1.0}
        if not self.sources:
            raise ConfigError(
                "data.sources: no data configured; set data.root_dir and data.sources (or data.dataset_files)"
            )
        return {name: w for name, w in self.sources.items() if w > 0}

    def files_of(self, source: str) -> list[str]:
        options = self.fsspec_options()
        if source == DATASET_FILES_SOURCE and self.dataset_files is not None:
            files: list[str] = []
            for entry in self.dataset_files:
                files.extend(
                    source_files(
                        entry,
                        root_dir=self.root_dir,
                        file_format=self.file_format,
                        storage_options=options,
                    )
                )
            return files
        return source_files(
            source,
            root_dir=self.root_dir,
            preprocess_dir=self.preprocess_dir,
            entropy_model_name=self.entropy_model_name,
            file_format=self.file_format,
            storage_options=options,
        )

    def _sequence_state(
        self, source: str, rank: int, world: int, files_cache: dict[str, list[str]]
    ) -> SequenceIteratorState:
        if source not in files_cache:
            listed = self.files_of(source)
            files, _ = drop_empty(
                listed, file_formats(listed, self.file_format), self.fsspec_options() or None
            )
            if listed and not files:
                raise DataError(
                    f"data source '{source}': none of its {len(listed)} file(s) has a row "
                    f"({listed[0]}{', ...' if len(listed) > 1 else ''}); check the data folder"
                )
            files_cache[source] = files
        files = files_cache[source]
        shards = assign_shards(files, rank, world, file_formats(files, self.file_format))
        file_state = FileIteratorState(
            shards=shards,
            storage_options=self.fsspec_options() or None,
            arrow_batch_size=self.arrow_batch_size,
            skip_bad_records=self.skip_bad_records,
            max_document_bytes=self.max_document_bytes,
            text_field=self.text_field,
            chat=self.chat_template is not None,
            open_files=self.open_files,
            order_seed=self.seed if self.shuffle_files else None,
        )
        preprocess = PreprocessIteratorState(
            source=LoopingIteratorState(file_state=file_state),
            tokenizer_args=self.tokenizer_for_data(),
            patcher_args=self.patcher_args if self.packing_mode == "patches" else None,
            skip_bad_records=self.skip_bad_records,
        )
        sequence_args = SequenceArgs(
            mode=self.packing_mode,
            seq_len=self.seq_len,
            max_length=self.max_encoder_seq_length if self.packing_mode == "patches" else None,
            buffer_size=self.buffer_size,
        )
        rng_state = None
        if self.buffer_size > 1:
            # one stream per (seed, rank, world, source): ranks and sources shuffle independently
            rng = np.random.default_rng((self.seed + 1, rank, world, zlib.crc32(source.encode())))
            rng_state = numpy_rng_state(rng)
        return SequenceIteratorState(args=sequence_args, source=preprocess, rng_state=rng_state)

    def initial_state(
        self,
        dp_rank: int,
        dp_world_size: int,
        files_cache: dict[str, list[str]] | None = None,
    ) -> PackingIteratorState:
        """The state of a fresh pipeline for this rank (no prefetcher); `files_cache` keeps each
        source's file list between calls (one listing for many virtual streams)."""
        files_cache = {} if files_cache is None else files_cache
        if not 0 <= dp_rank < dp_world_size:
            raise ConfigError(
                f"dp_rank {dp_rank} is outside a data-parallel world of {dp_world_size}"
            )
        weights = self.source_weights()
        sources = {
            name: self._sequence_state(name, dp_rank, dp_world_size, files_cache)
            for name in sorted(weights)
        }
        sampling = SamplingIteratorState(
            rng_state=numpy_rng_state(
                np.random.default_rng((self.seed + 1, dp_rank, dp_world_size))
            ),
            weights=weights,
            sources=sources,
        )
        packing_args = PackingArgs(
            mode=self.packing_mode,
            batch_size=self.batch_size,
            seq_len=self.seq_len,
            max_length=self.max_encoder_seq_length if self.packing_mode == "patches" else None,
            pad_to_max_length=self.pad_to_max_length,
            boundary_targets=self.boundary_targets,
        )
        return PackingIteratorState(args=packing_args, source=sampling)

    def build_validation(
        self,
        files: str | list[str],
        dp_rank: int,
        dp_world_size: int,
        batch_size: int | None = None,
    ) -> StatefulIterator:
        """One pass over validation files (paths, globs or directories; sharded across ranks like
        training files), unshuffled, packed like training batches; the last batch may be partial."""
        if not 0 <= dp_rank < dp_world_size:
            raise ConfigError(
                f"dp_rank {dp_rank} is outside a data-parallel world of {dp_world_size}"
            )
        options = self.fsspec_options()
        paths: list[str] = []
        for entry in [files] if isinstance(files, str) else files:
            found = source_files(
                entry, root_dir=self.root_dir, file_format=self.file_format, storage_options=options
            )
            paths.extend(found)
        file_state = FileIteratorState(
            shards=assign_shards(
                paths, dp_rank, dp_world_size, file_formats(paths, self.file_format)
            ),
            storage_options=options or None,
            arrow_batch_size=self.arrow_batch_size,
            skip_bad_records=self.skip_bad_records,
            max_document_bytes=self.max_document_bytes,
            text_field=self.text_field,
            chat=self.chat_template is not None,
        )
        patches = self.packing_mode == "patches"
        preprocess = PreprocessIteratorState(
            source=file_state,
            tokenizer_args=self.tokenizer_for_data(),
            patcher_args=self.patcher_args if patches else None,
            skip_bad_records=self.skip_bad_records,
        )
        max_length = self.max_encoder_seq_length if patches else None
        sequence = SequenceIteratorState(
            args=SequenceArgs(
                mode=self.packing_mode, seq_len=self.seq_len, max_length=max_length, buffer_size=1
            ),
            source=preprocess,
        )
        packing_args = PackingArgs(
            mode=self.packing_mode,
            batch_size=batch_size or self.batch_size,
            seq_len=self.seq_len,
            max_length=max_length,
            pad_to_max_length=self.pad_to_max_length,
            boundary_targets=self.boundary_targets,
        )
        return PackingIteratorState(args=packing_args, source=sequence).build()

    def build_from_rank(
        self, dp_rank: int, dp_world_size: int, state: str | dict | None = None
    ) -> StatefulIterator:
        """Iterator of `Batch` for one data-parallel rank; `state` (from `get_state()`) resumes it.

        A saved state carries its own position and shapes; whether batches are prefetched in a
        background process follows this config's `load_async`, whatever the saved state used.
        """
        if state is None:
            base = self.initial_state(dp_rank, dp_world_size)
        else:
            loaded = load_state(state)
            base = loaded.base if isinstance(loaded, MultiprocessIteratorState) else loaded
            if not isinstance(base, PackingIteratorState):
                raise ConfigError(
                    f"data state: expected a packing or multiprocess state, got '{base.type}'"
                )
        return self.wrap_prefetch(base)

    def wrap_prefetch(self, base: PackingIteratorState) -> StatefulIterator:
        """`base` built, in a background prefetching process when `load_async`."""
        if self.load_async:
            return MultiprocessIteratorState(base=base, prefetch_size=self.prefetch_size).build()
        return base.build()
