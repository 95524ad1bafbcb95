"""Run every fenced shell command of README.md and docs/*.md in a fresh folder, in order.

    python scripts/run_doc_commands.py [--workdir DIR] [--list] [--only SUBSTRING]

The folder gets a copy of the repository's tracked files (configs/, scripts/, ...), a `python`,
`python3` and `torchrun` of this interpreter first on PATH, and nothing else: every run,
checkpoint and data file the docs use is made by an earlier command, as a new user would. A
command fails the run when it exits non-zero or does nothing:

- `bytelatent.train` (not a dry run or --help): its dump_dir's metrics.jsonl must reach a step
  beyond the one it had (a resumed run that had nothing to do fails);
- `bytelatent.eval`: its dump_dir's results.json must be (re)written;
- anything else: it must print something or create/modify a file.

Training is shortened (and the corpus is 1 MB): `steps` (debug configs: 200) and every step-like key (`*.every`,
`relative_steps`, `probe_freq`, `checkpoint.steps`) are divided by STEP_DIVISOR (`apps.compare` runs
as written: its quick preset is short already), and
`checkpoints/0000000200` becomes `checkpoints/0000000020`. A few commands cannot run on one
CPU machine (a SLURM cluster, released weights, your own task files); SKIP names each with the
test that covers it. The rewrites and skips are listed by `--list`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STEP_DIVISOR = 10
TIMEOUT_S = 900
SHELL_LANGS = {"bash", "sh", "shell", "console"}
SHELL_STARTS = ("python", "torchrun", "pip", "sudo", "bash", "BYTELATENT_")

# (substring, reason): commands that cannot run here, each covered elsewhere.
SKIP = [
    ("-m pytest", "the test suite itself (CI runs it)"),
    ("pip install", "installs packages (the runner's interpreter has the test extra)"),
    (
        "config=configs/compare_cpu.yaml",
        "30 runs of 4 MB (an hour or more): the recipe is "
        "tests/apps/test_compare.py's quick preset; results in bench/RESULTS_compare_cpu.md",
    ),
    ("sudo ", "installs system packages (CI's scripts/ci_slurm_setup.sh)"),
    ("launch.slurm --nodes", "submits to a SLURM cluster (tests/integration/test_slurm.py)"),
    (
        "dump_dir=runs/gpu_",
        "needs GPUs and your corpus (docs/scaling.md; the configs' dry runs: "
        "tests/trainer/test_dry_run.py, tests/trainer/test_memory_advice.py)",
    ),
    ("launch.slurm --nproc", "submits to a SLURM cluster (tests/integration/test_slurm.py)"),
    ("async_launch.mode=slurm", "submits to a SLURM cluster (tests/eval/test_async_slurm.py)"),
    ("tasks=[my_task]", "needs your lm-eval task YAMLs (tests/generation/test_harness.py)"),
    (
        "hf/Llama-3.2-1B",
        "needs Meta's Llama weights from the HF hub (tests/trainer/test_byteify.py: tiny Llama)",
    ),
    ("mydata", "your own corpus (tests/trainer/test_byteify.py, tests/data/test_patch_size.py)"),
    (
        "runs/entropy/checkpoints/0000100000",
        "a 100k-step entropy model (tests/data/test_patch_size.py)",
    ),
    (
        "blt/bytelatent/configs/",
        "a file of the reference repository (tests/interop/test_from_reference.py)",
    ),
]
# (pattern, replacement, reason), applied in order to every command.
REWRITES = [
    (r"python3 -m venv \S+ && \S+/bin/pip install [^&]*&& ", "", "the venv exists already"),
    (r"\.venv/bin/python\b", "python", "the venv exists already"),
    (r"mode: online", "mode: offline", "wandb online needs an account and network"),
    (r"ckpt=DIR\b", "ckpt=runs/debug/checkpoints/0000000200", "DIR: the quick start's checkpoint"),
    (
        r"sft_debug/checkpoints/0000000600",
        "sft_debug/checkpoints/0000000060",
        "configs/sft_debug.yaml's 600 steps, shortened",
    ),
    (r'prompt="\.\.\."', 'prompt="import "', '"..." stands for your prompt'),
    (
        r"(train_token_teacher\.py .*--steps )(600|1500)\b",
        lambda m: f"{m.group(1)}{int(m.group(2)) // STEP_DIVISOR}",
        "the byteify teachers' 600 / 1500 steps, shortened (docs/byteify.md)",
    ),
    (
        r"(bytelatent\.data\.prepare --out \S+)",
        r"\1 --max-mb 1",
        "a 1 MB corpus: entropies in seconds",
    ),
]
STEP_KEYS = re.compile(
    r"(?<![\w.])((?:[\w.]+\.)?every|relative_steps|max_steps|probe_freq|steps)=(\d+)\b"
)


@dataclass
class Command:
    where: str  # file:line
    text: str  # what runs (after the rewrites)


def shell_blocks(path: Path) -> list[tuple[int, list[str]]]:
    """(first line number, lines) of each fenced block that holds shell commands."""
    blocks, current, start, lang = [], None, 0, ""
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith("```"):
            if current is None:
                current, start, lang = [], number + 1, line[3:].strip()
                continue
            first = next((s for s in current if s.strip() and not s.startswith("#")), "")
            if lang in SHELL_LANGS or (not lang and first.startswith(SHELL_STARTS)):
                blocks.append((start, current))
            current = None
        elif current is not None:
            current.append(line)
    return blocks


def block_commands(start: int, lines: list[str]) -> list[tuple[int, str]]:
    """Commands of a block (continuations joined, comment lines dropped); a block that keeps shell
    state between lines (`$!`, `$pid`, `wait`) is one command."""
    commands, pending, first = [], "", start
    for offset, line in enumerate(lines):
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if not pending:
            first = start + offset
        pending += line.rstrip()[:-1] + " " if line.rstrip().endswith("\\") else line
        if not line.rstrip().endswith("\\"):
            commands.append((first, pending.strip()))
            pending = ""
    if any(re.search(r"\$!|\$pid\b|\bwait\b", text) for _, text in commands):
        return [(commands[0][0], "\n".join(text for _, text in commands))]
    return commands


def collect() -> list[Command]:
    docs = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    found = []
    for path in docs:
        for start, lines in shell_blocks(path):
            for line, text in block_commands(start, lines):
                found.append(Command(f"{path.relative_to(REPO)}:{line}", text))
    return found


def conformance_dir() -> Path:
    """Released-layout weights for `hf-weights/...` (the conformance fixtures, as tests use them)."""
    default = REPO.parent / "shared" / "conformance"
    return Path(os.environ.get("BYTELATENT_CONFORMANCE_DIR", default))


def rewrite(text: str) -> str:
    for pattern, replacement, _ in REWRITES:
        text = re.sub(pattern, replacement, text)
    if conformance_dir().is_dir():
        text = re.sub(
            r"hf-weights/(blt_1b|entropy_model)",
            lambda m: str(
                conformance_dir() / ("blt" if m.group(1) == "blt_1b" else "entropy_model")
            ),
            text,
        )
    return text


def skip_reason(text: str) -> str | None:
    """Why a command (after the rewrites) cannot run here, or None."""
    if "hf-weights/" in text:
        return "released weights (../shared/conformance stands in for them when present)"
    return next((why for needle, why in SKIP if needle in text), None)


def is_training(text: str) -> bool:
    return "bytelatent.train" in text and "--help" not in text and "dry_run=true" not in text


def shorten(text: str) -> str:
    """Divide training step counts by STEP_DIVISOR."""
    text = text.replace("0000000200", f"{200 // STEP_DIVISOR:010d}")
    if "-m apps.compare" in text:
        return text  # compare_quick is short as it is; the others are skipped or dry runs
    if not is_training(text):
        return text
    text = STEP_KEYS.sub(lambda m: f"{m.group(1)}={max(1, int(m.group(2)) // STEP_DIVISOR)}", text)
    text = re.sub(
        r"checkpoint\.steps=\[([\d, ]+)\]",
        lambda m: "checkpoint.steps=["
        + ",".join(str(max(1, int(v) // STEP_DIVISOR)) for v in m.group(1).split(","))
        + "]",
        text,
    )
    if not re.search(r"(?<![\w.])steps=", text):
        text = re.sub(r"(-m bytelatent\.train)(?=\s)", rf"\1 steps={200 // STEP_DIVISOR}", text)
    return text


def config_dump_dir(text: str, folder: Path) -> Path | None:
    """dump_dir=... of a command, else the dump_dir line of its config file."""
    if match := re.search(r"(?<![\w.])dump_dir=(\S+)", text):
        return folder / match.group(1)
    if match := re.search(r"config=(\S+\.yaml)", text):
        for line in (folder / match.group(1)).read_text().splitlines():
            if line.startswith("dump_dir:"):
                return folder / line.split(":", 1)[1].strip()
    return None


def last_step(dump_dir: Path | None) -> int:
    metrics = dump_dir / "metrics.jsonl" if dump_dir else None
    if metrics is None or not metrics.exists():
        return -1
    steps = [json.loads(line).get("global_step", -1) for line in metrics.read_text().splitlines()]
    return max(steps, default=-1)


def snapshot(folder: Path) -> dict[str, float]:
    return {
        str(p): p.stat().st_mtime
        for p in folder.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and ".git" not in p.parts
    }


def prepare_folder(folder: Path) -> dict[str, str]:
    """Copy the tracked files into `folder`; return the environment the commands run in."""
    tracked = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split("\0")
    for name in filter(None, tracked):
        if (REPO / name).is_file():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, folder / name)
    bin_dir = folder / ".doc-bin"
    bin_dir.mkdir()
    python = shlex.quote(sys.executable)  # a script, not a symlink: a venv is found by its path
    for name, line in [("python", ""), ("python3", ""), ("torchrun", " -m torch.distributed.run")]:
        (bin_dir / name).write_text(f'#!/bin/sh\nexec {python}{line} "$@"\n')
        (bin_dir / name).chmod(0o755)
    (folder / "in.jsonl").write_text('{"prompt": "def f(x):"}\n{"prompt": "import "}\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHONPATH", "BYTELATENT_"))}
    return {**env, "PATH": f"{bin_dir}{os.pathsep}{env['PATH']}", "OMP_NUM_THREADS": "1"}


def did_nothing(command: Command, folder: Path, before: dict, proc) -> str | None:
    """Why a command that exited 0 counts as having done nothing, or None."""
    text = command.text
    if is_training(text):
        dump_dir = config_dump_dir(text, folder)
        if last_step(dump_dir) <= before["step"]:
            return f"trained no step ({dump_dir}/metrics.jsonl at step {last_step(dump_dir)})"
        return None
    if "bytelatent.eval " in text and (match := re.search(r"dump_dir=(\S+)", text)):
        results = folder / match.group(1) / "results.json"
        if str(results) not in snapshot(folder) or snapshot(folder)[str(results)] == before[
            "files"
        ].get(str(results)):
            return f"wrote no {results}"
        return None
    printed = proc.stdout.rstrip("\n") or proc.stderr.strip()  # whitespace is output (generate)
    if not printed and snapshot(folder) == before["files"]:
        return "printed nothing and wrote no file"
    return None


def run_one(command: Command, folder: Path, env: dict) -> str | None:
    """Run `command`; the failure (None: fine)."""
    dump_dir = config_dump_dir(command.text, folder) if is_training(command.text) else None
    before = {"step": last_step(dump_dir), "files": snapshot(folder)}
    try:
        proc = subprocess.run(
            ["bash", "-c", f"set -eo pipefail\n{command.text}"],
            cwd=folder,
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        return f"timed out after {TIMEOUT_S} s"
    if proc.returncode != 0:
        return f"exit {proc.returncode}:\n{(proc.stdout + proc.stderr)[-3000:]}"
    return did_nothing(command, folder, before, proc)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python scripts/run_doc_commands.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--workdir", default=None, help="run here (default: a new temp folder)")
    parser.add_argument("--list", action="store_true", help="print the commands as they would run")
    parser.add_argument("--only", default=None, help="run only commands containing this")
    args = parser.parse_args(argv)
    commands = collect()
    if args.list:
        for command in commands:
            text = rewrite(command.text)
            why = skip_reason(text)
            print(f"{command.where}: {'SKIP (' + why + ')' if why else shorten(text)}")
        return 0
    folder = Path(args.workdir or tempfile.mkdtemp(prefix="doc-commands-"))
    folder.mkdir(parents=True, exist_ok=True)
    env = prepare_folder(folder)
    failures = 0
    for command in commands:
        text = rewrite(command.text)
        if (why := skip_reason(text)) or (args.only and args.only not in text):
            print(f"skip {command.where}: {why or 'not selected'}", flush=True)
            continue
        command = Command(command.where, shorten(text))
        start = time.monotonic()
        failure = run_one(command, folder, env)
        status = "FAIL" if failure else "ok"
        print(
            f"{status:4} {command.where} ({time.monotonic() - start:.0f} s): {command.text}",
            flush=True,
        )
        if failure:
            failures += 1
            print(f"     {failure}", flush=True)
    print(f"{failures} of {len(commands)} doc commands failed (folder: {folder})")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
