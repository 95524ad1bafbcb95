"""torchrun worker: `torchrun --nproc-per-node 2 _hf_llama_worker.py LLAMA_DIR OUT LAYOUT`.

Builds the tiny-Llama-shaped BLT of test_hf_llama on a 2-rank gloo mesh (LAYOUT: fsdp or tp),
loads the HF weights into the sharded global transformer, and checks: the full tensors equal the
single-process conversion; with the global group frozen a step gives its parameters no gradients
and reduce-scatters nothing for their FSDP units; once unfrozen they get gradients again. Rank 0 writes OUT.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from bytelatent.archs.blt.model import ByteLatentTransformer
from bytelatent.checkpoint.hf_llama import load_hf_llama
from bytelatent.distributed.args import DistributedArgs
from bytelatent.distributed.env import cleanup_and_exit, setup_distributed
from bytelatent.distributed.mesh import build_mesh
from bytelatent.distributed.parallelize import init_model_weights, parallelize_model
from bytelatent.trainer.args import OptimArgs
from bytelatent.trainer.optim import build_optimizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_hf_llama import blt_args  # noqa: E402

LAYOUTS = {"fsdp": {"dp_shard": 2}, "tp": {"dp_shard": 1, "tp_size": 2}}


def full(model) -> dict[str, torch.Tensor]:
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for n, p in model.named_parameters()
        if n.startswith("global_transformer.layers")
    }


def step(model, optimizer, scheduler, counter: list[int]) -> dict[str, bool]:
    tokens = torch.randint(4, 260, (2, 17), generator=torch.Generator().manual_seed(0))
    patches = torch.tensor([[1, 4, 4, 4, 3], [1, 8, 4, 3, 0]])
    logits = model(tokens[:, :-1], patch_lengths=patches)
    F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    grads = {n: p.grad is not None for n, p in model.named_parameters()}
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return grads


def main(llama: str, out: str, layout: str) -> None:
    env = setup_distributed(DistributedArgs())
    dist_args = DistributedArgs(**LAYOUTS[layout], model_dtype="fp32")
    mesh = build_mesh(dist_args, env.world_size, "cpu")
    args = blt_args(Path(llama), max_encoder_seq_length=16, max_seqlen=16)
    with torch.device("meta"):
        model = ByteLatentTransformer(args)
    parallelize_model(model, mesh, dist_args)
    model.to_empty(device="cpu")
    init_model_weights(model, seed=0)
    load_hf_llama(model, args)
    loaded = full(model)
    counter = [0]
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group  # one call per FSDP unit

    original = _fsdp_param_group.foreach_reduce

    def counting(*a, **kw):
        counter[0] += 1
        return original(*a, **kw)

    _fsdp_param_group.foreach_reduce = counting
    groups = [{"params": "global_transformer.*", "freeze_until_step": 1}]
    optimizer, scheduler = build_optimizer(model, OptimArgs(groups=groups), 10, "cpu")
    frozen_grads = step(model, optimizer, scheduler, counter)
    frozen_calls, counter[0] = counter[0], 0
    after_frozen = full(model)
    open_grads = step(model, optimizer, scheduler, counter)
    result = {
        "loaded": {n: t.tolist() for n, t in loaded.items()},
        "unchanged_while_frozen": all(torch.equal(loaded[n], after_frozen[n]) for n in loaded),
        "frozen_global_grads": any(g for n, g in frozen_grads.items() if n.startswith("global_")),
        "frozen_local_grads": all(g for n, g in frozen_grads.items() if n.startswith("local_")),
        "open_global_grads": all(g for n, g in open_grads.items() if n.startswith("global_")),
        "reduce_scatters": [frozen_calls, counter[0]],
    }
    if env.rank == 0:
        Path(out).write_text(json.dumps(result))


if __name__ == "__main__":
    code = 0
    try:
        main(*sys.argv[1:4])
    except Exception:
        traceback.print_exc()
        code = 1
    cleanup_and_exit(code)
