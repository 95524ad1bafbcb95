"""`python -m bytelatent.checkpoint consolidate DIR [--out OUT] [--with-optim] [--s3-profile P]`
and `python -m bytelatent.checkpoint verify DIR [--sizes-only] [--s3-profile P]`."""

from __future__ import annotations

import argparse
import logging
import sys

from bytelatent.checkpoint.consolidate import consolidate
from bytelatent.errors import UserError


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
    cons.add_argument("--out", default=None, help="output folder (default: CKPT_DIR/consolidated)")
    cons.add_argument("--with-optim", action="store_true", help="also store the optimizer state")
    cons.add_argument("--s3-profile", default=None, help="AWS profile for s3:// paths")
    _add_verify_parser(commands)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    if args.command == "verify":
        return _run_verify(args)
    try:
        out = consolidate(
            args.ckpt_dir,
            args.out,
            with_optim=args.with_optim,
            s3_profile=args.s3_profile,
        )
    except UserError as e:
        print(e.one_line(), file=sys.stderr)
        return 2
    print(out)
    return 0


def _add_verify_parser(commands) -> None:
    verify = commands.add_parser(
        "verify", help="check a step folder, or every step folder under DIR, against its manifests"
    )
    verify.add_argument("ckpt_dir", help="a step folder or a checkpoints folder (local or s3://)")
    verify.add_argument(
        "--sizes-only", action="store_true", help="check file sizes only, not CRC32s (faster)"
    )
    verify.add_argument("--s3-profile", default=None, help="AWS profile for s3:// paths")


def _run_verify(args: argparse.Namespace) -> int:
    """Print one line per step folder; exit 1 if any complete (or named) folder fails."""
    from bytelatent.checkpoint.verify import verify_tree

    try:
        return verify_tree(args.ckpt_dir, checksum=not args.sizes_only, s3_profile=args.s3_profile)
    except UserError as e:
        print(e.one_line(), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
