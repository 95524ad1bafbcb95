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
    from bytelatent.trainer.run_lock import hold_run_lock
    from bytelatent.trainer.trainer import Trainer

    for key, value in args.env.items():
        os.environ.setdefault(key, value)
    code = 0
    env = None
    trainer = None
    lock = None
    try:
        env = setup_distributed(args.distributed)
        # Before anything is written to dump_dir: a second run there must leave no trace.
        lock = hold_run_lock(args.dump_dir, args.run_lock, env.rank, env.world_size, env.device)
        setup_logging(args.dump_dir, env.rank)
        trainer = Trainer(args, env)
        trainer.train()
        code = trainer.exit_code
    except UserError as e:
        if not getattr(e, "quiet", False):
            print(e.one_line(), file=sys.stderr)
        code = 2
    finally:
        if trainer is not None:
            trainer.close()
        if lock is not None:
            lock.release()
        for handler in logging.getLogger("bytelatent").handlers:
            handler.flush()
    if env is not None and env.world_size > 1:
        cleanup_and_exit(code)  # gloo meshes can abort at interpreter exit otherwise (os._exit)
    return code


if __name__ == "__main__":
    sys.exit(main())
