"""The wandb sink of `MetricLogger`: rank 0 only, one run per dump_dir across resumes and requeues.

* The run id is stored in `dump_dir/wandb_run.json` with the last step sent; a job resuming from
  a checkpoint reopens the same run (`resume="allow"`) and drops records at or below that step,
  so wandb never sees a step twice or a step going backwards (a job killed after its last
  checkpoint re-trains a few steps; their first values are the ones kept).
  In offline mode wandb writes one `offline-run-*-{id}` folder per process; they share the id, so
  `wandb sync` uploads them into one run.
* wandb is an observer, never a reason to stop training: a failure to start, or any error while
  logging (lost connection, dead service), is one warning and the sink goes quiet.
* `close()` calls `wandb.finish()`; `distributed.env.cleanup_and_exit` finishes a run still open
  before `os._exit`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from bytelatent.config.redact import redact_argv

logger = logging.getLogger("bytelatent")

RUN_FILE = "wandb_run.json"


class WandbArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    project: str = Field("bytelatent", description="wandb project")
    entity: str | None = Field(None, description="wandb team or user; default: wandb's default")
    name: str | None = Field(None, description="run name; default: the run's `name`")
    group: str | None = Field(None, description="wandb group of related runs")
    tags: list[str] = Field(default_factory=list, description="wandb run tags")
    mode: Literal["online", "offline", "disabled"] = Field(
        "online", description="online, offline (upload later with `wandb sync`) or disabled"
    )
    dir: str | None = Field(None, description="where wandb writes its files; default: dump_dir")


@contextlib.contextmanager
def _argv_redacted() -> Iterator[None]:
    """`sys.argv` with secret-looking `key=value` arguments redacted, for the duration."""
    saved = sys.argv
    sys.argv = [*saved[:1], *redact_argv(saved[1:])]
    try:
        yield
    finally:
        sys.argv = saved


class WandbSink:
    """Sends every metrics dict to wandb with its `global_step` as the step."""

    mirrors_all = True  # also gets records stored elsewhere (MetricLogger.log_external)

    def __init__(
        self,
        args: WandbArgs,
        dump_dir: str,
        name: str,
        config: dict[str, Any],
        start_step: int = 0,
    ):
        self.run = None
        self._state_path = Path(dump_dir) / RUN_FILE
        # A run starting from step 0 (no checkpoint: a new experiment in a reused dump_dir, or a
        # warm start) is a new trajectory, so it gets a new wandb run; resumes continue the stored one.
        stored = self._read_state() if start_step > 0 else {}
        # Records at or below this step were sent by an earlier process of this run.
        self._floor = stored.get("last_step", -1)
        self._last_step = self._floor
        try:
            import wandb

            with _argv_redacted():  # wandb records sys.argv in the run's metadata
                self.run = wandb.init(
                    project=args.project,
                    entity=args.entity,
                    name=args.name or name,
                    group=args.group,
                    tags=args.tags or None,
                    mode=args.mode,
                    dir=args.dir or dump_dir,
                    id=stored.get("id"),
                    resume="allow",
                    config=config,
                    settings=wandb.Settings(console="off", quiet=True),
                )
        except Exception as e:  # noqa: BLE001 - any failure of an observer must not stop training
            logger.warning("wandb: could not start (%s); training goes on without wandb", e)
            self.run = None
            return
        self._persist = args.mode != "disabled"  # a disabled run has nothing to continue
        if self._persist:
            self._write_state({"id": self.run.id, "last_step": self._last_step})
        logger.info("wandb: run %s (%s)", self.run.id, args.mode)

    def _read_state(self) -> dict[str, Any]:
        try:
            return json.loads(self._state_path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            logger.warning("wandb: cannot read %s (%s); starting a new run", self._state_path, e)
            return {}

    def _write_state(self, state: dict[str, Any]) -> None:
        tmp = self._state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state))
        os.replace(tmp, self._state_path)  # atomic: a kill never leaves half a file

    def set_summary(self, values: dict[str, Any]) -> None:
        if self.run is not None:
            self._guard(lambda: self.run.summary.update(values))

    def log(self, metrics: dict[str, Any]) -> None:
        if self.run is None:
            return
        step = int(metrics["global_step"])
        # Equal steps merge into one row (train then eval metrics of one step); lower ones are
        # dropped, as are steps an earlier process already sent.
        if step <= self._floor or step < self._last_step:
            return
        if self._guard(lambda: self.run.log(dict(metrics), step=step)) and step > self._last_step:
            self._last_step = step
            if self._persist:
                self._guard(lambda: self._write_state({"id": self.run.id, "last_step": step}))

    def _guard(self, fn) -> bool:
        try:
            fn()
            return True
        except Exception as e:  # noqa: BLE001 - see the module docstring
            logger.warning("wandb: %s; training goes on without wandb", e)
            self.run = None
            return False

    def close(self, exit_code: int = 0) -> None:
        if self.run is not None:
            run, self.run = self.run, None
            try:
                run.finish(exit_code=exit_code)
            except Exception as e:  # noqa: BLE001
                logger.warning("wandb: finish failed (%s)", e)
