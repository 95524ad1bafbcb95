"""DistributedArgs validation, launcher detection, mesh layout and dp/tp rank formulas."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bytelatent.config import parse_args
from bytelatent.distributed.args import DistributedArgs
from bytelatent.distributed.env import (
    detect_env,
    setup_distributed,
    slurm_master_port,
    slurm_tasks_on_node,
)
from bytelatent.distributed.mesh import (
    MESH_DIMS,
    build_mesh,
    dp_rank_and_size,
    dp_rank_from_coords,
    resolve_layout,
    tp_rank_and_size,
)
from bytelatent.errors import ConfigError
from tests.limits import hang_limit

LAUNCH_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "SLURM_JOB_ID",
    "SLURM_STEP_ID",
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "SLURM_NTASKS",
    "SLURM_STEP_NUM_TASKS",
    "SLURM_JOB_NODELIST",
    "SLURM_STEP_TASKS_PER_NODE",
    "SLURM_NODEID",
    "LOCAL_WORLD_SIZE",
)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


# --- args ----------------------------------------------------------------------------------


def test_defaults_fill_dp_shard():
    args = DistributedArgs()
    assert (args.dp_replicate, args.dp_shard, args.tp_size) == (1, -1, 1)
    assert args.param_dtype == torch.bfloat16 and args.reduce_dtype == torch.float32
    assert resolve_layout(args, 8).dp_shard == 8


def test_deprecated_selective_flag_means_full():
    args = DistributedArgs(selective_activation_checkpointing=True)
    assert args.activation_checkpointing == "full"
    with pytest.raises(ValueError, match="deprecated name"):
        DistributedArgs(
            selective_activation_checkpointing=True,
            activation_checkpointing="selective",
        )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["tp_size=0"], "tp_size=0: must be a positive integer, or -1 to fill"),
        (["dp_shard=-1", "tp_size=-1"], "only one of dp_replicate, dp_shard, tp_size"),
        (
            ["fsdp_type=no_shard", "dp_shard=2"],
            "fsdp_type=no_shard replicates parameters",
        ),
        (["fsdp_type=half_shard"], "fsdp_type: expected 'no_shard' or 'full_shard'"),
        (["model_dtyp=fp32"], "model_dtyp: unknown key (did you mean model_dtype?)"),
    ],
)
def test_bad_args_are_config_errors(argv: list[str], message: str):
    with pytest.raises(ConfigError) as err:
        parse_args(DistributedArgs, argv)
    assert message in str(err.value)


# --- layout ---------------------------------------------------------------------------------


def test_layout_product_must_match_world():
    args = DistributedArgs(dp_replicate=1, dp_shard=2, tp_size=2)
    with pytest.raises(ConfigError) as err:
        resolve_layout(args, 2)
    assert str(err.value).startswith(
        "distributed: dp_replicate(1) × dp_shard(2) × tp_size(2) = 4 but WORLD_SIZE is 2"
    )


def test_layout_fill_and_divisibility():
    assert resolve_layout(DistributedArgs(dp_replicate=-1, dp_shard=2), 8).dp_replicate == 4
    layout = resolve_layout(DistributedArgs(dp_shard=2, tp_size=-1), 8)
    assert (layout.dp_replicate, layout.dp_shard, layout.tp) == (1, 2, 4)
    with pytest.raises(ConfigError, match="WORLD_SIZE 6 is not divisible by .* = 4"):
        resolve_layout(DistributedArgs(dp_replicate=4, dp_shard=-1), 6)


def test_no_shard_replicates_everything():
    layout = resolve_layout(DistributedArgs(fsdp_type="no_shard"), 4)
    assert (layout.dp_replicate, layout.dp_shard, layout.tp) == (4, 1, 1)
    layout = resolve_layout(DistributedArgs(fsdp_type="no_shard", tp_size=2), 4)
    assert (layout.dp_replicate, layout.dp_shard, layout.tp) == (2, 1, 2)


def test_single_process_has_no_mesh():
    assert build_mesh(DistributedArgs(), 1, "cpu") is None
    assert dp_rank_and_size(None) == (0, 1)
    assert tp_rank_and_size(None) == (0, 1)
    with pytest.raises(ConfigError):
        build_mesh(DistributedArgs(dp_shard=2), 1, "cpu")


class FakeMesh:
    """Duck-typed DeviceMesh: coordinates of one rank in a (rep, shard, tp) mesh."""

    mesh_dim_names = MESH_DIMS

    def __init__(self, shape: tuple[int, int, int], rank: int):
        self.shape = shape
        _, shard, tp = shape
        self.coordinate = [rank // (shard * tp), rank // tp % shard, rank % tp]

    def get_coordinate(self) -> list[int]:
        return self.coordinate


@pytest.mark.parametrize("shape", [(2, 2, 1), (2, 3, 1), (3, 2, 1), (2, 2, 2), (1, 2, 2)])
def test_dp_ranks_are_a_permutation_and_shared_across_tp(shape: tuple[int, int, int]):
    rep, shard, tp = shape
    seen: dict[int, set[int]] = {}
    for rank in range(rep * shard * tp):
        mesh = FakeMesh(shape, rank)
        dp_rank, dp_size = dp_rank_and_size(mesh)
        tp_rank, tp_size = tp_rank_and_size(mesh)
        assert (dp_size, tp_size) == (rep * shard, tp)
        assert tp_rank == rank % tp
        seen.setdefault(dp_rank, set()).add(tp_rank)
    # Every dp rank appears once per tp rank: no two dp groups read the same data.
    assert sorted(seen) == list(range(rep * shard))
    assert all(tps == set(range(tp)) for tps in seen.values())


def test_reference_dp_formula_would_collide():
    ours = {dp_rank_from_coords(r, s, 3) for r in range(2) for s in range(3)}
    reference = {r * 2 + s for r in range(2) for s in range(3)}  # r_rep * size(dp_replicate)
    assert ours == set(range(6))
    assert len(reference) < 6


# --- launcher detection ---------------------------------------------------------------------


def test_detect_single(clean_env: pytest.MonkeyPatch):
    env = detect_env()
    assert (env.rank, env.local_rank, env.world_size, env.launcher) == (
        0,
        0,
        1,
        "single",
    )
    assert env.backend is None


def test_detect_torchrun(clean_env: pytest.MonkeyPatch):
    for name, value in {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4"}.items():
        clean_env.setenv(name, value)
    env = detect_env()
    assert (env.rank, env.local_rank, env.world_size, env.launcher) == (
        3,
        1,
        4,
        "torchrun",
    )
    expected = "nccl" if torch.cuda.is_available() else "gloo"
    assert env.backend == expected


def test_detect_slurm_only_inside_srun_step(clean_env: pytest.MonkeyPatch):
    clean_env.setenv("SLURM_JOB_ID", "77")
    clean_env.setenv("SLURM_PROCID", "5")
    clean_env.setenv("SLURM_LOCALID", "1")
    clean_env.setenv("SLURM_NTASKS", "8")
    assert detect_env().launcher == "single"  # batch script / salloc shell: one process
    clean_env.setenv("SLURM_STEP_ID", "0")
    clean_env.setenv("SLURM_STEP_NUM_TASKS", "6")
    env = detect_env()
    assert (env.rank, env.local_rank, env.world_size, env.launcher) == (
        5,
        1,
        6,
        "slurm",
    )


def test_bad_env_value_is_config_error(clean_env: pytest.MonkeyPatch):
    for name, value in {"RANK": "x", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}.items():
        clean_env.setenv(name, value)
    with pytest.raises(ConfigError, match="RANK='x'"):
        detect_env()


def test_slurm_port_is_stable_and_differs_per_step():
    assert slurm_master_port("123", "0") == slurm_master_port("123", "0")
    assert 20000 <= slurm_master_port("123", "0") <= 32767  # below the ephemeral range
    assert slurm_master_port("123", "0") != slurm_master_port("123", "1")


def _fake_scontrol(bin_dir: Path) -> None:
    script = bin_dir / "scontrol"
    script.write_text(
        '#!/bin/sh\n[ "$1 $2" = "show hostnames" ] && printf "127.0.0.1\\nnode2\\n"\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)


SLURM_CHILD = """
import torch.distributed as dist
from bytelatent.distributed.args import DistributedArgs
from bytelatent.distributed.env import setup_distributed, cleanup_and_exit
env = setup_distributed(DistributedArgs())
import os
print(env.launcher, env.rank, env.world_size, dist.get_world_size(), os.environ["MASTER_ADDR"],
      os.environ.get("LOCAL_WORLD_SIZE"), flush=True)
cleanup_and_exit(0)
"""


def test_setup_under_slurm_step_with_one_task(tmp_path: Path):
    """A 1-task srun step: rendezvous on the first host from scontrol, port from the job id."""
    _fake_scontrol(tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env |= {
        "PATH": f"{tmp_path}:{env['PATH']}",
        "SLURM_JOB_ID": "4242",
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NTASKS": "1",
        "SLURM_JOB_NODELIST": "node[1-2]",
        "SLURM_STEP_TASKS_PER_NODE": "1",
        "SLURM_NODEID": "0",
        "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
        "CUDA_VISIBLE_DEVICES": "",
    }
    out = subprocess.run(  # noqa: PLW1510 - the return code is asserted
        [sys.executable, "-c", SLURM_CHILD],
        env=env,
        capture_output=True,
        text=True,
        timeout=hang_limit(120),
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["slurm", "0", "1", "1", "127.0.0.1", "1"]


def test_slurm_tasks_on_node_reads_the_compressed_list():
    """LOCAL_WORLD_SIZE under srun: this node's task count, not the job's (thread defaults)."""
    assert slurm_tasks_on_node("8", 0) == 8
    assert [slurm_tasks_on_node("2(x3),1", n) for n in range(4)] == [2, 2, 2, 1]
    assert slurm_tasks_on_node("4,2(x2)", 2) == 2
    for bad, node in (("2(x3)", 3), ("two", 0)):
        with pytest.raises(ConfigError, match="SLURM_STEP_TASKS_PER_NODE"):
            slurm_tasks_on_node(bad, node)


def test_setup_single_process_needs_no_process_group(clean_env: pytest.MonkeyPatch):
    # setup_distributed picks the multiprocessing start method; keep pytest's own untouched.
    clean_env.setattr("bytelatent.distributed.env.mp.set_start_method", lambda method: None)
    env = setup_distributed(DistributedArgs())
    assert env.launcher == "single"
    assert not torch.distributed.is_initialized()


EXIT_CHILD = """
import sys
from bytelatent.distributed.env import cleanup_and_exit
sys.stdout.write("unflushed-output")
cleanup_and_exit(3)
"""


def test_cleanup_and_exit_flushes_and_keeps_code():
    out = subprocess.run(  # noqa: PLW1510 - the return code is asserted
        [sys.executable, "-c", EXIT_CHILD],
        capture_output=True,
        text=True,
        timeout=hang_limit(120),
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    assert out.returncode == 3
    assert out.stdout == "unflushed-output"
