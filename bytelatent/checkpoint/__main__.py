"""`python -m bytelatent.checkpoint consolidate DIR [--out OUT] [--with-optim] [--s3-profile P]
[--progress auto|on|off] [--format pth|safetensors]`.

Also `export-hf CKPT OUT [--entropy-model DIR] [--allow-window-mismatch] [--allow-arch-import]`
(a folder for transformers' BltForCausalLM),
`import-hf HFDIR OUT` (back to our consolidated layout) and `verify DIR [--sizes-only]` (check
a step folder, or every step folder under DIR, against its manifests).
"""

from __future__ import annotations

import argparse
import logging
import sys

from bytelatent.checkpoint.consolidate import consolidate
from bytelatent.checkpoint.hf_folder import export_hf, import_hf
from bytelatent.checkpoint.verify import verify_tree
from bytelatent.errors import UserError
from bytelatent.progress import PROGRESS_MODES


def _add_hf_commands(commands: argparse._SubParsersAction) -> None:
    export = commands.add_parser(
        "export-hf", help="checkpoint -> folder for transformers' BltForCausalLM.from_pretrained"
    )
    export.add_argument("ckpt", help="a DCP step folder, a consolidated or a released folder")
    export.add_argument("out", help="output folder (config.json, model.safetensors, tokenizer)")
    export.add_argument(
        "--entropy-model", default=None, help="entropy model folder to embed as HF's patcher"
    )
    export.add_argument(
        "--allow-window-mismatch",
        action="store_true",
        help="export a model whose attention window is shorter than its rows (HF has no window: "
        "its logits then equal ours only on rows no longer than the window)",
    )
    export.add_argument(
        "--allow-arch-import",
        action="store_true",
        help="import the module an arch 'pkg.module:name' in params.json names (runs its code: "
        "only for a checkpoint you trust)",
    )
    imp = commands.add_parser(
        "import-hf", help="Hugging Face BLT folder -> params.json + consolidated.pth"
    )
    imp.add_argument("hf_dir", help="folder with config.json (model_type blt) + model.safetensors")
    imp.add_argument("out", help="output folder (an entropy model goes to OUT/entropy_model)")


def _run_export_hf(args: argparse.Namespace) -> str:
    notes = export_hf(
        args.ckpt,
        args.out,
        entropy_model=args.entropy_model,
        allow_window_mismatch=args.allow_window_mismatch,
        allow_arch_import=args.allow_arch_import,
    )
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    return args.out


def _run_import_hf(args: argparse.Namespace) -> str:
    return import_hf(args.hf_dir, args.out)


HF_COMMANDS = {"export-hf": _run_export_hf, "import-hf": _run_import_hf}


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
    cons.add_argument(
        "--format",
        default="pth",
        help="pth (consolidated.pth, default) or safetensors (consolidated.safetensors, model only)",
    )
    cons.add_argument(
        "--progress",
        choices=PROGRESS_MODES,
        default="auto",
        help="progress bar while reading: auto (only on a terminal), on, off",
    )
    _add_hf_commands(commands)
    _add_verify_parser(commands)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    if args.command == "verify":
        return _run_verify(args)
    try:
        if args.command in HF_COMMANDS:
            out = HF_COMMANDS[args.command](args)
        else:
            out = consolidate(
                args.ckpt_dir,
                args.out,
                with_optim=args.with_optim,
                s3_profile=args.s3_profile,
                format=args.format,
                progress=args.progress,
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
    try:
        return verify_tree(args.ckpt_dir, checksum=not args.sizes_only, s3_profile=args.s3_profile)
    except UserError as e:
        print(e.one_line(), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
