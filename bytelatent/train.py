"""`python -m bytelatent.train config=configs/debug.yaml [key=value ...]` (also under torchrun / srun)."""

from __future__ import annotations

import logging
import os
import sys

from bytelatent.errors import UserError

logger = logging.getLogger("bytelatent")

USAGE = "usage: python -m bytelatent.train config=FILE.yaml [key=value ...]   (--help for more)"

# One line per config section; tests/trainer/test_dry_run.py checks that every section of
# TrainArgs is listed here.
SECTIONS = {
    "data": "corpus, sources and mixture weights, tokenizer, patcher, batch and sequence sizes",
    "model": "BLT shape: global (latent) transformer, local encoder/decoder, cross-attention, hashes",
    "entropy_model": "byte LM shape, used with train_entropy_model=true",
    "optim": "AdamW, gradient clipping, learning-rate schedule and warmup",
    "distributed": "mesh (dp_replicate x dp_shard x tp), FSDP, dtypes, activation checkpointing",
    "checkpoint": "where and how often to save, retention, resume and warm start",
    "logging": "log frequency, console line, peak FLOP/s for MFU",
    "actions": "run after log steps and evaluations, e.g. [{kind: early_stop, ...}]",
    "eval": "validation bpb in the loop / before training, eval tasks, async eval jobs (local/SLURM)",
    "profiling": "torch.profiler trace window (start step, active steps, CUDA memory snapshot)",
    "run_lock": "one run per dump_dir: the lock's heartbeat and when a dead holder's lock is stale",
    "env": "environment variables exported before the process group starts",
}

HELP = f"""{USAGE}

Train a Byte Latent Transformer (or its entropy model) from a YAML config plus key=value overrides
(dotted keys, later ones win; `config=` includes a file). Every key is validated before anything
is built; a mistake is reported in one line and exits 2.

Top-level keys: name, dump_dir (required: config.yaml, metrics.jsonl, train.log, model-info.txt
and checkpoints go there), seed, steps, max_steps, grad_acc_steps, train_entropy_model,
relative_steps (train N more steps from wherever the run resumes), probe_freq (per-module
statistics every N steps), dry_run (build and describe the model, then exit), num_threads,
gc_collect_freq, debug_dynamo.

Config sections:
{chr(10).join(f"  {name:<15} {line}" for name, line in SECTIONS.items())}

Examples:
  python -m bytelatent.data.prepare --out data/stdlib      # the default corpus, once
  python -m bytelatent.train config=configs/debug.yaml dump_dir=runs/debug
  python -m bytelatent.train config=configs/blt_1b.yaml dump_dir=runs/1b dry_run=true \\
      data.root_dir=data "data.sources={{stdlib: 1.0}}" data.preprocess_dir=data/entropies
  torchrun --nproc-per-node 2 -m bytelatent.train config=configs/debug.yaml \\
      dump_dir=runs/ddp distributed.dp_shard=2
  python -m bytelatent.print_config config=configs/debug.yaml optim.lr=1e-3   # resolved YAML
  python -m apps.plot runs/debug                          # PNG plots of a run
  python -m bytelatent.launch.slurm --help                # submit to SLURM

Docs: README.md, docs/architecture.md, docs/slurm.md.
"""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(HELP, end="")
        return 0
    if not argv:
        print(USAGE, file=sys.stderr)
        print("example: python -m bytelatent.train config=configs/debug.yaml", file=sys.stderr)
        return 2
    # Parse and validate everything before importing torch-heavy modules or touching processes.
    from bytelatent.args import TrainArgs
    from bytelatent.config import parse_args

    try:
        args = parse_args(TrainArgs, argv)
    except UserError as e:
        print(e.one_line(), file=sys.stderr)
        return 2
    return dry_run(args) if args.dry_run else run(args)


def dry_run(args) -> int:
    """Build the model on meta with this world size's parallelism plan, describe it, exit 0."""
    from bytelatent.distributed.env import cleanup_and_exit, setup_distributed
    from bytelatent.distributed.mesh import build_mesh
    from bytelatent.trainer.build import build_parallel_model
    from bytelatent.trainer.metrics import setup_logging
    from bytelatent.trainer.model_info import MODEL_INFO, summary_line, write_model_info

    for key, value in args.env.items():
        os.environ.setdefault(key, value)
    env = None
    code = 0
    try:
        env = setup_distributed(args.distributed)
        setup_logging(None, env.rank)  # console only: a dry run leaves the run's train.log alone
        mesh = build_mesh(args.distributed, env.world_size, env.device.type)
        model = build_parallel_model(args, mesh)
        if env.rank == 0:
            total, mem = write_model_info(model, args, mesh, env.rank)
            ranks = f"{env.world_size} rank{'s' if env.world_size > 1 else ''}"
            print(f"dry run ({ranks}): {summary_line(total, mem)}")
            print(f"dry run: wrote {os.path.join(args.dump_dir, MODEL_INFO)}; nothing trained")
    except UserError as e:
        print(e.one_line(), file=sys.stderr)
        code = 2
    sys.stdout.flush()
    if env is not None and env.backend is not None:  # a process group, 1-rank ones too
        cleanup_and_exit(code)
    return code


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
    except RuntimeError as e:
        code = _peer_failure(e, env, trainer)  # a hung or dead peer: one line, exit 4
    finally:
        if trainer is not None:  # an exception on the way out marks the wandb run failed
            trainer.close(code if sys.exc_info()[1] is None else 1)
        if lock is not None:
            lock.release()
        for handler in logging.getLogger("bytelatent").handlers:
            handler.flush()
    if env is not None and env.backend is not None:  # a process group, 1-rank ones too
        cleanup_and_exit(code)  # gloo meshes can abort at interpreter exit otherwise (os._exit)
    return code


def _peer_failure(exc: RuntimeError, env, trainer) -> int:
    """The exit code for a collective that a peer never answered (one line said); else re-raise."""
    from bytelatent.distributed.faults import PEER_FAILURE_EXIT_CODE, describe_peer_failure

    step = "init" if trainer is None else str(trainer.state.step + 1)
    line = None
    if env is not None:
        line = describe_peer_failure(exc, env.rank, env.world_size, step)
    if line is None:
        raise exc
    print(line, file=sys.stderr, flush=True)
    logger.error("%s", line)
    return PEER_FAILURE_EXIT_CODE


if __name__ == "__main__":
    sys.exit(main())
