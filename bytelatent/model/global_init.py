"""``model.global_init``: where the BLT's global transformer gets its initial weights.

Only the location and format live here; reading and converting the weights is an adapter at the
edge (``bytelatent/checkpoint/hf_llama.py``): the model code never knows where weights came from.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class GlobalInitArgs(BaseModel):
    """A pretrained decoder to copy into the global transformer before the first step.

    ``path``: a folder (local or s3://) holding ``config.json`` and ``*.safetensors`` (sharded
    with ``model.safetensors.index.json`` or a single ``model.safetensors``). ``format``:
    ``hf_llama`` (``LlamaForCausalLM``; its token embedding, final norm and LM head are not used).
    Used only when a run starts without a checkpoint: a resumed run reads its own checkpoints.
    """

    model_config = ConfigDict(extra="forbid")

    path: str = Field(
        ...,
        description="folder (local or s3://) with config.json and *.safetensors of the decoder",
    )
    format: Literal["hf_llama"] = Field(
        "hf_llama",
        description="hf_llama: a LlamaForCausalLM (its embedding, final norm and head are unused)",
    )

    @field_validator("path")
    @classmethod
    def _non_empty(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("model.global_init.path must be a folder (local or s3://)")
        return value
