"""Plot runs' mean return over their last 100 (--window) finished episodes against env steps, into one PNG.

    python tools/plot_runs.py RUN_DIR [RUN_DIR ...] --out FILE.png [--labels L1 L2 ...] [--window 100] [--title T]
    python tools/plot_runs.py docs/logs/*ppg__1* docs/logs/*ppg__2* docs/logs/*ppo__1* docs/logs/*ppo__2* \
        --labels PPG PPG PPO PPO --out docs/breakout.png
    python tools/plot_runs.py docs/logs/generalization-cpu/*ppg* docs/logs/generalization-cpu/*ppo* \
        --labels PPG PPO --test --train-procgen ../train-procgen --game starpilot --out docs/generalization-cpu.png

Runs that share a label are seeds of one method: each seed's curve is drawn faint, and their mean (over the steps
all of them reached) bold. A label of one run is drawn bold alone. Each curve ends at the run's last finished
rollout (its last charts/SPS), so that a stopped run's curve does not reach into a rollout it did not finish (the
test envs log their episodes during each rollout). With --test, a second panel draws each run's test envs (the
unseen levels of a run with --num-levels above 0) beside the training levels. With --train-procgen, each panel also
draws, as a grey band, the spread (lowest to highest) of train-procgen's three stored PPO runs of --game under its
protocol (easy, 200 levels), up to the last env step of the runs: its CSVs' eprewmean is the same mean of the last
100 episodes of a worker (a checkout: git clone https://github.com/openai/train-procgen).
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
from scores import TRAIN_PROCGEN_RUNS  # noqa: E402

TAG = "charts/episodic_return"
TEST_TAG = "charts/test_episodic_return"  # the test envs of a run with --num-levels above 0


def steps_label(x: float, _pos=None) -> str:
    """100000 -> 100k, 1500000 -> 1.5M."""
    if abs(x) >= 1e6:
        return f"{x / 1e6:g}M"
    return f"{x / 1e3:g}k" if abs(x) >= 1e3 else f"{x:g}"


def trailing_mean(run_dir: str, window: int, tag: str = TAG):
    """(env steps, mean return of the last `window` episodes, fewer at the start), as summarise_run.py computes it."""
    if not os.path.isdir(run_dir):
        sys.exit(f"error: {run_dir}: not a folder")
    acc = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    acc.Reload()
    if tag not in acc.Tags()["scalars"]:
        sys.exit(f"error: {run_dir}: no {tag} scalars (no finished episode logged, or not a run folder)")
    episodes = sorted(acc.Scalars(tag), key=lambda e: e.step)  # several event files may interleave
    if "charts/SPS" in acc.Tags()["scalars"]:  # only to the last finished rollout
        last_rollout = max(e.step for e in acc.Scalars("charts/SPS"))
        episodes = [e for e in episodes if e.step <= last_rollout]
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


def train_procgen_spread(checkout: str, game: str, last_step: float) -> dict:
    """split -> (env steps, lowest, highest) of train-procgen's three runs' eprewmean, up to last_step."""
    from train_procgen import read_rows  # the tools' reader of its CSVs

    spread = {}
    for split in ("train", "test"):
        runs = []
        for run in TRAIN_PROCGEN_RUNS:
            path = pathlib.Path(checkout) / "train_procgen" / "results" / run / f"progress-{game}-{split}.csv"
            if not path.is_file():
                sys.exit(f"error: --train-procgen {checkout}: no {path.relative_to(checkout)} (a checkout of it?)")
            runs.append(read_rows(pathlib.Path(checkout), run, game, split))
        steps = runs[0][0][runs[0][0] <= last_step]  # its rows: one per update of 16,384 env steps
        values = np.array([np.interp(steps, *run) for run in runs])
        spread[split] = steps, values.min(axis=0), values.max(axis=0)
    return spread


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter)
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="runs/{run_name} folders")
    parser.add_argument("--out", required=True, help="the PNG to write")
    parser.add_argument("--labels", nargs="+", help="one legend label per run (default: the run folders' names)")
    parser.add_argument("--window", type=int, default=100, help="episodes averaged")
    parser.add_argument("--title", default=TAG, help="the figure's title")
    parser.add_argument("--test", action="store_true", help=f"a second panel: each run's {TEST_TAG}")
    parser.add_argument("--train-procgen", metavar="CHECKOUT", help="a checkout of openai/train-procgen: its PPO runs")
    parser.add_argument("--game", help="the Procgen game of the runs, with --train-procgen")
    args = parser.parse_args()
    if (args.train_procgen is None) != (args.game is None):
        parser.error("--train-procgen and --game go together")
    labels = args.labels or [os.path.basename(os.path.abspath(d)) for d in args.run_dirs]
    if len(labels) != len(args.run_dirs):
        parser.error(f"--labels got {len(labels)} labels for {len(args.run_dirs)} runs")
    if args.window < 1:
        parser.error("--window must be at least 1")

    curves = {}  # (label, test) -> [(steps, trailing mean)] of its runs
    for run_dir, label in zip(args.run_dirs, labels):
        curves.setdefault((label, False), []).append(trailing_mean(run_dir, args.window))
        if args.test:
            curves.setdefault((label, True), []).append(trailing_mean(run_dir, args.window, TEST_TAG))
    # With --test: two panels side by side, the training levels and the unseen levels, on one scale
    panels = [False, True] if args.test else [False]
    width = 11 if args.test else 7
    fig, axes = plt.subplots(
        1, len(panels), figsize=(width, 4), dpi=110, layout="constrained", sharey=True, squeeze=False
    )
    spread = {}
    if args.train_procgen:
        last_step = max(steps[-1] for runs in curves.values() for steps, _ in runs)
        spread = train_procgen_spread(args.train_procgen, args.game, last_step)
    colors = {label: f"C{i}" for i, label in enumerate(dict.fromkeys(labels))}
    for ax, test in zip(axes[0], panels):
        if spread:
            steps, low, high = spread["test" if test else "train"]
            label = "train-procgen's PPO: its 3 runs, lowest to highest"
            ax.fill_between(steps, low, high, color="0.6", alpha=0.4, lw=0, label=label)
        for (label, of_test), runs in curves.items():
            if of_test != test:
                continue
            color = colors[label]
            if len(runs) == 1:
                ax.plot(*runs[0], color=color, lw=1.8, label=label)
                continue
            for steps, mean in runs:
                ax.plot(steps, mean, color=color, lw=0.9, alpha=0.35)
            ax.plot(*mean_of_seeds(runs), color=color, lw=2.0, label=f"{label}: mean of {len(runs)} seeds (each faint)")
        ax.xaxis.set_major_formatter(FuncFormatter(steps_label))
        ax.set_xlabel("env steps")
        ax.grid(alpha=0.3)
        ax.legend(loc="best", frameon=True)
        if args.test:
            ax.set_title("unseen levels (the test envs)" if test else "training levels")
    axes[0][0].set_ylabel(f"return (mean of last {args.window} episodes)")
    if args.test:
        fig.suptitle(args.title)
    else:
        axes[0][0].set_title(args.title)
    fig.savefig(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
