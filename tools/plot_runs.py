"""Plot runs' mean return over their last 100 (--window) finished episodes against env steps, into one PNG.

    python tools/plot_runs.py RUN_DIR [RUN_DIR ...] --out FILE.png [--labels L1 L2 ...] [--window 100] [--title T]
    python tools/plot_runs.py runs/BreakoutNoFrameskip-v4__ppg__1__<time> runs/BreakoutNoFrameskip-v4__ppo__1__<time> \
        --labels PPG PPO --out breakout.png
"""

import argparse
import os
import sys

import numpy as np
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

try:
    import matplotlib
except ImportError:
    sys.exit("error: tools/plot_runs.py needs matplotlib: pip install matplotlib")
matplotlib.use("Agg")  # no display needed
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402

TAG = "charts/episodic_return"


def steps_label(x: float, _pos=None) -> str:
    """100000 -> 100k, 1500000 -> 1.5M."""
    if abs(x) >= 1e6:
        return f"{x / 1e6:g}M"
    return f"{x / 1e3:g}k" if abs(x) >= 1e3 else f"{x:g}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="runs/{run_name} folders")
    parser.add_argument("--out", required=True, help="the PNG to write")
    parser.add_argument("--labels", nargs="+", help="one legend label per run (default: the run folders' names)")
    parser.add_argument("--window", type=int, default=100, help="episodes averaged")
    parser.add_argument("--title", default=TAG)
    args = parser.parse_args()
    labels = args.labels or [os.path.basename(os.path.abspath(d)) for d in args.run_dirs]
    if len(labels) != len(args.run_dirs):
        parser.error(f"--labels got {len(labels)} labels for {len(args.run_dirs)} runs")
    if args.window < 1:
        parser.error("--window must be at least 1")

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110, layout="constrained")
    for i, (run_dir, label) in enumerate(zip(args.run_dirs, labels)):
        if not os.path.isdir(run_dir):
            sys.exit(f"error: {run_dir}: not a folder")
        acc = EventAccumulator(run_dir, size_guidance={"scalars": 0})
        acc.Reload()
        if TAG not in acc.Tags()["scalars"]:
            sys.exit(f"error: {run_dir}: no {TAG} scalars (no finished episode logged, or not a run folder)")
        episodes = sorted(acc.Scalars(TAG), key=lambda e: e.step)  # several event files may interleave
        steps = np.array([e.step for e in episodes])
        returns = np.array([e.value for e in episodes])
        # trailing mean over the last `window` episodes (fewer at the start), as summarise_run.py computes it
        csum = np.concatenate([[0.0], np.cumsum(returns)])
        ends = np.arange(1, len(returns) + 1)
        starts = np.maximum(ends - args.window, 0)
        mean = (csum[ends] - csum[starts]) / (ends - starts)
        # each episode's own return as a faint dot under its run's mean line (as CleanRL's plots do)
        ax.scatter(steps, returns, s=3, alpha=0.3, color=f"C{i}", linewidths=0)
        ax.plot(steps, mean, color=f"C{i}", lw=1.8, label=label)

    ax.xaxis.set_major_formatter(FuncFormatter(steps_label))
    ax.set_xlabel("env steps")
    ax.set_ylabel(f"return (mean of last {args.window} episodes)")
    ax.set_title(args.title)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", frameon=True)
    fig.savefig(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
