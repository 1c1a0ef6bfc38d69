"""A sweep's report: a per-game table, the aggregate normalised score with rliable's intervals, and one figure.

    python tools/report.py runs/paper                        # a folder of tools/sweep.py: <game>__<method>__<seed>/
    python tools/report.py runs/paper --released $PPG_RELEASED_CODE/phasic_policy_gradient/results --reps 50000

1. Per game and method: the mean over seeds of each seed's mean return over its last 100 episodes, at the last env
   step every seed of that game and method reached. Beside it, the released code's figure at the same step (the mean
   of its 3 runs; row i of a released progress-GAME.csv is at (i + 1) x 65,536 env steps) where the protocol matches:
   hard mode at the paper's batch in one process (--num-envs 256 --aux-mb-trajectories 16). Its results folder is
   --released, or $PPG_RELEASED_CODE/phasic_policy_gradient/results.
2. Over games, per method: the Procgen-normalised score (tools/scores.py, the runs' --distribution-mode) at the last
   step every run reached, as rliable's IQM and mean with 95% stratified-bootstrap confidence intervals (a runs x
   games matrix, a row a seed), and rliable's probability that one method beats the other (--compare, default
   ppg ppo). An interval needs at least 2 seeds of the method in every game (with one, the bootstrap has nothing to
   resample): with fewer the report gives the point estimate and says so.
3. One figure, the layout of the paper's main figure: the aggregate normalised score (--metric, default mean)
   against env steps, a line a method with its 95% interval band (where it has 2 seeds or more); its title gives the
   game count, the seeds a method, and which lines have bands.
Writes <folder>/report.md and <folder>/report.png (or --out STEM); prints the report. rliable is imported here only.
"""

import argparse
import glob
import os
import pathlib
import sys

import numpy as np
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from helptext import DefaultsHelpFormatter  # noqa: E402
from scores import NORMALISATION, normalised_score  # noqa: E402

STEPS_PER_RELEASED_ROW = 65_536  # the released code's 4 workers x 64 envs x 256 steps
MIN_SEEDS = 2  # a method's seeds in every game for an interval: with one, every bootstrap resample is the same


def count(n: int, noun: str) -> str:
    """'1 game', '2 games'."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def seeds_a_method(seeds: dict) -> str:
    """'3 seeds a method', or each method's count where they differ: 'seeds ppg 3, ppo 1'."""
    if not seeds:
        return "no method with a score in every game yet"
    if len(set(seeds.values())) == 1:
        return count(next(iter(seeds.values())), "seed") + " a method"
    return "seeds " + ", ".join(f"{m} {n}" for m, n in seeds.items())


def read_runs(folder: pathlib.Path) -> list:
    """Every run of a sweep folder: game, method, seed, flags, and its episodes' (steps, returns) and last step."""
    runs = []
    for job in sorted(folder.glob("*__*__*")):
        game, method, seed = job.name.rsplit("__", 2)
        if not seed.isdigit():  # a folder kept aside (bigfish__ppg__1.old) is not one of the sweep's runs
            print(f"{job.name}: not a <game>__<method>__<seed> folder, left out")
            continue
        found = sorted(glob.glob(f"{job}/runs/*/checkpoint.pt"))
        if not found:
            print(f"{job.name}: no checkpoint yet, left out")
            continue
        run_dir = os.path.dirname(found[-1])
        flags = torch.load(found[-1], map_location="cpu", weights_only=True)["args"]
        acc = EventAccumulator(run_dir, size_guidance={"scalars": 0})
        acc.Reload()
        tags = acc.Tags()["scalars"]
        episodes = (
            sorted(acc.Scalars("charts/episodic_return"), key=lambda e: e.step)
            if "charts/episodic_return" in tags
            else []
        )
        last = max((e.step for e in acc.Scalars("losses/value_loss")), default=0) if "losses/value_loss" in tags else 0
        runs.append(
            dict(
                game=game,
                method=method,
                seed=int(seed),
                flags=flags,
                steps=np.array([e.step for e in episodes]),
                returns=np.array([e.value for e in episodes]),
                last=last,
            )
        )
    return runs


def mean_return_at(run: dict, step: int, window: int = 100) -> float:
    """The mean return of the run's last `window` episodes up to `step` (NaN if none had ended)."""
    ended = run["returns"][run["steps"] <= step][-window:]
    return float(ended.mean()) if len(ended) else float("nan")


def released_return(results: pathlib.Path, method: str, game: str, step: int):
    """The released code's mean over its runs of EpRewMean at the row of `step`, or None (no such row or file)."""
    row, values = step // STEPS_PER_RELEASED_ROW - 1, []
    for path in sorted(results.glob(f"{method}-run*/progress-{game}.csv")):
        column = np.loadtxt(path, delimiter=",", skiprows=1, ndmin=1)
        if 0 <= row < len(column):
            values.append(column[row])
    return float(np.mean(values)) if values else None


def paper_protocol(run: dict) -> bool:
    flags = run["flags"]
    return flags["distribution_mode"] == "hard" and flags["num_envs"] == 256 and flags["aux_mb_trajectories"] == 16


def score_matrix(runs: list, method: str, games: list, step: int) -> np.ndarray:
    """(seeds, games) normalised scores of a method at `step`: the seeds every game has, in order."""
    seeds = sorted(
        set.intersection(*({r["seed"] for r in runs if r["method"] == method and r["game"] == g} for g in games))
    )
    matrix = np.full((len(seeds), len(games)), np.nan)
    for r in runs:
        if r["method"] == method and r["game"] in games and r["seed"] in seeds:
            ret = mean_return_at(r, step)
            matrix[seeds.index(r["seed"]), games.index(r["game"])] = normalised_score(
                r["game"], r["flags"]["distribution_mode"], ret
            )
    return matrix


def interval_estimates(score_dict: dict, reps: int, seed: int = 0):
    """rliable's IQM and mean over a runs x games matrix per method, with 95% stratified-bootstrap intervals:
    ({method: [iqm, mean]}, {method: 2 x 2 array of [lower, upper] rows for iqm and mean})."""
    from rliable import library as rly
    from rliable import metrics

    def iqm_and_mean(matrix):
        return np.array([metrics.aggregate_iqm(matrix), metrics.aggregate_mean(matrix)])

    np.random.seed(seed)  # rliable's resampling draws from numpy's global stream (not from its random_state)
    return rly.get_interval_estimates(score_dict, iqm_and_mean, reps=reps)


def probability_of_improvement(x: np.ndarray, y: np.ndarray, reps: int, seed: int = 0):
    """rliable's P(X > Y) over games, with its 95% stratified-bootstrap interval."""
    from rliable import library as rly
    from rliable import metrics

    np.random.seed(seed)  # as in interval_estimates
    point, interval = rly.get_interval_estimates({"x,y": (x, y)}, metrics.probability_of_improvement, reps=reps)
    return float(point["x,y"]), interval["x,y"].ravel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter)
    parser.add_argument("folder", type=pathlib.Path, help="a sweep's folder, runs/<name>")
    parser.add_argument(
        "--released",
        type=pathlib.Path,
        default=None,
        help="the released code's results folder (default: $PPG_RELEASED_CODE/phasic_policy_gradient/results)",
    )
    parser.add_argument("--compare", nargs=2, default=["ppg", "ppo"], metavar=("X", "Y"), help="P(X beats Y)")
    parser.add_argument("--metric", choices=("mean", "iqm"), default="mean", help="the figure's aggregate")
    parser.add_argument(
        "--reps",
        type=int,
        default=2000,
        help="bootstrap resamples of the intervals and P(X > Y) (the figure's bands: a tenth, at least 200); "
        "rliable's own default is 50,000",
    )
    parser.add_argument("--points", type=int, default=20, help="env-step points on the figure's curves")
    parser.add_argument("--out", default=None, help="the report's files: OUT.md and OUT.png (default: FOLDER/report)")
    opts = parser.parse_args()
    if opts.reps < 1:
        sys.exit(f"error: --reps must be at least 1 (got {opts.reps})")
    if opts.points < 2:
        sys.exit(f"error: --points must be at least 2: a curve needs two (got {opts.points})")
    if not opts.folder.is_dir():
        sys.exit(f"error: {opts.folder}: not a folder")
    runs = read_runs(opts.folder)
    if not runs:
        sys.exit(
            f"error: {opts.folder}: no run with a checkpoint (a tools/sweep.py folder holds <game>__<method>__<seed>/)"
        )
    released = opts.released
    if released is None and os.environ.get("PPG_RELEASED_CODE"):
        released = pathlib.Path(os.environ["PPG_RELEASED_CODE"]) / "phasic_policy_gradient" / "results"
    games, methods = sorted({r["game"] for r in runs}), sorted({r["method"] for r in runs})
    if not all("distribution_mode" in r["flags"] for r in runs):  # scores are normalised by Procgen's ranges
        sys.exit(f"error: {opts.folder}: Procgen sweeps only (an Atari run: tools/summarise_run.py, plot_runs.py)")
    modes = {r["flags"]["distribution_mode"] for r in runs}
    if len(modes) > 1:
        sys.exit(f"error: {opts.folder}: runs of both distribution modes ({sorted(modes)}): report each sweep alone")
    mode = modes.pop()
    if unknown := [g for g in games if g not in NORMALISATION[mode]]:
        sys.exit(f"error: {opts.folder}: {unknown} have no Procgen normalisation range")
    lines = [
        f"# Report of {opts.folder}",
        "",
        f"{count(len(runs), 'run')}: {count(len(games), 'game')} x methods {methods}, {mode} mode.",
        "",
    ]

    # 1. The per-game table
    header = "| game | " + " | ".join(f"{m} (seeds, step)" for m in methods)
    columns = [m for m in methods if m in ("ppg", "ppo")]
    protocol = all(paper_protocol(r) for r in runs) and released is not None and released.is_dir()
    header += "".join(f" | released {m}" for m in columns) if protocol else ""
    lines += [header + " |", "|" + "---|" * (header.count("|"))]
    for game in games:
        own_cells, released_cells = [], []
        for method in methods:
            own = [r for r in runs if r["game"] == game and r["method"] == method]
            step = min((r["last"] for r in own), default=0)
            means = [mean_return_at(r, step) for r in own]
            mean = f"{np.mean(means):.2f}" if own and not np.isnan(means).any() else "no episode ended in a seed"
            own_cells.append("-" if not own else f"{mean} ({len(own)}, {step:,})")
            if protocol and method in columns:
                found = released_return(released, method, game, step) if own else None
                released_cells.append("-" if found is None else f"{found:.2f}")
        lines.append(f"| {game} | " + " | ".join(own_cells + released_cells) + " |")
    if not protocol:
        why = (
            "no released results folder given"
            if released is None or not released.is_dir()
            else "the runs are not the paper's protocol (hard, --num-envs 256, --aux-mb-trajectories 16)"
        )
        lines += ["", f"(No released-code column: {why}.)"]

    # 2. The aggregate at the last step every run reached
    step = min(r["last"] for r in runs)
    score_dict = {m: score_matrix(runs, m, games, step) for m in methods}
    score_dict = {m: s for m, s in score_dict.items() if len(s) and not np.isnan(s).any()}
    seeds = {m: s.shape[0] for m, s in score_dict.items()}  # the seeds every game has, per method
    lines += [
        "",
        f"Aggregate {mode}-normalised score over the {count(len(games), 'game')} at {step:,} env steps (95% "
        f"stratified-bootstrap CIs, {opts.reps:,} resamples, where a method has {MIN_SEEDS} seeds or more):",
        "",
    ]
    lines += ["| method | seeds x games | IQM [95% CI] | mean [95% CI] |", "|---|---|---|---|"]
    if score_dict:
        points, intervals = interval_estimates(score_dict, opts.reps)
        for m in score_dict:
            (iqm_lo, mean_lo), (iqm_hi, mean_hi) = intervals[m]
            iqm, mean = f"{points[m][0]:.3f}", f"{points[m][1]:.3f}"
            if seeds[m] >= MIN_SEEDS:
                iqm, mean = f"{iqm} [{iqm_lo:.3f}, {iqm_hi:.3f}]", f"{mean} [{mean_lo:.3f}, {mean_hi:.3f}]"
            lines.append(f"| {m} | {seeds[m]} x {score_dict[m].shape[1]} | {iqm} | {mean} |")
    if few := [f"{m} has {count(n, 'seed')}" for m, n in seeds.items() if n < MIN_SEEDS]:
        lines += ["", f"No interval where a method has fewer than {MIN_SEEDS} seeds in every game ({', '.join(few)})."]
    x, y = opts.compare
    if x in score_dict and y in score_dict:
        if min(seeds[x], seeds[y]) < MIN_SEEDS:
            lines += ["", f"P({x} > {y}) needs more seeds: at least {MIN_SEEDS} of each method in every game."]
        elif score_dict[x].shape != score_dict[y].shape:
            lines += ["", f"P({x} > {y}) needs the same seeds x games of both ({seeds[x]} and {seeds[y]} seeds)."]
        else:
            p, (lo, hi) = probability_of_improvement(score_dict[x], score_dict[y], opts.reps)
            lines += ["", f"P({x} > {y}) = {p:.3f} [95% CI {lo:.3f}, {hi:.3f}] (rliable's probability of improvement)"]

    # 3. The figure
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = np.unique(np.linspace(0, step, opts.points + 1)[1:].astype(int))
    which = 0 if opts.metric == "iqm" else 1
    fig, ax = plt.subplots(figsize=(6, 4))
    banded = []  # the methods drawn with an interval band
    for m in sorted(score_dict):
        curve = {int(s): score_matrix(runs, m, games, s) for s in grid}
        curve = {s: v for s, v in curve.items() if not np.isnan(v).any()}  # steps where every run had an episode
        if not curve:
            continue
        points, intervals = interval_estimates({str(s): v for s, v in curve.items()}, max(opts.reps // 10, 200))
        xs = np.array(sorted(curve))
        ys = np.array([points[str(s)][which] for s in xs])
        lo, hi = (np.array([intervals[str(s)][k][which] for s in xs]) for k in (0, 1))
        ax.plot(xs, ys, label=m)
        if seeds[m] >= MIN_SEEDS:
            ax.fill_between(xs, lo, hi, alpha=0.25)
            banded.append(m)
    ax.set_xlabel("env steps")
    ax.set_ylabel(f"{'IQM' if which == 0 else 'mean'} normalised score ({mode})")
    title = f"{opts.folder.name}: {count(len(games), 'game')}, {seeds_a_method(seeds)}"
    if banded and len(banded) == len(ax.lines):
        title += "\nbands: 95% stratified-bootstrap CIs"
    elif banded:
        title += f"\nbands ({', '.join(banded)} only): 95% stratified-bootstrap CIs"
    ax.set_title(title, fontsize=10)
    if ax.lines:
        ax.legend()
    ax.grid(alpha=0.3)
    stem = pathlib.Path(opts.out) if opts.out else opts.folder / "report"
    fig.tight_layout()
    fig.savefig(f"{stem}.png", dpi=120)
    lines += ["", f"![aggregate normalised score against env steps]({stem.name}.png)"]
    pathlib.Path(f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"\nwritten to {stem}.md and {stem}.png")


if __name__ == "__main__":
    main()
