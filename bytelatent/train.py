"""`python -m bytelatent.train config=configs/debug.yaml [key=value ...]` (also under torchrun / srun)."""

from __future__ import annotations

if __name__ == "__main__":
    # The first line: from here on a SIGUSR2/SIGTERM (a SLURM warning, a preemption) is kept
    # and stops the run cleanly at its first boundary, also while it starts up.
    from bytelatent.distributed.signals import early_flag

    early_flag()

import sys

from bytelatent.args import TrainArgs  # torch-free, as is everything imported up to the E402 block
from bytelatent.config import parse_args
from bytelatent.config.help import (
    help_topic,
    section_help,
    section_lines,
    top_level_lines,
    wants_help,
)
from bytelatent.data.worker_server import start_early
from bytelatent.errors import FILE_ONLY, UserError
from bytelatent.preflight import offline_patching_warning, preflight

USAGE = "usage: python -m bytelatent.train config=FILE.yaml [key=value ...]   (--help for more)"

EXAMPLES = """\
  python -m bytelatent.data.prepare --out data/stdlib      # the default corpus, once
  python -m bytelatent.train config=configs/debug.yaml dump_dir=runs/debug
  python -m bytelatent.train config=configs/blt_1b.yaml dump_dir=runs/1b dry_run=true
  torchrun --nproc-per-node 2 -m bytelatent.train config=configs/debug.yaml \\
      dump_dir=runs/ddp distributed.dp_shard=2
  python -m bytelatent.print_config config=configs/debug.yaml optim.lr=1e-3   # resolved YAML
  python -m apps.plot runs/debug                          # PNG plots of a run
  python -m bytelatent.launch.slurm --help                # submit to SLURM"""


def help_text() -> str:
    """The `--help` page, from TrainArgs' field descriptions."""
    return f"""{USAGE}

Train a Byte Latent Transformer (or its entropy model) from a YAML config plus key=value overrides
(dotted keys, later ones win; `config=` includes a file). Every key is validated before anything
is built; a mistake is reported in one line and exits 2.

Top-level keys (key = default):
{chr(10).join(top_level_lines(TrainArgs))}

Config sections (`--help SECTION` lists a section's keys with defaults; `--help all` every key):
{chr(10).join(section_lines(TrainArgs))}

Examples:
{EXAMPLES}

Docs: README.md, docs/architecture.md, docs/slurm.md.
"""


def parse_command(argv: list[str]) -> TrainArgs | int:
    """The validated TrainArgs of a command, or the exit code of one that ends here without
    loading torch: 0 after `--help`, 2 after the usage line, a config error or a mistake the
    preflight finds (missing data, a mesh that does not fit the launch; one line)."""
    try:
        if wants_help(argv):
            topic = help_topic(argv)
            page = (
                help_text() if topic is None else section_help(TrainArgs, topic, "bytelatent.train")
            )
            print(page, end="")
            return 0
        if not argv:
            print(USAGE, file=sys.stderr)
            print("example: python -m bytelatent.train config=configs/debug.yaml", file=sys.stderr)
            return 2
        args = parse_args(TrainArgs, argv)
        preflight(args)  # missing files, a mesh that does not fit the launch: before torch
        return args
    except UserError as e:
        print(e.one_line(), file=sys.stderr)
        return 2


if __name__ == "__main__":
    # Before torch is imported (hence E402 below, ruff.toml): help and config errors answer at
    # once, and the data loader's fork server imports torch alongside us.
    _COMMAND = parse_command(sys.argv[1:])
    if isinstance(_COMMAND, int):
        sys.exit(_COMMAND)
    start_early(sys.argv[1:])

import logging
import os
import signal

from bytelatent.distributed.lifecycle import Process
from bytelatent.distributed.mesh import build_mesh
from bytelatent.distributed.signals import early_flag
from bytelatent.model.cpu_bf16 import cpu_bf16_line
from bytelatent.trainer.build import build_parallel_model
from bytelatent.trainer.metrics import setup_logging
from bytelatent.trainer.model_info import MODEL_INFO, summary_line, write_model_info
from bytelatent.trainer.resume_check import changes_line, check_resume, complete_line
from bytelatent.trainer.run_files import disk_error_of, log_final_error, raise_log_file_error
from bytelatent.trainer.run_lock import hold_run_lock
from bytelatent.trainer.trainer import Trainer

logger = logging.getLogger("bytelatent")


def main(argv: list[str] | None = None) -> int:
    command = parse_command(sys.argv[1:] if argv is None else argv)
    return command if isinstance(command, int) else start(command)


def start(args: TrainArgs) -> int:
    return dry_run(args) if args.dry_run else run(args)


def dry_run(args: TrainArgs) -> int:
    """Build the model on meta with this world size's parallelism plan, describe it, exit 0."""
    with Process(args.distributed, env_vars=args.env) as proc:
        env = proc.start()
        setup_logging(None, env.rank)  # console only: a dry run leaves the run's train.log alone
        mesh = build_mesh(args.distributed, env.world_size, env.device.type)
        model = build_parallel_model(args, mesh)
        if env.rank == 0:
            total, mem = write_model_info(model, args, mesh, env.rank)
            ranks = f"{env.world_size} rank{'s' if env.world_size > 1 else ''}"
            print(f"dry run ({ranks}): {summary_line(total, mem)}")
            for line in memory_advice(model, args, mesh, mem, env.device.type):
                print(line)
            print(f"dry run: wrote {os.path.join(args.dump_dir, MODEL_INFO)}; nothing trained")
    return proc.code


def memory_advice(model, args: TrainArgs, mesh, mem, device_type: str) -> list[str]:
    """The knobs that bring an estimate over the device's memory under it (none when it fits)."""
    from bytelatent.trainer.memory_advice import advice_lines, device_memory_gib
    from bytelatent.trainer.model_info import parameter_table

    device_gib, source = device_memory_gib(args, device_type)
    shape = dict(zip(mesh.mesh_dim_names, mesh.shape)) if mesh is not None else {}
    return advice_lines(model, parameter_table(model), args, shape, mem, device_gib, source)


def run(args: TrainArgs) -> int:
    """Check there is work to do, take the run lock, train; always leave through `Process`."""
    preemption = early_flag()  # installed already under `python -m`; here for callers of main()
    with Process(args.distributed, env_vars=args.env) as proc:
        env = proc.start()
        # Read-only: a run with nothing to do, or a checkpoint it cannot load, writes nothing.
        check = check_resume(args)
        if check.complete:
            if env.rank == 0:
                print(complete_line(args, check.step), flush=True)
            return proc.code
        # Before anything is written to dump_dir: a second run there must leave no trace.
        lock = hold_run_lock(args.dump_dir, args.run_lock, env.rank, env.world_size, env.device)
        trainer = None
        try:
            setup_logging(args.dump_dir, env.rank)
            if check.changes and env.rank == 0:
                logger.warning(changes_line(check))
            if env.rank == 0 and (line := offline_patching_warning(args)):
                logger.warning(line)
            # In the run's log (stdout, train.log), not on stderr: stderr is for the one error line.
            dtype = args.distributed.model_dtype
            if env.rank == 0 and (line := cpu_bf16_line(env.device, dtype)):
                logger.info(line)
            trainer = Trainer(args, env)  # takes `preemption`, the process's flag
            trainer.train()
            raise_log_file_error()  # train.log failed on the last lines (a full disk)
            proc.code = trainer.exit_code
        except UserError as e:  # Process prints it on stderr; train.log gets it too, if it can
            log_final_error(e.one_line())
            raise
        except Exception as e:
            if (disk := disk_error_of(e)) is not None:  # a full disk under another writer
                log_final_error(disk.one_line())
                raise disk from e
            # a hung or dead peer: one line, exit 4; torn down by the launcher: quiet, 128 + signal
            code = _stopped_by_launcher(e, env, preemption) or _peer_failure(e, env, trainer)
            if code is None:
                raise
            proc.code = code
        finally:
            try:
                if trainer is not None:  # an exception on the way out marks the wandb run failed
                    failed = sys.exc_info()[1]
                    trainer.close(
                        2 if isinstance(failed, UserError) else 1 if failed else proc.code
                    )
            finally:
                if lock is not None:  # held by rank 0 only; released whatever close() did
                    lock.release()
    return proc.code


def _stopped_by_launcher(exc: Exception, env, preemption) -> int | None:
    """128 + SIGTERM, said by nobody, for an error on the way down after the launcher sent SIGTERM
    to stop a multi-rank job (another rank failed and said why; e.g. the data loader's forkserver
    died with the signal while this rank started its worker, or a collective lost that rank)."""
    received = preemption.received
    if received != signal.SIGTERM or env is None or env.world_size < 2:
        return None
    first = " ".join(str(exc).split())[:200]  # kept in train.log (rank 0), not on the console
    logger.warning("stopped by SIGTERM; on the way: %s: %s", type(exc).__name__, first,
                   extra=FILE_ONLY)  # fmt: skip
    return 128 + int(signal.SIGTERM)


def _peer_failure(exc: Exception, env, trainer) -> int | None:
    """The exit code for a collective that a peer never answered (one line said); else None."""
    from bytelatent.distributed.faults import PEER_FAILURE_EXIT_CODE, describe_peer_failure

    step = "init" if trainer is None else str(trainer.state.step + 1)
    line = None
    if env is not None and isinstance(exc, RuntimeError):
        line = describe_peer_failure(exc, env.rank, env.world_size, step)
    if line is None:
        return None
    print(line, file=sys.stderr, flush=True)
    logger.error("%s", line)
    return PEER_FAILURE_EXIT_CODE


if __name__ == "__main__":
    sys.exit(start(_COMMAND))
