"""Redact secret-looking values before a config is written to disk (config.yaml, params.json).

A value is redacted when its key looks like a credential (password, token, api_key, ...) or
when the value itself looks like a well-known credential format (AWS access key ids, GitHub,
Hugging Face, OpenAI and Slack tokens, URLs with a password). The config object in memory is
never changed; only the dumped copy is.
"""

from __future__ import annotations

import re
from typing import Any

import yaml
from pydantic import BaseModel

REDACTED = "<redacted>"

_SECRET_KEY = re.compile(
    r"(pass(word|wd)?|secret|token|api[_-]?key|access[_-]?key|private[_-]?key|credential|"
    r"(^|[_-])auth($|[_-])|authorization|session[_-]?key)",
    re.IGNORECASE,
)
# Keys that match the pattern above but are not secrets in this project's configs.
_NOT_SECRET_KEYS = frozenset({"tokenizer_args", "tokenizer", "tokens_seen", "max_tokens"})
_SECRET_VALUE = re.compile(
    r"^(AKIA|ASIA)[0-9A-Z]{16}$"  # AWS access key id
    r"|^gh[pousr]_[A-Za-z0-9]{20,}$"  # GitHub
    r"|^hf_[A-Za-z0-9]{20,}$"  # Hugging Face
    r"|^sk-[A-Za-z0-9_-]{20,}$"  # OpenAI-style
    r"|^xox[abpr]-[A-Za-z0-9-]{10,}$"  # Slack
)
_URL_PASSWORD = re.compile(r"^([a-z][a-z0-9+.-]*://[^/:@\s]+):[^/@\s]+@", re.IGNORECASE)


def _secret_key(key: Any) -> bool:
    return isinstance(key, str) and key not in _NOT_SECRET_KEYS and bool(_SECRET_KEY.search(key))


def _redact_value(value: Any) -> Any:
    if isinstance(value, str):
        if _SECRET_VALUE.match(value):
            return REDACTED
        return _URL_PASSWORD.sub(rf"\1:{REDACTED}@", value)
    return value


def redact_secrets(tree: Any) -> Any:
    """A copy of `tree` (dicts, lists, scalars) with secret-looking values replaced by REDACTED."""
    if isinstance(tree, dict):
        out = {}
        for key, value in tree.items():
            if _secret_key(key) and isinstance(value, (str, int, float)) and value != "":
                out[key] = REDACTED
            else:
                out[key] = redact_secrets(value)
        return out
    if isinstance(tree, (list, tuple)):
        return [redact_secrets(v) for v in tree]
    return _redact_value(tree)


def dump_redacted_yaml(model: BaseModel) -> str:
    """YAML of `model` in field order with secrets redacted (what a run writes as config.yaml)."""
    tree = redact_secrets(model.model_dump(mode="json"))
    return yaml.safe_dump(tree, sort_keys=False, allow_unicode=True)
