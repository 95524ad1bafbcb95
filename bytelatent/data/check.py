"""`python -m bytelatent.data.check config=... [key=value ...] [--val PATH ...]`: scan data up front.

Reads every file of every training source (data.sources / data.dataset_files) and every
validation file (`*.val.jsonl` beside the training files, plus each `--val` path or glob), and
checks what training would otherwise find hours later, with the reader of each file's format
(`bytelatent/data/readers`): the file opens (an Arrow IPC or Parquet file has its footer, a
`.zst`/`.gz` stream is complete), it has a text column, every record is valid (JSON, UTF-8, a
string text), an `entropies` list has one value per token, and what the format's `inspect` adds
(Arrow/Parquet: the text column is a string, every batch is valid data). Prints a summary table; exits 1 if anything is wrong
(2 for a config error).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field

from bytelatent.data.readers import (
    BadFile,
    BadRecord,
    ReadOptions,
    get_format,
    open_fs,
    text_keys,
)
from bytelatent.data.readers.base import DEFAULT_MAX_DOCUMENT_BYTES
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


class _WholeFile:
    """Every row of a file (the shard a check reads)."""

    stride = 1
    offset = 0

    def __init__(self, path: str) -> None:
        self.path = path


def check_records(report: FileReport, options: ReadOptions, tokenizer) -> None:
    """Read every record with the file's reader (as training does, from its start) and report
    each bad one, and what the format's `inspect` finds that reading does not."""
    fmt = get_format(report.format)
    try:
        reader = fmt.open(_WholeFile(report.path), fmt.position(), options)
    except BadFile as exc:
        report.bad(str(exc))
        return
    except DataError as exc:
        report.bad(str(exc).removeprefix(f"{report.path}: "))
        return
    try:
        while True:
            try:
                doc = reader.read()
            except BadRecord as exc:
                report.records += 1
                report.bad(f"row {exc.row}: {exc.reason}")
                continue
            except BadFile as exc:
                report.bad(str(exc))
                break
            if doc is None:
                break
            report.records += 1
            problem = _entropy_problem(doc, tokenizer)
            if problem:
                report.bad(f"row {doc.row}: {problem}")
    finally:
        reader.close()
    for problem in fmt.inspect(report.path, options) if fmt.inspect else ():
        report.bad(problem)


def check_file(
    report: FileReport,
    options: dict | None,
    tokenizer,
    text_field: str = "text",
    max_document_bytes: int | None = DEFAULT_MAX_DOCUMENT_BYTES,
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
    read_options = ReadOptions(
        text_keys=text_keys(text_field),
        storage_options=options,
        max_document_bytes=max_document_bytes,
    )
    try:
        check_records(report, read_options, tokenizer)
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
        check_file(
            FileReport(role, path, fmt),
            storage,
            tokenizer,
            args.data.text_field,
            args.data.max_document_bytes,
        )
        for (role, path), fmt in _progress(list(zip(files, formats)), "checking data")
    ]
    print_table(reports)
    return 0 if all(r.ok for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
