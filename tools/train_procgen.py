"""train-procgen's PPO under its generalization protocol, from a checkout of openai/train-procgen: the figures that
tools/scores.py keeps (TRAIN_PROCGEN_PPO) and tools/report.py sets beside a generalization sweep, recomputed, and each
run's figures at another env step (to set a shorter run beside them).

    git clone https://github.com/openai/train-procgen ../train-procgen && git -C ../train-procgen checkout 1a2ae21
    python tools/train_procgen.py ../train-procgen                                  # the table, against scores.py's
    python tools/train_procgen.py ../train-procgen --game starpilot --at 1048576    # each run's row at or below a step

Its stored runs (train_procgen/results/easy-200-run{0,1,2}/progress-<game>-{train,test}.csv) are PPO on easy mode, as
its README's command `mpiexec -np 2 python -m train_procgen.train --num_levels 200 --distribution_mode easy
--test_worker_interval 2` runs it: one training worker of 64 envs on levels 0 to 199 (the -train CSV) and one test
worker of 64 envs on the full level distribution with the same weights (the -test CSV). A row is one update of 64 envs
x 256 steps (its misc/total_timesteps counts one worker's env steps); its eprewmean is the mean return of the worker's
last 100 finished episodes, actions sampled.
"""

import argparse
import ast
import csv
import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from scores import TRAIN_PROCGEN_EASY, TRAIN_PROCGEN_PPO, TRAIN_PROCGEN_RUNS, train_procgen_score  # noqa: E402

AT, ROWS = 25_100_000, 10  # TRAIN_PROCGEN_PPO: the mean of each CSV's last 10 rows at or below 25.1M env steps


def read_rows(checkout: pathlib.Path, run: str, game: str, split: str) -> tuple:
    """(env steps, eprewmean) of each row of one run's CSV; split: "train" or "test"."""
    path = checkout / "train_procgen" / "results" / run / f"progress-{game}-{split}.csv"
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    return np.array([float(r["misc/total_timesteps"]) for r in rows]), np.array([float(r["eprewmean"]) for r in rows])


def at_step(checkout: pathlib.Path, game: str, step: int, rows: int = 1) -> list:
    """Each run's (env step of its last row used, test figure, train figure): the mean eprewmean of its last `rows`
    rows at or below `step` (rows=1: the row at or below the step)."""
    found = []
    for run in TRAIN_PROCGEN_RUNS:
        figures = []
        for split in ("test", "train"):
            steps, values = read_rows(checkout, run, game, split)
            kept = steps <= step
            if not kept.any():
                sys.exit(
                    f"error: {run} {game} {split}: no row at or below {step:,} env steps (the first: {steps[0]:,.0f})"
                )
            figures += [int(steps[kept][-1]), float(values[kept][-rows:].mean())]
        if figures[0] != figures[2]:  # the two workers log in lockstep: the same steps
            sys.exit(
                f"error: {run} {game}: its train and test rows end at other steps ({figures[2]:,} and {figures[0]:,})"
            )
        found.append((figures[0], figures[1], figures[3]))
    return found


def easy_ranges(checkout: pathlib.Path) -> dict:
    """Its EASY_GAME_RANGES (train_procgen/constants.py), read without running its code: game -> (R_min, R_max)."""
    tree = ast.parse((checkout / "train_procgen" / "constants.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and [t.id for t in node.targets] == ["EASY_GAME_RANGES"]:
            return {game: tuple(map(float, pair)) for game, pair in ast.literal_eval(node.value).items()}
    sys.exit(f"error: {checkout}: no EASY_GAME_RANGES in train_procgen/constants.py")


def reference(checkout: pathlib.Path) -> dict:
    """TRAIN_PROCGEN_PPO recomputed: game -> {"test": [a figure per run], "train": [...]}."""
    table = {}
    for game in TRAIN_PROCGEN_PPO:
        runs = at_step(checkout, game, AT, ROWS)
        table[game] = {"test": [r[1] for r in runs], "train": [r[2] for r in runs]}
    return table


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkout", type=pathlib.Path, help="a checkout of openai/train-procgen")
    parser.add_argument("--game", help="one game's runs at --at")
    parser.add_argument("--at", type=int, help="env steps: each run's row at or below it (with --game)")
    opts = parser.parse_args(argv)
    if (opts.game is None) != (opts.at is None):
        sys.exit("error: --game and --at go together")
    if opts.game is not None:
        if opts.game not in TRAIN_PROCGEN_PPO:
            sys.exit(f"error: --game {opts.game}: not a Procgen game ({', '.join(TRAIN_PROCGEN_PPO)})")
        runs = at_step(opts.checkout, opts.game, opts.at)
        print(f"{opts.game}, each run's row at or below {opts.at:,} env steps: run, env steps, test, train")
        for run, (step, test, train) in zip(TRAIN_PROCGEN_RUNS, runs):
            print(f"{run} {step:,} {test:.2f} {train:.2f}")
        tests, trains = [r[1] for r in runs], [r[2] for r in runs]
        print(f"mean (min to max): test {np.mean(tests):.2f} ({min(tests):.2f} to {max(tests):.2f}), ", end="")
        print(f"train {np.mean(trains):.2f} ({min(trains):.2f} to {max(trains):.2f})")
        return
    table, differ = reference(opts.checkout), []
    print("game test_run0 test_run1 test_run2 train_run0 train_run1 train_run2")
    for game, figures in table.items():
        print(game, *(f"{v:.3f}" for v in figures["test"] + figures["train"]))
        stored = TRAIN_PROCGEN_PPO[game]
        if not np.allclose(figures["test"] + figures["train"], stored["test"] + stored["train"], atol=5e-4):
            differ.append(game)
    for split in ("test", "train"):
        score = np.mean([train_procgen_score(g, np.mean(table[g][split])) for g in table])
        print(f"mean normalised score, {split}: {score:.5f}")
    print(f"tools/scores.py's TRAIN_PROCGEN_PPO: {'differs in ' + ', '.join(differ) if differ else 'the same'}")
    ranges = easy_ranges(opts.checkout) == TRAIN_PROCGEN_EASY
    print(f"tools/scores.py's TRAIN_PROCGEN_EASY: {'the same' if ranges else 'differs'} as its EASY_GAME_RANGES")
    if differ or not ranges:
        sys.exit(1)


if __name__ == "__main__":
    main()
