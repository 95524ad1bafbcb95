"""One process lifecycle for every entry point (train, dry run, standalone eval).

    with Process(args.distributed, env_vars=args.env) as proc:
        env = proc.start()          # process group, device; a UserError here is reported too
        proc.code = do_the_work(env)
    return proc.code

On the way out: a `UserError` becomes its one line on stderr and exit code 2 (a `quiet` one has
already been reported); logs and stdio are flushed; and a distributed process leaves through
`cleanup_and_exit`, because gloo meshes can abort at interpreter exit otherwise. Any other
exception propagates as usual (after the same flush).
"""

from __future__ import annotations

import logging
import os
import sys

from bytelatent.distributed.args import DistributedArgs
from bytelatent.distributed.env import DistEnv, cleanup_and_exit, setup_distributed
from bytelatent.errors import UserError


class Process:
    def __init__(self, distributed: DistributedArgs, env_vars: dict[str, str] | None = None):
        self.distributed = distributed
        self.env_vars = env_vars or {}
        self.env: DistEnv | None = None
        self.code = 0

    def start(self) -> DistEnv:
        """Export `env_vars` (never overriding the caller's), then set up the process group."""
        for key, value in self.env_vars.items():
            os.environ.setdefault(key, value)
        self.env = setup_distributed(self.distributed)
        return self.env

    def __enter__(self) -> Process:
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        handled = exc is not None and isinstance(exc, UserError)
        if handled:
            if not getattr(exc, "quiet", False):
                print(exc.one_line(), file=sys.stderr)
            self.code = 2
        for handler in logging.getLogger("bytelatent").handlers:
            handler.flush()
        sys.stdout.flush()
        if exc is None or handled:
            if self.env is not None and self.env.backend is not None:  # 1-rank groups too
                cleanup_and_exit(self.code)  # does not return
        return handled
