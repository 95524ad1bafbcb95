"""Helpers shared by the mask tests: the largest tensor an op produces, a BlockMask's elementwise
form."""

import torch


class LargestTensor(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the largest number of elements of any tensor an op produces."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def flex_elementwise(block_mask, bsz: int, q_len: int, kv_len: int | None = None) -> torch.Tensor:
    """The [B, Q, K] mask a BlockMask applies: full blocks, partial blocks through mask_mod."""
    from torch.nn.attention.flex_attention import create_mask

    kv_len = q_len if kv_len is None else kv_len
    block = block_mask.BLOCK_SIZE[0]

    def expand(blocks: torch.Tensor) -> torch.Tensor:  # [B,1,nQ,nK] -> [B,Q,K]
        return (
            blocks[:, 0]
            .repeat_interleave(block, 1)
            .repeat_interleave(block, 2)[:, :q_len, :kv_len]
            .expand(bsz, q_len, kv_len)
        )

    # to_dense() of a BlockMask rebuilt from the full blocks alone: only the full blocks
    full = (
        type(block_mask)
        .from_kv_blocks(
            block_mask.full_kv_num_blocks,
            block_mask.full_kv_indices,
            BLOCK_SIZE=block,
            seq_lengths=(q_len, kv_len),
        )
        .to_dense()
        .bool()
    )
    touched = block_mask.to_dense().bool()  # partial or full
    inner = create_mask(block_mask.mask_mod, bsz, 1, q_len, kv_len, device="cpu")[:, 0]
    return expand(full) | (expand(touched) & inner)


class FakeBias:
    """Stands in for xformers' BlockDiagonalCausalMask: records what it was built from."""

    def __init__(self, seqlens, window=None):
        self.seqlens, self.window = list(seqlens), window

    @classmethod
    def from_seqlens(cls, seqlens):
        return cls(seqlens)

    def make_local_attention(self, window):
        return FakeBias(self.seqlens, window)

    def allowed(self) -> torch.Tensor:
        """The [T, T] bool mask of the flattened batch (block-diagonal causal, + window)."""
        doc = torch.repeat_interleave(torch.arange(len(self.seqlens)), torch.tensor(self.seqlens))
        pos = torch.arange(len(doc))
        allowed = (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])
        if self.window is not None:
            allowed &= pos[:, None] - pos[None, :] < self.window
        return allowed
