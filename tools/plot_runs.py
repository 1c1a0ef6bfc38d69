"""Plot runs' mean return over their last 100 (--window) finished episodes against env steps, into one PNG.

    python tools/plot_runs.py RUN_DIR [RUN_DIR ...] --out FILE.png [--labels L1 L2 ...] [--window 100] [--title T]
    python tools/plot_runs.py docs/logs/*ppg__1* docs/logs/*ppg__2* docs/logs/*ppo__1* docs/logs/*ppo__2* \
        --labels PPG PPG PPO PPO --out docs/breakout.png

Runs that share a label are seeds of one method: each seed's curve is drawn faint, and their mean (over the
steps all of them reached) bold. A label of one run is drawn bold alone.
"""

import argparse
import logging
import os
import pathlib
import sys

import numpy as np
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

# A resumed run's event files hold what its stopped start logged past its checkpoint, which the resume's purge marker
# drops, as it should: TensorBoard warns of it ("Detected out of order event.step") at every read, telling a reader
# nothing
logging.getLogger("tensorboard").setLevel(logging.ERROR)

try:
    import matplotlib
except ImportError:
    sys.exit("error: tools/plot_runs.py needs matplotlib: pip install matplotlib")
matplotlib.use("Agg")  # no display needed
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # the tools' own modules
from helptext import DefaultsHelpFormatter  # noqa: E402

TAG = "charts/episodic_return"


def steps_label(x: float, _pos=None) -> str:
    """100000 -> 100k, 1500000 -> 1.5M."""
    if abs(x) >= 1e6:
        return f"{x / 1e6:g}M"
    return f"{x / 1e3:g}k" if abs(x) >= 1e3 else f"{x:g}"


def trailing_mean(run_dir: str, window: int):
    """(env steps, mean return of the last `window` episodes, fewer at the start), as summarise_run.py computes it."""
    if not os.path.isdir(run_dir):
        sys.exit(f"error: {run_dir}: not a folder")
    acc = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    acc.Reload()
    if TAG not in acc.Tags()["scalars"]:
        sys.exit(f"error: {run_dir}: no {TAG} scalars (no finished episode logged, or not a run folder)")
    episodes = sorted(acc.Scalars(TAG), key=lambda e: e.step)  # several event files may interleave
    steps, returns = np.array([e.step for e in episodes]), np.array([e.value for e in episodes])
    csum, ends = np.concatenate([[0.0], np.cumsum(returns)]), np.arange(1, len(returns) + 1)
    starts = np.maximum(ends - window, 0)
    return steps, (csum[ends] - csum[starts]) / (ends - starts)


def mean_of_seeds(runs):
    """The seeds' trailing means averaged on a common grid of env steps, over the steps every seed reached."""
    first, last = max(steps[0] for steps, _ in runs), min(steps[-1] for steps, _ in runs)
    if first >= last:
        sys.exit(f"error: seeds of one label share no steps (one starts at {first:,}, one ends at {last:,})")
    grid = np.linspace(first, last, 400)
    return grid, np.mean([np.interp(grid, steps, mean) for steps, mean in runs], axis=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter)
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="runs/{run_name} folders")
    parser.add_argument("--out", required=True, help="the PNG to write")
    parser.add_argument("--labels", nargs="+", help="one legend label per run (default: the run folders' names)")
    parser.add_argument("--window", type=int, default=100, help="episodes averaged")
    parser.add_argument("--title", default=TAG, help="the figure's title")
    args = parser.parse_args()
    labels = args.labels or [os.path.basename(os.path.abspath(d)) for d in args.run_dirs]
    if len(labels) != len(args.run_dirs):
        parser.error(f"--labels got {len(labels)} labels for {len(args.run_dirs)} runs")
    if args.window < 1:
        parser.error("--window must be at least 1")

    curves = {}  # label -> [(steps, trailing mean)] of its runs
    for run_dir, label in zip(args.run_dirs, labels):
        curves.setdefault(label, []).append(trailing_mean(run_dir, args.window))
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110, layout="constrained")
    for i, (label, runs) in enumerate(curves.items()):
        if len(runs) == 1:
            ax.plot(*runs[0], color=f"C{i}", lw=1.8, label=label)
            continue
        for steps, mean in runs:
            ax.plot(steps, mean, color=f"C{i}", lw=0.9, alpha=0.35)
        ax.plot(*mean_of_seeds(runs), color=f"C{i}", lw=2.0, label=f"{label}: mean of {len(runs)} seeds (each faint)")

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
