"""What `python -m bytelatent.train` checks after the config validates and before it imports torch.

Mistakes that the model build (10-40 s of imports, process group and meta model) used to hide,
each found here in about a second from the config, the environment and the files alone, with
nothing written (no dump_dir, no train.log): a missing data source or `data.root_dir` (with a
close name when there is one), a missing validation file, a mesh that does not fill the launched
world (`dp_shard=2` without torchrun), a `model.global_init.path` that is not a HF folder, a
`patching_mode=tokenizer` tokenizer that is missing or not a byte-level BPE, a resume whose
global batch differs from the checkpoint's data stream, and a data file that changed since the
checkpoint's data state was saved. Every check reads what the run itself would read next;
torch-free (tests/test_preflight.py checks it never loads torch).
"""

from __future__ import annotations

import json

from bytelatent.args import TrainArgs
from bytelatent.checkpoint import fs as cfs
from bytelatent.checkpoint.layout import FolderStore, train_state_name
from bytelatent.data.changed_files import changed_files
from bytelatent.data.elastic import check_layout, packing_base
from bytelatent.data.iterators.streams import StreamsIteratorState
from bytelatent.data.patcher_args import PatchingMode
from bytelatent.distributed.world import launch_ranks, resolve_layout
from bytelatent.errors import CheckpointError, ConfigError, DataError
from bytelatent.eval.val_sources import resolve_validation_sources
from bytelatent.tokenizers.hf_bpe import load_byte_level_bpe
from bytelatent.trainer.resume_config import (
    ResumeCheck,
    config_diff,
    read_params,
    refuse_unresumable,
)


def preflight(args: TrainArgs) -> None:
    """Raise the UserError a run would meet in its first seconds; read-only."""
    layout = resolve_layout(args.distributed, launch_ranks().world_size)
    resume = resume_folder(args)
    if args.dry_run:
        return  # a dry run reads no data, no checkpoint and no pretrained weights
    if args.checkpoint.load_path:
        check_load_path(args.checkpoint.load_path, args.checkpoint.s3_profile)
    if resume is not None and _already_complete(args, resume):
        return  # nothing to do: the run says so in one line, whatever its data or config now
    if resume is not None:
        check_resumed_config(args, resume)
        check_resumed_batch(args, resume, layout.dp_size)
        check_resumed_data_files(args, resume)
    elif (init := getattr(args.active_model_args(), "global_init", None)) is not None:
        check_global_init(init.path, "model.global_init")
    for source in args.data.source_weights():
        args.data.files_of(source)
    patcher = args.data.patcher_args
    if args.data.add_patches and patcher.patching_mode == PatchingMode.tokenizer:
        online = sorted(set(args.eval.tasks) & {"generation", "harness"})
        if online:
            raise ConfigError(
                f"eval.tasks={online}: patching_mode=tokenizer cannot generate or score (a patch "
                "start depends on the bytes after it); evaluate with the bpb task, or run those "
                "tasks on the checkpoint with a causal patcher (patcher.patching_mode=space)"
            )
        load_byte_level_bpe(patcher.tokenizer_path)  # what each data-loader worker loads
    if args.eval.enabled:
        resolve_validation_sources(args.eval, args.data)


def offline_patching_warning(args: TrainArgs) -> str | None:
    """The line a run whose patches are decided from the whole document gets in train.log: its
    val/bpb sees where the tokenizer cuts (bytes after each start), so it is not a causal score."""
    patcher = args.data.patcher_args
    if not (args.data.add_patches and patcher.patching_mode == PatchingMode.tokenizer):
        return None
    if args.data.boundary_targets:  # the model pays for each boundary: a causal score
        return None
    return (
        "patching_mode=tokenizer: bpb is conditional on the tokenizer's boundaries, which see the "
        "bytes after each patch start (not a causal score): compare it only with runs patched the "
        "same way; bench/byteify_causal_eval.py rescores a checkpoint causally (docs/byteify.md)"
    )


def resume_folder(args: TrainArgs) -> str | None:
    """The step folder a resume would load first (`checkpoint.load_path`, else the newest
    complete save); None for a fresh start."""
    ckpt = args.checkpoint
    if ckpt.load_path:
        return ckpt.load_path
    path = ckpt.path or cfs.join(args.dump_dir, "checkpoints")
    fs = cfs.get_fs(path, ckpt.s3_profile)
    if not cfs.exists(fs, path):
        return None
    complete = FolderStore(fs, path).complete()
    return complete[-1].path if complete else None


def check_load_path(path: str, s3_profile: str | None = None) -> None:
    """`checkpoint.load_path` is a folder (a step folder the resume loads), checked before the
    model is built and before anything is written to dump_dir."""
    fs = cfs.get_fs(path, s3_profile)
    if not cfs.exists(fs, path):
        what = "does not exist"
    elif not cfs.isdir(fs, path):
        what = "is a file, not a step folder"
    else:
        return
    raise CheckpointError(
        f"checkpoint.load_path {path}: {what}; point it at a step folder "
        "(e.g. runs/x/checkpoints/0000001000), or unset it to resume from dump_dir"
    )


def _already_complete(args: TrainArgs, folder: str) -> bool:
    """The saved step has reached the run's stop step (`relative_steps` runs always continue)."""
    if args.relative_steps is not None:
        return False
    fs = cfs.get_fs(folder, args.checkpoint.s3_profile)
    try:
        step = json.loads(cfs.read_text(fs, cfs.join(folder, train_state_name(0))))["step"]
    except (OSError, ValueError, KeyError, TypeError):
        return False  # the resume reads the folder and says what is wrong
    return isinstance(step, int) and step >= (args.max_steps or args.steps)


def _saved_data_state(args: TrainArgs, folder: str) -> dict | None:
    fs = cfs.get_fs(folder, args.checkpoint.s3_profile)
    file = cfs.join(folder, train_state_name(0))
    if not cfs.exists(fs, file):
        return None  # an older layout, or a damaged folder: the resume reports it
    try:
        return json.loads(cfs.read_text(fs, file)).get("data_state")
    except (ValueError, AttributeError):
        return None  # unreadable here: the resume verifies the folder and says what is wrong


def check_resumed_config(args: TrainArgs, folder: str) -> None:
    """A changed key the resume could not apply (`resume_rules`: the patcher, a new source,
    data.root_dir, ...) is refused now; the model's shapes are compared after torch loads."""
    fs = cfs.get_fs(folder, args.checkpoint.s3_profile)
    try:
        saved = read_params(fs, folder)
    except ValueError:
        return
    if saved is None:
        return
    check = ResumeCheck(path=folder)
    check.changes, check.rules = config_diff(args, saved, _saved_data_state(args, folder))
    refuse_unresumable(check)


def check_resumed_batch(args: TrainArgs, folder: str, dp_size: int) -> None:
    """The global batch (dp x data.batch_size x grad_acc_steps) must be the checkpoint's: its
    data stream has that many rows per step (`data/elastic.py`)."""
    try:
        base = packing_base(_saved_data_state(args, folder))
    except (ValueError, DataError):
        return  # unreadable here: the resume verifies the folder and says what is wrong
    if base is None or not isinstance(base.source, StreamsIteratorState):
        return  # per-rank states of an older version restart their streams (with a warning)
    streams = base.source
    check_layout(
        streams.n_streams,
        streams.n_streams * streams.rows_per_stream,
        dp_size,
        args.data.batch_size,
        args.grad_acc_steps,
    )


def check_resumed_data_files(args: TrainArgs, folder: str) -> None:
    """A data file the checkpoint's data state reads from must be the one it was saved with
    (`data/fingerprint.py`); the data loader finds the same, but after the model build."""
    error = changed_files(_saved_data_state(args, folder), args.data.fsspec_options() or None)
    if error is not None:
        raise error


def check_global_init(path: str, key: str = "model.global_init") -> None:
    """`<key>.path` (`model.global_init` of a BLT, `arch_args.global_init` of an H-Net) is a
    folder with config.json and its safetensors files."""
    from bytelatent.checkpoint.hf_llama_files import read_hf_config, weight_files

    fs = cfs.get_fs(path)
    if not cfs.isdir(fs, path):
        raise CheckpointError(
            f"{key}.path {path}: no such folder; point it at a HF LlamaForCausalLM "
            "folder (config.json + *.safetensors, e.g. from `huggingface-cli download`)"
        )
    read_hf_config(path)
    weight_files(path)
