"""tools/report.py: the per-game table (with the released code's figure at the same step where the protocol
matches), rliable's IQM, mean and intervals over a runs x games matrix, the probability of improvement, the figure."""

import contextlib
import importlib.util
import io
import logging
import os
import pathlib
import re
import subprocess
import sys
import unittest.mock

import numpy as np
import pytest
import torch

from conftest import PATIENCE_S, ROOT, SWEEP_GAMES


def load_tool(name: str, as_name: str):
    spec = importlib.util.spec_from_file_location(as_name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_report():
    return load_tool("report", "report_tool")


def without_released_code(monkeypatch, folder) -> None:
    """As where the released code is not found: $PPG_RELEASED_CODE names a folder without it (unset, report.py would
    find a copy beside the checkout, as the tests do)."""
    monkeypatch.setenv("PPG_RELEASED_CODE", str(folder))


def test_the_report_of_a_sweep_has_its_table_aggregate_and_figure(sweep_grid, tmp_path):
    out = tmp_path / "report"
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "report.py"), str(sweep_grid.folder), "--reps", "200", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=PATIENCE_S,
        env=dict(os.environ, PPG_RELEASED_CODE=str(tmp_path)),  # a folder without the released code
    )
    assert done.returncode == 0, done.stderr[-2000:]
    text = out.with_suffix(".md").read_text()
    for game in SWEEP_GAMES:  # each method's mean over its 2 seeds, at the step both reached: a few episodes each
        row = next(line for line in text.splitlines() if line.startswith(f"| {game} |"))
        assert row.count("(2, 192, ") == 2 and row.count(" < 100)") == 2, row
    assert f"(No released column: PPG_RELEASED_CODE={tmp_path} holds no phasic_policy_gradient/ppg.py.)" in text
    assert "at 192 env steps" in text and text.count("| 2 x 1 | ") == 2  # ppg and ppo: 2 seeds x 1 game each
    assert "Ranking: none, the runs are too short: fewer than 100 episodes a run by 192 env steps." in text
    assert "P(ppg > ppo) needs longer runs" in text and "[" not in text.split("| ppg | 2 x 1 |")[1].splitlines()[0]
    assert out.with_suffix(".png").stat().st_size > 10_000  # drawn (and looked at when this test was written)


def test_a_resumed_runs_log_is_read_without_tensorboards_purge_warning(tmp_path, caplog):
    """A resumed run's event files: its stopped start logged past its checkpoint (here step 192 after one at 128),
    which the resume's purge marker drops. report.py reads the run as resumed, without TensorBoard's "Detected out of
    order event.step" warning, which would come at every resumed run's read."""
    from torch.utils.tensorboard import SummaryWriter

    report = load_report()
    run = tmp_path / "sweep" / "dodgeball__ppg__1" / "runs" / "dodgeball__ppg__1__1"
    run.mkdir(parents=True)
    torch.save(dict(args={}, global_step=256, phase=2), run / "checkpoint.pt")
    writer = SummaryWriter(str(run))
    for step in (64, 128, 192):
        writer.add_scalar("losses/value_loss", 1.0, step)
    writer.close()
    writer = SummaryWriter(str(run), purge_step=129)  # as the scripts resume from a checkpoint at step 128
    for step in (192, 256):
        writer.add_scalar("losses/value_loss", 2.0, step)
    writer.close()
    caplog.set_level(logging.NOTSET)  # every record, as a command line prints those its logger lets through
    (read,) = report.read_runs(tmp_path / "sweep")
    assert read["last"] == 256
    assert not [r for r in caplog.records if "out of order" in r.getMessage()], caplog.text


def test_iqm_and_intervals_are_rliables_and_the_iqm_a_hand_computation():
    from rliable import library as rly
    from rliable import metrics

    report, rng = load_report(), np.random.default_rng(0)
    scores = {"a": rng.random((5, 4)), "b": rng.random((5, 4)) + 0.2}  # 5 runs x 4 games each
    points, intervals = report.interval_estimates(scores, reps=1000, seed=3)
    np.random.seed(3)  # rliable resamples from numpy's global stream
    direct_points, direct_intervals = rly.get_interval_estimates(
        scores, lambda m: np.array([metrics.aggregate_iqm(m), metrics.aggregate_mean(m)]), reps=1000
    )
    for method, matrix in scores.items():
        assert np.array_equal(points[method], direct_points[method])
        assert np.array_equal(intervals[method], direct_intervals[method])  # the same stratified bootstrap
        middle = np.sort(matrix.ravel())[5:15]  # 20 scores: the interquartile mean drops 5 at each end
        assert points[method][0] == pytest.approx(middle.mean()) and points[method][1] == pytest.approx(matrix.mean())
        low, high = intervals[method][:, 0]
        assert low < points[method][0] < high
    p, (low, high) = report.probability_of_improvement(scores["b"] + 1.0, scores["a"], reps=200)
    assert p == 1.0 and low == high == 1.0  # b + 1 beats a in every game and run


def script_args(*flags: str) -> dict:
    """Every Args field of a ppg_procgen.py run started with `flags`, as its checkpoint keeps them."""
    import tyro

    from conftest import load_script

    return vars(tyro.cli(load_script("ppg_procgen.py").Args, args=list(flags)))


def write_run(folder, game: str, method: str, seed: int, returns: list, last: int, flags: str = None) -> None:
    """A run as tools/sweep.py leaves it: <game>__<method>__<seed>/runs/<run>/ with a checkpoint and its log. Its Args
    are the script's for `flags` (default: the released protocol, with the method's own flags where it is a variant)."""
    from torch.utils.tensorboard import SummaryWriter

    experiments = load_tool("experiments", "experiments_table")
    if flags is None:
        variants = {name: v for e in experiments.EXPERIMENTS.values() for name, v in e["variants"].items()}
        flags = f"{experiments.PAPER_PROTOCOL} {variants.get(method, '')}"
    run = folder / f"{game}__{method}__{seed}" / "runs" / f"{game}__{method}__{seed}__1"
    run.mkdir(parents=True)
    args = dict(script_args(*flags.split(), "--seed", str(seed)), env_id=game)  # (env_id: Atari's too)
    torch.save(dict(args=args, global_step=last, phase=1), run / "checkpoint.pt")
    writer = SummaryWriter(str(run))
    for i, value in enumerate(returns):
        writer.add_scalar("charts/episodic_return", value, (i + 1) * last // len(returns))
    writer.add_scalar("losses/value_loss", 0.0, last)
    writer.close()


def test_the_released_figure_sits_beside_at_the_same_step_where_the_protocol_matches(tmp_path):
    """Hard mode at the paper's batch: the released column is the mean of the released runs' EpRewMean at the row of
    the step the method's seeds all reached (row i at (i + 1) x 65,536); elsewhere no such column."""
    report, results, sweep = load_report(), tmp_path / "results", tmp_path / "sweep"
    for run in range(3):  # a released results folder: row i of run r has EpRewMean 10 r + i
        (results / f"ppg-run{run}").mkdir(parents=True)
        rows = "\n".join(str(10.0 * run + i) for i in range(20))
        (results / f"ppg-run{run}" / "progress-bigfish.csv").write_text("EpRewMean\n" + rows + "\n")
    write_run(sweep, "bigfish", "ppg", 1, [1.0] * 150 + [3.0] * 100, last=10 * 65_536)
    write_run(sweep, "bigfish", "ppg", 2, [5.0] * 120, last=12 * 65_536)  # 100 of them by 10 x 65,536
    argv = [sys.executable, str(ROOT / "tools" / "report.py"), str(sweep), "--released", str(results), "--reps", "100"]
    # (a process of its own: rliable's imports hold on to stderr)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=PATIENCE_S)
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    # step 655,360 (both seeds reached it): seed 1's last 100 episodes by then are 3.0, seed 2's are 5.0; the released
    # row 9 (10 x 65,536) is 9, 19, 29 over the 3 runs
    assert "| bigfish | 4.00 (2, 655,360, 100) | 19.00 |" in out
    assert report.released_return(results, "ppg", "bigfish", 65_535) is None  # before the first row


@pytest.mark.slow  # 7 s; tests/test_readme_commands.py runs `report.py --released-only` in a fresh copy as well
def test_released_only_finds_the_released_code_where_the_quick_start_clones_it(tmp_path):
    """`python tools/report.py --released-only`, no --released, no $PPG_RELEASED_CODE, in a copy of the checkout: with no
    released code beside it, one line saying so and the clone command; with the released code where the README's
    Quick start clones it (../phasic-policy-gradient: here a link to a copy of it), the released runs' table."""
    import shutil

    from released_shims import CLONE_COMMAND, released_root

    root, why = released_root()
    if root is None:
        pytest.skip(why)
    checkout = tmp_path / "ppg"  # what report.py needs of a checkout: tools/ and where the tests find the released code
    shutil.copytree(ROOT / "tools", checkout / "tools", ignore=shutil.ignore_patterns("__pycache__"))
    (checkout / "tests").mkdir()
    shutil.copy(ROOT / "tests" / "released_shims.py", checkout / "tests")
    env = {k: v for k, v in os.environ.items() if k != "PPG_RELEASED_CODE"}
    argv = [sys.executable, "tools/report.py", "--released-only", "--experiment", "ppg", "--reps", "50"]  # (quicker)
    done = subprocess.run(argv, cwd=checkout, env=env, capture_output=True, text=True, timeout=PATIENCE_S)
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr[-2000:]
    assert "error: --released-only: the authors' released code is not beside the checkout" in done.stderr
    assert f"(to add it: {CLONE_COMMAND}, with $PPG_RELEASED_CODE unset; or --released DIR)" in done.stderr
    (tmp_path / "phasic-policy-gradient").symlink_to(root.resolve(), target_is_directory=True)
    done = subprocess.run(argv, cwd=checkout, env=env, capture_output=True, text=True, timeout=PATIENCE_S)
    assert done.returncode == 0, done.stderr[-2000:]
    assert re.search(r"\| ppg \| ppg \| 3 \| 0\.754 \[0\.7\d\d, 0\.7\d\d\] \|", done.stdout), done.stdout


def test_released_rows_are_read_from_the_real_results():
    from released_shims import released_root

    root, why = released_root()  # $PPG_RELEASED_CODE, or the copy beside the checkout
    if root is None:
        pytest.skip(why)
    report = load_report()
    results = root / "phasic_policy_gradient" / "results"
    runs = sorted(results.glob("ppo-run*/progress-starpilot.csv"))
    assert len(runs) == 3
    row = [float(path.read_text().splitlines()[1 + 99]) for path in runs]  # row 99: 100 x 65,536 steps
    assert report.released_return(results, "ppo", "starpilot", 100 * 65_536) == pytest.approx(np.mean(row))


def test_with_one_seed_the_report_says_intervals_need_more_seeds(tmp_path, monkeypatch, capsys):
    """Fewer than 2 seeds of a method in every game: its point estimates alone, a line saying why there is no interval
    and no P(X > Y), no band on its curve; the figure's title gives the game count and the seeds a method, and names
    bands only where it draws them. (In this process, with the figure's title and bands read as it is saved.)"""
    import matplotlib.figure

    report, drawn = load_report(), []

    def savefig(figure, *args, **kwargs):
        ax = figure.axes[-1]  # the aggregate, beside the per-game panels
        drawn.append((ax.get_title(), len(ax.lines), len(ax.collections)))

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    without_released_code(monkeypatch, tmp_path)

    def report_of(folder) -> str:
        monkeypatch.setattr(sys, "argv", ["report.py", str(folder), "--reps", "50", "--points", "4"])
        report.main()
        return capsys.readouterr().out

    one = tmp_path / "one"  # 1 game, 1 seed of each method
    for method, value in (("ppg", 10.0), ("ppo", 8.0)):
        write_run(one, "bigfish", method, 1, [value] * 100, last=2 * 65_536)
    out = report_of(one)
    assert "2 runs: 1 game x methods" in out and "over the 1 game at" in out
    assert "| ppg | 1 x 1 | 100 | 0.250 | 0.250 |" in out and "| ppo | 1 x 1 | 100 | 0.200 | 0.200 |" in out
    assert "No interval where a method has fewer than 2 seeds in every game (ppg has 1 seed, ppo has 1 seed)." in out
    assert (
        "P(ppg > ppo) needs more seeds: at least 2 of each method in every game." in out and "P(ppg > ppo) =" not in out
    )
    assert drawn[-1] == ("one: 1 game, 1 seed a method", 2, 0)  # two lines, no band, no interval named

    mixed = tmp_path / "mixed"  # ppg: 2 seeds (intervals), ppo: 1 (none)
    for method, seed, value in (("ppg", 1, 10.0), ("ppg", 2, 12.0), ("ppo", 1, 8.0)):
        write_run(mixed, "bigfish", method, seed, [value] * 100, last=2 * 65_536)
    out = report_of(mixed)
    assert re.search(r"\| ppg \| 2 x 1 \| 100 \| 0\.275 \[\S+, \S+\] \| 0\.275 \[\S+, \S+\] \|", out), out
    assert "| ppo | 1 x 1 | 100 | 0.200 | 0.200 |" in out and "(ppo has 1 seed)" in out
    assert "P(ppg > ppo) needs more seeds" in out
    title = "mixed: 1 game, seeds ppg 2, ppo 1\nbands (ppg only): 95% stratified-bootstrap CIs"
    assert drawn[-1] == (title, 2, 1)  # two lines, one band


def test_bad_input_stops_in_one_line_and_a_folder_kept_aside_is_left_out(tmp_path, monkeypatch, capsys):
    """--reps and --points below what they can mean, and an Atari sweep (no Procgen normalisation range), stop in one
    line naming the flag or the folder; a job folder kept aside under another name is left out, said in one line."""
    report = load_report()
    without_released_code(monkeypatch, tmp_path)

    def stop_of(*argv) -> str:
        monkeypatch.setattr(sys, "argv", ["report.py", *map(str, argv)])
        with pytest.raises(SystemExit) as stop:
            report.main()
        return str(stop.value.code)

    sweep = tmp_path / "sweep"
    write_run(sweep, "bigfish", "ppg", 1, [10.0] * 20, last=2 * 65_536)
    assert stop_of(sweep, "--reps", "0") == "error: --reps must be at least 1 (got 0)"
    assert stop_of(sweep, "--points", "1").startswith("error: --points must be at least 2")
    (sweep / "bigfish__ppg__1").rename(sweep / "bigfish__ppg__1.old")  # kept aside: not a run of the sweep
    write_run(sweep, "bigfish", "ppg", 1, [10.0] * 20, last=2 * 65_536)
    monkeypatch.setattr(sys, "argv", ["report.py", str(sweep), "--reps", "50", "--points", "4", "--out", "x"])
    monkeypatch.chdir(tmp_path)
    report.main()
    out = capsys.readouterr().out
    assert "bigfish__ppg__1.old: not a <game>__<method>__<seed> folder, left out" in out and "1 run: " in out, out
    atari = tmp_path / "atari"
    write_run(atari, "BreakoutNoFrameskip-v4", "ppg", 1, [1.0] * 20, last=65_536)
    (checkpoint,) = atari.glob("*/runs/*/checkpoint.pt")
    state = torch.load(checkpoint, weights_only=True)
    del state["args"]["distribution_mode"]  # as ppg_atari.py writes its checkpoint: no Procgen mode
    torch.save(state, checkpoint)
    assert stop_of(atari) == f"error: {atari}: Procgen sweeps only (an Atari run: tools/summarise_run.py, plot_runs.py)"


def test_a_run_is_the_released_run_of_its_variant_only_with_every_released_flag():
    """The paper's protocol with a variant's own flags (tools/experiments.py) is the released run of that variant, for
    all seven experiments; each flag that makes a run the released one, changed alone, is named as the difference; a
    variant's flags make another variant's run no released run; a method of no released variant is named as such."""
    report, experiments = load_report(), load_tool("experiments", "experiments_table")
    for experiment in experiments.EXPERIMENTS.values():
        for variant, flags in experiment["variants"].items():
            args = script_args(*f"{experiments.PAPER_PROTOCOL} {flags}".split())
            assert report.differences_from_released(dict(method=variant, flags=args)) == [], variant
    changed = {  # flag -> a value other than the released one
        "--distribution-mode": "easy",
        "--num-levels": "200",
        "--start-level": "5",
        "--num-envs": "64",
        "--aux-mb-trajectories": "4",
        "--num-steps": "128",
        "--gamma": "0.99",
        "--gae-lambda": "0.9",
        "--learning-rate": "3e-4",
        "--anneal-lr": None,
        "--num-minibatches": "4",
        "--clip-coef": "0.1",
        "--ent-coef": "0.02",
        "--no-norm-reward": None,
        "--reward-norm-gamma": "0.999",
        "--max-grad-norm": "0.5",
        "--arch": "detach",
        "--e-pi": "2",
        "--e-v": "2",
        "--e-aux": "2",
        "--n-pi": "16",
        "--beta-clone": "0.5",
        "--kl-penalty": "1",
        "--aux-kl-stop": "0.02",
        "--precision": "bf16",
    }
    assert {flag[2:].removeprefix("no-").replace("-", "_") for flag in changed} == set(report.RELEASED_RUN)
    for flag, value in changed.items():
        args = script_args(*experiments.PAPER_PROTOCOL.split(), flag, *([value] if value else []))
        (difference,) = report.differences_from_released(dict(method="ppg", flags=args))
        assert difference.startswith(flag.replace("--no-", "--") + " "), (flag, difference)
    eaux2 = script_args(*experiments.PAPER_PROTOCOL.split(), "--e-aux", "2")
    assert report.differences_from_released(dict(method="e-aux-2", flags=eaux2)) == []
    assert report.differences_from_released(dict(method="ppg", flags=eaux2)) == ["--e-aux 2 (released: 6)"]
    no_guard = script_args(*experiments.PAPER_PROTOCOL.split())
    del no_guard["kl_penalty"]  # a checkpoint written before the flag existed
    assert report.differences_from_released(dict(method="ppg", flags=no_guard)) == [
        "--kl-penalty not in its checkpoint (released: 0.0)"
    ]
    assert report.differences_from_released(dict(method="eaux2", flags=eaux2)) == ["no released variant is named eaux2"]


def test_every_flag_of_both_scripts_is_compared_with_the_released_run_or_named_as_the_same_run(
    tmp_path, monkeypatch, capsys
):
    """Each Args field of both scripts is compared with its released value or named in SAME_RUN with its reason:
    changed alone, a compared field is the one difference named, a SAME_RUN field none; a field in neither (a flag
    added later, an Atari flag) is named too, so no flag slips through. A bf16 run at the paper's protocol is not the
    released run: the report prints no released column beside it, and a line naming --precision."""
    import dataclasses

    from conftest import SCRIPTS, load_script

    report, experiments = load_report(), load_tool("experiments", "experiments_table")
    released = script_args(*experiments.PAPER_PROTOCOL.split())
    assert report.differences_from_released(dict(method="ppg", flags=released)) == []
    assert all(report.SAME_RUN.values()) and not set(report.SAME_RUN) & set(report.RELEASED_RUN)

    def another(value):  # a value other than `value`: True -> False, None -> 1, 3 -> 4, 0.2 -> 1.2, "dual" -> "dual1"
        if isinstance(value, bool):
            return not value
        return 1 if value is None else value + type(value)(1)

    for name in SCRIPTS:
        for field in dataclasses.fields(load_script(name).Args):
            value = another(released.get(field.name, field.default))  # a Procgen run with this one flag changed
            found = report.differences_from_released(dict(method="ppg", flags={**released, field.name: value}))
            if field.name in report.SAME_RUN:
                assert found == [], (name, field.name, found)
            else:
                assert len(found) == 1 and found[0].startswith(f"--{field.name.replace('_', '-')} "), (name, found)
                assert field.name in report.RELEASED_RUN or field.name not in released, (name, field.name)
    results, sweep = tmp_path / "results", tmp_path / "sweep"
    for run in range(3):
        (results / f"ppg-run{run}").mkdir(parents=True)
        (results / f"ppg-run{run}" / "progress-bigfish.csv").write_text("EpRewMean\n" + "1.0\n" * 20)
    write_run(sweep, "bigfish", "ppg", 1, [1.0] * 100, last=12 * 65_536, flags=experiments.PAPER_PROTOCOL)
    assert "| ppg released |" in report_out(sweep, monkeypatch, capsys, "--released", str(results))
    bf16 = f"{experiments.PAPER_PROTOCOL} --precision bf16"
    write_run(sweep, "bigfish", "ppg", 2, [1.0] * 100, last=12 * 65_536, flags=bf16)  # a second seed, in bf16
    out = report_out(sweep, monkeypatch, capsys, "--released", str(results))
    aggregate = next(line for line in out.splitlines() if line.startswith("| ppg | 2 x 1 |"))
    assert "released" not in out.split("| game |")[1].splitlines()[0] and aggregate.endswith(" | - | - |"), out
    assert (
        "(No released column beside ppg: its runs are not the released run: --precision bf16 (released: fp32).)" in out
    )


def released_by_hand(results, folders: list) -> float:
    """The mean normalised score at 100M over the 16 games of the released runs in `folders`, read from the CSVs with
    the csv module: each CSV's last 10 rows averaged, the runs averaged per game, normalised by the released
    constants.py's HARD_GAME_RANGES (loaded from its own file), the games averaged."""
    import csv

    from released_shims import released_root

    spec = importlib.util.spec_from_file_location(
        "released_constants", released_root()[0] / "phasic_policy_gradient" / "constants.py"
    )
    constants = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(constants)
    scores = []
    for game in constants.ENV_NAMES:
        finals = []
        for folder in folders:
            with open(results / folder / f"progress-{game}.csv") as f:
                rows = list(csv.reader(f))
            assert rows[0] == ["EpRewMean"] and len(rows) == 1 + 1526  # 1,526 rows: 100,007,936 env steps
            finals.append(np.mean([float(row[0]) for row in rows[-10:]]))
        low, high = constants.HARD_GAME_RANGES[game]
        scores.append((np.mean(finals) - low) / (high - low))
    assert len(scores) == 16
    return float(np.mean(scores))


def test_the_released_scores_at_100m_the_report_prints_are_the_csvs(monkeypatch, capsys):
    """`report.py --released-only` prints, a row an experiment, each variant's released mean normalised score at
    100M: each is what the CSVs give by hand (released_by_hand), and the published ones are the paper's figures."""
    from released_shims import released_root

    root, why = released_root()
    if root is None:
        pytest.skip(why)
    results = root / "phasic_policy_gradient" / "results"
    report = load_report()
    monkeypatch.setattr(sys, "argv", ["report.py", "--released-only", "--released", str(results), "--reps", "50"])
    report.main()
    out = capsys.readouterr().out
    assert "the mean of its CSV's last 10 rows (EpRewMean at 99,418,112 to 100,007,936 env steps" in out
    printed = {}  # variant -> its score, from the rows "| e-aux | e-aux-1 0.642, e-aux-2 0.675, ... |"
    header = "| experiment | mean normalised score at 100M, a variant each |"
    rows = out[out.index(header) :].split("\n\n")[0].splitlines()[2:]
    assert [row.split("|")[1].strip() for row in rows] == [
        "ppg",
        "ppo",
        "ppgkl",
        "ppg-single-network",
        "e-pi",
        "e-aux",
        "n-pi",
    ]
    for row in rows:
        for cell in row.split("|")[2].split(","):
            variant, score = cell.split()
            printed[variant] = score
    assert len(printed) == 20  # 1 + 1 + 1 + 1 + 6 + 5 + 5 variants
    for variant, score in printed.items():  # a 3-run variant's folders are <variant>-run0..2, a 1-run one's <variant>
        folders = [f"{variant}-run{i}" for i in range(3)] if (results / f"{variant}-run0").is_dir() else [variant]
        assert score == f"{released_by_hand(results, folders):.3f}", variant
    published = {"ppg": "0.754", "ppo": "0.588", "e-aux-1": "0.642", "e-aux-6": "0.743", "n-pi-2": "0.626"}
    assert {v: printed[v] for v in published} == published  # the paper's figures and ppg-facts' reading of the CSVs
    assert re.search(r"\| ppg \| ppg \| 3 \| 0\.754 \[0\.7\d\d, 0\.7\d\d\] \|", out)  # 3 runs: an interval
    assert "| e-aux | e-aux-1 | 1 | 0.642 | " in out  # 1 run: none


def test_an_experiment_report_puts_each_variant_beside_its_released_runs(tmp_path, monkeypatch, capsys):
    """--experiment e-aux: a variant whose runs are the released run has its released column (the row of the step)
    and its released mean normalised score at the same step and at 100M (the last 10 rows), over the runs' games; a
    variant with one flag off has none, the flag named; a method of no variant of the experiment is left out, said;
    the figure has a panel a game beside the aggregate, the released runs dashed from row 10 on."""
    import matplotlib.figure

    report, results, sweep = load_report(), tmp_path / "results", tmp_path / "e-aux"
    for variant, slope in (("e-aux-1", 1.0), ("e-aux-6", 2.0)):  # row i of a released CSV: slope x i
        (results / variant).mkdir(parents=True)
        for game in ("bigfish", "starpilot"):
            rows = "\n".join(str(slope * i) for i in range(20))
            (results / variant / f"progress-{game}.csv").write_text("EpRewMean\n" + rows + "\n")
    last = 15 * 65_536  # row 14 of the released CSVs
    for seed, value in ((1, 20.0), (2, 30.0)):
        for game in ("bigfish", "starpilot"):
            write_run(sweep, game, "e-aux-1", seed, [value] * 100, last=last)
    guarded = "--distribution-mode hard --num-envs 256 --aux-mb-trajectories 16 --e-aux 6 --aux-kl-stop 0.02"
    for game in ("bigfish", "starpilot"):
        write_run(sweep, game, "e-aux-6", 1, [10.0] * 100, last=last, flags=guarded)
    write_run(sweep, "bigfish", "ppg", 1, [10.0] * 100, last=last)
    drawn = []

    def savefig(figure, *args, **kwargs):
        drawn.append([(ax.get_title(), [line.get_linestyle() for line in ax.lines]) for ax in figure.axes])

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    argv = ["report.py", str(sweep), "--experiment", "e-aux", "--released", str(results), "--reps", "50"]
    monkeypatch.setattr(sys, "argv", [*argv, "--points", "3"])
    report.main()
    out = capsys.readouterr().out
    assert "bigfish__ppg__1: ppg is not a variant of the experiment, left out" in out
    assert "4 runs: " not in out and "6 runs: 2 games x methods ['e-aux-1', 'e-aux-6'], hard mode." in out
    header = (
        "| game | e-aux-1 (seeds, step, episodes a seed) | e-aux-1 released | e-aux-6 (seeds, step, episodes a seed) |"
    )
    assert header in out
    assert "| bigfish | 25.00 (2, 983,040, 100) | 14.00 | 10.00 (1, 983,040, 100) |" in out  # released: row 14 of run 1
    assert (
        "(No released column beside e-aux-6: its runs are not the released run: --aux-kl-stop 0.02 (released: " in out
    )
    now = np.mean([(14 - 0) / 40, (14 - 1.5) / 33.5])  # the hard ranges: bigfish (0, 40), starpilot (1.5, 35)
    final = np.mean([(14.5 - 0) / 40, (14.5 - 1.5) / 33.5])  # rows 10..19: 14.5
    row = next(line for line in out.splitlines() if line.startswith("| e-aux-1 | 2 x 2 |"))
    assert row.endswith(f" | {now:.3f} | {final:.3f} |"), row  # 1 released run: no interval
    assert next(line for line in out.splitlines() if line.startswith("| e-aux-6 | 1 x 2 |")).endswith(" | - | - |")
    (panels,) = drawn
    assert [title for title, _ in panels[:2]] == ["bigfish", "starpilot"]
    assert panels[0][1] == ["-", "--", "-"]  # e-aux-1 ours, its released runs, e-aux-6 ours
    assert panels[2][1] == ["-", "--", "-"] and "dashed: released" in panels[2][0]  # the aggregate


def report_out(folder, monkeypatch, capsys, *flags) -> str:
    """What report.py prints for a sweep folder, in this process (its figure drawn but not written)."""
    import matplotlib.figure

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda *args, **kwargs: None)
    without_released_code(monkeypatch, folder)
    monkeypatch.setattr(sys, "argv", ["report.py", str(folder), "--reps", "50", "--points", "3", *flags])
    load_report().main()
    return capsys.readouterr().out


def test_runs_too_short_for_100_episodes_are_marked_and_not_ranked(tmp_path, monkeypatch, capsys):
    """Runs that ended fewer than 100 episodes by the step: each cell gives the episodes its seeds averaged, marked
    below 100; the aggregate gives no interval and no P(X > Y) and says the runs are too short to rank methods. Runs
    of 100 episodes and more: cells say 100, intervals are given and the methods ranked where they do not overlap."""
    short = tmp_path / "short"  # 768 env steps, as a tiny sweep: 4 to 11 episodes ended
    for method, seed, episodes in (("ppg", 1, 4), ("ppg", 2, 11), ("ppo", 1, 10), ("ppo", 2, 10)):
        write_run(short, "bigfish", method, seed, [1.0] * episodes, last=768)
    out = report_out(short, monkeypatch, capsys)
    assert "| game | ppg (seeds, step, episodes a seed) | ppo (seeds, step, episodes a seed) |" in out
    assert "| bigfish | 1.00 (2, 768, 4-11 < 100) | 1.00 (2, 768, 10 < 100) |" in out
    assert "Ours: a run's mean return over the episodes it had ended by the step, the last 100 at most" in out
    assert "| ppg | 2 x 1 | 4-11 < 100 | 0.025 | 0.025 |" in out and "| ppo | 2 x 1 | 10 < 100 | 0.025 | 0.025 |" in out
    assert (
        "No interval where a run had ended fewer than 100 episodes by 768 env steps (ppg: 2 of 2 runs; ppo: 2 of 2 "
        in out
    )
    assert "Ranking: none, the runs are too short: fewer than 100 episodes a run by 768 env steps." in out
    assert (
        "P(ppg > ppo) needs longer runs: at least 100 episodes a run by the step." in out
        and "P(ppg > ppo) =" not in out
    )

    long = tmp_path / "long"  # 150 episodes a run by 2 x 65,536 steps
    for method, seed, value in (("ppg", 1, 20.0), ("ppg", 2, 22.0), ("ppo", 1, 10.0), ("ppo", 2, 12.0)):
        write_run(long, "bigfish", method, seed, [value] * 150, last=2 * 65_536)
    out = report_out(long, monkeypatch, capsys)
    assert "| bigfish | 21.00 (2, 131,072, 100) | 11.00 (2, 131,072, 100) |" in out
    assert re.search(r"\| ppg \| 2 x 1 \| 100 \| 0\.525 \[\S+, \S+\] \| 0\.525 \[\S+, \S+\] \|", out), out
    assert "Ranking by the mean (~: their 95% intervals overlap, so these runs do not order them): ppg > ppo" in out
    assert "P(ppg > ppo) = 1.000" in out and "No interval" not in out


def test_a_method_or_seed_left_out_of_the_aggregate_says_why(tmp_path, monkeypatch, capsys):
    """A method with no seed in every game, a method with a run that had ended no episode by the step, and a seed
    missing a game are each left out of the aggregate in a line that says why; one seed a method is too few to rank."""
    sweep = tmp_path / "sweep"
    for game in ("bigfish", "starpilot"):
        write_run(sweep, game, "ppg", 1, [10.0] * 100, last=65_536)
        write_run(sweep, game, "e-aux-2", 1, [10.0] * 100 if game == "bigfish" else [], last=65_536)
    write_run(sweep, "bigfish", "ppg", 2, [12.0] * 100, last=65_536)  # seed 2 has no starpilot run
    write_run(sweep, "bigfish", "ppo", 1, [8.0] * 100, last=65_536)  # ppo has no starpilot run
    out = report_out(sweep, monkeypatch, capsys)
    assert "| ppg | 1 x 2 | 100 | " in out and "| ppo |" not in out.split("Aggregate")[1]
    assert "ppo is left out of the aggregate: no seed has a run in every game (none in starpilot)." in out
    assert "e-aux-2 is left out of the aggregate: no episode had ended by 65,536 env steps in starpilot seed 1." in out
    assert "ppg seed 2 is left out of the aggregate: it has no run in starpilot." in out
    assert "Ranking: none, too few seeds: ppg has 1 seed in every game (an interval needs 2)." in out


def write_generalization_run(folder, game: str, method: str, seed: int, train: float, test: float, last: int) -> None:
    """A run of the generalization experiment as tools/sweep.py leaves it, planned to 16,384 env steps (one rollout of
    64 envs x 256 steps), at step `last`: 100 training episodes of return `train` and 100 test episodes (the full
    distribution) of return `test`, spread up to `last`."""
    from torch.utils.tensorboard import SummaryWriter

    experiments = load_tool("experiments", "experiments_table")
    own = experiments.EXPERIMENTS["generalization"]["variants"][method]
    flags = f"{experiments.GENERALIZATION_PROTOCOL} {own} --total-timesteps 16384"
    run = folder / f"{game}__{method}__{seed}" / "runs" / f"{game}__{method}__{seed}__1"
    run.mkdir(parents=True)
    args = dict(script_args(*flags.split(), "--seed", str(seed)), env_id=game, num_test_envs=16)
    torch.save(dict(args=args, global_step=last, phase=1), run / "checkpoint.pt")
    writer = SummaryWriter(str(run))
    for i in range(100):
        writer.add_scalar("charts/episodic_return", train, (i + 1) * last // 100)
        writer.add_scalar("charts/test_episodic_return", test, (i + 1) * last // 100)
    writer.add_scalar("losses/value_loss", 0.0, last)
    writer.close()


def generalization_sweep(folder, skip=(), running=()) -> None:
    """bigfish and coinrun x ppg and ppo x seeds 1 and 2, all at 16,384 env steps but those in `running` (at 8,192)
    and without those in `skip`. Normalised by train-procgen's easy ranges (bigfish 1 to 40, coinrun 5 to 10), ppg
    trains to 1.0 and tests at 0.5, ppo trains to 0.8 and tests at 0.4, in both games."""
    returns = {"ppg": {"bigfish": (40.0, 20.5), "coinrun": (10.0, 7.5)}}
    returns["ppo"] = {"bigfish": (32.2, 16.6), "coinrun": (9.0, 7.0)}
    for method, games in returns.items():
        for game, (train, test) in games.items():
            for seed in (1, 2):
                if (game, method, seed) not in skip:
                    last = 8_192 if (game, method, seed) in running else 16_384
                    write_generalization_run(folder, game, method, seed, train, test, last)


def report_of(folder, *flags) -> str:
    """tools/report.py's main() in this process with this command line; returns what it printed."""
    out = io.StringIO()
    with unittest.mock.patch.object(sys, "argv", ["report.py", str(folder), "--reps", "100", *flags]):
        with contextlib.redirect_stdout(out):
            load_report().main()
    return out.getvalue()


def test_a_generalization_sweep_reports_train_test_their_gap_and_train_procgens_ppo(tmp_path):
    """A sweep trained on 200 levels with test envs: a row per game with each method's train and test return, its gap
    and train-procgen's PPO (mean of its 3 runs, min to max); the train, test and gap scores normalised by
    train-procgen's easy ranges, with intervals, and train-procgen's over the same games, worked out here by hand from
    its table; the source of its figures; the figure."""
    generalization_sweep(tmp_path / "sweep")
    out = report_of(tmp_path / "sweep")
    assert "Every run is there and has reached its planned env steps." in out, out
    bigfish = "| bigfish | 40.00 | 20.50 | 19.50 | 2, 16,384, 100 train, 100 test | 32.20 | 16.60 | 15.60 | 2, 16,384, 100 train, 100 test | "
    # train-procgen's bigfish: train 12.971, 11.513, 12.552 (mean 12.345), test 4.959, 5.092, 3.958 (mean 4.670)
    assert bigfish + "12.35 (11.51-12.97) | 4.67 (3.96-5.09) | 7.68 |" in out, out
    for method, train, test, gap in (("ppg", "1.000", "0.500", "0.500"), ("ppo", "0.800", "0.400", "0.400")):
        for split, score in (("train", train), ("test", test), ("gap", gap)):
            row = f"| {method} | {split} | 2 x 2 | 100 | {score} [{score}, {score}] | {score} [{score}, {score}] |"
            assert row in out, (row, out)
    # train-procgen over bigfish and coinrun: test ((4.670 - 1) / 39 + (8.657 - 5) / 5) / 2 = 0.413, train
    # ((12.345 - 1) / 39 + (9.5 - 5) / 5) / 2 = 0.595, gap 0.183
    for split, score in (("train", "0.595"), ("test", "0.413"), ("gap", "0.183")):
        row = next(line for line in out.splitlines() if line.startswith(f"| train-procgen PPO | {split} | 3 x 2 |"))
        assert row.split(" | ")[-1].startswith(f"{score} ["), row
    assert "https://github.com/openai/train-procgen at commit 1a2ae2194a61f76a733a39339530401c024c3ad8" in out
    assert "It is not the score of a final policy on test levels (PLR's and IDAAC's): tools/evaluate.py" in out
    assert "not the same step" in out  # ours at 16,384 env steps, its at 25M
    assert (tmp_path / "sweep" / "report.png").stat().st_size > 10_000  # drawn (and looked at when this was written)


def test_a_generalization_report_names_missing_games_and_runs_still_running(tmp_path):
    """A game with no run of a method, and a run short of its planned steps, are named, the method without every
    game is left out of the aggregate, saying why; the report says the sweep is not complete. With --experiment
    generalization the grid is the experiment's, so its 14 games with no run are named too."""
    generalization_sweep(
        tmp_path / "sweep", skip={("coinrun", "ppo", 1), ("coinrun", "ppo", 2)}, running={("bigfish", "ppg", 2)}
    )
    out = report_of(tmp_path / "sweep")
    assert "Runs missing: coinrun ppo seed 1, coinrun ppo seed 2." in out, out
    assert "Still running or stopped, short of their planned env steps: bigfish ppg seed 2 at 8,192 of 16,384." in out
    assert "The sweep is not complete" in out and "ppo is left out of the aggregate: no seed has a run" in out
    assert "| coinrun | 10.00 | 7.50 | 2.50 | 2, 16,384, 100 train, 100 test | - | - | - | no run |" in out, out
    assert "| ppg | train | 2 x 2 | " in out and "| ppo | train |" not in out  # ppg at 8,192 env steps, ppo not at all
    out = report_of(tmp_path / "sweep", "--experiment", "generalization", "--out", str(tmp_path / "experiment"))
    assert "Missing: 90 of 96 runs (no folder with a checkpoint)." in out, out
    assert "Games with no run: bossfight, caveflyer, chaser, climber, dodgeball, fruitbot, heist," in out, out


def test_train_procgens_figures_are_the_mean_of_its_last_10_rows_up_to_25_1m(tmp_path, monkeypatch):
    """tools/train_procgen.py on a checkout of made-up CSVs (row k at k x 16,384 env steps, test eprewmean k and train
    2k in run 0, plus 1000 x run in the others): the rows up to 25,100,000 are 1 to 1,531, so each run's figure is
    the mean of rows 1,522 to 1,531; at 1,048,576 env steps, row 64. Where a copy of the repository is found
    ($PPG_TRAIN_PROCGEN, else ../train-procgen) it recomputes tools/scores.py's table from it."""
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    tool = load_tool("train_procgen", "train_procgen_tool")
    checkout = tmp_path / "train-procgen"
    for r, run in enumerate(("easy-200-run0", "easy-200-run1", "easy-200-run2")):
        (checkout / "train_procgen" / "results" / run).mkdir(parents=True)
        for split, scale in (("test", 1), ("train", 2)):
            rows = "\n".join(f"{scale * k + 1000 * r},{k * 16_384}" for k in range(1, 3_052))
            path = checkout / "train_procgen" / "results" / run / f"progress-maze-{split}.csv"
            path.write_text("eprewmean,misc/total_timesteps\n" + rows + "\n")
    found = tool.at_step(checkout, "maze", tool.AT, tool.ROWS)
    assert found == [(1531 * 16_384, 1526.5 + 1000 * r, 3053.0 + 1000 * r) for r in range(3)]
    assert tool.at_step(checkout, "maze", 1_048_576) == [
        (1_048_576, 64.0 + 1000 * r, 128.0 + 1000 * r) for r in range(3)
    ]
    given = os.environ.get("PPG_TRAIN_PROCGEN", str(ROOT.parent / "train-procgen"))
    if not (pathlib.Path(given) / "train_procgen" / "results" / "easy-200-run0").is_dir():
        pytest.skip(f"no copy of openai/train-procgen at {given} ($PPG_TRAIN_PROCGEN): the stored table not recomputed")
    scores = load_tool("scores", "scores_table")
    table = tool.reference(pathlib.Path(given))
    for game, figures in table.items():
        assert np.allclose(
            figures["test"] + figures["train"],
            scores.TRAIN_PROCGEN_PPO[game]["test"] + scores.TRAIN_PROCGEN_PPO[game]["train"],
            atol=5e-4,
        ), game
    assert tool.easy_ranges(pathlib.Path(given)) == scores.TRAIN_PROCGEN_EASY
