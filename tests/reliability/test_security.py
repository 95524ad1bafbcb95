"""Security review checks: safe deserialisation everywhere, and a SLURM script that runs nothing
a job name or config value smuggles in."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from bytelatent.errors import ConfigError
from bytelatent.launch.slurm import SlurmArgs, main, render_script
from tests.limits import hang_limit

REPO = Path(__file__).resolve().parents[2]
PACKAGES = [REPO / "bytelatent", REPO / "apps"]


def _python_files() -> list[Path]:
    return sorted(p for package in PACKAGES for p in package.rglob("*.py"))


def _calls(name: str):
    """(file, line, call) for every call of `module.attr` (e.g. torch.load) in the package."""
    module, attr = name.split(".")
    for path in _python_files():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == attr
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == module
            ):
                yield path.relative_to(REPO), node.lineno, node


def test_every_torch_load_uses_weights_only():
    found = list(_calls("torch.load"))
    assert found, "the scan found no torch.load at all: it is not looking in the right place"
    unsafe = [
        f"{path}:{line}"
        for path, line, call in found
        if not any(
            kw.arg == "weights_only"
            and isinstance(kw.value, ast.Constant)
            and kw.value.value is True
            for kw in call.keywords
        )
    ]
    assert not unsafe, f"torch.load without weights_only=True: {unsafe}"
    # Text check too: an alias (`from torch import load`) or a string-built call would slip past AST.
    for path in _python_files():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if "torch.load(" in line or "from torch import load" in line:
                assert "weights_only=True" in line or line.strip().startswith(
                    "#"
                ), f"{path.relative_to(REPO)}:{number}: {line.strip()}"


def test_no_unsafe_yaml_or_pickle():
    for path, line, call in _calls("yaml.load"):
        loader = next((kw.value for kw in call.keywords if kw.arg == "Loader"), None)
        assert isinstance(loader, ast.Name) and loader.id == "_Loader", f"{path}:{line}"
    from bytelatent.config.parser import _Loader

    assert issubclass(_Loader, yaml.SafeLoader)
    for name in ("yaml.unsafe_load", "yaml.full_load", "pickle.load"):
        assert not list(_calls(name)), name
    # The only unpickling: exceptions from the data loader's own child process over its pipe
    # (multiprocessing pickles every message on that channel anyway); never data from disk.
    loads = {str(path) for path, _, _ in _calls("pickle.loads")}
    assert loads <= {"bytelatent/data/iterators/multiprocess.py"}, loads


def test_no_shell_commands_built_from_strings():
    for path in _python_files():
        text = path.read_text()
        for bad in ("shell=True", "os.system(", "os.popen("):
            assert bad not in text, f"{path.relative_to(REPO)}: {bad}"


EVIL = "$(touch PWNED_1)`touch PWNED_2`'\"; touch PWNED_3 #"
STUB = """#!{python}
import json, sys
json.dump(sys.argv[1:], open({out!r}, "w"))
"""


def test_launcher_script_runs_nothing_from_job_name_or_config(tmp_path):
    out = tmp_path / "argv.json"
    stub = tmp_path / "python-stub"
    stub.write_text(STUB.format(python=sys.executable, out=str(out)))
    stub.chmod(0o755)
    work = tmp_path / "work dir $(touch PWNED_4)"
    work.mkdir()
    train_argv = ["config=configs/debug.yaml", f"name={EVIL}", f"dump_dir={EVIL}"]
    args = SlurmArgs(python=str(stub), workdir=str(work), partition="p`touch PWNED_5`")
    script = render_script(args, train_argv, job_name=EVIL, log_dir=str(tmp_path / "logs"))
    path = tmp_path / "submit.slurm"
    path.write_text(script)
    env = dict(os.environ, SLURM_JOB_ID="1", SLURM_RESTART_COUNT="0")
    result = subprocess.run(["bash", str(path)], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=hang_limit(60))  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert json.loads(out.read_text()) == ["-m", "bytelatent.train", *train_argv]
    leaked = [p for p in (tmp_path, work, Path.cwd()) for p in p.glob("PWNED_*")]
    assert not leaked, leaked


@pytest.mark.parametrize("field", ["job_name", "partition", "sbatch_args"])
def test_line_break_in_sbatch_header_is_refused(field):
    value = "x\ntouch PWNED"
    args = SlurmArgs(**({field: [value]} if field == "sbatch_args" else {field: value}))
    with pytest.raises(ConfigError, match="line breaks"):
        render_script(args, ["config=c.yaml"], job_name=args.job_name or "job", log_dir="/logs")


def test_dry_run_with_config_name_is_refused_in_one_line(tmp_path, capsys):
    """The job name defaults to the config's `name`: a YAML "\\n" escape must not become a line."""
    tree = yaml.safe_load((REPO / "configs" / "debug.yaml").read_text())
    tree["name"] = "a\ntouch PWNED"
    config = tmp_path / "evil.yaml"
    config.write_text(yaml.safe_dump(tree))
    argv = [
        "--dry-run",
        f"--workdir={tmp_path}",
        f"config={config}",
        f"dump_dir={tmp_path / 'run'}",
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("config error:") and err.count("\n") == 1
