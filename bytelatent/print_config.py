"""`python -m bytelatent.print_config config=... [key=value ...]`: print the resolved config as YAML.

Secret-looking values (tokens, keys, passwords) are redacted, as in `dump_dir/config.yaml`.
"""

from __future__ import annotations

import sys

from bytelatent.errors import UserError

USAGE = "usage: python -m bytelatent.print_config config=FILE.yaml [key=value ...]"


def main(argv: list[str] | None = None) -> int:
    from bytelatent.args import TrainArgs
    from bytelatent.config import parse_args
    from bytelatent.config.help import entry_help
    from bytelatent.config.redact import redacted_yaml

    argv = sys.argv[1:] if argv is None else argv
    try:
        if (page := entry_help(argv, usage=USAGE, model=TrainArgs, doc=__doc__)) is not None:
            print(page, end="")
            return 0
        args = parse_args(TrainArgs, argv)
    except UserError as e:
        print(e.one_line(), file=sys.stderr)
        return 2
    print(redacted_yaml(args), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
