"""The toy <-> a Hugging Face-style folder (config.json with our args, model.safetensors with our
parameter names), through the framework's folder helpers (`bytelatent/checkpoint/hf_folder.py`)."""

from __future__ import annotations

from pathlib import Path

from bytelatent.checkpoint import hf_folder
from bytelatent.errors import CheckpointError

MODEL_TYPE = "bytelatent_toy"


def export_toy_hf(
    ckpt: str, out: str, entropy_model: str | None = None, allow_window_mismatch: bool = False
) -> list[str]:
    from bytelatent.checkpoint.pretrained import load_any_checkpoint

    hf_folder.require_hf_deps()
    if entropy_model is not None:
        raise CheckpointError(f"{ckpt}: the toy has no entropy model; drop --entropy-model")
    model, args, _ = load_any_checkpoint(ckpt)
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    hf_folder.save_safetensors(hf_folder.state_for_export(model), out_dir / hf_folder.WEIGHTS_FILE)
    config = {"model_type": MODEL_TYPE, hf_folder.OURS_KEY: args.model_dump(mode="json")}
    hf_folder.write_json(out_dir / hf_folder.CONFIG_FILE, config)
    return []


def import_toy_hf(hf_dir: str, out: str) -> str:
    from tests.toy_arch import ToyArgs

    config, weights = hf_folder.read_hf_folder(hf_dir, (MODEL_TYPE,), "an exported toy")
    args = ToyArgs.model_validate(config[hf_folder.OURS_KEY])
    params = {"arch": "toy", "arch_args": args.model_dump(mode="json")}
    hf_folder.write_consolidated(Path(out), params, weights)
    return out
