"""Distributed environment, device mesh, model parallelization and gradient clipping."""

from bytelatent.distributed.clip import clip_grad_norm_
from bytelatent.distributed.env import (
    DistEnv,
    DistributedArgs,
    cleanup_and_exit,
    detect_env,
    setup_distributed,
)
from bytelatent.distributed.mesh import (
    MESH_DIMS,
    MeshLayout,
    build_mesh,
    dp_group,
    dp_rank_and_size,
    resolve_layout,
    tp_rank_and_size,
)
from bytelatent.distributed.parallelize import (
    forward_context,
    init_model_weights,
    parallelize_model,
    set_gradient_sync,
)

__all__ = [
    "MESH_DIMS",
    "DistEnv",
    "DistributedArgs",
    "MeshLayout",
    "build_mesh",
    "cleanup_and_exit",
    "clip_grad_norm_",
    "detect_env",
    "dp_group",
    "dp_rank_and_size",
    "forward_context",
    "init_model_weights",
    "parallelize_model",
    "resolve_layout",
    "set_gradient_sync",
    "setup_distributed",
    "tp_rank_and_size",
]
