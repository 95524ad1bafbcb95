"""Pick the entropy threshold that gives a target mean patch size.

    python -m bytelatent.data.patch_size --target-mean 4.5 --entropies DIR_or_s3
    python -m bytelatent.data.patch_size --target-mean 4.5 --entropy-model DIR --text FILES_OR_GLOB

reads a sample of documents (preprocessed entropy shards, or text in any format the data
pipeline reads, whose entropies the entropy model computes as realtime patching would), patches
every document with the ``Patcher`` exactly as training does (one document at a time,
``include_next_token=False``; ``--monotonicity`` and ``--max-patch-length`` as in
``data.patcher_args``), and bisects the global threshold until the mean patch length (bytes per
patch over the sample) is the target. Prints ``threshold=<value>`` on a line of its own, then the
patch-length distribution at that threshold and at the thresholds for the target +-0.5 and +-1
byte, which shows how sensitive the choice is (``--png`` draws it; needs the ``plot`` extra). With ``--monotonicity`` the value is the threshold on the entropy rise
(``data.patcher_args.monotonicity=true``).

Training rows are cut from a stream of packed documents, so a patch crossing a row boundary is
split in two: ``patch_len_mean`` in training is slightly below the sample's mean for short rows.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import numpy as np
import torch

from bytelatent.errors import ConfigError, DataError, UserError
from bytelatent.progress import Progress

NEIGHBOUR_OFFSETS = (-1.0, -0.5, 0.5, 1.0)  # bytes per patch around the target


@dataclass
class SampleDocument:
    tokens: torch.Tensor  # [1, n] long
    entropies: torch.Tensor  # [1, n] float32


def _documents(location: str, file_format: str = "auto", option: str | None = None):
    from bytelatent.data.iterators.file import FileIteratorState, FileShard
    from bytelatent.data.sources import file_formats, source_files

    files = source_files(location, root_dir=None, file_format=file_format, option=option)
    shards = [FileShard(path=p, format=f) for p, f in zip(files, file_formats(files, file_format))]
    return FileIteratorState(shards=shards).build()


def load_sample(
    source: str, sample_bytes: int, entropy_model: str | None = None, device: str = "auto"
) -> list[SampleDocument]:
    """Whole documents from `source` until `sample_bytes` tokens, each with its entropies."""
    from bytelatent.data.args import DataArgs
    from bytelatent.data.patcher import Patcher, PatcherArgs

    tokenizer = DataArgs().tokenizer_for_data().build()  # BOS/EOS as the training pipeline adds
    model_patcher = None
    if entropy_model is not None:
        model_patcher = Patcher(
            PatcherArgs(
                realtime_patching=True,
                entropy_model_checkpoint_dir=entropy_model,
                patching_device=device,
            )
        )
    sample, total = [], 0
    progress = Progress(  # the entropy model is the slow part: a line off a terminal, or a bar
        f"patch_size: entropies of {sample_bytes} bytes with {entropy_model}",
        total=sample_bytes, unit="B", unit_scale=True, mode="auto" if model_patcher else "off",
    )  # fmt: skip
    for doc in _documents(source, option="--text" if entropy_model else "--entropies"):
        if total >= sample_bytes:
            break
        tokens = torch.from_numpy(tokenizer.encode_array(doc.text, strict=True))[None]
        if model_patcher is not None:
            _, entropies = model_patcher.patch(tokens, include_next_token=False)
            progress.update(tokens.shape[1])
        elif doc.entropies is None:
            raise DataError(
                f"{doc.path}: row {doc.row}: no 'entropies'; pass preprocessed shards "
                "(apps/preprocess_entropies) or --entropy-model DIR --text FILES"
            )
        else:
            entropies = torch.from_numpy(np.asarray(doc.entropies, dtype=np.float32))[None]
            if entropies.shape != tokens.shape:
                raise DataError(
                    f"{doc.path}: row {doc.row}: {entropies.shape[1]} entropies for "
                    f"{tokens.shape[1]} tokens; were they computed with another tokenizer?"
                )
        sample.append(SampleDocument(tokens, entropies.float().cpu()))
        total += tokens.shape[1]
    progress.close()
    if not sample:
        raise DataError(f"{source}: no documents")
    return sample


def patch_lengths(
    sample: list[SampleDocument],
    threshold: float,
    monotonicity: bool = False,
    max_patch_length: int | None = None,
) -> np.ndarray:
    """Every patch length of the sample at `threshold`, from the training patcher."""
    from bytelatent.data.patcher import Patcher, PatcherArgs

    patcher = Patcher(
        PatcherArgs(
            threshold=threshold, monotonicity=monotonicity, max_patch_length=max_patch_length
        )
    )
    out = []
    for doc in sample:
        lengths, _ = patcher.patch(doc.tokens, include_next_token=False, entropies=doc.entropies)
        row = lengths[0]
        out.append(row[row > 0].numpy())
    return np.concatenate(out)


def find_threshold(
    sample: list[SampleDocument],
    target_mean: float,
    monotonicity: bool = False,
    max_patch_length: int | None = None,
    iterations: int = 50,
    tolerance: float = 1e-4,
) -> tuple[float, float]:
    """(threshold, mean patch length there): bisection, the mean grows with the threshold."""

    def mean_at(t: float) -> float:
        return float(patch_lengths(sample, t, monotonicity, max_patch_length).mean())

    values = torch.cat([d.entropies[0] for d in sample])
    spread = float(values.max() - values.min()) + 1.0
    lo, hi = (-spread, spread) if monotonicity else (float(values.min()) - 1.0, float(values.max()))
    mean_lo, mean_hi = mean_at(lo), mean_at(hi)
    if not mean_lo <= target_mean <= mean_hi:
        raise ConfigError(
            f"--target-mean {target_mean}: this sample's mean patch length ranges from "
            f"{mean_lo:.3f} to {mean_hi:.3f} (set --max-patch-length higher or sample more text)"
        )
    for _ in range(iterations):
        mid = (lo + hi) / 2
        mean = mean_at(mid)
        if mean < target_mean:
            lo, mean_lo = mid, mean
        else:
            hi, mean_hi = mid, mean
        if hi - lo < 1e-7 or abs(mean - target_mean) < tolerance * target_mean:
            break
    if abs(mean_lo - target_mean) < abs(mean_hi - target_mean):
        return lo, mean_lo
    return hi, mean_hi


def distribution(lengths: np.ndarray) -> list[float]:
    """Fraction of patches per bin of the training metrics' histogram (patch_len_hist)."""
    from bytelatent.trainer.patch_stats import PATCH_LEN_UPPER

    bins = np.searchsorted(PATCH_LEN_UPPER, lengths, side="left")
    counts = np.bincount(bins, minlength=len(PATCH_LEN_UPPER) + 1)
    return (counts / max(1, counts.sum())).tolist()


def table(rows: list[tuple[float, np.ndarray]]) -> str:
    from bytelatent.trainer.patch_stats import PATCH_LEN_BINS

    head = f"{'threshold':>12} {'mean':>7} {'patches':>9} " + " ".join(
        f"{b:>6}" for b in PATCH_LEN_BINS
    )
    lines = [head]
    for threshold, lengths in rows:
        fractions = " ".join(f"{f:6.3f}" for f in distribution(lengths))
        lines.append(f"{threshold:12.6f} {lengths.mean():7.3f} {len(lengths):9d} {fractions}")
    return "\n".join(lines)


def write_png(rows: list[tuple[float, np.ndarray]], path: str, chosen: float) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--png needs matplotlib: pip install -e '.[plot]'") from None
    from bytelatent.trainer.patch_stats import PATCH_LEN_BINS

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for threshold, lengths in rows:
        style = "-" if threshold == chosen else "--"
        label = f"threshold {threshold:.4f} (mean {lengths.mean():.2f})"
        ax.plot(PATCH_LEN_BINS, distribution(lengths), style, marker="o", label=label)
    ax.set_xlabel("patch length (bytes)")
    ax.set_ylabel("fraction of patches")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _neighbours(sample: list[SampleDocument], args: argparse.Namespace) -> list[float]:
    """Thresholds for target means +-0.5 and +-1 byte (those this sample can reach)."""
    out = []
    for offset in NEIGHBOUR_OFFSETS:
        if args.target_mean + offset < 1:
            continue
        try:
            threshold, _ = find_threshold(
                sample,
                args.target_mean + offset,
                args.monotonicity,
                args.max_patch_length,
                tolerance=5e-3,  # the neighbours only show the sensitivity
            )
        except ConfigError:
            continue
        out.append(threshold)
    return out


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bytelatent.data.patch_size", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--target-mean", type=float, required=True, help="bytes per patch")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--entropies", help="preprocessed entropy shards (a folder, local or s3://)"
    )
    source.add_argument("--entropy-model", help="entropy model checkpoint folder (with --text)")
    parser.add_argument("--text", help="documents for --entropy-model: a file, folder or glob")
    parser.add_argument("--monotonicity", action="store_true")
    parser.add_argument("--max-patch-length", type=int, default=None)
    parser.add_argument("--sample-bytes", type=int, default=1_000_000)
    parser.add_argument("--device", default="auto", help="where the entropy model runs")
    parser.add_argument("--png", default=None, help="write the distribution plot here")
    args = parser.parse_args(argv)
    if args.entropy_model and not args.text:
        parser.error("--entropy-model needs --text FILES_OR_GLOB")
    if args.entropies and args.text:
        parser.error("--text goes with --entropy-model, not --entropies")
    if args.target_mean < 1 or args.sample_bytes < 1:
        parser.error("--target-mean must be >= 1 and --sample-bytes >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        sample = load_sample(
            args.entropies or args.text, args.sample_bytes, args.entropy_model, args.device
        )
        threshold, mean = find_threshold(
            sample, args.target_mean, args.monotonicity, args.max_patch_length
        )
        print(f"threshold={threshold!r}")
        n_bytes = sum(d.tokens.shape[1] for d in sample)
        print(f"sample: {len(sample)} documents, {n_bytes} bytes; mean patch length {mean:.4f}")
        thresholds = [threshold] + _neighbours(sample, args)
        rows = sorted(
            (t, patch_lengths(sample, t, args.monotonicity, args.max_patch_length))
            for t in thresholds
        )
        print(table(rows))
        if args.png:
            write_png(rows, args.png, threshold)
            print(f"wrote {args.png}")
    except UserError as err:
        print(err.one_line(), file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
