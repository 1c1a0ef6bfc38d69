"""A sweep's report beside the released runs: a per-game table, the mean normalised score with rliable's intervals,
and one figure in the layout of the released graph.py.

    python tools/report.py runs/paper                       # a folder of tools/sweep.py: <game>__<method>__<seed>/
    python tools/report.py runs/e-aux --experiment e-aux    # one of tools/experiments.py's seven experiments
    python tools/report.py --released-only                  # the released runs alone: every experiment at 100M
    python tools/report.py --released-only --experiment e-aux --out e-aux   # one experiment, per game, a figure
    python tools/report.py runs/generalization              # runs on a set of levels: train, test, train-procgen's PPO

The released results (phasic_policy_gradient/results/<folder>/progress-<game>.csv of the authors' code: hard mode,
100M env steps, one EpRewMean row every 65,536 env steps) are --released, or those of the released code where the
tests find it ($PPG_RELEASED_CODE, else ../phasic-policy-gradient, where the README clones it). A method is a variant
of tools/experiments.py by its name (ppg, ppo, e-aux-2, ...); its released figures stand beside its runs only where
each flag is the released value (RELEASED_RUN, the variant's own flags over it) or one of SAME_RUN's, and the runs are
ppg_procgen.py's own (a copy's runs are reported, without the released figures).

main() prints the report in steps, a function each: heading, 1. per_game_table, released_column_notes, 2. aggregate,
aggregate_table, ranking, early_rows_notes, comparison (--compare), 3. our_curves, draw. Writes <folder>/report.md and
<folder>/report.png (or --out STEM); prints the report. rliable is imported here only.
"""

import argparse
import functools
import glob
import logging
import math
import os
import pathlib
import sys
import types

import numpy as np
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

# A resumed run's event files hold what its stopped start logged past its checkpoint, which the resume's purge marker
# drops, as it should: TensorBoard warns of it ("Detected out of order event.step") at every read, telling a reader
# nothing
logging.getLogger("tensorboard").setLevel(logging.ERROR)

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from checkpoints import ROOT, load_script, retired_flags  # noqa: E402
from experiments import EXPERIMENTS, RELEASED_EXPERIMENTS  # noqa: E402
from helptext import DefaultsHelpFormatter  # noqa: E402
from released import CLONE_COMMAND, released_root  # noqa: E402
from scores import (  # noqa: E402
    NORMALISATION,
    TRAIN_PROCGEN_AT,
    TRAIN_PROCGEN_COMMIT,
    TRAIN_PROCGEN_PPO,
    TRAIN_PROCGEN_REPOSITORY,
    normalised_score,
    train_procgen_score,
)

STEPS_PER_RELEASED_ROW = 65_536  # the released code's 4 workers x 64 envs x 256 steps
FIRST_VALID = 10  # the released graph.py drops each CSV's first 10 rows (its episode buffers are still filling)
SMOOTHING = 0.9  # ... and smooths the rest by an exponential moving average of this weight
FINAL_ROWS = 10  # the released figure "at 100M": the mean of each CSV's last 10 rows (99.4M to 100M env steps)
WINDOW = 100  # episodes a run's figure averages (the released code's EpRewMean: 100 episodes of each worker)
MIN_SEEDS = 2  # a method's seeds in every game for an interval: with one, every bootstrap resample is the same
GAMES = sorted(NORMALISATION["hard"])  # the 16 Procgen games, each a released CSV
TEST_TAG = "charts/test_episodic_return"  # a run with --num-levels > 0: the finished episodes of its test envs


def test_envs_of(flags: dict) -> str:
    """A run's number of test envs: --num-test-envs, whose unset value means as many as --num-envs."""
    if "num_test_envs" not in flags:
        return "not in its checkpoint"
    return str(flags["num_envs"] if flags["num_test_envs"] is None else flags["num_test_envs"])


# Every flag of ppg_procgen.py that makes a run the released one, at the released train.py's values (its README runs
# `mpiexec -np 4`: 4 workers x 64 envs, 4 x 4 aux trajectories, in one process 256 and 16); a variant's own flags
# (tools/experiments.py) replace these.
RELEASED_RUN = dict(distribution_mode="hard", num_levels=0, start_level=0)  # all levels from 0 (envs.py's defaults)
RELEASED_RUN.update(num_envs=256, aux_mb_trajectories=16, num_steps=256, gamma=0.999, gae_lambda=0.95)
RELEASED_RUN.update(learning_rate=5e-4, anneal_lr=False)  # lr and aux_lr, constant
# A flag that some versions lacked, with the value a checkpoint of such a version ran at: no --anneal-lr, a constant rate
ABSENT_MEANS = dict(anneal_lr=False)
RELEASED_RUN.update(num_minibatches=8, clip_coef=0.2, kl_penalty=0.0, ent_coef=0.01)
RELEASED_RUN.update(norm_reward=True, reward_norm_gamma=0.99, max_grad_norm=0.0)  # reward_normalizer.py; no clipping
RELEASED_RUN.update(arch="dual", n_pi=32, e_pi=1, e_v=1, e_aux=6, beta_clone=1.0)
RELEASED_RUN.update(aux_kl_stop=0.0, precision="fp32")  # no KL guard in the released code; float32 throughout
# The flags that do not make a run another run, each with why. Any other flag in a run's checkpoint (a flag added
# later, an Atari flag) is a difference: tests/test_report.py holds every Args field of both scripts to one of the two.
SAME_RUN = dict(seed="a seed is one of the runs", env_id="the game: a run a game", exp_name="the run's name")
SAME_RUN.update(total_timesteps="the budget: a shorter run is compared at its own step", resume="the same run, resumed")
SAME_RUN.update(track="logging", wandb_project_name="logging", wandb_entity="logging", cuda="the device")
SAME_RUN.update(micro_batch_size="chunks of a minibatch: the same update in another summation order")
SAME_RUN.update(num_test_envs="test envs watch unseen levels: the run trains the same, bit for bit")
# variant name -> (flags, released results folders), over the seven experiments (a name means one variant in all)
VARIANTS = {
    name: (flags, exp["released"][name])
    for exp in RELEASED_EXPERIMENTS.values()
    for name, flags in exp["variants"].items()
}


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


def released_flags(variant: str) -> dict:
    """The flags of the released runs of `variant`: RELEASED_RUN with the variant's own flags ("--e-aux 2") over it."""
    flags, words = dict(RELEASED_RUN), VARIANTS[variant][0].split()
    for name, value in zip(words[::2], words[1::2]):
        key = name[2:].replace("-", "_")
        flags[key] = type(RELEASED_RUN[key])(value)  # the type of the released value: "3" -> 3, "0" -> 0.0
    return flags


@functools.cache
def retired() -> dict:
    """ppg_procgen.py's retired flags (RETIRED_FLAGS): older checkpoints hold them, at the one value this version has."""
    return retired_flags(load_script(ROOT / "ppg_procgen.py"))


def differences_from_released(run: dict) -> list:
    """Why a run is not the released run of its method: ['--num-envs 64 (released: 256)', ...]; [] if it is. A retired
    flag at the value it is fixed at is the released value; a run of a copy of the script (its `script`) is none."""
    if run["method"] not in VARIANTS:
        return [f"no released variant is named {run['method']}"]
    released, differences = released_flags(run["method"]), []
    released.update({name: value for name, value in retired().items() if name in run["flags"]})
    if run.get("script", "ppg_procgen.py") != "ppg_procgen.py":  # a hacked copy: its code is not the released code
        differences.append(f"--script {run['script']} (released: ppg_procgen.py)")
    for name in [*released, *(n for n in run["flags"] if n not in released and n not in SAME_RUN)]:
        have = run["flags"].get(name, ABSENT_MEANS.get(name, "not in its checkpoint"))
        want = released.get(name, "no such flag")
        if have != want:
            differences.append(f"--{name.replace('_', '-')} {have} (released: {want})")
    return differences


def read_runs(folder: pathlib.Path, methods=None) -> list:
    """Every run of a sweep folder: game, method, seed, flags, and its episodes' (steps, returns) and last step.
    `methods`: the methods to read (None: all)."""
    runs = []
    for job in sorted(folder.glob("*__*__*")):
        game, method, seed = job.name.rsplit("__", 2)
        if not seed.isdigit():  # a folder kept aside (bigfish__ppg__1.old) is not one of the sweep's runs
            print(f"{job.name}: not a <game>__<method>__<seed> folder, left out")
            continue
        if methods is not None and method not in methods:
            print(f"{job.name}: {method} is not a variant of the experiment, left out")
            continue
        found = sorted(glob.glob(f"{job}/runs/*/checkpoint.pt"))
        if not found:
            print(f"{job.name}: no checkpoint yet, left out")
            continue
        state = torch.load(found[-1], map_location="cpu", weights_only=True)
        flags = state["args"]
        acc = EventAccumulator(os.path.dirname(found[-1]), size_guidance={"scalars": 0})
        acc.Reload()
        tags = acc.Tags()["scalars"]
        episodes = acc.Scalars("charts/episodic_return") if "charts/episodic_return" in tags else []
        episodes = sorted(episodes, key=lambda e: e.step)
        last = max((e.step for e in acc.Scalars("losses/value_loss")), default=0) if "losses/value_loss" in tags else 0
        steps, returns = np.array([e.step for e in episodes]), np.array([e.value for e in episodes])
        run = dict(game=game, method=method, seed=int(seed), flags=flags, steps=steps, returns=returns, last=last)
        tests = sorted(acc.Scalars(TEST_TAG), key=lambda e: e.step) if TEST_TAG in tags else []  # unseen levels
        run.update(test_steps=np.array([e.step for e in tests]), test_returns=np.array([e.value for e in tests]))
        runs.append(dict(run, script=state.get("script", "ppg_procgen.py")))  # a copy's own name
    return runs


def mean_return_at(run: dict, step: int, window: int = WINDOW) -> float:
    """The mean return of the run's last `window` episodes up to `step` (NaN if none had ended)."""
    ended = run["returns"][run["steps"] <= step][-window:]
    return float(ended.mean()) if len(ended) else float("nan")


def episodes_at(run: dict, step: int) -> int:
    """How many episodes the run's figure at `step` averages: those it had ended by then, WINDOW at most."""
    return min(WINDOW, int((run["steps"] <= step).sum()))


def episode_counts(counts: list) -> str:
    """'100' where every run's figure averages WINDOW episodes, else the fewest to the most, marked: '4-11 < 100'."""
    low, high = min(counts), max(counts)
    if low >= WINDOW:
        return str(WINDOW)
    return f"{low if low == high else f'{low}-{high}'} < {WINDOW}"


def released_rows(results: pathlib.Path, folders: list, game: str):
    """(runs, rows) EpRewMean of the variant's released runs in `game`, or None where a CSV is missing."""
    paths = [results / folder / f"progress-{game}.csv" for folder in folders]
    if not all(path.is_file() for path in paths):
        return None
    columns = [np.loadtxt(path, delimiter=",", skiprows=1, ndmin=1) for path in paths]
    rows = min(len(c) for c in columns)
    return np.array([c[:rows] for c in columns])


def released_return(results: pathlib.Path, method: str, game: str, step: int):
    """The mean over the released runs of `method` of EpRewMean at the row of `step`, or None (no such row or file)."""
    rows = released_rows(results, VARIANTS[method][1], game) if method in VARIANTS else None
    row = step // STEPS_PER_RELEASED_ROW - 1
    return None if rows is None or not 0 <= row < rows.shape[1] else float(rows[:, row].mean())


def released_matrix(results: pathlib.Path, method: str, games: list, step=None):
    """(released runs, games) hard-normalised scores of `method`: at the row of `step`, or (None) the mean of each
    CSV's last FINAL_ROWS rows; None where a CSV or the row is missing."""
    columns = []
    for game in games:
        rows = released_rows(results, VARIANTS[method][1], game)
        row = None if step is None else step // STEPS_PER_RELEASED_ROW - 1
        if rows is None or (row is not None and not 0 <= row < rows.shape[1]):
            return None
        values = rows[:, -FINAL_ROWS:].mean(axis=1) if row is None else rows[:, row]
        columns.append(normalised_score(game, "hard", values))
    return np.array(columns).T


def common_seeds(runs: list, method: str, games: list) -> list:
    """The seeds of a method that have a run in every game, in order."""
    return sorted(
        set.intersection(*({r["seed"] for r in runs if r["method"] == method and r["game"] == g} for g in games))
    )


def score_matrix(runs: list, method: str, games: list, step: int) -> np.ndarray:
    """(seeds, games) normalised scores of a method at `step`: the seeds every game has, in order."""
    seeds = common_seeds(runs, method, games)
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


def with_interval(point: float, interval, runs: int) -> str:
    """'0.754 [0.741, 0.766]' where the figure has MIN_SEEDS runs or more, else '0.754'."""
    return f"{point:.3f} [{interval[0]:.3f}, {interval[1]:.3f}]" if runs >= MIN_SEEDS else f"{point:.3f}"


def smoothed(values: np.ndarray, weight: float = SMOOTHING) -> np.ndarray:
    """An exponential moving average along the last axis that starts at the first value (the released graph.py's)."""
    out = np.array(values, dtype=float)
    for i in range(1, out.shape[-1]):
        out[..., i] = weight * out[..., i - 1] + (1 - weight) * out[..., i]
    return out


def released_curve(results: pathlib.Path, method: str, games: list, last_step: int, metric: int):
    """(steps, values) of the released runs as the released graph.py draws them, up to `last_step`: rows from
    FIRST_VALID on, smoothed. One game: the mean EpRewMean; several: the aggregate normalised score (metric 0 IQM,
    1 mean over the runs x games matrix of each row). None where a CSV is missing or no row is drawn yet."""
    from rliable import metrics

    stacks = [released_rows(results, VARIANTS[method][1], game) for game in games]
    if any(rows is None for rows in stacks):
        return None
    rows = min(min(rows.shape[1] for rows in stacks), last_step // STEPS_PER_RELEASED_ROW)
    if rows <= FIRST_VALID:
        return None
    if len(games) == 1:
        values = stacks[0][:, FIRST_VALID:rows].mean(axis=0)
    else:
        scores = np.stack([normalised_score(g, "hard", s[:, FIRST_VALID:rows]) for g, s in zip(games, stacks)], axis=1)
        aggregate = metrics.aggregate_iqm if metric == 0 else metrics.aggregate_mean
        values = np.array([aggregate(scores[:, :, i]) for i in range(scores.shape[2])])
    return (np.arange(FIRST_VALID, rows) + 1) * STEPS_PER_RELEASED_ROW, smoothed(values)


def draw(path, title: str, games: list, methods: list, ours: dict, results, released: list, metric: int, end, mode):
    """The figure in the released graph.py's layout: a square grid of per-game panels and, beside it, the aggregate
    normalised score; a colour a method, ours solid (its band where `ours` gives one), dashed the released runs of the
    methods in `released`, up to env step `end`.
    ours: {method: {"games": {game: (steps, means)}, "aggregate": (steps, values, lows, highs or None)}}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    side = math.ceil(math.sqrt(len(games)))
    fig = plt.figure(figsize=(5 * side + 2, 2.6 * side + 1))
    grid = fig.add_gridspec(side, 2 * side)
    panels = {game: fig.add_subplot(grid[i // side, i % side]) for i, game in enumerate(games)}
    aggregate = fig.add_subplot(grid[:, side:])
    colours = {m: f"C{i % 10}" for i, m in enumerate(methods)}
    for m in methods:
        drawn = ours.get(m)
        for game, ax in panels.items():
            if drawn and game in drawn["games"]:
                ax.plot(*drawn["games"][game], color=colours[m])
            if m in released and (curve := released_curve(results, m, [game], end, metric)):
                ax.plot(curve[0] / 1e6, curve[1], color=colours[m], linestyle="--")
        if drawn and drawn["aggregate"]:
            xs, ys, lows, highs = drawn["aggregate"]
            aggregate.plot(xs, ys, color=colours[m], label=m)
            if lows is not None:
                aggregate.fill_between(xs, lows, highs, color=colours[m], alpha=0.25)
        if m in released and (curve := released_curve(results, m, games, end, metric)):
            aggregate.plot(curve[0] / 1e6, curve[1], color=colours[m], linestyle="--", label=f"{m}, released")
    for game, ax in panels.items():
        ax.set_title(game, fontsize=10)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    aggregate.set_xlabel("env steps (M)")
    aggregate.set_ylabel(f"{'IQM' if metric == 0 else 'mean'} normalised score ({mode}, {count(len(games), 'game')})")
    aggregate.set_title(title, fontsize=10)
    if aggregate.lines:
        aggregate.legend(fontsize=8)
    aggregate.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def released_results(given) -> tuple:
    """(the released results folder, "") or (None, why not): --released, else those of the released code where the
    tests find it (released_root: $PPG_RELEASED_CODE, else beside the checkout, where the README clones it)."""
    if given is not None:
        return given, ""  # a folder: parse_options checked it
    root, why = released_root()
    if root is None:
        return None, why
    results = root / "phasic_policy_gradient" / "results"
    return (results, "") if results.is_dir() else (None, f"{root} holds no phasic_policy_gradient/results")


def released_only(opts, results: pathlib.Path) -> None:
    """The released runs alone: each variant's mean normalised score at 100M over the 16 games (and with --experiment,
    its per-game returns and the figure)."""
    names = [opts.experiment] if opts.experiment else list(RELEASED_EXPERIMENTS)
    final = {v: released_matrix(results, v, GAMES) for name in names for v in EXPERIMENTS[name]["variants"]}
    if missing := [v for v, matrix in final.items() if matrix is None]:
        sys.exit(f"error: {results}: no CSV of every game for {missing} (a released results folder holds them)")
    points, intervals = interval_estimates(final, opts.reps)
    rows = min(released_rows(results, VARIANTS[v][1], g).shape[1] for v in final for g in GAMES)
    first, last = (rows - FINAL_ROWS + 1) * STEPS_PER_RELEASED_ROW, rows * STEPS_PER_RELEASED_ROW
    lines = [
        "# The released runs at 100M env steps",
        "",
        f"Hard mode, the {len(GAMES)} games. A run's figure in a game: the mean of its CSV's last {FINAL_ROWS} rows "
        f"(EpRewMean at {first:,} to {last:,} env steps, each row the mean of the last {WINDOW} episodes of each of "
        f"the 4 workers), normalised by the Procgen paper's hard ranges; a variant's score: the mean over its runs "
        f"and the games (IQM: rliable's), with 95% stratified-bootstrap CIs ({opts.reps:,} resamples) where it has "
        f"{MIN_SEEDS} runs or more.",
        "",
        "| experiment | variant | released runs | mean [95% CI] | IQM [95% CI] |",
        "|---|---|---|---|---|",
    ]
    for name in names:
        for v in EXPERIMENTS[name]["variants"]:
            runs = final[v].shape[0]
            iqm, mean = (with_interval(points[v][k], intervals[v][:, k], runs) for k in (0, 1))
            lines.append(f"| {name} | {v} | {runs} | {mean} | {iqm} |")
    lines += ["", "| experiment | mean normalised score at 100M, a variant each |", "|---|---|"]
    for name in names:
        cells = ", ".join(f"{v} {points[v][1]:.3f}" for v in EXPERIMENTS[name]["variants"])
        lines.append(f"| {name} | {cells} |")
    if opts.experiment:
        variants = list(EXPERIMENTS[opts.experiment]["variants"])
        lines += [
            "",
            f"EpRewMean per game (the mean of each CSV's last {FINAL_ROWS} rows, over the variant's runs):",
            "",
        ]
        lines += ["| game | " + " | ".join(variants) + " |", "|---|" + "---|" * len(variants)]
        for game in GAMES:
            cells = [f"{released_rows(results, VARIANTS[v][1], game)[:, -FINAL_ROWS:].mean():.2f}" for v in variants]
            lines.append(f"| {game} | " + " | ".join(cells) + " |")
    if opts.out:
        if opts.experiment:
            title = f"the released runs of {opts.experiment}\nfirst {FIRST_VALID} rows dropped, smoothed {SMOOTHING}"
            metric, end = (0 if opts.metric == "iqm" else 1), rows * STEPS_PER_RELEASED_ROW
            draw(f"{opts.out}.png", title, GAMES, list(final), {}, results, list(final), metric, end, "hard")
            lines += ["", f"![the released runs]({pathlib.Path(opts.out).name}.png)"]
        pathlib.Path(f"{opts.out}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def parse_options() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter)
    parser.add_argument("folder", type=pathlib.Path, nargs="?", help="a sweep's folder, runs/<name>")
    parser.add_argument("--experiment", choices=list(EXPERIMENTS), help="report the variants of this experiment")
    parser.add_argument("--released-only", action="store_true", help="the released runs alone, without a folder")
    where = "the released code's results folder (default: those of $PPG_RELEASED_CODE or ../phasic-policy-gradient)"
    parser.add_argument("--released", type=pathlib.Path, help=where)
    parser.add_argument("--compare", nargs=2, default=["ppg", "ppo"], metavar=("X", "Y"), help="P(X beats Y)")
    parser.add_argument("--metric", choices=("mean", "iqm"), default="mean", help="the figure's aggregate")
    reps = "bootstrap resamples of the intervals and P(X > Y) (the figure's bands: a tenth, at least 200); rliable's"
    parser.add_argument("--reps", type=int, default=2000, help=reps + " own default is 50,000")
    parser.add_argument("--points", type=int, default=20, help="env-step points on the figure's curves")
    parser.add_argument("--out", help="the report's files: OUT.md and OUT.png (default: FOLDER/report)")
    opts = parser.parse_args()
    if opts.reps < 1:
        sys.exit(f"error: --reps must be at least 1 (got {opts.reps})")
    if opts.points < 2:
        sys.exit(f"error: --points must be at least 2: a curve needs two (got {opts.points})")
    if opts.released is not None and not opts.released.is_dir():
        sys.exit(
            f"error: --released {opts.released}: not a folder (the released code's phasic_policy_gradient/results)"
        )
    if opts.released_only and opts.folder is not None:
        sys.exit(f"error: --released-only reports no folder ({opts.folder}): drop one of them")
    if not opts.released_only and opts.folder is None:
        sys.exit("error: no folder given: tools/report.py runs/<name> (or --released-only)")
    if opts.released_only and opts.experiment and opts.experiment not in RELEASED_EXPERIMENTS:
        sys.exit(f"error: --released-only: experiment {opts.experiment} has no released runs (report a folder of it)")
    return opts


def read_sweep(opts) -> tuple:
    """(runs, games, methods, distribution mode) of the folder, in the report's order; stops where it cannot report."""
    if not opts.folder.is_dir():
        sys.exit(f"error: {opts.folder}: not a folder")
    variants = list(EXPERIMENTS[opts.experiment]["variants"]) if opts.experiment else None
    runs = read_runs(opts.folder, variants)
    if not runs:
        sys.exit(
            f"error: {opts.folder}: no run with a checkpoint (a tools/sweep.py folder holds <game>__<method>__<seed>/)"
        )
    present = {r["method"] for r in runs}
    methods = [m for m in variants if m in present] if variants else sorted(present)
    if not all("distribution_mode" in r["flags"] for r in runs):  # scores are normalised by Procgen's ranges
        sys.exit(f"error: {opts.folder}: Procgen sweeps only (an Atari run: tools/summarise_run.py, plot_runs.py)")
    modes = {r["flags"]["distribution_mode"] for r in runs}
    if len(modes) > 1:
        sys.exit(f"error: {opts.folder}: runs of both distribution modes ({sorted(modes)}): report each sweep alone")
    games, mode = sorted({r["game"] for r in runs}), modes.pop()
    if unknown := [g for g in games if g not in NORMALISATION[mode]]:
        sys.exit(f"error: {opts.folder}: {unknown} have no Procgen normalisation range")
    return runs, games, methods, mode


def heading(opts, runs: list, games: list, methods: list, mode: str) -> list:
    """The report's title, what it holds, and how each figure of ours and of the released runs is made."""
    experiment = f" (experiment {opts.experiment})" if opts.experiment else ""
    return [
        f"# Report of {opts.folder}{experiment}",
        "",
        f"{count(len(runs), 'run')}: {count(len(games), 'game')} x methods {methods}, {mode} mode.",
        "",
        f"Ours: a run's mean return over the episodes it had ended by the step, the last {WINDOW} at most (each figure "
        f"says how many, < {WINDOW} marking fewer), a method's the mean over its seeds. Released: EpRewMean at the row "
        f"of the step (a row: the last {WINDOW} episodes of each of the released code's 4 workers), the mean over the "
        f"variant's released runs; at 100M: the mean of each CSV's last {FINAL_ROWS} rows.",
        "",
    ]


def per_game_table(runs: list, games: list, methods: list, results, beside: list) -> tuple:
    """1. A row a game: each method's mean over its seeds at the last step they all reached, and the released figure
    beside the methods in `beside`. (lines, the steps the released figures are read at)."""
    header = "| game | " + " | ".join(
        f"{m} (seeds, step, episodes a seed)" + (f" | {m} released" if m in beside else "") for m in methods
    )
    lines = [header + " |", "|" + "---|" * (header.count("|"))]
    released_steps, marked = [], False  # marked: a figure of < WINDOW episodes
    for game in games:
        cells = []
        for method in methods:
            own = [r for r in runs if r["game"] == game and r["method"] == method]
            step = min((r["last"] for r in own), default=0)
            means = [mean_return_at(r, step) for r in own]
            mean = f"{np.mean(means):.2f}" if own and not np.isnan(means).any() else "no episode ended in a seed"
            episodes = episode_counts([episodes_at(r, step) for r in own]) if own else ""
            marked = marked or "<" in episodes
            cells.append("-" if not own else f"{mean} ({len(own)}, {step:,}, {episodes})")
            if method in beside:
                found = released_return(results, method, game, step) if own else None
                cells.append("-" if found is None else f"{found:.2f}")
                released_steps += [step] if own else []
        lines.append(f"| {game} | " + " | ".join(cells) + " |")
    if marked:
        lines += [
            "",
            f"(A figure marked < {WINDOW} averages fewer than {WINDOW} episodes in a seed: by that step the run had "
            f"not ended {WINDOW}, so it is not the {WINDOW}-episode mean of the others.)",
        ]
    return lines, released_steps


def released_column_notes(methods: list, differences: dict, missing: str) -> list:
    """Why a method has no released column: no released results (`missing` says why), or runs not the released run."""
    if missing:
        return ["", f"(No released column: {missing}.)"]
    why = {
        m: f"(No released column beside {m}: its runs are not the released run: {'; '.join(d)}.)"
        for m, d in differences.items()
    }
    return [line for m in methods if differences[m] for line in ("", why[m])]


def aggregate(runs: list, games: list, methods: list, reps: int) -> types.SimpleNamespace:
    """2. At the last step every run reached, a method's seeds x games matrix of normalised scores (of its seeds with
    a run in every game; what is left out says why), the episodes a run averages, rliable's IQM and mean, intervals."""
    step = min(r["last"] for r in runs)
    scores, left_out, counts = {}, [], {}
    for m in methods:
        mine = [r for r in runs if r["method"] == m]
        kept, out = common_seeds(runs, m, games), f"{m} is left out of the aggregate"
        if missing := [g for g in games if not any(r["game"] == g for r in mine)]:
            left_out.append(f"{out}: no seed has a run in every game (none in {', '.join(missing)}).")
            continue
        if not kept:
            left_out.append(f"{out}: no seed has a run in every game.")
            continue
        for seed in sorted({r["seed"] for r in mine} - set(kept)):
            lacks = [g for g in games if not any(r["game"] == g and r["seed"] == seed for r in mine)]
            left_out.append(f"{m} seed {seed} is left out of the aggregate: it has no run in {', '.join(lacks)}.")
        mine = [r for r in mine if r["seed"] in kept]
        if empty := [f"{r['game']} seed {r['seed']}" for r in mine if episodes_at(r, step) == 0]:
            left_out.append(f"{out}: no episode had ended by {step:,} env steps in {', '.join(empty)}.")
            continue
        scores[m] = score_matrix(runs, m, games, step)
        counts[m] = [episodes_at(r, step) for r in mine]
    agg = types.SimpleNamespace(step=step, scores=scores, counts=counts, left_out=left_out)
    agg.seeds = {m: s.shape[0] for m, s in scores.items()}  # the seeds every game has, per method
    agg.short = {m: sum(c < WINDOW for c in counts[m]) for m in scores}  # runs of fewer than WINDOW episodes
    agg.banded = {m: agg.seeds[m] >= MIN_SEEDS and not agg.short[m] for m in scores}  # those with an interval
    agg.points, agg.intervals = interval_estimates(scores, reps) if scores else ({}, {})
    return agg


def aggregate_table(agg, games: list, mode: str, results, beside: list, reps: int) -> list:
    """2. A row a method: its seeds x games, episodes a run, IQM and mean (intervals where banded), and the released
    runs' mean over the same games at the same step and at 100M; then what was left out and why."""
    lines = [
        "",
        f"Aggregate {mode}-normalised score over the {count(len(games), 'game')} at {agg.step:,} env steps (95% "
        f"stratified-bootstrap CIs, {reps:,} resamples, where a method has {MIN_SEEDS} seeds or more); the "
        f"released runs over the same games, at the same step and at 100M:",
        "",
        "| method | seeds x games | episodes a run | IQM [95% CI] | mean [95% CI] | released mean, same step | "
        "released mean at 100M |",
        "|---|---|---|---|---|---|---|",
    ]
    released_now = {m: released_matrix(results, m, games, agg.step) for m in agg.scores if m in beside}
    released_final = {m: released_matrix(results, m, games) for m in agg.scores if m in beside}
    released_final = {m: s for m, s in released_final.items() if s is not None}
    final_points, final_intervals = interval_estimates(released_final, reps) if released_final else ({}, {})
    for m in agg.scores:
        runs = agg.seeds[m] if agg.banded[m] else 0  # intervals[m][:, k]: [lower, upper] of the IQM (0), mean (1)
        iqm, mean = (with_interval(agg.points[m][k], agg.intervals[m][:, k], runs) for k in (0, 1))
        now = "-" if released_now.get(m) is None else f"{released_now[m].mean():.3f}"
        final = "-"
        if m in final_points:
            final = with_interval(final_points[m][1], final_intervals[m][:, 1], released_final[m].shape[0])
        matrix = f"{agg.seeds[m]} x {agg.scores[m].shape[1]}"
        lines.append(f"| {m} | {matrix} | {episode_counts(agg.counts[m])} | {iqm} | {mean} | {now} | {final} |")
    return lines + [line for why in agg.left_out for line in ("", why)]


def ranking(agg) -> list:
    """Why there is no interval or no ranking (too few seeds, runs too short), or the methods ranked by the mean."""
    few = [f"{m} has {count(n, 'seed')}" for m, n in agg.seeds.items() if n < MIN_SEEDS]
    shorts = [f"{m}: {agg.short[m]} of {len(agg.counts[m])} runs" for m in agg.scores if agg.short[m]]
    lines = []
    if few:
        lines += ["", f"No interval where a method has fewer than {MIN_SEEDS} seeds in every game ({', '.join(few)})."]
    if shorts:
        lines += [
            "",
            f"No interval where a run had ended fewer than {WINDOW} episodes by {agg.step:,} env steps "
            f"({'; '.join(shorts)}).",
            "",
            f"Ranking: none, the runs are too short: fewer than {WINDOW} episodes a run by {agg.step:,} env steps.",
        ]
    elif few:
        lines += ["", f"Ranking: none, too few seeds: {', '.join(few)} in every game (an interval needs {MIN_SEEDS})."]
    elif len(agg.scores) > 1:
        order = sorted(agg.scores, key=lambda m: -agg.points[m][1])
        ranks = order[0]
        for above, below in zip(order, order[1:]):  # neighbours apart where their intervals do not overlap
            ranks += f" {'>' if agg.intervals[above][0][1] > agg.intervals[below][1][1] else '~'} {below}"
        lines += ["", f"Ranking by the mean (~: their 95% intervals overlap, so these runs do not order them): {ranks}"]
    return lines


def early_rows_notes(released_steps: list) -> list:
    """Where a released figure was read before the CSVs' first row, or from the rows the released graph.py drops."""
    lines = []
    if any(s < STEPS_PER_RELEASED_ROW for s in released_steps):
        lines += ["", f"(No released figure below {STEPS_PER_RELEASED_ROW:,} env steps: the CSVs' first row is there.)"]
    if any(STEPS_PER_RELEASED_ROW <= s < (FIRST_VALID + 1) * STEPS_PER_RELEASED_ROW for s in released_steps):
        lines += [
            "",
            f"(Released figures below {(FIRST_VALID + 1) * STEPS_PER_RELEASED_ROW:,} env steps come from the CSVs' "
            f"first {FIRST_VALID} rows, which the released graph.py drops: their episode buffers were still filling.)",
        ]
    return lines


def comparison(x: str, y: str, agg, reps: int) -> list:
    """rliable's P(X > Y) where both methods have the runs for it, else what it needs."""
    if x not in agg.scores or y not in agg.scores:
        return []
    if agg.short[x] or agg.short[y]:
        return ["", f"P({x} > {y}) needs longer runs: at least {WINDOW} episodes a run by the step."]
    if min(agg.seeds[x], agg.seeds[y]) < MIN_SEEDS:
        return ["", f"P({x} > {y}) needs more seeds: at least {MIN_SEEDS} of each method in every game."]
    if agg.scores[x].shape != agg.scores[y].shape:
        return ["", f"P({x} > {y}) needs the same seeds x games of both ({agg.seeds[x]} and {agg.seeds[y]} seeds)."]
    p, (lo, hi) = probability_of_improvement(agg.scores[x], agg.scores[y], reps)
    return ["", f"P({x} > {y}) = {p:.3f} [95% CI {lo:.3f}, {hi:.3f}] (rliable's probability of improvement)"]


def our_curves(opts, runs: list, games: list, methods: list, agg) -> dict:
    """3. What the figure draws of ours, at opts.points steps up to agg.step: {method: {"games": {game: (steps,
    means)}, "aggregate": (steps, values, lows, highs) or None}} (see draw)."""
    grid = np.unique(np.linspace(0, agg.step, opts.points + 1)[1:].astype(int))
    which = 0 if opts.metric == "iqm" else 1
    ours = {}
    for m in methods:
        per_game = {}
        for game in games:
            own = [r for r in runs if r["game"] == game and r["method"] == m]
            means = np.array([[mean_return_at(r, s) for s in grid] for r in own])
            keep = ~np.isnan(means).any(axis=0) if own else np.zeros(len(grid), bool)  # steps every seed had an episode
            if keep.any():
                per_game[game] = (grid[keep] / 1e6, means[:, keep].mean(axis=0))
        ours[m] = dict(games=per_game, aggregate=None)
        if m not in agg.scores:
            continue
        curve = {int(s): score_matrix(runs, m, games, s) for s in grid}
        curve = {s: v for s, v in curve.items() if not np.isnan(v).any()}  # steps where every run had an episode
        if not curve:
            continue
        points, intervals = interval_estimates({str(s): v for s, v in curve.items()}, max(opts.reps // 10, 200))
        xs = np.array(sorted(curve))
        ys = np.array([points[str(s)][which] for s in xs])
        lo, hi = (np.array([intervals[str(s)][k][which] for s in xs]) for k in (0, 1))
        ours[m]["aggregate"] = (xs / 1e6, ys, lo if agg.banded[m] else None, hi if agg.banded[m] else None)
    return ours


def figure_title(opts, games: list, ours: dict, agg, beside: list) -> str:
    """The aggregate panel's title: the folder, the games and seeds, and what the bands and dashed lines are."""
    title = f"{opts.folder.name}: {count(len(games), 'game')}, {seeds_a_method(agg.seeds)}"
    if any(agg.short.values()):
        title += f"\ntoo short to rank: fewer than {WINDOW} episodes a run by {agg.step:,} env steps"
    if bands := [m for m in agg.scores if agg.banded[m]]:
        only = "" if len(bands) == len(ours) else f" ({', '.join(bands)} only)"
        title += f"\nbands{only}: 95% stratified-bootstrap CIs"
    if beside:
        title += f"\ndashed: released, first {FIRST_VALID} rows dropped, smoothed {SMOOTHING}"
    return title


# ---- A sweep trained on a set of levels (--num-levels > 0, experiment generalization): its train and test returns ----


def planned(run: dict) -> int:
    """The env steps a run plans: --total-timesteps rounded up to whole rollouts, as the script's make_plan does."""
    batch = run["flags"]["num_envs"] * run["flags"]["num_steps"]
    return math.ceil(run["flags"]["total_timesteps"] / batch) * batch


def test_return_at(run: dict, step: int, window: int = WINDOW) -> float:
    """The mean return of the run's last `window` test episodes (unseen levels) up to `step` (NaN if none had ended)."""
    ended = run["test_returns"][run["test_steps"] <= step][-window:]
    return float(ended.mean()) if len(ended) else float("nan")


def test_episodes_at(run: dict, step: int) -> int:
    return min(WINDOW, int((run["test_steps"] <= step).sum()))


def sweep_state(opts, runs: list, games: list, methods: list) -> tuple:
    """(lines naming each run missing, unfinished or without a test episode, whether every run is there and done).
    Expected: the experiment's 16 games x variants x seeds, or else every game, method and seed the folder has."""
    if opts.experiment:
        exp = EXPERIMENTS[opts.experiment]
        want = (GAMES, list(exp["variants"]), list(exp["seeds"]))
    else:
        want = (games, methods, sorted({r["seed"] for r in runs}))
    have = {(r["game"], r["method"], r["seed"]) for r in runs}
    missing = [(g, m, s) for g in want[0] for m in want[1] for s in want[2] if (g, m, s) not in have]
    absent = [g for g in want[0] if not any(r["game"] == g for r in runs)]
    lines, total = [], len(want[0]) * len(want[1]) * len(want[2])
    if missing:
        lines.append(f"Missing: {len(missing)} of {total} runs (no folder with a checkpoint).")
        if absent:
            lines.append(f"Games with no run: {', '.join(absent)}.")
        if others := [f"{g} {m} seed {s}" for g, m, s in missing if g not in absent]:
            lines.append(f"Runs missing: {', '.join(others)}.")
    unfinished = [r for r in runs if r["last"] < planned(r)]
    if unfinished:
        where = [f"{r['game']} {r['method']} seed {r['seed']} at {r['last']:,} of {planned(r):,}" for r in unfinished]
        lines.append(f"Still running or stopped, short of their planned env steps: {'; '.join(where)}.")
    if untested := [f"{r['game']} {r['method']} seed {r['seed']}" for r in runs if not len(r["test_steps"])]:
        lines.append(
            f"No test episode logged (--num-test-envs 0, or none ended yet): {', '.join(untested)}; no test figure."
        )
    complete = not missing and not unfinished
    if not complete:
        lines.append(
            "The sweep is not complete: the figures below are of the runs there, each at the last step its runs all "
            "reached, and not the protocol's figures at its planned steps."
        )
    return lines, complete


def reference_cells(game: str) -> list:
    """train-procgen's PPO in a game: train and test (mean of its 3 runs, min to max) and the gap."""
    found = TRAIN_PROCGEN_PPO[game]
    train, test = (f"{np.mean(found[k]):.2f} ({min(found[k]):.2f}-{max(found[k]):.2f})" for k in ("train", "test"))
    return [train, test, f"{np.mean(found['train']) - np.mean(found['test']):.2f}"]


def generalization_table(runs: list, games: list, methods: list) -> list:
    """A row per game: each method's train and test returns (the mean over its seeds of each seed's last WINDOW
    episodes at the last step those seeds all reached), their gap, and train-procgen's PPO beside them."""
    header = "| game | " + " | ".join(f"{m} train | {m} test | {m} gap | {m} (seeds, step, episodes)" for m in methods)
    header += " | train-procgen PPO train | test | gap |"
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for game in games:
        cells = []
        for m in methods:
            own = [r for r in runs if r["game"] == game and r["method"] == m]
            if not own:
                cells += ["-", "-", "-", "no run"]
                continue
            step = min(r["last"] for r in own)
            train = np.mean([mean_return_at(r, step) for r in own])
            test = np.mean([test_return_at(r, step) for r in own])
            cells += ["-" if np.isnan(x) else f"{x:.2f}" for x in (train, test, train - test)]
            episodes = ", ".join(
                f"{episode_counts([count_at(r, step) for r in own])} {split}"
                for count_at, split in ((episodes_at, "train"), (test_episodes_at, "test"))
            )
            cells.append(f"{len(own)}, {step:,}, {episodes}")
        lines.append(f"| {game} | " + " | ".join(cells + reference_cells(game)) + " |")
    return lines


def generalization_aggregate(runs: list, games: list, methods: list, reps: int) -> list:
    """Over the games, per method, the train and test scores normalised by train-procgen's easy ranges and their gap
    (train minus test, a seed and game at a time): rliable's IQM and mean with 95% intervals where a method has
    MIN_SEEDS seeds and every run WINDOW episodes of each; train-procgen's PPO over the same games beside them."""
    step = min(r["last"] for r in runs)
    scores, notes, banded, shapes, counts = {}, [], {}, {}, {}
    for m in methods:
        mine = [r for r in runs if r["method"] == m]
        seeds = common_seeds(runs, m, games) if all(any(r["game"] == g for r in mine) for g in games) else []
        if not seeds:
            notes.append(f"{m} is left out of the aggregate: no seed has a run in every game.")
            continue
        mine = [r for r in mine if r["seed"] in seeds]
        matrices = {split: np.full((len(seeds), len(games)), np.nan) for split in ("train", "test")}
        for r in mine:
            at = (seeds.index(r["seed"]), games.index(r["game"]))
            matrices["train"][at] = train_procgen_score(r["game"], mean_return_at(r, step))
            matrices["test"][at] = train_procgen_score(r["game"], test_return_at(r, step))
        if np.isnan(matrices["train"]).any() or np.isnan(matrices["test"]).any():
            notes.append(f"{m} is left out of the aggregate: a run had no train or no test episode by {step:,}.")
            continue
        if left := sorted({r["seed"] for r in runs if r["method"] == m} - set(seeds)):
            notes.append(f"{m} seed {', '.join(map(str, left))} left out of the aggregate: no run in every game.")
        matrices["gap"] = matrices["train"] - matrices["test"]
        short = min(min(episodes_at(r, step), test_episodes_at(r, step)) for r in mine) < WINDOW
        counts[m] = episode_counts([min(episodes_at(r, step), test_episodes_at(r, step)) for r in mine])
        for split, matrix in matrices.items():
            scores[f"{m} {split}"] = matrix
            banded[f"{m} {split}"], shapes[f"{m} {split}"] = len(seeds) >= MIN_SEEDS and not short, matrix.shape
    reference = {
        k: np.array([[train_procgen_score(g, v) for v in TRAIN_PROCGEN_PPO[g][k]] for g in games]).T
        for k in ("train", "test")
    }
    reference["gap"] = reference["train"] - reference["test"]
    for split, matrix in reference.items():
        scores[f"train-procgen PPO {split}"] = matrix
        banded[f"train-procgen PPO {split}"], shapes[f"train-procgen PPO {split}"] = True, matrix.shape
    points, intervals = interval_estimates(scores, reps)
    lines = [
        "",
        f"Normalised by train-procgen's easy ranges (tools/scores.py), over the {count(len(games), 'game')} "
        f"({', '.join(games)}): ours at {step:,} env steps, train-procgen's PPO at {TRAIN_PROCGEN_AT:,}. 95% "
        f"stratified-bootstrap CIs ({reps:,} resamples) where a method has {MIN_SEEDS} seeds or more and every run "
        f"{WINDOW} train and {WINDOW} test episodes by the step. Gap: train minus test, a seed and game at a time.",
        "",
        "| method | train, test or gap | runs x games | episodes per run | IQM [95% CI] | mean [95% CI] |",
        "|---|---|---|---|---|---|",
    ]
    for name in scores:
        method, split = name.rsplit(" ", 1)
        runs_ = shapes[name][0] if banded[name] else 0
        iqm, mean = (with_interval(points[name][k], intervals[name][:, k], runs_) for k in (0, 1))
        episodes = counts.get(method, f"{WINDOW} (its eprewmean)")
        lines.append(f"| {method} | {split} | {shapes[name][0]} x {shapes[name][1]} | {episodes} | {iqm} | {mean} |")
    if step < TRAIN_PROCGEN_AT - 10 * 16_384:  # before the first of the reference's 10 rows
        lines += [
            "",
            f"(Ours at {step:,} env steps, train-procgen's at 25M: not the same step. Its runs at another "
            "step: tools/train_procgen.py CHECKOUT --game GAME --at STEP.)",
        ]
    if any(not b for n, b in banded.items() if not n.startswith("train-procgen")):
        lines += [
            "",
            f"(No interval where a method has fewer than {MIN_SEEDS} seeds, or a run fewer than {WINDOW} "
            f"train or test episodes by {step:,} env steps.)",
        ]
    return lines + [line for note in notes for line in ("", note)]


def draw_generalization(path, title: str, runs: list, games: list, methods: list, points: int) -> None:
    """A panel per game: each method's train (solid) and test (dashed) return against env steps, the mean over its
    seeds; train-procgen's PPO at 25M as markers (train o, test x), its 3 runs' range as the bar, where the game's
    runs reached half of that (else its markers would squeeze their curves into the panel's first few pixels)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = math.ceil(math.sqrt(len(games)))
    rows = math.ceil(len(games) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4 * columns, 3 * rows + 0.8), squeeze=False)
    for ax, game in zip(axes.ravel(), games):
        for i, m in enumerate(methods):
            own = [r for r in runs if r["game"] == game and r["method"] == m]
            if not own:
                continue
            grid = np.unique(np.linspace(0, max(r["last"] for r in own), points + 1)[1:].astype(int))
            for at, style, split in ((mean_return_at, "-", "train"), (test_return_at, "--", "test")):
                values = np.array([[at(r, s) for s in grid] for r in own])
                keep = ~np.isnan(values).any(axis=0)  # steps where every seed had an episode
                if keep.any():
                    ax.plot(grid[keep] / 1e6, values[:, keep].mean(axis=0), style, color=f"C{i}", label=f"{m} {split}")
        for split, marker in (("train", "o"), ("test", "x")):
            if max((r["last"] for r in runs if r["game"] == game), default=0) < TRAIN_PROCGEN_AT / 2:
                continue
            found = TRAIN_PROCGEN_PPO[game][split]
            bar = [[np.mean(found) - min(found)], [max(found) - np.mean(found)]]
            ax.errorbar(
                TRAIN_PROCGEN_AT / 1e6,
                np.mean(found),
                yerr=bar,
                fmt=marker,
                color="black",
                capsize=3,
                label=f"train-procgen PPO {split}",
            )
        ax.set_title(game, fontsize=10)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    for ax in axes.ravel()[len(games) :]:
        ax.axis("off")
    axes[0, 0].legend(fontsize=6)
    fig.suptitle(title, fontsize=10)
    fig.supxlabel("env steps (M)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def generalization_report(opts, runs: list, games: list, methods: list) -> None:
    """A sweep trained on a set of levels: where it stands, a row per game (train, test, gap, train-procgen's PPO), the
    normalised scores over the games, the figure. Writes <folder>/report.md and .png (or --out STEM) and prints it."""
    if full := [f"{r['game']} {r['method']} seed {r['seed']}" for r in runs if r["flags"].get("num_levels", 0) == 0]:
        sys.exit(
            f"error: {opts.folder}: runs on the full level distribution beside runs on a set of levels ({full[0]}, "
            "...): report each sweep alone"
        )
    levels = " and ".join(
        f"{n} levels from {s}" for n, s in sorted({(r["flags"]["num_levels"], r["flags"]["start_level"]) for r in runs})
    )
    tests = ", ".join(sorted({test_envs_of(r["flags"]) for r in runs}))
    state, complete = sweep_state(opts, runs, games, methods)
    lines = [
        f"# Generalization report of {opts.folder}" + (f" (experiment {opts.experiment})" if opts.experiment else ""),
        "",
        f"{count(len(runs), 'run')}: {count(len(games), 'game')} x methods {methods}, "
        f"{runs[0]['flags']['distribution_mode']} mode; trained on {levels}; test envs per run: {tests}.",
        "",
        f"Train: a run's mean return over its last {WINDOW} training episodes by the step; test: over its last "
        f"{WINDOW} episodes of its test envs, which play the full level distribution (unseen levels, almost all) with "
        "the current policy, actions sampled, during training, as train-procgen's test worker does. It is not the "
        "score of a final policy on test levels (PLR's and IDAAC's): tools/evaluate.py gives that. A method's "
        "figure: the mean over its seeds.",
        "",
        f"train-procgen's PPO: {TRAIN_PROCGEN_REPOSITORY} at commit {TRAIN_PROCGEN_COMMIT}, "
        "train_procgen/results/easy-200-run0, -run1 and -run2: each CSV's eprewmean (its worker's last 100 episodes) "
        f"averaged over its last 10 rows up to {TRAIN_PROCGEN_AT:,} env steps, then over the 3 runs (min to max "
        "beside). Its PPO is baselines' ppo2 (value clipping, gradient norm clipped at 0.5, 3 epochs) with one test "
        "worker of 64 envs, not the PPG paper's PPO that a sweep runs.",
        "",
    ]
    for line in state or ["Every run is there and has reached its planned env steps."]:
        lines += [line, ""]
    lines += generalization_table(runs, games, methods)
    lines += generalization_aggregate(runs, games, methods, opts.reps)
    stem = pathlib.Path(opts.out) if opts.out else opts.folder / "report"
    title = f"{opts.folder.name}: train (solid) and test (dashed) return" + ("" if complete else ", sweep not complete")
    if min(r["last"] for r in runs) < TRAIN_PROCGEN_AT / 2:
        title += "\ntrain-procgen's PPO at 25M drawn only in games whose runs reached 12.5M"
    draw_generalization(f"{stem}.png", title, runs, games, methods, opts.points)
    lines += ["", f"![per-game train and test returns against env steps]({stem.name}.png)"]
    pathlib.Path(f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"\nwritten to {stem}.md and {stem}.png")


def main() -> None:
    opts = parse_options()
    results, missing = released_results(opts.released)
    if opts.released_only:
        if results is None:
            fix = f"{CLONE_COMMAND}, with $PPG_RELEASED_CODE unset; or --released DIR"
            sys.exit(f"error: --released-only: {missing} (to add it: {fix})")
        return released_only(opts, results)
    runs, games, methods, mode = read_sweep(opts)
    if opts.experiment == "generalization" or any(r["flags"].get("num_levels", 0) > 0 for r in runs):
        return generalization_report(opts, runs, games, methods)  # trained on a set of levels: train and test
    # a method's released figures stand beside it only where each of its runs is the released run of its variant
    differences = {
        m: sorted({d for r in runs if r["method"] == m for d in differences_from_released(r)}) for m in methods
    }
    beside = [m for m in methods if results is not None and not differences[m]]
    lines = heading(opts, runs, games, methods, mode)
    table, released_steps = per_game_table(runs, games, methods, results, beside)
    lines += table + released_column_notes(methods, differences, missing)
    agg = aggregate(runs, games, methods, opts.reps)
    lines += aggregate_table(agg, games, mode, results, beside, opts.reps) + ranking(agg)
    released_steps += [agg.step] if any(m in beside for m in agg.scores) else []
    lines += early_rows_notes(released_steps) + comparison(*opts.compare, agg, opts.reps)
    ours = our_curves(opts, runs, games, methods, agg)
    stem = pathlib.Path(opts.out) if opts.out else opts.folder / "report"
    title, end = figure_title(opts, games, ours, agg, beside), max(r["last"] for r in runs)
    draw(f"{stem}.png", title, games, methods, ours, results, beside, 0 if opts.metric == "iqm" else 1, end, mode)
    lines += ["", f"![per-game returns and the aggregate normalised score against env steps]({stem.name}.png)"]
    pathlib.Path(f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"\nwritten to {stem}.md and {stem}.png")


if __name__ == "__main__":
    main()
