"""`python -m bytelatent.data.check config=... [key=value ...] [--val PATH ...]`: scan data up front.

Reads every file of every training source (data.sources / data.dataset_files) and every
validation file (`*.val.jsonl` beside the training files, plus each `--val` path or glob), and
checks what training would otherwise find hours later: the file opens (an Arrow IPC or Parquet
file has its footer, a `.zst`/`.gz` stream is complete), it has a text column, every record is valid JSON and UTF-8 with a string text, and an
`entropies` list has one value per token. Prints a summary table; exits 1 if anything is wrong
(2 for a config error).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field

import pyarrow as pa

from bytelatent.data.iterators.file import (
    SAMPLE_ID_KEYS,
    _ArrowColumns,
    _ArrowReader,
    _BadRecord,
    _document,
    _record_from_json,
    open_fs,
    text_keys,
)
from bytelatent.data.iterators.formats import BadFile, CompressedLines, ParquetReader
from bytelatent.data.sources import file_formats, source_files
from bytelatent.errors import DataError, UserError

MAX_EXAMPLES = 3  # problems printed per file; all are counted


@dataclass
class FileReport:
    role: str  # "train:<source>" or "val"
    path: str
    format: str
    records: int = 0
    n_bad: int = 0
    examples: list[str] = field(default_factory=list)

    def bad(self, problem: str) -> None:
        self.n_bad += 1
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append(problem)

    @property
    def ok(self) -> bool:
        return self.n_bad == 0


def _entropy_problem(doc, tokenizer) -> str | None:
    if not doc.text:
        return "empty text"
    try:
        n_tokens = len(tokenizer.encode_array(doc.text, strict=True))
    except UnicodeEncodeError as exc:
        return f"text is not valid Unicode (unpaired surrogate at character {exc.start})"
    if doc.entropies is not None and len(doc.entropies) != n_tokens:
        return f"'entropies' has {len(doc.entropies)} values for {n_tokens} tokens"
    return None


def _lines(report: FileReport, options: dict | None):
    """(row, line) of a plain or compressed JSONL file; a broken stream is reported and ends it."""
    fs, fs_path = open_fs(report.path, options)
    if report.format == "json":
        with fs.open(fs_path, "rb") as f:
            yield from enumerate(f)
        return
    reader = CompressedLines(report.path, report.format, fs, fs_path)
    row = 0
    try:
        while line := reader.readline():
            yield row, line
            row += 1
    except BadFile as exc:
        report.bad(f"{exc}; the last good line is line {row}")
    finally:
        reader.close()


def check_jsonl(report: FileReport, options: dict | None, tokenizer, keys=("text",)) -> None:
    for row, line in _lines(report, options):
        if not line.strip():
            continue
        report.records += 1
        try:
            doc = _document(_record_from_json(line), report.path, row, keys)
        except (_BadRecord, ValueError, TypeError) as exc:
            report.bad(f"row {row}: {exc}")
            continue
        problem = _entropy_problem(doc, tokenizer)
        if problem:
            report.bad(f"row {row}: {problem}")


def _open_table(report: FileReport, options: dict | None, keys: tuple[str, ...]):
    if report.format == "arrow":
        return _ArrowReader(report.path, options)
    fs, fs_path = open_fs(report.path, options)
    return ParquetReader(report.path, fs, fs_path, keys, SAMPLE_ID_KEYS)


def check_arrow(report: FileReport, options: dict | None, tokenizer, keys=("text",)) -> None:
    """Arrow IPC and Parquet files: footer, text column type, then every batch / row group."""
    try:
        reader = _open_table(report, options, keys)
    except (_BadRecord, BadFile) as exc:
        report.bad(str(exc))
        return
    except DataError as exc:
        report.bad(str(exc).removeprefix(f"{report.path}: "))
        return
    index = 0
    try:
        names = reader.schema.names
        text_key = next((k for k in keys if k in names), None)
        if text_key is None:
            wanted = " or ".join(repr(k) for k in keys)
            report.bad(f"no {wanted} column (columns: {names})")
            return
        if not pa.types.is_string(reader.schema.field(text_key).type) and not (
            pa.types.is_large_string(reader.schema.field(text_key).type)
        ):
            report.bad(f"column '{text_key}' is {reader.schema.field(text_key).type}, not string")
            return
        index, row = 0, 0
        while (batch := reader.batch(index)) is not None:
            _check_arrow_batch(report, batch, index, row, tokenizer, keys)
            row += batch.num_rows
            index += 1
    except (_BadRecord, BadFile) as exc:
        report.bad(f"record batch {index}: {exc}")
    finally:
        reader.close()


def _check_arrow_batch(
    report: FileReport, batch, index: int, first_row: int, tokenizer, keys: tuple[str, ...]
) -> None:
    report.records += batch.num_rows
    invalid = None
    try:
        batch.validate(full=True)  # invalid UTF-8, bad offsets
    except pa.ArrowInvalid as exc:
        invalid = f"record batch {index} (rows {first_row}-): invalid data ({exc})"
        if not _valid_as_bytes(batch):
            report.bad(invalid)
            return
        # only invalid UTF-8: the rows below name the rows that training would fail on
    if batch.num_rows == 0:
        return
    n_bad = report.n_bad
    columns = _ArrowColumns(batch, 0, batch.num_rows, report.path, keys)
    for local in range(batch.num_rows):
        row = first_row + local
        try:
            doc = _document(columns.record(local), report.path, row, keys)
        except _BadRecord as exc:
            report.bad(f"row {row}: {exc}")
            continue
        problem = _entropy_problem(doc, tokenizer)
        if problem:
            report.bad(f"row {row}: {problem}")
    if invalid and report.n_bad == n_bad:  # in a column that training does not read
        report.bad(invalid)


def _valid_as_bytes(batch: pa.RecordBatch) -> bool:
    """Whether `batch` is valid with its string columns read as bytes: its only fault is UTF-8."""
    as_bytes = {pa.string(): pa.binary(), pa.large_string(): pa.large_binary()}
    try:
        columns = [c.view(as_bytes[c.type]) if c.type in as_bytes else c for c in batch.columns]
        pa.RecordBatch.from_arrays(columns, names=batch.schema.names).validate(full=True)
    except pa.ArrowException:
        return False
    return True


def check_file(
    report: FileReport, options: dict | None, tokenizer, text_field: str = "text"
) -> FileReport:
    fs, fs_path = open_fs(report.path, options)
    try:
        size = fs.size(fs_path)
    except FileNotFoundError:
        report.bad("file not found")
        return report
    except OSError as exc:  # a symlink loop, no permission, ...
        report.bad(f"cannot open ({exc.strerror or exc})")
        return report
    if size == 0:
        report.bad("empty file (0 bytes)")
        return report
    try:
        check = check_arrow if report.format in ("arrow", "parquet") else check_jsonl
        check(report, options, tokenizer, text_keys(text_field))
    except (OSError, DataError) as exc:
        report.bad(f"unreadable ({exc})")
    if report.records == 0 and report.ok:
        report.bad("no records")
    return report


def gather_files(args, val: list[str]) -> list[tuple[str, str]]:
    """(role, path) for every training file of every source and every validation file."""
    data = args.data
    options = data.fsspec_options() or None
    out: list[tuple[str, str]] = []
    train_dirs: set[str] = set()
    for source in data.source_weights():
        for path in data.files_of(source):
            out.append((f"train:{source}", path))
            train_dirs.add(path.rsplit("/", 1)[0])
    for directory in sorted(train_dirs):
        fs, fs_dir = open_fs(directory, options)
        for path in sorted(fs.glob(fs_dir.rstrip("/") + "/*.val.jsonl")):
            out.append(("val", fs.unstrip_protocol(path) if "://" in directory else path))
    for entry in val:
        for path in source_files(entry, root_dir=data.root_dir, storage_options=options):
            out.append(("val", path))
    seen: set[tuple[str, str]] = set()
    return [item for item in out if not (item in seen or seen.add(item))]


def _progress(items: list, desc: str):
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is optional: a plain counter on a terminal
        return _plain_progress(items, desc)
    return tqdm(items, desc=desc, unit="file", file=sys.stderr, disable=None)


def _plain_progress(items: list, desc: str):
    tty = sys.stderr.isatty()
    for i, item in enumerate(items, 1):
        if tty:
            print(f"\r{desc}: {i}/{len(items)}", end="", file=sys.stderr, flush=True)
        yield item
    if tty:
        print(file=sys.stderr)


def print_table(reports: list[FileReport]) -> None:
    width = max([len(r.path) for r in reports] + [4])
    print(f"{'role':<16} {'file':<{width}} {'format':<6} {'records':>8} {'bad':>6}  status")
    for r in reports:
        status = (
            "ok" if r.ok else "; ".join(r.examples) + (" ..." if r.n_bad > MAX_EXAMPLES else "")
        )
        print(f"{r.role:<16} {r.path:<{width}} {r.format:<6} {r.records:>8} {r.n_bad:>6}  {status}")
    bad = [r for r in reports if not r.ok]
    print(
        f"{len(reports)} file(s), {sum(r.records for r in reports)} records: "
        + (f"{len(bad)} file(s) with problems" if bad else "no problems found")
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="python -m bytelatent.data.check",
        usage="%(prog)s config=FILE [key=value ...] [--val PATH ...]",
        description=__doc__.split("\n\n", 1)[1],
        epilog="key=value: any training key (`python -m bytelatent.train --help data`).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument("--val", action="append", default=[], help="validation file/glob/folder")
    options, rest = parser.parse_known_args(argv)
    # here, not at the top: `--help` and option errors come without torch start-up (TrainArgs)
    from bytelatent.args import TrainArgs
    from bytelatent.config import parse_args

    try:
        bad = [a for a in rest if a.startswith("-")]
        if bad:
            raise UserError(f"{bad[0]}: unknown option (use key=value for the config, --val PATH)")
        if not any(a.startswith("dump_dir=") for a in rest):
            rest = [*rest, f"dump_dir={os.devnull}"]  # required by TrainArgs; nothing is written
        args = parse_args(TrainArgs, rest)
        files = gather_files(args, options.val)
        tokenizer = args.data.tokenizer_for_data().build()
    except UserError as e:
        print(e.one_line(), file=sys.stderr)
        return 2
    storage = args.data.fsspec_options() or None
    formats = file_formats([path for _, path in files], args.data.file_format)
    reports = [
        check_file(FileReport(role, path, fmt), storage, tokenizer, args.data.text_field)
        for (role, path), fmt in _progress(list(zip(files, formats)), "checking data")
    ]
    print_table(reports)
    return 0 if all(r.ok for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
