"""Secret-looking values never leave the process: redact_secrets on config trees."""

from bytelatent.args import TrainArgs
from bytelatent.config.redact import REDACTED, redact_secrets, redacted_yaml


def test_secret_looking_keys_are_redacted_anywhere_mappings_are_searched():
    tree = {
        "env": {"HF_TOKEN": "hf_x", "WANDB_API_KEY": "k", "PATH": "/bin", "unset_token": ""},
        "data": {"tokenizer_args": {"name": "blt", "hub_token": "t"}},
        "db": [{"Password": 123}, {"host": "h"}],
        "aws_secret_access_key": None,
        "keep": 2,
    }
    out = redact_secrets(tree)
    assert out["env"] == {
        "HF_TOKEN": REDACTED,
        "WANDB_API_KEY": REDACTED,
        "PATH": "/bin",
        "unset_token": "",
    }
    assert out["data"]["tokenizer_args"] == {"name": "blt", "hub_token": REDACTED}
    assert out["db"] == [{"Password": REDACTED}, {"host": "h"}]
    assert out["aws_secret_access_key"] is None and out["keep"] == 2
    assert tree["env"]["HF_TOKEN"] == "hf_x"  # the input is not modified


def test_redacted_yaml_of_train_args_hides_env_tokens_and_keeps_the_rest():
    args = TrainArgs(dump_dir="x", env={"HF_TOKEN": "hf_very_secret", "OMP_NUM_THREADS": "1"})
    text = redacted_yaml(args)
    assert "hf_very_secret" not in text and "HF_TOKEN: <redacted>" in text
    assert "OMP_NUM_THREADS: '1'" in text and "tokenizer_args:" in text
