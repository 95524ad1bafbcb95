"""Config parser: includes, precedence, merge rules and one-line errors."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import pytest
from pydantic import BaseModel, ConfigDict, Field, model_validator

from bytelatent.config import (
    ConfigValidationError,
    dump_yaml,
    load_config_tree,
    parse_args,
)
from bytelatent.errors import ConfigError


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PatcherArgs(Strict):
    patching_mode: str = "entropy"
    threshold: float | None = None


class DataArgs(Strict):
    root_dir: str | None = None
    sources: dict[str, float] = Field(default_factory=dict)
    seq_len: int = 16
    patcher_args: PatcherArgs = Field(default_factory=PatcherArgs)


class ModelArgs(Strict):
    dim: int = 32
    cross_attn_k: int = 2
    norm: Literal["rms", "layer"] = "rms"
    hash_sizes: list[int] = Field(default_factory=lambda: [3, 4, 5])

    @model_validator(mode="after")
    def _check(self) -> ModelArgs:
        if self.dim % self.cross_attn_k:
            raise ValueError(f"dim ({self.dim}) must be divisible by cross_attn_k")
        return self


class OptimArgs(Strict):
    lr: float = 1e-3
    betas: list[float] = Field(default_factory=lambda: [0.9, 0.95])


class TrainArgs(Strict):
    name: str = "run"
    seed: int = 42
    dump_dir: str = ""
    data: DataArgs = Field(default_factory=DataArgs)
    optim: OptimArgs = Field(default_factory=OptimArgs)
    model: ModelArgs | None = Field(default_factory=ModelArgs)


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.fixture
def cfgs(tmp_path: Path) -> Path:
    """The reference's fixtures/test-cfgs, plus a sibling dir for cross-directory includes."""
    d = tmp_path / "test-cfgs"
    write(d / "root.yaml", "seed: -1\na: 1\nb:\n  x: 0\n  y: ???\n  z: ???\n")
    write(d / "middle.yaml", "config: root.yaml\nb:\n  y: 10\n")
    write(d / "top.yaml", "config: middle.yaml\nhello: world\n")
    write(d / "override.yaml", "a: 100\n")
    write(d / "list.yaml", "- 1\n- 2\n- 3\n")
    return d


def test_no_args_is_empty_tree():
    assert load_config_tree([]) == {}


def test_single_file_with_missing_values_errors_naming_all_of_them(cfgs: Path):
    with pytest.raises(ConfigError) as err:
        load_config_tree([f"config={cfgs / 'root.yaml'}"])
    assert str(err.value) == "b.y, b.z: 2 mandatory values (???) not set; pass b.y=... b.z=..."
    assert err.value.one_line().startswith("config error: b.y, b.z: 2 mandatory values")
    with pytest.raises(ConfigError) as err:
        load_config_tree([f"config={cfgs / 'root.yaml'}", "b.z=1"])
    assert str(err.value) == "b.y: mandatory value (???) not set; pass b.y=..."


def test_one_level_include(cfgs: Path):
    tree = load_config_tree([f"config={cfgs / 'middle.yaml'}", "b.z=3"])
    assert tree == {"seed": -1, "a": 1, "b": {"x": 0, "y": 10, "z": 3}}


def test_two_level_include_and_cli_precedence(cfgs: Path):
    tree = load_config_tree([f"config={cfgs / 'top.yaml'}", "b.z=5", "b.y=11", "a=2"])
    assert tree == {
        "seed": -1,
        "a": 2,
        "b": {"x": 0, "y": 11, "z": 5},
        "hello": "world",
    }


def test_list_of_includes_later_wins(cfgs: Path):
    argv = [f"config=[{cfgs / 'top.yaml'},{cfgs / 'override.yaml'}]", "b.z=0"]
    assert load_config_tree(argv)["a"] == 100
    reverse = [f"config=[{cfgs / 'override.yaml'},{cfgs / 'top.yaml'}]", "b.z=0"]
    assert load_config_tree(reverse)["a"] == 1
    # The including file itself beats its includes, and a file may include a list.
    write(cfgs / "multi.yaml", "config: [top.yaml, override.yaml]\na: 7\nb: {z: 1}\n")
    assert load_config_tree([f"config={cfgs / 'multi.yaml'}"])["a"] == 7


def test_repeated_config_args_are_applied_in_order(cfgs: Path):
    argv = [f"config={cfgs / 'top.yaml'}", f"config={cfgs / 'override.yaml'}", "b.z=1"]
    assert load_config_tree(argv)["a"] == 100


def test_relative_include_resolves_against_including_file_then_cwd(
    tmp_path: Path, cfgs: Path, monkeypatch: pytest.MonkeyPatch
):
    write(tmp_path / "exp" / "run.yaml", "config: ../test-cfgs/top.yaml\nb: {z: 2}\n")
    monkeypatch.chdir(tmp_path / "exp")
    assert load_config_tree(["config=run.yaml"])["hello"] == "world"
    # Not next to the including file -> taken from the CWD.
    write(tmp_path / "shared.yaml", "name: from_cwd\n")
    write(tmp_path / "sub" / "inc.yaml", "config: shared.yaml\n")
    monkeypatch.chdir(tmp_path)
    assert load_config_tree(["config=sub/inc.yaml"]) == {"name": "from_cwd"}


def test_cli_values_are_yaml_typed():
    tree = load_config_tree(
        ["a.b=1", "c=null", "l=[1,2]", "f=1e-3", "s=hello", "t=true", "e=", "q='3'"]
    )
    assert tree == {
        "a": {"b": 1},
        "c": None,
        "l": [1, 2],
        "f": 1e-3,
        "s": "hello",
        "t": True,
        "e": "",
        "q": "3",
    }


def test_yaml_floats_without_dot_are_floats(tmp_path: Path):
    path = write(tmp_path / "f.yaml", "lr: 3e-4\nwd: 1.0e-1\nd: 2024-01-01\n")
    tree = load_config_tree([f"config={path}"])
    assert tree == {"lr": 3e-4, "wd": 0.1, "d": "2024-01-01"}


def test_lists_replace_and_null_replaces_dict(tmp_path: Path):
    base = write(tmp_path / "base.yaml", "l: [1, 2, 3]\nmodel: {dim: 4, k: 2}\n")
    child = write(tmp_path / "child.yaml", f"config: {base}\nl: [9]\nmodel: null\n")
    assert load_config_tree([f"config={child}"]) == {"l": [9], "model": None}
    # And a dict written after a null fills it again.
    assert load_config_tree([f"config={child}", "model.dim=8"])["model"] == {"dim": 8}


def test_data_sources_taken_whole_from_last_definition(tmp_path: Path):
    base = write(tmp_path / "base.yaml", "data:\n  root_dir: /d\n  sources: {a: 1.0, b: 2.0}\n")
    child = write(tmp_path / "child.yaml", f"config: {base}\ndata:\n  sources: {{c: 0.5}}\n")
    assert load_config_tree([f"config={child}"])["data"] == {
        "root_dir": "/d",
        "sources": {"c": 0.5},
    }
    # Other dicts still merge key by key; a layer without sources keeps the previous ones.
    tree = load_config_tree([f"config={child}", "data.seq_len=8"])
    assert tree["data"] == {"root_dir": "/d", "sources": {"c": 0.5}, "seq_len": 8}
    # From the CLI, sources with dotted file names are given as one YAML mapping.
    tree = load_config_tree([f"config={child}", "data.sources={x.chunk.00.jsonl: 1}"])
    assert tree["data"]["sources"] == {"x.chunk.00.jsonl": 1}


def test_missing_value_error_names_nested_key(tmp_path: Path):
    path = write(tmp_path / "m.yaml", "data:\n  root_dir: ???\n")
    with pytest.raises(ConfigError, match=r"^data.root_dir: mandatory value \(\?\?\?\) not set"):
        load_config_tree([f"config={path}"])
    assert load_config_tree([f"config={path}", "data.root_dir=/x"]) == {"data": {"root_dir": "/x"}}


def test_missing_marker_does_not_erase_earlier_value(tmp_path: Path):
    base = write(tmp_path / "base.yaml", "a: 5\n")
    child = write(tmp_path / "child.yaml", f"config: {base}\na: ???\n")
    assert load_config_tree([f"config={child}"]) == {"a": 5}


def test_interpolations_resolved(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("BLT_TEST_ROOT", "/scratch")
    path = write(
        tmp_path / "i.yaml",
        "dump_dir: ${oc.env:BLT_TEST_ROOT}/runs/${name}\nname: debug\nseq: ${data.seq_len}\n"
        "data: {seq_len: 8}\n",
    )
    tree = load_config_tree([f"config={path}", "name=exp1"])
    assert tree["dump_dir"] == "/scratch/runs/exp1"
    assert tree["seq"] == 8
    with pytest.raises(ConfigError, match="interpolation"):
        load_config_tree(["a=${nope.nothing}"])


@pytest.mark.parametrize(
    ("name", "text", "pattern"),
    [
        ("list.yaml", "- 1\n- 2\n", r"list.yaml: top level must be a mapping"),
        ("bad.yaml", "a: [1, 2\n", r"bad.yaml: invalid YAML at line"),
        (
            "dup.yaml",
            "a: 1\na: 2\n",
            r"dup.yaml: invalid YAML at line 2.*duplicate key 'a'",
        ),
        ("inc.yaml", "config: 3\n", r"inc.yaml: 'config' must be a path"),
    ],
)
def test_bad_files_name_the_file(tmp_path: Path, name: str, text: str, pattern: str):
    path = write(tmp_path / name, text)
    with pytest.raises(ConfigError, match=pattern):
        load_config_tree([f"config={path}"])


def test_reference_list_fixture_rejected(cfgs: Path):
    with pytest.raises(ConfigError, match="list.yaml: top level must be a mapping"):
        load_config_tree([f"config={cfgs / 'list.yaml'}"])


def test_missing_file_names_the_file(tmp_path: Path):
    with pytest.raises(ConfigError, match=r"nope.yaml: config file not found"):
        load_config_tree([f"config={tmp_path / 'nope.yaml'}"])
    inc = write(tmp_path / "inc.yaml", "config: gone.yaml\n")
    with pytest.raises(ConfigError, match=r"gone.yaml: config file not found"):
        load_config_tree([f"config={inc}"])


def test_include_cycle_detected(tmp_path: Path):
    write(tmp_path / "a.yaml", "config: b.yaml\n")
    write(tmp_path / "b.yaml", "config: a.yaml\n")
    with pytest.raises(ConfigError, match=r"include cycle: .*a.yaml -> .*b.yaml -> .*a.yaml"):
        load_config_tree([f"config={tmp_path / 'a.yaml'}"])
    # A diamond (same file reached twice, no cycle) is fine.
    write(tmp_path / "base.yaml", "x: 1\n")
    write(tmp_path / "l.yaml", "config: base.yaml\n")
    write(tmp_path / "r.yaml", "config: base.yaml\n")
    write(tmp_path / "d.yaml", "config: [l.yaml, r.yaml]\n")
    assert load_config_tree([f"config={tmp_path / 'd.yaml'}"]) == {"x": 1}


@pytest.mark.parametrize("arg", ["model.dim", "=3", "a..b=1"])
def test_malformed_cli_argument(arg: str):
    with pytest.raises(ConfigError, match="argument"):
        load_config_tree([arg])


# --- parse_args --------------------------------------------------------------------------


def test_parse_args_defaults_and_lax_coercion(tmp_path: Path):
    path = write(tmp_path / "t.yaml", "optim: {lr: 3e-4}\ndata: {seq_len: '32'}\n")
    args = parse_args(TrainArgs, [f"config={path}", "model.hash_sizes=[3,6]", "seed=7"])
    assert args.optim.lr == pytest.approx(3e-4)
    assert args.data.seq_len == 32
    assert args.model.hash_sizes == [3, 6]
    assert args.seed == 7
    assert args.data.patcher_args.patching_mode == "entropy"


def test_model_null_from_cli():
    assert parse_args(TrainArgs, ["model=null"]).model is None


def test_unknown_key_suggestion_at_nested_depth():
    with pytest.raises(ConfigError) as err:
        parse_args(TrainArgs, ["model.cross_atn_k=3"])
    assert str(err.value) == "model.cross_atn_k: unknown key (did you mean model.cross_attn_k?)"
    with pytest.raises(ConfigError) as err:
        parse_args(TrainArgs, ["data.patcher_args.patching_mde=space"])
    assert str(err.value) == (
        "data.patcher_args.patching_mde: unknown key "
        "(did you mean data.patcher_args.patching_mode?)"
    )
    with pytest.raises(ConfigError) as err:
        parse_args(TrainArgs, ["sed=1"])
    assert str(err.value) == "sed: unknown key (did you mean seed?)"
    with pytest.raises(ConfigError) as err:
        parse_args(TrainArgs, ["zzzzzz=1"])
    assert str(err.value) == "zzzzzz: unknown key"


def test_wrong_type_messages():
    cases = {
        "optim.lr=fast": "optim.lr: expected a number, got 'fast'",
        "seed=1.5": "seed: expected an integer, got 1.5",
        "data.seq_len=abc": "data.seq_len: expected an integer, got 'abc'",
        "model.hash_sizes=[3,x]": "model.hash_sizes[1]: expected an integer, got 'x'",
        "model.norm=batch": "model.norm: expected 'rms' or 'layer', got 'batch'",
        "data=5": "data: expected a mapping, got 5",
        "data.sources={a: lots}": "data.sources.a: expected a number, got 'lots'",
    }
    for arg, expected in cases.items():
        with pytest.raises(ConfigValidationError) as err:
            parse_args(TrainArgs, [arg])
        assert str(err.value) == expected, arg


def test_validator_error_message():
    with pytest.raises(ConfigError) as err:
        parse_args(TrainArgs, ["model.dim=33", "model.cross_attn_k=2"])
    assert str(err.value) == "model: dim (33) must be divisible by cross_attn_k"


def test_several_errors_first_plus_count_and_details():
    with pytest.raises(ConfigValidationError) as err:
        parse_args(TrainArgs, ["optim.lr=fast", "model.cross_atn_k=1", "sed=2"])
    line = str(err.value)
    assert line.endswith("(+2 more)")
    assert "\n" not in line
    assert len(err.value.details) == 3
    assert any(d.startswith("sed: unknown key") for d in err.value.details)


class Cat(Strict):
    kind: Literal["cat"] = "cat"
    meows: int = 1


class Dog(Strict):
    kind: Literal["dog"] = "dog"
    barks: int = 1


class Zoo(Strict):
    pet: Cat | Dog = Field(default_factory=Cat, discriminator="kind")
    either: Cat | Dog = Field(default_factory=Cat)
    num_or_word: int | list[int] = 0


def test_union_tags_are_stripped_from_keys():
    with pytest.raises(ConfigError) as err:
        parse_args(Zoo, ["pet.kind=dog", "pet.barkz=2"])
    assert str(err.value) == "pet.barkz: unknown key (did you mean pet.barks?)"
    with pytest.raises(ConfigError) as err:
        parse_args(Zoo, ["either.meowz=2"])
    assert str(err.value) == "either.meowz: unknown key (did you mean either.meows?)"
    with pytest.raises(ConfigError) as err:
        parse_args(Zoo, ["num_or_word=abc"])
    assert str(err.value).startswith("num_or_word: 'abc' matches none of the allowed types")


def test_dump_yaml_round_trips(tmp_path: Path):
    args = parse_args(TrainArgs, ["data.sources={a.jsonl: 0.5}", "optim.lr=2e-5", "name=x"])
    text = dump_yaml(args)
    assert text.index("name:") < text.index("seed:") < text.index("data:")  # field order
    path = write(tmp_path / "dump.yaml", text)
    assert parse_args(TrainArgs, [f"config={path}"]) == args


def test_parse_args_uses_sys_argv_by_default(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr("sys.argv", ["prog", "seed=3"])
    assert parse_args(TrainArgs).seed == 3


def test_cwd_untouched(cfgs: Path):
    before = os.getcwd()
    load_config_tree([f"config={cfgs / 'top.yaml'}", "b.z=1"])
    assert os.getcwd() == before
