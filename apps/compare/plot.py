"""compare.png, drawn from the rows of compare.json: test bpb against training FLOPs (the mean
over seeds, a band from the lowest to the highest seed), the learning-rate sweep (final tune bpb
per rate, the chosen one marked), and test bpb against training seconds (step time only)."""

from __future__ import annotations

from apps.compare.args import CompareArgs


def _band(
    curves: list[dict], x_key: str
) -> tuple[list[float], list[float], list[float], list[float]]:
    n = min(len(c["test_bpb"]) for c in curves)
    xs = [sum(c[x_key][i] for c in curves) / len(curves) for i in range(n)]
    ys = [[c["test_bpb"][i] for c in curves] for i in range(n)]
    return xs, [sum(y) / len(y) for y in ys], [min(y) for y in ys], [max(y) for y in ys]


def write_png(path, rows: list[dict], args: CompareArgs, caption: str) -> bool:
    """False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (by_flops, sweep, by_time) = plt.subplots(1, 3, figsize=(16, 5), dpi=110)
    for r in rows:
        xs, mean, lo, hi = _band(r["curves"], "flops")
        (line,) = by_flops.plot(xs, mean, "o-", label=r["row"], markersize=3)
        by_flops.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.2)
        ts, mean_t, lo_t, hi_t = _band(r["curves"], "seconds")
        by_time.plot(ts, mean_t, "o-", color=line.get_color(), label=r["row"], markersize=3)
        by_time.fill_between(ts, lo_t, hi_t, color=line.get_color(), alpha=0.2)
        lrs = sorted(r["lr_sweep"], key=float)
        sweep.plot([float(x) for x in lrs], [r["lr_sweep"][x] for x in lrs], "o-",
                   color=line.get_color(), label=r["row"])  # fmt: skip
        sweep.plot([r["lr"]], [r["lr_sweep"][f"{r['lr']:g}"]], "*", color=line.get_color(),
                   markersize=12)  # fmt: skip
    by_flops.set(xlabel="training FLOPs (real patch / chunk counts)",
                 ylabel="test bits per byte (held-out documents)",
                 title="bpb vs training FLOPs (band: min-max over seeds)")  # fmt: skip
    sweep.set(xscale="log", xlabel="learning rate", ylabel=f"tune bpb (seed {args.seeds[0]})",
              title="learning-rate sweep (tune split; * chosen)")  # fmt: skip
    by_time.set(xlabel="training seconds (step time only; data time apart)",
                ylabel="test bits per byte",
                title="bpb vs training seconds (runs shared a machine)")  # fmt: skip
    for ax in (by_flops, sweep, by_time):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Byte LM vs BLT vs H-Net at matched training FLOPs per byte")
    fig.text(0.5, 0.01, caption, ha="center", fontsize=7, wrap=True)
    fig.tight_layout(rect=(0, 0.05, 1, 0.95))
    fig.savefig(path)
    plt.close(fig)
    return True
