"""`python -m bytelatent.train config=configs/debug.yaml [key=value ...]` (also under torchrun / srun)."""

from __future__ import annotations

import logging
import os
import sys

from bytelatent.errors import UserError

logger = logging.getLogger("bytelatent")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # Parse and validate everything before importing torch-heavy modules or touching processes.
    from bytelatent.args import TrainArgs
    from bytelatent.config import parse_args

    try:
        args = parse_args(TrainArgs, argv)
    except UserError as e:
        print(e.one_line(), file=sys.stderr)
        return 2
    return run(args)


def run(args) -> int:
    """Set up the process group, train, and always leave through `cleanup_and_exit` when distributed."""
    from bytelatent.distributed.env import cleanup_and_exit, setup_distributed
    from bytelatent.trainer.metrics import setup_logging
    from bytelatent.trainer.trainer import Trainer

    for key, value in args.env.items():
        os.environ.setdefault(key, value)
    code = 0
    env = None
    trainer = None
    try:
        env = setup_distributed(args.distributed)
        setup_logging(args.dump_dir, env.rank)
        trainer = Trainer(args, env)
        trainer.train()
        code = trainer.exit_code
    except UserError as e:
        print(e.one_line(), file=sys.stderr)
        code = 2
    finally:
        if trainer is not None:  # an exception on the way out marks the wandb run failed
            trainer.close(code if sys.exc_info()[1] is None else 1)
        for handler in logging.getLogger("bytelatent").handlers:
            handler.flush()
    if env is not None and env.world_size > 1:
        cleanup_and_exit(code)  # gloo meshes can abort at interpreter exit otherwise (os._exit)
    return code


if __name__ == "__main__":
    sys.exit(main())
