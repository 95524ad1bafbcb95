"""Redact secret-looking values before a config leaves the process (config.yaml, wandb).

A value is secret-looking when its key (any case, anywhere in the tree, `env` included) has a
word `key`, `pass`, `pwd`, `pat`, `auth`, `cred`/`creds` or `cookie` (words split at `_`, `-`, `.` and
camelCase), or contains `token` (not `tokenizer`, `tokens`), `secret`, `passw`, `passphrase`,
`credential`, `apikey`, `accesskey` or `privatekey`: `S3_CREDS`, `HF_TOKEN`, `AWS_SECRET_ACCESS_KEY`,
`api_key`, `DB_PASS`; not `bpe_tokenizer_path`, `max_tokens`, `keep`. Mappings are searched, not
redacted, so `data.tokenizer_args` keeps its contents while `env.HF_TOKEN` does not. Values that look like
a credential whatever their key (AWS access key ids, GitHub / Hugging Face / OpenAI / Slack
tokens) are redacted too, and so is the password of a `scheme://user:password@host` URL.
"""

from __future__ import annotations

import re
from typing import Any

import yaml
from pydantic import BaseModel

REDACTED = "<redacted>"
SECRET_KEY = re.compile(
    r"(^|_)(key|pass|pwd|pat|auth|creds?|cookie)(_|$)"
    r"|token(?!iz|s)|secret|passw|passphrase|credential|api_?key|access_?key|private_?key"
)
_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")
SECRET_VALUE = re.compile(
    r"^(AKIA|ASIA)[0-9A-Z]{16}$"  # AWS access key id
    r"|^gh[pousr]_[A-Za-z0-9]{20,}$"  # GitHub
    r"|^hf_[A-Za-z0-9]{20,}$"  # Hugging Face
    r"|^sk-[A-Za-z0-9_-]{20,}$"  # OpenAI-style
    r"|^xox[abpr]-[A-Za-z0-9-]{10,}$"  # Slack
)
URL_PASSWORD = re.compile(r"^([a-z][a-z0-9+.-]*://[^/:@\s]+):[^/@\s]+@", re.IGNORECASE)


def is_secret_key(key: object) -> bool:
    if not isinstance(key, str):
        return False
    words = re.sub(r"[^a-z0-9]+", "_", _CAMEL.sub("_", key).lower())
    return SECRET_KEY.search(words) is not None


def redact_secrets(tree: Any) -> Any:
    """A copy of `tree` (dicts, lists, scalars) with secret-looking values replaced by REDACTED."""
    if isinstance(tree, dict):
        return {
            k: REDACTED if is_secret_key(k) and _has_value(v) else redact_secrets(v)
            for k, v in tree.items()
        }
    if isinstance(tree, (list, tuple)):
        return [redact_secrets(v) for v in tree]
    if isinstance(tree, str):
        if SECRET_VALUE.match(tree):
            return REDACTED
        return URL_PASSWORD.sub(rf"\1:{REDACTED}@", tree)
    return tree


def redact_argv(argv: list[str]) -> list[str]:
    """`key=value` arguments with secret-looking values redacted (what wandb records as argv)."""
    return [_redact_arg(arg) for arg in argv]


def _redact_arg(arg: str) -> str:
    key, sep, value = arg.partition("=")
    if not sep or key.startswith("-"):
        return redact_secrets(arg)
    if any(is_secret_key(part) for part in key.split(".")) and value:
        return f"{key}={REDACTED}"
    try:
        tree = yaml.safe_load(value)  # e.g. eval.async_launch.env={HF_TOKEN: hf_...}
    except yaml.YAMLError:
        tree = value
    redacted = redact_secrets(tree)
    if redacted == tree:
        return arg
    if isinstance(redacted, str):
        return f"{key}={redacted}"
    return f"{key}={yaml.safe_dump(redacted, default_flow_style=True).strip()}"


def _has_value(value: Any) -> bool:
    """Mappings are searched instead; an unset value (None, "") has nothing to hide."""
    return not isinstance(value, dict) and value not in (None, "")


def redacted_dump(model: BaseModel) -> dict:
    """`model` as JSON-able data, secrets redacted: what config.yaml and wandb receive."""
    return redact_secrets(model.model_dump(mode="json"))


def redacted_yaml(model: BaseModel) -> str:
    return yaml.safe_dump(redacted_dump(model), sort_keys=False, allow_unicode=True)
