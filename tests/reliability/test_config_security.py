"""Config text that reaches a shell, a file or wandb: environment names, secrets, alias bombs,
and the SLURM launcher's files (issue 22 items 2, 3, 4, 12)."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest

from bytelatent.args import TrainArgs
from bytelatent.config.parser import load_yaml_file, parse_args
from bytelatent.config.redact import REDACTED, is_secret_key, redact_argv
from bytelatent.errors import ConfigError
from bytelatent.eval.args import AsyncLaunchArgs
from bytelatent.launch.async_eval import AsyncEvalLauncher, EvalJob
from bytelatent.launch.slurm import main as slurm_main

REPO = Path(__file__).resolve().parents[2]
DEBUG = f"config={REPO / 'configs' / 'debug.yaml'}"


# ---------------------------------------------------------------- item 2: environment names
@pytest.mark.parametrize(
    "key", ["eval.async_launch.env", "env"], ids=["async_launch_env", "train_env"]
)
@pytest.mark.parametrize("name", ["X=1;id>F;Y", "1ABC", "A B", "A-B", ""])
def test_an_environment_name_a_shell_would_not_accept_is_a_config_error(tmp_path, key, name):
    argv = [DEBUG, f"dump_dir={tmp_path}", f"{key}={{'{name}': v}}"]
    with pytest.raises(ConfigError) as err:
        parse_args(TrainArgs, argv)
    message = str(err.value)
    assert message.startswith(f"{key}: ") and "not an environment variable name" in message
    assert "\n" not in message


def test_good_environment_names_and_any_value_pass(tmp_path):
    env = "{_A: 'x;y $(z)', B2: '', HF_HOME: /tmp}"
    args = parse_args(TrainArgs, [DEBUG, f"dump_dir={tmp_path}", f"eval.async_launch.env={env}"])
    assert args.eval.async_launch.env == {"_A": "x;y $(z)", "B2": "", "HF_HOME": "/tmp"}


def _fake_sbatch(tmp_path: Path, monkeypatch) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    sbatch = bin_dir / "sbatch"
    sbatch.write_text("#!/bin/sh\necho 4242\n")
    sbatch.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


def test_eval_slurm_script_quotes_values_and_is_private(tmp_path, monkeypatch):
    _fake_sbatch(tmp_path, monkeypatch)
    value = "v;touch PWNED $(touch PWNED2) `touch PWNED3`"
    args = AsyncLaunchArgs(mode="slurm", env={"HF_TOKEN": value}, python=sys.executable)
    launcher = AsyncEvalLauncher(args, str(tmp_path), "run", enabled=True)
    out = tmp_path / "evals" / "1"
    out.mkdir(parents=True)
    launcher._submit_slurm(EvalJob(1, str(tmp_path / "ckpt"), "lease"), ["ckpt=x"], out)
    script = out / "eval.slurm"
    lines = script.read_text().splitlines()
    assert "export HF_TOKEN='v;touch PWNED $(touch PWNED2) `touch PWNED3`'" in lines
    assert stat.S_IMODE(script.stat().st_mode) == 0o600


def test_an_eval_that_cannot_start_is_logged_not_raised(tmp_path):
    """A NUL byte in an override cannot reach exec: the launch fails, training goes on."""
    args = AsyncLaunchArgs(mode="local", overrides=["data.root_dir=a\0b"], python=sys.executable)
    launcher = AsyncEvalLauncher(args, str(tmp_path), "run", enabled=True)
    folder = tmp_path / "checkpoints" / "0000000001"
    folder.mkdir(parents=True)
    launcher.launch(1, str(folder))
    assert launcher.failed == [1] and not launcher.jobs
    assert not list(folder.glob(".lease*"))


# ---------------------------------------------------------------- item 3: secrets
SECRET_NAMES = [
    "S3_CREDS", "HF_TOKEN", "OTHER_TOKEN", "AWS_SECRET_ACCESS_KEY", "PASSWORD", "api_key",
    "WANDB_API_KEY", "apiKey", "DB_PASS", "db_password", "GITHUB_PAT", "SSH_PRIVATE_KEY",
    "client_credentials", "key", "secret", "hub_token", "AUTH", "session_cookie",
]  # fmt: skip
PLAIN_NAMES = [
    "tokenizer_args", "bpe_tokenizer_path", "max_tokens", "tokens_seen", "keep", "monkey",
    "keyboard", "PATH", "HOME", "OMP_NUM_THREADS", "NCCL_IB_TIMEOUT", "s3_profile", "dump_dir",
    "entropy_model_checkpoint_dir", "author", "passes", "name",
]  # fmt: skip


@pytest.mark.parametrize("name", SECRET_NAMES)
def test_secret_names_are_redacted(name):
    assert is_secret_key(name)


@pytest.mark.parametrize("name", PLAIN_NAMES)
def test_plain_names_are_not_redacted(name):
    assert not is_secret_key(name)


def test_argv_is_redacted_key_by_key_and_inside_mappings():
    argv = [
        DEBUG, "env.OTHER_TOKEN=abc123", "eval.async_launch.env={HF_TOKEN: hf_x, PATH: /bin}",
        "data.root_dir=s3://user:pw@host/b", "steps=10", "env.S3_CREDS=", "--dry-run",
    ]  # fmt: skip
    assert redact_argv(argv) == [
        DEBUG, f"env.OTHER_TOKEN={REDACTED}",
        f"eval.async_launch.env={{HF_TOKEN: {REDACTED}, PATH: /bin}}",
        f"data.root_dir=s3://user:{REDACTED}@host/b", "steps=10", "env.S3_CREDS=", "--dry-run",
    ]  # fmt: skip


def test_wandb_never_sees_a_secret_from_the_command_line(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    from bytelatent.trainer.wandb_sink import WandbArgs, WandbSink

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    argv = [
        "train.py",
        "env.OTHER_TOKEN=tok-1234567890",
        "eval.async_launch.env={HF_TOKEN: hfv-987654}",
    ]
    monkeypatch.setattr(sys, "argv", argv)
    sink = WandbSink(WandbArgs(mode="offline"), str(tmp_path), "run", {"lr": 0.1})
    assert sink.run is not None and sys.argv == argv  # restored after wandb.init
    sink.log({"global_step": 1, "loss": 1.0})
    sink.close()
    wandb.teardown()
    files = [p for p in (tmp_path / "wandb").rglob("*") if p.is_file()]
    assert files
    leaked = [p for p in files if b"1234567890" in p.read_bytes() or b"987654" in p.read_bytes()]
    assert not leaked, leaked
    assert any(b"OTHER_TOKEN=" + REDACTED.encode() in p.read_bytes() for p in files)


def test_launcher_script_with_environment_values_is_private(tmp_path):
    dump = tmp_path / "run"
    argv = ["--dry-run", f"--workdir={tmp_path}", DEBUG, f"dump_dir={dump}", "env.HF_TOKEN=hf_x"]
    assert slurm_main(argv) == 0
    assert stat.S_IMODE((dump / "submit.slurm").stat().st_mode) == 0o600


# ---------------------------------------------------------------- item 4: alias bomb
def test_yaml_alias_bomb_is_one_config_error(tmp_path):
    levels = "abcdefghi"
    lines = ["a: &a [" + ", ".join(["lol"] * 9) + "]"]
    lines += [f"{c}: &{c} [" + ", ".join([f"*{p}"] * 9) + "]" for p, c in zip(levels, levels[1:])]
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError) as err:
        load_yaml_file(bomb)
    assert str(err.value).startswith(f"{bomb}: YAML aliases expand to ")
    with pytest.raises(ConfigError, match="YAML aliases expand"):
        parse_args(TrainArgs, [f"config={bomb}", f"dump_dir={tmp_path}"])


def test_yaml_aliases_of_ordinary_size_still_work(tmp_path):
    path = tmp_path / "anchors.yaml"
    path.write_text("base: &b {x: 1, y: [1, 2]}\none: *b\ntwo: {<<: *b, z: 3}\n")
    assert load_yaml_file(path) == {
        "base": {"x": 1, "y": [1, 2]},
        "one": {"x": 1, "y": [1, 2]},
        "two": {"x": 1, "y": [1, 2], "z": 3},
    }


# ---------------------------------------------------------------- item 12: --log-dir
def test_slurm_launcher_with_log_dir_creates_a_new_dump_dir(tmp_path):
    dump, logs = tmp_path / "new" / "run", tmp_path / "logs"
    argv = ["--dry-run", f"--workdir={tmp_path}", f"--log-dir={logs}", DEBUG, f"dump_dir={dump}"]
    assert slurm_main(argv) == 0
    assert (dump / "submit.slurm").is_file() and logs.is_dir()
    assert f"#SBATCH --output={logs}/%j.out" in (dump / "submit.slurm").read_text()


# ---------------------------------------------------------------- issue 29 item 8a: deep nesting
@pytest.mark.parametrize("text", ["x: " + "[" * 1000, "x: " + "[" * 1000 + "]" * 1000,
                                  "a:\n" + "".join(" " * i + "b:\n" for i in range(1, 400))])  # fmt: skip
def test_deeply_nested_yaml_is_one_config_error(tmp_path, text):
    deep = tmp_path / "deep.yaml"
    deep.write_text(text + "\n")
    with pytest.raises(ConfigError, match=r"YAML nested more than 100 levels deep \(at line"):
        load_yaml_file(deep)
    with pytest.raises(ConfigError, match="nested more than 100 levels"):
        parse_args(TrainArgs, [f"config={deep}", f"dump_dir={tmp_path}"])


def test_deeply_nested_value_or_key_on_the_command_line_is_one_config_error(tmp_path):
    with pytest.raises(ConfigError, match="nested more than 100 levels"):
        parse_args(TrainArgs, [f"dump_dir={tmp_path}", "data.sources=" + "[" * 1000])
    with pytest.raises(ConfigError, match="nested more than 100 levels"):
        parse_args(TrainArgs, [f"dump_dir={tmp_path}", "a" + ".a" * 1000 + "=1"])


def test_the_train_command_says_it_in_one_line_and_exits_2(tmp_path, capsys):
    from bytelatent.train import main

    deep = tmp_path / "deep.yaml"
    deep.write_text("x: " + "[" * 1000 + "\n")
    assert main([f"config={deep}", f"dump_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"config error: {deep}: YAML nested more than")
