#!/usr/bin/env bash
# GPU checks in one call, for a session that is lent a device (NOT YET RUN: no task so far had one).
#   run: command="bash bench/gpu/run_checks.sh", carry=[".venv"] if the device lacks torch.
# 1. backend equivalence: flex_attention / xformers vs brute force (these tests skip on CPU);
# 2. training throughput, bf16 + per-block torch.compile, on the reference shapes (entropy model
#    100M, BLT-1B with space patching), bytes/s, MFU and peak memory from metrics.jsonl.
# Results go to $OUT (or bench/gpu/out); copy the summary into bench/gpu/RESULTS.md.
set -uo pipefail
OUT=${OUT:-bench/gpu/out}
mkdir -p "$OUT"
PY=${PY:-python}
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
$PY -m pytest -q tests/model/test_attention.py tests/model/test_blt_patch_utils.py > "$OUT/tests.txt" 2>&1
echo "tests rc=$?" >> "$OUT/tests.txt"
$PY -m bytelatent.data.prepare --out "$OUT/data/stdlib" > /dev/null
common=(data.root_dir="$OUT/data" "data.sources={stdlib: 1.0}" steps=40 logging.freq=10
        checkpoint.dump.every=0 distributed.compile=true distributed.model_dtype=bf16)
timeout 240 $PY -m bytelatent.train config=configs/entropy_model.yaml dump_dir="$OUT/entropy" \
    data.batch_size=8 "${common[@]}" > "$OUT/entropy.log" 2>&1
timeout 300 $PY -m bytelatent.train config=configs/blt_1b.yaml dump_dir="$OUT/blt_1b" \
    data.preprocess_dir=null data.patcher_args.patching_mode=space data.batch_size=2 \
    "${common[@]}" > "$OUT/blt_1b.log" 2>&1
for run in entropy blt_1b; do
    echo "== $run"; tail -n 2 "$OUT/$run/metrics.jsonl" 2>/dev/null || tail -n 5 "$OUT/$run.log"
done | tee "$OUT/summary.txt"
