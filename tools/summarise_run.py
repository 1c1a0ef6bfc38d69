"""Print a run's mean return over its last 100 finished episodes at given env steps, and its SPS. A run with test
envs (--num-levels above 0) also gets the mean return of its test envs' last 100 episodes, on the unseen levels.

python tools/summarise_run.py runs/BreakoutNoFrameskip-v4__ppg__1__1796042480 --at 100000 250000 500000
python tools/summarise_run.py runs/paper/bigfish__ppg__1      # a run of tools/sweep.py: its runs/<run_name>/ inside
"""

import argparse
import glob
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

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # the tools' own modules
from helptext import DefaultsHelpFormatter  # noqa: E402


def scalars(run_dir: str):
    """The run's event files, read whole, and their scalar tags."""
    acc = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    acc.Reload()
    return acc, acc.Tags()["scalars"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter)
    parser.add_argument(
        "run_dir", help="a runs/{run_name} folder, or a sweep's run folder runs/<name>/<game>__<method>__<seed>"
    )
    parser.add_argument("--at", type=int, nargs="+", default=[100_000, 250_000, 500_000], help="env steps")
    parser.add_argument("--window", type=int, default=100, help="episodes averaged")
    args = parser.parse_args()
    if args.window < 1:
        sys.exit(f"error: --window must be at least 1 (got {args.window})")

    acc, tags = scalars(args.run_dir)
    # a run of tools/sweep.py runs the script in its own folder, so its event files lie one level down, in
    # runs/<run_name>/ (one run name: a resumed run goes on in the same folder)
    inner = sorted(
        {os.path.dirname(p) for p in glob.glob(os.path.join(args.run_dir, "runs", "*", "events.out.tfevents.*"))}
    )
    if "charts/SPS" not in tags and len(inner) > 1:
        sys.exit(f"error: {args.run_dir}: holds {len(inner)} run folders ({', '.join(inner)}): name one of them")
    if "charts/SPS" not in tags and inner:
        print(f"reading {inner[0]}")
        acc, tags = scalars(inner[0])
    if "charts/SPS" not in tags:  # no rollout logged: not a runs/{run_name} folder, or the run's first rollout is on
        sys.exit(f"error: {args.run_dir}: no charts/SPS in its event files (a runs/{{run_name}} folder holds them)")
    episodes = acc.Scalars("charts/episodic_return") if "charts/episodic_return" in tags else []
    steps = np.array([e.step for e in episodes])
    returns = np.array([e.value for e in episodes])
    test_episodes = acc.Scalars("charts/test_episodic_return") if "charts/test_episodic_return" in tags else []
    test_steps = np.array([e.step for e in test_episodes])
    test_returns = np.array([e.value for e in test_episodes])
    last_step = max(e.step for e in acc.Scalars("charts/SPS"))
    for at in args.at:
        if at > last_step:
            print(f"{at:>9,} steps: not reached (the run logged up to {last_step:,})")
            continue
        window = returns[steps <= at][-args.window :]
        if len(window) == 0:
            print(f"{at:>9,} steps: no episode had finished yet")
            continue
        line = f"{at:>9,} steps: mean return {window.mean():7.2f} over the last {len(window)} episodes"
        test_window = test_returns[test_steps <= at][-args.window :] if test_episodes else []
        if len(test_window):
            line += f"; test {test_window.mean():.2f} over the last {len(test_window)}"
        print(line)
    sps = acc.Scalars("charts/SPS")[-1]
    print(f"SPS at step {sps.step:,}: {sps.value:.0f} (env steps per second since the start)")


if __name__ == "__main__":
    main()
