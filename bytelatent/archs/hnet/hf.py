"""H-Net <-> a Hugging Face-style model folder (`arch: hnet`; the spec's HF adapters).

transformers has no H-Net class, so this is not a folder `AutoModel` loads. It is the closest
real thing: the folder layout the BLT export writes (``config.json``, ``model.safetensors``,
``tokenizer.json`` + ``tokenizer_config.json`` + ``special_tokens_map.json``), which
``huggingface_hub`` uploads and downloads as any model repository and the tokenizer files load
with ``PreTrainedTokenizerFast``. ``config.json`` holds ``model_type: bytelatent_hnet``, a few
HF-style fields (vocab size, widths, token ids) and the full H-Net args under ``OURS_KEY``; the
weights keep our parameter names (``stages.0.encoder.0.attention.wq.weight``,
``global_transformer.layers.*``), so ``import_hnet_hf`` rebuilds the identical model
(``params.json`` + ``consolidated.pth``, what ``load_any_checkpoint`` reads).
"""

from __future__ import annotations

from pathlib import Path

import torch
from pydantic import ValidationError

from bytelatent.archs.hnet.args import HNetArgs
from bytelatent.checkpoint import hf_folder as hf
from bytelatent.checkpoint.hf_folder import CONFIG_FILE, OURS_KEY, WEIGHTS_FILE, JsonDict, StateDict
from bytelatent.errors import CheckpointError
from bytelatent.tokenizers.constants import BOS_ID

HNET_MODEL_TYPE = "bytelatent_hnet"  # config.json's model_type (transformers has no H-Net class)


def hnet_hf_config(args: HNetArgs, weights: StateDict) -> JsonDict:
    """config.json of an exported H-Net: HF-style summary fields and our args (what import
    reads back)."""
    return {
        "architectures": ["HNet"],
        "model_type": HNET_MODEL_TYPE,
        "torch_dtype": str(weights["output.weight"].dtype).removeprefix("torch."),
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "stage_hidden_sizes": [stage.dim for stage in args.stages],
        "max_position_embeddings": args.max_seqlen,
        "bos_token_id": BOS_ID,
        "eos_token_id": args.eos_id,
        "pad_token_id": 0,
        OURS_KEY: {"arch": "hnet", "model": args.model_dump(mode="json")},
    }


def export_hnet_hf(
    ckpt: str, out: str, entropy_model: str | None = None, allow_window_mismatch: bool = False
) -> list[str]:
    """Write `out/` from an H-Net checkpoint (DCP step folder or consolidated); returns notes."""
    from bytelatent.checkpoint.pretrained import load_any_checkpoint

    hf.require_hf_deps()
    if entropy_model is not None:
        raise CheckpointError(f"{ckpt}: an H-Net has no entropy model; drop --entropy-model")
    model, args, _ = load_any_checkpoint(ckpt, kind="hnet")
    weights = hf.state_for_export(model)
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    hf.save_safetensors(weights, out_dir / WEIGHTS_FILE)
    hf.write_json(out_dir / CONFIG_FILE, hnet_hf_config(args, weights))
    hf.write_tokenizer(out_dir, args.max_seqlen)
    return [
        "transformers has no H-Net class: the folder has our parameter names and args "
        "(model_type bytelatent_hnet); load it with `python -m bytelatent.checkpoint import-hf`"
    ]


def import_hnet_hf(hf_dir: str, out: str) -> str:
    """An exported H-Net folder -> `out/params.json` + `out/consolidated.pth`."""
    config, weights = hf.read_hf_folder(hf_dir, (HNET_MODEL_TYPE,), "an exported H-Net")
    where = f"{hf_dir}/{CONFIG_FILE}"
    ours = config.get(OURS_KEY) or {}
    section = ours.get("model") or ours.get("arch_args")  # arch_args: exports before one section
    if not isinstance(section, dict):
        raise CheckpointError(f"{where}: no {OURS_KEY}.model; not an exported H-Net")
    try:
        args = HNetArgs.model_validate(section)
    except ValidationError as exc:
        first = str(exc).splitlines()
        raise CheckpointError(f"{where}: model args invalid ({' '.join(first[:3])})") from None
    _check_hnet_weights(args, weights, hf_dir)
    params = {
        "name": "hf_import",
        "source": str(hf_dir),
        "arch": "hnet",
        "model": args.model_dump(mode="json"),
        "data": {"add_patches": False, "patcher_args": {"patching_mode": "byte"}},
    }
    hf.write_consolidated(Path(out), params, weights)
    return str(out)


def _check_hnet_weights(args: HNetArgs, weights: StateDict, where: str) -> None:
    """Every missing, unexpected or misshaped tensor against the model the args build, in one
    line (shapes from a meta-device model: nothing allocated)."""
    from bytelatent.archs.hnet.model import HNet

    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in HNet(args).state_dict().items()}
    problems = [f"missing {k}" for k in sorted(set(expected) - set(weights))]
    problems += [f"unexpected {k}" for k in sorted(set(weights) - set(expected))]
    problems += [
        f"{k} has shape {tuple(weights[k].shape)}, the args need {shape}"
        for k, shape in expected.items()
        if k in weights and tuple(weights[k].shape) != shape
    ]
    if problems:
        raise CheckpointError(f"{where}: weights do not fit the H-Net args: " + "; ".join(problems))
