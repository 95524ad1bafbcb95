"""`python -m bytelatent.train`, optionally slowed down so a test can act at a known point.

Training steps of the tiny test models take a few milliseconds: without a pause a test cannot
deliver a signal "around step k" or kill a process in the middle of a checkpoint write. The pauses
change only timing, never numerics. Environment variables (seconds, default 0):

* BYTELATENT_TEST_STEP_DELAY: sleep before every optimizer step.
* BYTELATENT_TEST_RESTORE_DELAY: sleep when a checkpoint restore begins (after printing
  "train_entry: restoring"), so a signal can arrive in the middle of a run's start-up.
* BYTELATENT_TEST_MARKER_DELAY: sleep after a checkpoint's data is written and before its
  `.complete` marker, i.e. inside the window where a crash leaves a partial step folder; only
  for steps >= BYTELATENT_TEST_MARKER_DELAY_FROM_STEP (default 0).

Also importable as a module (`--module train_entry` with this folder on PYTHONPATH), which is how
the SLURM test runs it under torchrun inside sbatch.
"""

from __future__ import annotations

import os
import sys
import time


def _delay(name: str) -> float:
    return float(os.environ.get(name, "0") or 0)


def install_delays() -> None:
    from bytelatent.checkpoint.manager import CheckpointManager
    from bytelatent.trainer.trainer import Trainer

    step_delay = _delay("BYTELATENT_TEST_STEP_DELAY")
    restore_delay = _delay("BYTELATENT_TEST_RESTORE_DELAY")
    marker_delay = _delay("BYTELATENT_TEST_MARKER_DELAY")
    marker_from_step = int(os.environ.get("BYTELATENT_TEST_MARKER_DELAY_FROM_STEP", "0") or 0)
    if step_delay > 0:
        train_step = Trainer.train_step

        def slow_train_step(self, batches):
            time.sleep(step_delay)
            return train_step(self, batches)

        Trainer.train_step = slow_train_step
    if restore_delay > 0:
        load = CheckpointManager.load

        def slow_load(self, *args, **kwargs):
            print(f"train_entry: restoring; continuing in {restore_delay}s", flush=True)
            time.sleep(restore_delay)
            return load(self, *args, **kwargs)

        CheckpointManager.load = slow_load
    if marker_delay > 0:
        from bytelatent.checkpoint.saver import Saver

        write_marker = Saver._write_marker

        def slow_write_marker(self, folder, step, kinds):
            if step >= marker_from_step:
                print(
                    f"train_entry: data of {folder} written; marker in {marker_delay}s", flush=True
                )
                time.sleep(marker_delay)
            return write_marker(self, folder, step, kinds)

        Saver._write_marker = slow_write_marker


def main() -> int:
    from bytelatent.distributed.signals import early_flag

    early_flag()  # the first line of `python -m bytelatent.train` too
    from bytelatent.data.worker_server import start_early

    start_early(sys.argv[1:])  # as `python -m bytelatent.train` does, before torch is imported
    install_delays()
    from bytelatent.train import main as train_main

    return train_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
