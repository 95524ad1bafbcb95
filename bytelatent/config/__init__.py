"""Config loading: YAML includes + CLI dotlist -> validated pydantic arg models."""

from bytelatent.config.parser import (
    ConfigValidationError,
    dump_yaml,
    load_config_tree,
    load_yaml_file,
    merge_config_trees,
    parse_args,
    parse_dotlist,
)
from bytelatent.config.redact import redact_secrets, redacted_yaml

__all__ = [
    "ConfigValidationError",
    "dump_yaml",
    "load_config_tree",
    "load_yaml_file",
    "merge_config_trees",
    "parse_args",
    "parse_dotlist",
    "redact_secrets",
    "redacted_yaml",
]
