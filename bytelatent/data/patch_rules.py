"""The patching rules on numpy arrays, without torch (the rules themselves: patcher.py's docstring).

Every rule that needs no model is here: where patches start in `space`, `bpe`, `tokenizer` and
threshold `entropy` mode (entropies given), `static` and `byte` lengths, patch lengths from start
masks, `max_patch_length` splitting. `Patcher` (patcher.py, torch) runs the models and the top-k entropy
rule and hands their start masks to `patch_lengths`; a data-loader worker whose run needs neither
(`PatcherArgs.needs_torch` false) patches each document here and never imports torch.
"""

from __future__ import annotations

import codecs

import numpy as np

from bytelatent.data.chat import is_marker, turn_starts
from bytelatent.data.patcher_args import PatcherArgs, PatchingMode
from bytelatent.errors import ConfigError, DataError
from bytelatent.tokenizers.constants import BPE_ID, OFFSET
from bytelatent.tokenizers.hf_bpe import ByteLevelBPE, load_byte_level_bpe


def patch_document(
    args: PatcherArgs, tokens: np.ndarray, entropies: np.ndarray | None
) -> np.ndarray:
    """One document's patch lengths (`include_next_token=False`), for the data pipeline."""
    scores = None if entropies is None else entropies[None]
    return patch_lengths(args, tokens[None], scores=scores)[0]


def patch_lengths(
    args: PatcherArgs,
    tokens: np.ndarray,
    include_next_token: bool = False,
    scores: np.ndarray | None = None,
    threshold: float | None = None,
    starts: np.ndarray | None = None,
) -> np.ndarray:
    """tokens [B,N] -> patch lengths [B,P] int64 (right-padded with 0, trailing zero columns
    trimmed; rows sum to N, or N + 1 with `include_next_token`). `scores`: entropies [B,N] for
    entropy mode; `threshold` overrides `args.threshold`; `starts`: a start mask [B, N(+1)]
    computed elsewhere (a model's, or top-k entropy patching's)."""
    batch, seq_len = tokens.shape
    length = seq_len + int(include_next_token)
    mode = args.patching_mode
    turns = turn_starts(tokens, length)  # chat markers end a patch in every mode (data/chat.py)
    if mode == PatchingMode.static:
        lengths = static_patch_lengths(batch, length, int(args.patch_size))
    elif mode == PatchingMode.byte:
        lengths = np.ones((batch, length), dtype=np.int64)
    else:
        if starts is None:
            starts = _rule_starts(args, tokens, scores, length, threshold)
        lengths = lengths_from_starts(starts | turns if turns.any() else starts)
    if args.max_patch_length is not None:
        lengths = split_long_patches(lengths, args.max_patch_length)
    if mode == PatchingMode.static and turns.any():
        # static: the document's grid, then a cut after each marker (what generation decides)
        lengths = lengths_from_starts(starts_from_lengths(lengths, length) | turns)
    lengths = trim_zero_columns(lengths)
    if lengths.shape[1] and not np.all(lengths.sum(axis=1) == length):
        raise RuntimeError(f"patch lengths do not sum to {length}: {lengths.sum(axis=1)}")
    return lengths


def _rule_starts(
    args: PatcherArgs,
    tokens: np.ndarray,
    scores: np.ndarray | None,
    length: int,
    threshold: float | None,
) -> np.ndarray:
    mode = args.patching_mode
    if mode == PatchingMode.space:
        return space_patch_starts(tokens, length)
    if mode == PatchingMode.bpe:
        return bpe_delim_patch_starts(tokens, length)
    if mode == PatchingMode.tokenizer:
        return tokenizer_patch_starts(tokens, length, args.tokenizer_path)
    threshold = args.threshold if threshold is None else threshold
    if mode != PatchingMode.entropy or threshold is None:
        raise ValueError(f"patching_mode={mode.value}: its starts come from Patcher (torch)")
    check_entropies(tokens.shape, None if scores is None else scores.shape)
    return entropy_patch_starts(
        scores, length, threshold, threshold_add=args.threshold_add,
        monotonicity=args.monotonicity,
    )  # fmt: skip


def check_entropies(tokens_shape: tuple, entropies_shape: tuple | None) -> None:
    """Entropy mode needs one entropy per token (None: none were given, and no model runs)."""
    if entropies_shape is None:
        raise ConfigError(
            "patching_mode=entropy without entropies: pass entropies (e.g. from "
            "apps.preprocess_entropies) or set realtime_patching=true with "
            "entropy_model_checkpoint_dir"
        )
    if tuple(entropies_shape) != tuple(tokens_shape):
        raise DataError(
            f"entropies shape {tuple(entropies_shape)} does not match tokens shape "
            f"{tuple(tokens_shape)}"
        )


def first_two_starts(batch: int, length: int) -> np.ndarray:
    starts = np.zeros((batch, length), dtype=bool)
    starts[:, : min(2, length)] = True
    return starts


def static_patch_lengths(batch: int, length: int, patch_size: int) -> np.ndarray:
    """ceil(length / patch_size) patches of patch_size; the last holds the remainder."""
    n_patches = -(-length // patch_size)
    lengths = np.full((batch, n_patches), patch_size, dtype=np.int64)
    if n_patches and length % patch_size:
        lengths[:, -1] = length % patch_size
    return lengths


def entropy_patch_starts(
    entropies: np.ndarray,
    length: int,
    threshold: float,
    threshold_add: float | None = None,
    monotonicity: bool = False,
) -> np.ndarray:
    """Start mask [B, length]; a start at p >= 2 is decided by H[p-1] (entropies [B, N]).
    Compared in float32, the threshold included (as torch compares a tensor with a float)."""
    starts = first_two_starts(entropies.shape[0], length)
    if length <= 2:
        return starts
    later = entropies[:, 1:].astype(np.float32)  # later[j] = H[j+1] decides position j+2
    rise = np.zeros_like(later)
    rise[:, 1:] = later[:, 1:] - later[:, :-1]
    if monotonicity:
        decide = rise > np.float32(threshold)
        decide[:, 0] = True  # the reference always starts a patch at position 2 here
    elif threshold_add is not None:
        decide = (rise > np.float32(threshold_add)) & (later > np.float32(threshold))
        decide[:, 0] = True
        decide[:, 1:2] = False  # ... and never at position 3
    else:
        decide = later > np.float32(threshold)
    starts[:, 2:] = decide[:, : length - 2]
    return starts


def space_like(tokens: np.ndarray) -> np.ndarray:
    """Bytes that end a patch in space mode: first of a run of non-alphanumeric ASCII or UTF-8
    lead bytes; special tokens (< OFFSET) always count."""
    byte = tokens - OFFSET
    like = (
        (byte < ord("0"))
        | ((byte > ord("9")) & (byte < ord("A")))
        | ((byte > ord("Z")) & (byte < ord("a")))
        | ((byte > ord("z")) & (byte < 0x80))
        | (byte >= 0xC0)
    )
    first = like.copy()
    first[:, 1:] &= ~like[:, :-1]
    return first | (tokens < OFFSET)


def space_patch_starts(tokens: np.ndarray, length: int) -> np.ndarray:
    """Start mask [B, length] for space mode: a patch starts after each space-like byte."""
    starts = first_two_starts(tokens.shape[0], length)
    starts[:, 2:] = space_like(tokens)[:, 1 : length - 1]
    return starts


def bpe_delim_patch_starts(tokens: np.ndarray, length: int) -> np.ndarray:
    """Start mask [B, length] for bpe mode: a patch starts after each BPE delimiter."""
    starts = first_two_starts(tokens.shape[0], length)
    starts[:, 2:] = tokens[:, 1 : length - 1] == BPE_ID
    return starts


def tokenizer_patch_starts(tokens: np.ndarray, length: int, path: str) -> np.ndarray:
    """Start mask [B, length] for tokenizer mode: a patch starts at the first byte of each token
    of the byte-level BPE at `path`, each row's text tokenized once as a whole.

    Positions 0 and 1 start a patch (as in every mode), so does the first byte after a special
    token or a chat marker (as in space mode; `turn_starts` adds the markers' starts). The bytes
    between such tokens are one text: its valid UTF-8 stretches are tokenized, and a byte that
    is not valid UTF-8 is a patch of its own (what a byte-level BPE, which merged valid text,
    makes of such bytes). A stretch whose tokens do not spell it (the tokenizer's normalizer
    changed it) is patched with the space rule. Unlike every other mode, a start at p depends on
    the bytes from p on (where the tokenizer cuts): the starts cannot be decided online."""
    if length > tokens.shape[1]:
        raise ConfigError(
            "patching_mode=tokenizer cannot patch online (include_next_token, generation): a "
            "token's start depends on the bytes after it; use it for training and scoring only"
        )
    bpe = load_byte_level_bpe(path)
    starts = first_two_starts(tokens.shape[0], length)
    text = (tokens >= OFFSET) & (tokens < OFFSET + 256) & ~is_marker(tokens)
    for row in range(tokens.shape[0]):
        edges = np.flatnonzero(np.diff(np.concatenate([[0], text[row].astype(np.int8), [0]])))
        for begin, end in zip(edges[::2].tolist(), edges[1::2].tolist()):
            data = (tokens[row, begin:end] - OFFSET).astype(np.uint8).tobytes()
            starts[row, begin + _text_starts(bpe, data)] = True
    return starts


def _text_starts(bpe: ByteLevelBPE, data: bytes) -> np.ndarray:
    """Token starts (byte offsets) of one text: its valid UTF-8 stretches through the tokenizer,
    each invalid byte alone, a stretch the normalizer changed by the space rule."""
    found, offset, view = [], 0, memoryview(data)
    while offset < len(data):
        try:  # a view, not a slice: each try reads only up to the next invalid byte
            codecs.utf_8_decode(view[offset:], "strict", True)
            end = len(data)
        except UnicodeDecodeError as exc:
            end = offset + exc.start
        if end > offset:
            piece = data[offset:end]
            starts = bpe.token_starts(piece)
            found.append(offset + (_space_starts(piece) if starts is None else starts))
        if end < len(data):
            found.append(np.array([end], dtype=np.int64))  # an invalid byte: a patch alone
        offset = end + 1
    return np.concatenate(found) if found else np.zeros(0, dtype=np.int64)


def _space_starts(data: bytes) -> np.ndarray:
    """Space-mode starts of one text on its own (its first byte starts a patch)."""
    ids = np.frombuffer(data, dtype=np.uint8).astype(np.int64)[None] + OFFSET
    starts = np.zeros(len(data), dtype=bool)
    starts[0] = True
    starts[1:] = space_like(ids)[0, :-1]
    return np.flatnonzero(starts)


def lengths_from_starts(starts: np.ndarray) -> np.ndarray:
    """Start mask [B, L] -> patch lengths [B, max starts] right-padded with 0."""
    batch, length = starts.shape
    n_patches = int(starts.sum(axis=1).max()) if batch and length else 0
    # Unused slots hold `length`, so the gaps after a row's last real start are 0; each start
    # position goes straight to its slot (its rank among the row's starts), no sort.
    start_ids = np.full((batch, n_patches), length, dtype=np.int64)
    rows, cols = np.nonzero(starts)
    slots = np.cumsum(starts, axis=1, dtype=np.int64)[rows, cols] - 1
    start_ids[rows, slots] = cols
    last = np.full((batch, min(1, n_patches)), length, dtype=np.int64)
    return np.concatenate([start_ids[:, 1:], last], axis=1) - start_ids


def starts_from_lengths(lengths: np.ndarray, length: int) -> np.ndarray:
    """Patch lengths [B, P] (rows summing to `length`) -> start mask [B, length]."""
    starts = np.zeros((lengths.shape[0], length), dtype=bool)
    begins = np.cumsum(lengths, axis=1) - lengths
    rows, cols = np.nonzero(lengths > 0)
    starts[rows, begins[rows, cols]] = True
    return starts


def split_long_patches(lengths: np.ndarray, max_length: int) -> np.ndarray:
    """Split every patch longer than max_length into max_length pieces plus the remainder."""
    batch = lengths.shape[0]
    pieces = (lengths + max_length - 1) // max_length  # 0 for padding
    per_row = pieces.sum(axis=1)
    width = int(per_row.max()) if batch else 0
    flat_lengths, flat_pieces = lengths.ravel(), pieces.ravel()
    repeated = np.repeat(flat_lengths, flat_pieces)
    total = repeated.size
    first_piece = np.cumsum(flat_pieces) - flat_pieces
    piece_index = np.arange(total) - np.repeat(first_piece, flat_pieces)
    values = np.minimum(repeated - piece_index * max_length, max_length)
    rows = np.repeat(np.arange(batch), per_row)
    row_first = np.cumsum(per_row) - per_row
    cols = np.arange(total) - np.repeat(row_first, per_row)
    out = np.zeros((batch, width), dtype=np.int64)
    out[rows, cols] = values
    return out


def trim_zero_columns(lengths: np.ndarray) -> np.ndarray:
    """Drop trailing columns that are 0 in every row."""
    if lengths.size == 0:
        return lengths
    keep = int((lengths != 0).sum(axis=1).max())
    return lengths[:, :keep]
