"""`python -m apps.compare config=configs/compare_cpu.yaml [key=value ...]`: a byte LM, a BLT and
an H-Net at matched training FLOPs per byte on one corpus, compared by validation bpb.

1. the BLT's entropy model: trained (`entropy.config`) and consolidated, or `entropy.checkpoint`;
2. `python -m bytelatent.data.patch_size` picks the entropy threshold giving `bytes_per_patch`
   (N, also the H-Net's target ratio) on the training corpus;
3. the runs are sized to the reference's FLOPs per byte (rule in `apps/compare/sizing.py`,
   printed with the achieved ratios);
4. each run trains as a `python -m bytelatent.train` subprocess, one at a time, for the same
   steps of `batch_size` rows of `row_bytes` bytes, with `evals` validations;
5. `out_dir` gets compare.md (table), compare.json (numbers) and compare.png (val bpb against
   training FLOPs and training seconds; needs the `plot` extra).

Finished steps are reused on a rerun; a rerun with nothing left to train says so.
"""
