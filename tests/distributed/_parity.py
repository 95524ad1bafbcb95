"""Shared by the parity tests and the torchrun worker: tiny models, batches, a training loop.

Not collected by pytest (no test_ prefix). The worker imports it from this directory.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from bytelatent.archs.blt.args import ByteLatentTransformerArgs
from bytelatent.archs.blt.model import ByteLatentTransformer
from bytelatent.archs.hnet.args import HNetArgs
from bytelatent.archs.hnet.model import HNet
from bytelatent.archs.lm.model import LMTransformer
from bytelatent.distributed.args import DistributedArgs
from bytelatent.distributed.clip import clip_grad_norm_
from bytelatent.distributed.parallelize import (
    apply_fsdp,
    init_model_weights,
    parallelize_model,
    set_gradient_sync,
)
from bytelatent.model.args import LMTransformerArgs

SEED = 1234
STEPS = 5
BATCH = 4
SEQ = 16
LM_ARGS = LMTransformerArgs(
    dim=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    max_seqlen=SEQ,
    multiple_of=32,
    attn_bias_type="causal",
)
BLT_ARGS = ByteLatentTransformerArgs(
    dim=64,
    n_layers=2,
    n_heads=4,
    dim_local_encoder=32,
    dim_local_decoder=32,
    n_layers_local_encoder=1,
    n_layers_local_decoder=1,
    n_heads_local_encoder=2,
    n_heads_local_decoder=2,
    max_encoder_seq_length=SEQ,
    max_seqlen=SEQ,
    multiple_of=32,
    downsampling_by_pooling="max",
    encoder_hash_byte_group_size=None,
)
HNET_ARGS = HNetArgs(
    stages=[dict(dim=32, n_heads=2, n_layers_encoder=1, n_layers_decoder=1, sliding_window=8,
                 target_ratio=3.0)],
    dim=64,
    n_layers=2,
    n_heads=4,
    max_seqlen=SEQ,
    multiple_of=32,
)  # fmt: skip
# Fixed patches for the BLT batches: first patch 1 byte, rows sum to SEQ.
PATCHES = torch.tensor([[1, 4, 4, 4, 3], [1, 5, 5, 5, 0], [1, 3, 6, 6, 0], [1, 15, 0, 0, 0]])


def build_model(kind: str) -> nn.Module:
    with torch.device("meta"):
        if kind == "lm":
            return LMTransformer(LM_ARGS)
        if kind == "hnet":
            return HNet(HNET_ARGS)
        return ByteLatentTransformer(BLT_ARGS)


def make_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(4, 260, (BATCH, SEQ + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full (unsharded) parameter values by name; a collective when params are DTensors."""
    out = {}
    for name, param in model.named_parameters():
        value = param.full_tensor() if hasattr(param, "full_tensor") else param
        out[name] = value.detach().float().cpu().clone()
    return out


def setup_model(kind: str, mesh, args: DistributedArgs, force_2d: bool = False) -> nn.Module:
    model = build_model(kind)
    if force_2d:  # HSDP on (dp_replicate, dp_shard) even when dp_replicate is 1
        apply_fsdp(model, mesh["dp_replicate", "dp_shard"], args)
    else:
        parallelize_model(model, mesh, args)
    model.to_empty(device="cpu")
    init_model_weights(model, SEED)
    return model


def train(
    model: nn.Module,
    kind: str,
    dp_rank: int = 0,
    dp_size: int = 1,
    grad_acc: int = 1,
    steps: int = STEPS,
) -> dict[str, list[float]]:
    """AdamW steps on this dp rank's rows: global mean losses, grad norms, and whether any grad
    existed after the first micro-batch (with grad_acc > 1)."""
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses, norms, early = [], [], []
    rows = BATCH // dp_size
    for step in range(steps):
        x, y = make_batch(step)
        lo = dp_rank * rows
        x, y, patches = x[lo : lo + rows], y[lo : lo + rows], PATCHES[lo : lo + rows]
        total = torch.zeros(())
        micro = rows // grad_acc
        for m in range(grad_acc):
            sl = slice(m * micro, (m + 1) * micro)
            set_gradient_sync(model, m == grad_acc - 1)
            loss = _loss(model, kind, x[sl], y[sl], patches[sl]) / grad_acc
            loss.backward()
            total += loss.detach()
            if m == 0 and grad_acc > 1:
                # FSDP keeps grads unsharded and unreduced until the synced micro-batch.
                early.append(any(p.grad is not None for p in model.parameters()))
        norm = clip_grad_norm_(model.parameters(), max_norm=1.0)
        optim.step()
        optim.zero_grad()
        if dist.is_initialized():
            dist.all_reduce(total, op=dist.ReduceOp.AVG)
        losses.append(total.item())
        norms.append(norm.item())
    return {"losses": losses, "grad_norms": norms, "grads_before_sync": early}


def _loss(
    model: nn.Module, kind: str, x: torch.Tensor, y: torch.Tensor, patches: torch.Tensor
) -> torch.Tensor:
    """Cross-entropy of one micro-batch; the H-Net adds its ratio loss (the trainer's objective)."""
    aux = {}
    if kind == "lm":
        logits = model(x)
    elif kind == "hnet":
        logits, aux = model(x)
    else:
        logits = model(x, patches)
    return F.cross_entropy(logits.flatten(0, 1), y.flatten()) + aux.get("ratio_loss", 0.0)
