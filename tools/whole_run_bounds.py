"""The figures behind tests/test_whole_run.py's bounds: coupled whole runs of ppg_procgen.py against the authors'
released code (as the test runs them, with every bound lifted), each in a process of its own, since float rounding
differs between processes.

    python tools/whole_run_bounds.py                                   # the CI configurations, seeds 1 to 10
    python tools/whole_run_bounds.py --configs ppo --seeds 1 --repeats 10          # one seed in 10 processes
    python tools/whole_run_bounds.py --configs dual ppgkl detach shared e_pi1_e_v2 minibatches2 \
        detachkl64                                                     # the slow ones
    PPG_SCRIPT=/tmp/scratch/kl_sign/ppg_procgen.py python tools/whole_run_bounds.py --configs ends64 --seeds 1 \
        --repeats 5                                                    # a scratch copy with a mistake, 5 processes
    python tools/whole_run_bounds.py --summarise runs.jsonl            # the worsts of runs kept with --jsonl runs.jsonl
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 python tools/whole_run_bounds.py
                                                  # AVX2 kernels: an AVX2-only machine's rounding, on an AVX-512 one

One line a run: its near ties (draws where the two codes' actions differ) and the farthest one's distance, the largest
difference of the two CDFs at a draw of phase 1 (before any aux phase) and later, each network's largest final parameter
difference and root mean square, the CPU seconds and the kernels' instruction set (`cpu`), its largest figure / bound
against the test's BOUNDS, and which of them it breaks. Then, per configuration, the worst of each figure and the bounds
the test's RULES (or --margin) give from those worsts: float32 3 times and float64 100 times the worst, rounded up to 2
significant digits, float64 at least 1e-10; float32 at least 2 near ties, as a configuration that met none can still
meet one, float64 none; with no near tie measured, the farthest a tie may lie is the later CDF bound, which a near
tie's distance cannot exceed; and the least and most of the runs' largest figure / bound (a mistake is caught by 10x
where the least is 10 or more). --jsonl keeps every run's figures; --summarise prints these of the runs such files
kept, of the real script and of each scratch copy apart. Needs what the test needs: the released code at
$PPG_RELEASED_CODE or ../shared/reference/phasic-policy-gradient. One thread a run, one run at a time."""

import argparse
import json
import math
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))  # the tools' own modules
from helptext import DefaultsHelpFormatter  # noqa: E402

FIGURES = ("ties", "farthest", "cdf_first", "cdf", "policy_max", "policy_rms", "value_max", "value_rms")


def test_module():
    """tests/test_whole_run.py, imported as pytest imports it (its folder on the path: conftest, released_shims)."""
    if str(ROOT / "tests") not in sys.path:
        sys.path.insert(0, str(ROOT / "tests"))
    import test_whole_run

    return test_whole_run


def one_run(config: str, seed: int) -> dict:
    """The test's coupled runs of a configuration at a seed, every bound lifted: the figures the bounds limit."""
    import pytest
    import torch

    w = test_module()
    if w.RELEASED_ROOT is None:
        sys.exit(f"error: {w.WHY_NOT}")
    torch.set_num_threads(w.THREADS)
    rel = w.rs.load_released(w.RELEASED_ROOT)
    start = time.process_time()
    with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as patch:
        r = w.whole_runs(rel, config, seed, pathlib.Path(tmp), patch, w.UNBOUNDED)
    c = r["coupler"]
    figures = dict(
        config=config,
        seed=seed,
        ties=len(c.near_ties),
        farthest=max([distance for _, distance in c.near_ties], default=0.0),
        cdf_first=c.divergence["first"],
        cdf=c.divergence["later"],
        episodes_agree=w.same_episodes(r["ours_episodes"], r["released_episodes"]),
        episodes=len(r["ours_episodes"]),
        nonzero=r["nonzero"],
        last_rewards=r["last_rewards"],
        cpu_s=round(time.process_time() - start, 1),
        cpu=torch.backends.cpu.get_cpu_capability(),  # the kernels' instruction set: rounding differs between them
    )
    for network, (worst, _, rms) in r["networks"].items():
        figures.update({f"{network}_max": worst, f"{network}_rms": rms})
    return figures


def broken(figures: dict, bounds) -> list:
    """The test's checks a run's figures fail: its bounds, the episodes, and the run's floor of episodes and rewards."""
    failed = [name for name, limit in test_module().limits(bounds).items() if figures[name] > limit]
    if not figures["episodes_agree"]:
        failed.append("episodes")
    least_episodes, least_rewards, least_last = test_module().FLOORS[figures["config"]]
    last = figures.get("last_rewards", 0)  # runs measured before it was counted: none asked of them
    if figures["episodes"] < least_episodes or figures["nonzero"] < least_rewards or last < least_last:
        failed.append("too few episodes or rewards")
    return failed


def overshoot(figures: dict, bounds) -> float:
    """How far a run lies past its bounds: the largest figure / bound (inf where a figure exceeds a bound of 0)."""
    limits = test_module().limits(bounds)
    return max(figures[k] / limits[k] if limits[k] else (math.inf if figures[k] else 0.0) for k in limits)


def rounded_up(x: float) -> float:
    """x rounded up to 2 significant digits."""
    if x <= 0:
        return 0.0
    step = 10.0 ** (math.floor(math.log10(x)) - 1)
    return float(f"{math.ceil(x / step - 1e-9) * step:.2g}")


def bounds_from(worst: dict, margin: float, floor: float = 0.0, ties: int = 2) -> dict:
    """The bounds margin x the worst figures give: rounded up to 2 digits, at least `floor` and `ties` near ties."""
    bounds = dict(ties=max(math.ceil(margin * worst["ties"]), ties))
    bounds.update({k: max(rounded_up(margin * worst[k]), floor) for k in FIGURES if k != "ties"})
    if worst["ties"] == 0:
        bounds["farthest"] = bounds["cdf"]
    return bounds


def worst_of(runs: list) -> dict:
    """The largest of each figure over runs."""
    return {k: max(f[k] for f in runs) for k in FIGURES}


def read_runs(paths: list, configs: list) -> dict:
    """{label: [figures]} of the runs --jsonl files kept, of these configurations: the label is the configuration,
    with the script's path after it for a scratch copy's runs."""
    kept = {}
    for path in paths:
        for number, line in enumerate(open(path), 1):
            try:
                figures = json.loads(line)
                script = figures["script"]
                [float(figures[k]) for k in (*FIGURES, "cpu_s")]  # a line of another kind stops here
            except (ValueError, KeyError, TypeError):
                sys.exit(f"error: --summarise {path}: line {number} is not a run's figures (as --jsonl writes them)")
            if figures["config"] in configs:  # the real script's runs apart from each scratch copy's
                label = figures["config"] + ("" if script == "ppg_procgen.py" else f" ({script})")
                kept.setdefault(label, []).append(figures)
    return kept


def rule(config: str, margin=None) -> dict:
    """How the test's bounds of a configuration follow from its worst figures (RULES), with --margin's if given."""
    found = dict(test_module().RULES[config])
    return dict(found, margin=margin) if margin else found


def summarise(runs: dict, margin=None) -> None:
    """runs: {label: [figures]}; per label, the worst of each figure, the bounds the configuration's rule (or margin x
    the worst) would give, and how far the runs lie from the test's BOUNDS: the largest figure / bound of each run,
    the least and the most over the runs (a scratch copy's mistake is caught where the least is above 1)."""
    w = test_module()
    print("worst of each figure, and the bounds it gives (farthest: a near tie's distance)")
    for label, found in runs.items():
        worst, config = worst_of(found), label.split(" ", 1)[0]
        how = rule(config, margin)
        suggested = bounds_from(worst, **how)
        past = [overshoot(f, w.BOUNDS[config]) for f in found]
        kernels = {}
        for f in found:
            kernels[f.get("cpu", "?")] = kernels.get(f.get("cpu", "?"), 0) + 1
        on = ", ".join(f"{cpu} {n}" for cpu, n in kernels.items())
        print(f"{label} ({len(found)} runs: {on}; at most {max(f['cpu_s'] for f in found):.0f} s CPU a run):")
        print("  worst:  " + " ".join(f"{k} {worst[k]:.2g}" for k in FIGURES))
        print(
            f"  bounds ({how['margin']:g} x, at least {how['floor']:g}): "
            + " ".join(f"{k} {suggested[k]:g}" for k in FIGURES)
        )
        print(f"  largest figure / the test's bound, a run: least {min(past):.3g}, most {max(past):.3g}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--configs", nargs="+", help="configurations of tests/test_whole_run.py (default: its CI ones)")
    parser.add_argument("--seeds", nargs="+", type=int, default=list(range(1, 11)), help="seeds of each configuration")
    parser.add_argument("--repeats", type=int, default=1, help="processes a seed (rounding differs between them)")
    parser.add_argument(
        "--margin", type=float, help="bounds suggested: this times the worst (default: the test's RULES)"
    )
    parser.add_argument("--jsonl", help="append every run's figures to this file, one JSON line a run")
    parser.add_argument("--summarise", nargs="+", metavar="JSONL", help="run nothing: summarise these --jsonl files")
    parser.add_argument("--one", nargs=2, metavar=("CONFIG", "SEED"), help=argparse.SUPPRESS)  # a child process
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_run(args.one[0], int(args.one[1]))))
        return
    w = test_module()
    configs = args.configs or list(w.CONFIGS if args.summarise else w.CI)  # what the files hold, or CI's
    if unknown := [c for c in configs if c not in w.CONFIGS]:
        sys.exit(f"error: --configs {' '.join(unknown)}: not in tests/test_whole_run.py ({', '.join(w.CONFIGS)})")
    if args.repeats < 1 or (args.margin is not None and args.margin <= 0):
        sys.exit("error: --repeats must be at least 1 and --margin above 0")
    if args.summarise:
        if missing := [f for f in args.summarise if not os.path.isfile(f)]:
            sys.exit(f"error: --summarise {' '.join(missing)}: no such file")
        kept = read_runs(args.summarise, configs)
        if not kept:
            sys.exit(f"error: --summarise: no run of {', '.join(configs)} in {' '.join(args.summarise)}")
        summarise(kept, args.margin)
        return
    if w.RELEASED_ROOT is None:
        sys.exit(f"error: {w.WHY_NOT}")
    script = os.environ.get("PPG_SCRIPT", "ppg_procgen.py")
    print(f"{script}: {', '.join(configs)} at seeds {args.seeds}, {args.repeats} process(es) each")
    runs = {c: [] for c in configs}
    for config in configs:
        for seed in args.seeds:
            for _ in range(args.repeats):
                command = [sys.executable, __file__, "--one", config, str(seed)]
                child = subprocess.run(command, capture_output=True, text=True)
                if child.returncode != 0:
                    last = (child.stderr.strip().splitlines() or ["no message"])[-1]
                    sys.exit(f"error: {config} seed {seed} stopped: {last}")
                figures = json.loads(child.stdout.strip().splitlines()[-1])
                runs[config].append(figures)
                if args.jsonl:
                    with open(args.jsonl, "a") as f:
                        f.write(json.dumps(dict(figures, script=script)) + "\n")
                failed = broken(figures, w.BOUNDS[config])
                print(
                    f"{config} seed {seed}: {figures['ties']} near ties (farthest {figures['farthest']:.2g}), CDFs "
                    f"{figures['cdf_first']:.2g} / {figures['cdf']:.2g} apart (phase 1 / later); parameters policy "
                    f"{figures['policy_max']:.2g} / {figures['policy_rms']:.2g}, value {figures['value_max']:.2g} / "
                    f"{figures['value_rms']:.2g} (max / rms); {figures['episodes']} episodes, {figures['nonzero']} "
                    f"rewards ({figures['last_rewards']} on a last step); {figures['cpu_s']:.0f} s CPU; "
                    "largest figure / bound "
                    f"{overshoot(figures, w.BOUNDS[config]):.3g}; "
                    + (f"FAILS {', '.join(failed)}" if failed else "passes"),
                    flush=True,
                )
    print()
    summarise(runs, args.margin)


if __name__ == "__main__":
    main()
