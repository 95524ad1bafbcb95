"""One process, FSDP2 on a 1-rank mesh (`single_device_fsdp`): losses as JSON on stdout.

Run in its own process by test_single_device_fsdp.py (it creates a process group).
"""

from __future__ import annotations

import json
import sys

from _parity import setup_model, train
from torch.distributed.tensor import DTensor

from bytelatent.distributed.args import DistributedArgs
from bytelatent.distributed.env import setup_distributed
from bytelatent.distributed.mesh import build_mesh

if __name__ == "__main__":
    out = {}
    for dtype in sys.argv[1:]:
        args = DistributedArgs(model_dtype=dtype, single_device_fsdp=True)
        env = setup_distributed(args)
        mesh = build_mesh(args, env.world_size, env.device.type)
        model = setup_model("lm", mesh, args)
        assert mesh is not None and env.backend == "gloo", (mesh, env)
        assert all(isinstance(p, DTensor) for p in model.parameters())
        out[dtype] = train(model, "lm")
    print(json.dumps(out))
