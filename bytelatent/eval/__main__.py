"""`python -m bytelatent.eval ckpt=DIR dump_dir=OUT [eval.* | data.* | distributed.* overrides]`

Evaluates a DCP step folder (its params.json supplies the model, data and eval config) or a
consolidated / released-layout folder (pass `data.*` when its params.json has no data section),
in one process or under torchrun (the model is then FSDP-sharded as in training, so results
match the in-loop eval). Writes `OUT/results.json`, prints one summary line, and with
`metrics_file=...` also appends the results line there (the async launcher points it at the
run's `metrics.eval.jsonl`). `lease=PATH` is a reader lease (see bytelatent/launch/async_eval.py)
removed when the eval ends, however it ends.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pydantic
import torch
from pydantic import BaseModel, ConfigDict, Field

from bytelatent.checkpoint import fs as cfs
from bytelatent.checkpoint.manager import parse_step
from bytelatent.checkpoint.pretrained import load_any_checkpoint, read_params
from bytelatent.config.help import entry_help
from bytelatent.config.parser import (
    merge_config_trees,
    parse_dotlist,
    validation_error_to_config_error,
)
from bytelatent.data.args import DataArgs
from bytelatent.distributed.args import DistributedArgs
from bytelatent.distributed.lifecycle import Process
from bytelatent.distributed.mesh import build_mesh, dp_group
from bytelatent.distributed.parallelize import parallelize_model
from bytelatent.distributed.threads import set_tool_cpu_threads
from bytelatent.errors import ConfigError, UserError
from bytelatent.eval.args import EvalArgs
from bytelatent.eval.validate import Validator, append_jsonl, summary_line

logger = logging.getLogger("bytelatent")
RESULTS_FILE = "results.json"


class StandaloneEvalArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    ckpt: str = Field(..., description="DCP step folder, or a consolidated/released folder")
    dump_dir: str = Field(..., description="results.json goes here")
    eval: EvalArgs = Field(
        default_factory=EvalArgs,
        description="tasks and validation data (default: the checkpoint's eval section)",
    )
    data: DataArgs = Field(
        default_factory=DataArgs,
        description="tokenizer, patcher and data roots (default: the checkpoint's data section)",
    )
    distributed: DistributedArgs = Field(
        default_factory=DistributedArgs,
        description="numerics (default: the checkpoint's); the model is FSDP-sharded over all ranks",
    )
    step: int | None = Field(None, description="global_step to record (default: from ckpt)")
    metrics_file: str | None = Field(None, description="also append the results line here")
    lease: str | None = Field(None, description="reader lease file to remove when done")
    device: str | None = Field(None, description="default: the distributed env's device")
    allow_arch_import: bool = Field(
        False,
        description="import the module an arch 'pkg.module:name' in the checkpoint's params.json "
        "names (runs its code: only for a checkpoint you trust)",
    )
    num_threads: int | None = Field(
        None,
        ge=1,
        description="CPU threads; null: $OMP_NUM_THREADS when set (torchrun, async jobs), else "
        "this process's share of the cores less one, as the trainer chooses",
    )


def parse_standalone_args(argv: list[str]) -> StandaloneEvalArgs:
    """Dotlist over the checkpoint's own config (params.json `data`, `distributed`, `eval`)."""
    cli = parse_dotlist(argv)
    if "ckpt" not in cli or "dump_dir" not in cli:
        raise ConfigError("usage: python -m bytelatent.eval ckpt=DIR dump_dir=OUT [key=value ...]")
    params = read_params(str(cli["ckpt"]))
    base = {
        k: params[k] for k in ("data", "distributed", "eval") if isinstance(params.get(k), dict)
    }
    # The training run's async-launch settings are the trainer's business, not this job's.
    base.get("eval", {}).pop("async_launch", None)
    tree = merge_config_trees(base, cli)
    try:
        return StandaloneEvalArgs.model_validate(tree)
    except pydantic.ValidationError as exc:
        raise validation_error_to_config_error(exc, StandaloneEvalArgs, tree) from None


def _step_of(ckpt: str) -> int | None:
    # a step folder, or a folder inside one (e.g. .../0000000200/consolidated)
    parts = ckpt.rstrip("/").rsplit("/", 2)
    return parse_step(parts[-1]) if parse_step(parts[-1]) is not None else parse_step(parts[-2])


def evaluate(args: StandaloneEvalArgs, env) -> dict:
    """Load, (FSDP-)shard, run the tasks; every rank calls this, rank 0 writes the results."""
    # Pure FSDP over all ranks (whatever layout trained it), with the training numerics.
    distributed = args.distributed.model_copy(
        update={"dp_shard": -1, "dp_replicate": 1, "tp_size": 1, "compile": False,
                "activation_checkpointing": "none", "selective_activation_checkpointing": False}
    )  # fmt: skip
    device = torch.device(args.device) if args.device else env.device
    set_tool_cpu_threads(device.type, args.num_threads)  # a shared CPU does not collapse
    validator = Validator(
        args.eval, args.data, distributed=distributed, device=device,
        dp_rank=env.rank, dp_size=env.world_size,
        progress=args.eval.progress if args.eval.progress is not None else sys.stderr.isatty(),
    )  # fmt: skip
    model, _, _ = load_any_checkpoint(args.ckpt, device, allow_arch_import=args.allow_arch_import)
    mesh = build_mesh(distributed, env.world_size, device.type)
    if mesh is not None:
        model = parallelize_model(model, mesh, distributed)
        validator.mesh, validator.dp_group = mesh, dp_group(mesh)
    step = args.step if args.step is not None else _step_of(args.ckpt)
    metrics = validator.run(model, step, mode="standalone")
    if env.rank == 0:
        out = Path(args.dump_dir)
        out.mkdir(parents=True, exist_ok=True)
        record = {**metrics, "ckpt": args.ckpt}
        tmp = out / (RESULTS_FILE + ".tmp")
        tmp.write_text(json.dumps(record, indent=2) + "\n")
        tmp.replace(out / RESULTS_FILE)  # atomic: a results.json on disk is always whole
        if args.metrics_file:
            append_jsonl(args.metrics_file, {**metrics, "eval_mode": "async"})
        print(f"{summary_line(metrics)} -> {out / RESULTS_FILE}", flush=True)
    return metrics


def _remove_lease(path: str | None) -> None:
    if not path:
        return
    fs = cfs.get_fs(path)
    if cfs.exists(fs, path):
        cfs.rm(fs, path, recursive=False)


USAGE = "usage: python -m bytelatent.eval ckpt=DIR dump_dir=OUT [key=value ...]"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    lease = next((a.split("=", 1)[1] for a in argv if a.startswith("lease=")), None)
    try:
        if (
            page := entry_help(argv, usage=USAGE, model=StandaloneEvalArgs, doc=__doc__)
        ) is not None:
            print(page, end="")
            return 0
        args = parse_standalone_args(argv)
    except UserError as e:
        print(e.one_line(), file=sys.stderr)
        _remove_lease(lease)  # nobody reads the checkpoint now
        return 2
    proc = Process(args.distributed)
    with proc:
        try:
            env = proc.start()
            logging.basicConfig(level=logging.INFO if env.rank == 0 else logging.WARNING,
                                format="%(levelname)s %(asctime)s - %(message)s")  # fmt: skip
            evaluate(args, env)
        finally:
            if proc.env is None or proc.env.rank == 0:
                _remove_lease(lease)  # however the eval ended
    return proc.code


if __name__ == "__main__":
    sys.exit(main())
