"""Config dumps redact secret-looking values (config.yaml, params.json)."""

from __future__ import annotations

import yaml

from bytelatent.args import TrainArgs
from bytelatent.config import parse_args, redact_secrets, redacted_yaml
from bytelatent.config.redact import REDACTED
from tests.trainer.test_cli import REPO


def test_redacts_by_key_and_by_value_without_touching_the_rest():
    tree = {
        "env": {"WANDB_API_KEY": "abc123", "HF_TOKEN": "x", "NCCL_IB_TIMEOUT": "22"},
        "data": {
            "tokenizer_args": {"name": "blt"},
            "storage_options": {"key": "AKIAABCDEFGHIJKLMNOP", "secret": "s3cr3t", "anon": False},
            "root_dir": "s3://user:pw@host/bucket",
        },
        "notes": ["ghp_abcdefghijklmnopqrstuvwxyz0123", "hf_abcdefghijklmnopqrstuvwx", "plain"],
        "password": "",  # nothing to hide
    }
    out = redact_secrets(tree)
    assert out["env"] == {"WANDB_API_KEY": REDACTED, "HF_TOKEN": REDACTED, "NCCL_IB_TIMEOUT": "22"}
    assert out["data"]["storage_options"] == {"key": REDACTED, "secret": REDACTED, "anon": False}
    assert out["data"]["root_dir"] == f"s3://user:{REDACTED}@host/bucket"
    assert out["data"]["tokenizer_args"] == {"name": "blt"}
    assert out["notes"] == [REDACTED, REDACTED, "plain"] and out["password"] == ""
    assert tree["env"]["WANDB_API_KEY"] == "abc123"  # the input is not modified


def test_run_config_dump_is_redacted_and_otherwise_round_trips(tmp_path):
    argv = [f"config={REPO / 'configs' / 'debug.yaml'}", f"dump_dir={tmp_path}",
            "env.WANDB_API_KEY=very-secret-value"]  # fmt: skip
    args = parse_args(TrainArgs, argv)
    text = redacted_yaml(args)
    assert "very-secret-value" not in text
    loaded = yaml.safe_load(text)
    assert loaded["env"]["WANDB_API_KEY"] == REDACTED
    loaded["env"]["WANDB_API_KEY"] = "very-secret-value"
    assert TrainArgs.model_validate(loaded) == args
