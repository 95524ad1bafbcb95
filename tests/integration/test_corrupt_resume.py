"""A corrupted newest checkpoint is set aside and the run resumes from the previous one, bitwise.

One `.distcp` shard of the newest complete checkpoint is truncated (size check) or has a byte
flipped (caught with checkpoint.verify=checksum); the same command then moves that folder aside
(renamed, never deleted), resumes from the checkpoint before it, and logs losses equal to the
uninterrupted run's. Under torchrun the ranks split the verification and agree on the result.
"""

from __future__ import annotations

import json

import pytest
from harness import model_args, read_metrics
from test_resume import checkpoint_steps


def _flip_middle_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("nproc", "damage"), [(1, "truncate"), (2, "bitflip")], ids=["1proc-truncated", "fsdp2-bitflip"]
)
def test_corrupted_newest_checkpoint_is_set_aside_and_resume_is_bitwise(
    runner, nproc: int, damage: str
) -> None:
    args = [
        *model_args("entropy", nproc),
        "checkpoint.dump.every=5",
        "checkpoint.dump.keep=0",
        "checkpoint.verify=checksum",
    ]
    first = runner.start("run", args, nproc=nproc)
    first.wait_ok()
    uninterrupted = read_metrics(first.dump_dir)
    assert [r["global_step"] for r in uninterrupted] == list(range(1, 21))
    newest = first.dump_dir / "checkpoints" / "0000000020"
    shard = newest / f"__{nproc - 1}_0.distcp"
    if damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:1000])
    else:
        _flip_middle_byte(shard)

    second = runner.start("run", args, nproc=nproc)
    out = second.wait_ok()
    assert "0000000020 fails verification" in out and shard.name in out
    assert f"resumed from {first.dump_dir / 'checkpoints' / '0000000015'} at step 15" in out
    aside = [p for p in (first.dump_dir / "checkpoints").iterdir() if ".corrupt-" in p.name]
    assert len(aside) == 1 and (aside[0] / shard.name).exists()  # kept, not deleted

    # one record per step: the first run's records of steps 16-20 were moved aside at the resume
    records = read_metrics(first.dump_dir)
    assert [r["global_step"] for r in records] == list(range(1, 21))
    replayed = (first.dump_dir / "metrics.replayed.jsonl").read_text().splitlines()
    assert [json.loads(line)["global_step"] for line in replayed] == list(range(16, 21))
    resumed = records[15:]
    want = {r["global_step"]: r["loss"] for r in uninterrupted}
    mismatches = {r["global_step"]: (r["loss"], want[r["global_step"]]) for r in resumed
                  if r["loss"] != want[r["global_step"]]}  # fmt: skip
    assert not mismatches, f"losses differ from the uninterrupted run: {mismatches}"
    assert checkpoint_steps(first.dump_dir)[20] is not None  # step 20 saved again, complete
