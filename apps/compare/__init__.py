"""`python -m apps.compare config=configs/compare_cpu.yaml [key=value ...]`: byte-level
architectures (the rows: a byte LM, BLTs with entropy, space and static patching, 1- and 2-stage
H-Nets, or any registered architecture) at matched training FLOPs per byte on one corpus, each
tuned and seeded, compared by held-out and out-of-domain bpb (docs/compare.md).

1. splits: the corpus's held-out documents into `tune` and `test`, and out-of-domain text (`ood`);
2. the BLT's entropy model (trained, or `entropy.checkpoint`) and its threshold for N bytes per
   patch (`python -m bytelatent.data.patch_size`);
3. sizing: each row's `size_key` matches the reference's FLOPs per byte (rule printed; a row that
   cannot be matched is one config-error line);
4. phase 1: every row at each learning rate (`lrs`) with `seeds[0]`, `parallel` at a time;
5. phase 2: rows whose runs trained off the reference's real FLOPs per byte are sized again from
   their real patch / chunk counts and swept again;
6. phase 3: the rate with the best `tune` bpb, with the other `seeds`;
7. `out_dir` gets compare.md, compare.json and compare.png (the plot needs the `plot` extra).

Finished runs are reused on a rerun (and a rerun with nothing left says so); a rerun with another
config is refused. `dry_run=true` prints the plan and expected time; `status=true` the finished
runs so far; `launcher=slurm` submits each phase as a job array.
"""
