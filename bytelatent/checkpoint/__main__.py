"""`python -m bytelatent.checkpoint consolidate DIR [--out OUT] [--with-optim] [--s3-profile P]
[--progress auto|on|off]`."""

from __future__ import annotations

import argparse
import logging
import sys

from bytelatent.checkpoint.consolidate import consolidate
from bytelatent.errors import UserError
from bytelatent.progress import PROGRESS_MODES


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bytelatent.checkpoint")
    commands = parser.add_subparsers(dest="command", required=True)
    cons = commands.add_parser(
        "consolidate",
        help="DCP step folder -> params.json + consolidated.pth (single-process loadable)",
    )
    cons.add_argument(
        "ckpt_dir",
        help="a DCP step folder, e.g. dump/checkpoints/0000001000 or s3://...",
    )
    cons.add_argument(
        "--out", default=None, help="output folder (default: CKPT_DIR/consolidated)"
    )
    cons.add_argument(
        "--with-optim", action="store_true", help="also store the optimizer state"
    )
    cons.add_argument("--s3-profile", default=None, help="AWS profile for s3:// paths")
    cons.add_argument(
        "--progress",
        choices=PROGRESS_MODES,
        default="auto",
        help="progress bar while reading: auto (only on a terminal), on, off",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    try:
        out = consolidate(
            args.ckpt_dir,
            args.out,
            with_optim=args.with_optim,
            s3_profile=args.s3_profile,
            progress=args.progress,
        )
    except UserError as e:
        print(e.one_line(), file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
