"""tools/summarise_run.py and tools/plot_runs.py, which turn runs' TensorBoard logs into the README's evidence
figures and plots; tools/benchmark.py; and every tool's --help."""

import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

from conftest import PATIENCE_S, ROOT


def test_summarise_run_reads_returns_at_steps(tmp_path):
    """A resumed run's log (its stopped start logged past its checkpoint, which the resume's purge marker drops) is
    read as resumed, without TensorBoard's "Detected out of order event.step" warning, which told a reader nothing."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path))
    for i in range(160):  # a first start, which logged past its last checkpoint (step 100,000) before its stop
        writer.add_scalar("charts/episodic_return", -1.0 if i >= 100 else float(i), (i + 1) * 1000)
    writer.close()
    writer = SummaryWriter(str(tmp_path), purge_step=100_001)  # the resume
    for i in range(100, 300):  # returns 0, 1, ..., 299 at steps 1000, 2000, ...
        writer.add_scalar("charts/episodic_return", float(i), (i + 1) * 1000)
    writer.add_scalar("charts/SPS", 123.0, 300_000)
    writer.close()
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "summarise_run.py"), str(tmp_path), "--at", "150000", "400000"],
        capture_output=True,
        text=True,
        check=True,
    )
    out = done.stdout
    assert "out of order" not in done.stderr and "Purging" not in done.stderr, done.stderr
    # the 100 episodes up to step 150,000 have returns 50..149: mean 99.5
    assert "150,000 steps: mean return   99.50 over the last 100 episodes" in out
    assert "400,000 steps: not reached" in out
    assert "SPS at step 300,000: 123" in out


def test_summarise_run_stops_in_one_line_on_a_folder_without_a_runs_log_or_a_window_below_1(tmp_path):
    """A folder whose event files hold no charts/SPS (not a runs/{run_name} folder: a sweep's job folder, say) and
    --window 0 (which would average every episode) each stop in one line; a run with no finished episode says so."""
    from torch.utils.tensorboard import SummaryWriter

    def summarise(*argv):
        command = [sys.executable, str(ROOT / "tools" / "summarise_run.py"), *map(str, argv)]
        return subprocess.run(command, capture_output=True, text=True)

    writer = SummaryWriter(str(tmp_path / "run"))
    writer.add_scalar("charts/SPS", 50.0, 4096)  # one rollout logged, no episode ended
    writer.close()
    done = summarise(tmp_path / "run", "--at", "4096")
    assert done.returncode == 0 and "4,096 steps: no episode had finished yet" in done.stdout, done.stderr
    done = summarise(tmp_path, "--at", "4096")  # the folder above: no event file of its own
    assert done.returncode == 1 and done.stderr.strip() == (
        f"error: {tmp_path}: no charts/SPS in its event files (a runs/{{run_name}} folder holds them)"
    ), done.stderr
    done = summarise(tmp_path / "run", "--window", "0")
    assert done.returncode == 1 and done.stderr.strip() == "error: --window must be at least 1 (got 0)", done.stderr


def test_summarise_run_reads_a_sweep_run_folder_from_its_run_inside(tmp_path):
    """A run of tools/sweep.py (runs/<name>/<game>__<method>__<seed>) holds the script's runs/<run_name>/ one level
    down: summarise_run reads that, says which, and gives the same figures as when named directly; a folder with two
    run folders inside stops in one line asking for one."""
    from torch.utils.tensorboard import SummaryWriter

    job = tmp_path / "tiny" / "bigfish__ppg__1"
    writer = SummaryWriter(str(job / "runs" / "bigfish__ppg__1__1796000000"))
    for i in range(10):  # returns 0..9 at steps 100, 200, ..., 1000
        writer.add_scalar("charts/episodic_return", float(i), (i + 1) * 100)
    writer.add_scalar("charts/SPS", 77.0, 1000)
    writer.close()
    (job / "train.log").write_text("a sweep's log beside the runs folder\n")

    def summarise(folder):
        command = [sys.executable, str(ROOT / "tools" / "summarise_run.py"), str(folder), "--at", "500"]
        return subprocess.run(command, capture_output=True, text=True)

    done = summarise(job)
    assert done.returncode == 0, done.stderr
    inner = job / "runs" / "bigfish__ppg__1__1796000000"
    assert done.stdout.splitlines()[0] == f"reading {inner}"
    assert "500 steps: mean return    2.00 over the last 5 episodes" in done.stdout  # returns 0..4
    assert done.stdout.splitlines()[1:] == summarise(inner).stdout.splitlines()
    SummaryWriter(str(job / "runs" / "bigfish__ppg__1__1796000001")).close()  # a second run folder: which one?
    done = summarise(job)
    assert done.returncode == 1 and done.stderr.strip().startswith(f"error: {job}: holds 2 run folders ("), done.stderr
    assert done.stderr.strip().endswith("): name one of them")


def _write_run(run_dir, offset: float) -> None:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(run_dir))
    for i in range(300):  # noisy returns rising with i, one episode every 1000 env steps
        writer.add_scalar("charts/episodic_return", offset + i / 10 + (i * 7919 % 13), (i + 1) * 1000)
    writer.close()


def test_plot_runs_draws_a_png(tmp_path):
    image = pytest.importorskip("matplotlib.image")
    _write_run(tmp_path / "run_a", 0.0)
    _write_run(tmp_path / "run_b", 5.0)
    out = tmp_path / "returns.png"
    tool = [sys.executable, str(ROOT / "tools" / "plot_runs.py")]
    done = subprocess.run(
        [
            *tool,
            *(str(tmp_path / r) for r in ("run_a", "run_b", "run_a")),
            "--labels",
            "PPG",
            "PPG",
            "PPO",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    png = out.read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    assert len(png) < 200_000
    assert image.imread(str(out)).shape[:2] == (440, 770)  # figsize (7, 4) inches at 110 dpi

    # runs sharing a label are seeds: their mean, over the steps all reached (offsets 0 and 5: the mean is 2.5 above)
    spec = importlib.util.spec_from_file_location("plot_runs", ROOT / "tools" / "plot_runs.py")
    plot_runs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot_runs)
    a, b = (plot_runs.trailing_mean(str(tmp_path / r), 100) for r in ("run_a", "run_b"))
    grid, mean = plot_runs.mean_of_seeds([a, (b[0][:200], b[1][:200])])  # b stops at step 200,000
    assert grid[0] == 1000 and grid[-1] == 200_000 and np.allclose(mean, np.interp(grid, *a) + 2.5)

    # a missing run folder: one line naming it, not a traceback
    done = subprocess.run(
        [*tool, str(tmp_path / "run_a"), str(tmp_path / "nope"), "--out", str(out)], capture_output=True, text=True
    )
    assert done.returncode != 0
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("error") and "nope" in line and "Traceback" not in done.stderr


def test_plot_runs_and_summarise_run_draw_and_read_the_test_envs_beside_train_procgens_ppo(tmp_path, monkeypatch):
    """A run with test envs: summarise_run prints the test envs' mean return beside the training one, and plot_runs
    --test draws a second panel of them; --train-procgen draws the lowest and highest of train-procgen's three runs
    (made-up CSVs: run r's eprewmean at row k is k + r for train and k - r for test, one row per 16,384 env steps),
    up to the runs' last env step."""
    image = pytest.importorskip("matplotlib.image")
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path / "run"))
    for i in range(300):  # returns i at steps 1000 (i + 1); test returns 2i at steps 1000 (i + 1) + 500
        writer.add_scalar("charts/episodic_return", float(i), (i + 1) * 1000)
        writer.add_scalar("charts/test_episodic_return", 2.0 * i, (i + 1) * 1000 + 500)
    writer.add_scalar("charts/SPS", 50.0, 300_000)
    writer.close()
    summarise = [sys.executable, str(ROOT / "tools" / "summarise_run.py"), str(tmp_path / "run"), "--at", "150000"]
    done = subprocess.run(summarise, capture_output=True, text=True)
    # returns 50..149 up to step 150,000 (mean 99.5); test returns 2 x (49..148), the last 100 logged by step
    # 149,500 (mean 197)
    assert "150,000 steps: mean return   99.50 over the last 100 episodes; test 197.00 over the last 100" in done.stdout

    checkout = tmp_path / "train-procgen"
    for r, run in enumerate(("easy-200-run0", "easy-200-run1", "easy-200-run2")):
        (checkout / "train_procgen" / "results" / run).mkdir(parents=True)
        for split, sign in (("train", 1), ("test", -1)):
            rows = "\n".join(f"{k + sign * r},{k * 16_384}" for k in range(1, 100))
            path = checkout / "train_procgen" / "results" / run / f"progress-starpilot-{split}.csv"
            path.write_text("eprewmean,misc/total_timesteps\n" + rows + "\n")
    out = tmp_path / "generalization.png"
    tool = [sys.executable, str(ROOT / "tools" / "plot_runs.py"), str(tmp_path / "run"), "--test", "--out", str(out)]
    done = subprocess.run(
        [*tool, "--train-procgen", str(checkout), "--game", "starpilot"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert image.imread(str(out)).shape[:2] == (440, 1210)  # two panels: figsize (11, 4) inches at 110 dpi
    done = subprocess.run([*tool, "--train-procgen", str(checkout)], capture_output=True, text=True)
    assert done.returncode == 2 and "--train-procgen and --game go together" in done.stderr

    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    spec = importlib.util.spec_from_file_location("plot_runs", ROOT / "tools" / "plot_runs.py")
    plot_runs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot_runs)
    spread = plot_runs.train_procgen_spread(str(checkout), "starpilot", 300_500)
    k = np.arange(1, 19)  # the rows up to 300,500 env steps: 18 x 16,384 = 294,912
    for split, low, high in (("train", k, k + 2), ("test", k - 2, k)):
        steps, lowest, highest = spread[split]
        assert np.array_equal(steps, k * 16_384) and np.array_equal(lowest, low) and np.array_equal(highest, high)

    # The test panel's curve is the test envs' own, and ends at the last rollout (charts/SPS at 300,000): the test
    # episode at 300,500, logged during a rollout that did not finish, is left out
    steps, mean = plot_runs.trailing_mean(str(tmp_path / "run"), 100, plot_runs.TEST_TAG)
    assert steps[-1] == 299_500 and mean[-1] == 2 * np.mean(np.arange(199, 299))
    _write_run(tmp_path / "no_test_envs", 0.0)  # a run without test envs: --test stops in one line naming the tag
    done = subprocess.run(
        [*tool[:2], str(tmp_path / "no_test_envs"), "--test", "--out", str(out)], capture_output=True, text=True
    )
    assert done.returncode == 1 and done.stderr.strip().endswith(
        "no charts/test_episodic_return scalars (no finished episode logged, or not a run folder)"
    )


@pytest.mark.slow  # 8 s: the benchmark is a tool for figures, not part of a training run
def test_benchmark_runs_and_prints_its_figures(tmp_path):
    """tools/benchmark.py on the smallest Atari config that still has the default envs and an aux phase (3 rollouts
    of 8 x 16 steps, one aux phase of 2 epochs; raw speed measured on the training's own 32-state chunks, over 128
    states): the script's own main() runs, timed from outside, and every figure is printed. Only how the printed
    figures follow from each other is checked, never their size: the suite runs on loaded machines too, where any
    speed, and so any efficiency, can come out (docs/benchmarks.md has measured ones, on an idle machine)."""
    import re

    env = dict(os.environ, OMP_NUM_THREADS="2")
    flags = ["--cpu", "--micro-batch-size", "32", "--raw-states", "128", "--set", "n-pi=2", "--set", "num-steps=16"]
    flags += ["--set", "total-timesteps=384", "--set", "e-aux=2"]
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "benchmark.py"), "ppg_atari.py", *flags],
        capture_output=True,
        text=True,
        timeout=PATIENCE_S,
        cwd=tmp_path,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    raw = float(re.search(r"chunk 32: raw forward \d+ states/s, forward\+backward (\d+) states/s", out).group(1))
    update, aux = map(float, re.search(r"policy update (\d+), aux epochs (\d+)", out).groups())
    efficiency = re.search(r"efficiency .*: policy update ([\d.]+), aux epochs ([\d.]+)", out).groups()
    for achieved, printed in ((update, efficiency[0]), (aux, efficiency[1])):
        # efficiency = achieved / raw; the speeds are printed as whole states/s and the ratio to 2 decimals, so each
        # printed figure is within its rounding of the exact one
        low, high = (achieved - 0.5) / (raw + 0.5) - 0.005, (achieved + 0.5) / max(raw - 0.5, 1e-9) + 0.005
        assert low <= float(printed) <= high, (achieved, raw, printed)
    pattern = r"first phase ([\d.]+) s: rollouts ([\d.]+) s, policy updates ([\d.]+) s, aux phase ([\d.]+) s"
    phase, *parts = map(float, re.search(pattern, out).groups())
    # the phase's clock runs around its parts' (each printed to 0.01 s); what runs between them takes any time
    assert phase >= sum(parts) - 0.02
    steps_per_s = float(re.search(r"whole-phase env steps/s ([\d.]+)", out).group(1))
    steps = 2 * 8 * 16  # N_pi rollouts of 8 envs x 16 steps in the first phase, over its seconds (printed to 0.01 s)
    assert steps / (phase + 0.005) - 0.05 <= steps_per_s <= steps / max(phase - 0.005, 1e-9) + 0.05


def test_benchmark_measures_raw_speed_at_the_chunks_training_runs(monkeypatch, capsys):
    """With whole minibatches, raw speed is measured at both chunks training runs (Procgen's scaled run: 2,048-state
    PPO minibatches, 1,024-state aux minibatches), each with the TF32 setting the script makes for the precision."""
    import torch

    spec = importlib.util.spec_from_file_location("benchmark_tool", ROOT / "tools" / "benchmark.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    measured = []

    def raw_speed(module, agent, device, chunk, states=2048):
        measured.append((chunk, agent.bf16, torch.backends.cudnn.allow_tf32))
        return {"forward": 1.0, "forward+backward": 1.0}

    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", torch.backends.cudnn.allow_tf32)  # put back afterwards
    monkeypatch.setattr(bench, "raw_speed", raw_speed)
    for precision, tf32 in (("tf32", True), ("fp32", False)):  # (fp32 last: the matmul flag is left off)
        argv = ["benchmark.py", "ppg_procgen.py", "--cpu", "--sweep", "--no-train", "--micro-batch-size", "0"]
        monkeypatch.setattr(sys, "argv", [*argv, "--precision", precision])
        bench.main()
        assert (0, True, False) in measured  # the sweep's bf16
        assert measured[-2:] == [(1024, False, tf32), (2048, False, tf32)]
        assert "chunk 1024: raw" in capsys.readouterr().out


def summarised_returns(run, steps, monkeypatch, capsys) -> dict:
    """{step: mean return} as tools/summarise_run.py prints it for the run folder at those env steps; a step it says
    the run has not reached is left out."""
    spec = importlib.util.spec_from_file_location("summarise_run", ROOT / "tools" / "summarise_run.py")
    summarise = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(summarise)
    monkeypatch.setattr(sys, "argv", ["summarise_run.py", str(run), "--at", *(str(step) for step in steps)])
    summarise.main()
    found = {}
    for line in capsys.readouterr().out.splitlines():
        if "mean return" in line:  # "  524,288 steps: mean return    3.50 over the last 100 episodes"
            at, words = line.split("steps:")
            found[int(at.replace(",", ""))] = float(words.split()[2])
    return found


def readme_table(header: str, path: str = "README.md") -> dict:
    """{first cell: the other cells} of the table under this header row in the README (or another of the docs)."""
    readme = (ROOT / path).read_text()
    rows = readme[readme.index(header) :].split("\n\n")[0].splitlines()[2:]
    return {cells[0]: cells[1:] for cells in ([c.strip() for c in row.strip("|").split("|")] for row in rows)}


def test_readme_breakout_table_comes_from_the_committed_logs(monkeypatch, capsys):
    """Every return of the README's Breakout table is what tools/summarise_run.py reads from the event files in
    docs/logs (a seed's mean of its last 100 games), or "-" at a step the run has not reached."""
    table = readme_table("| env steps | PPG seed 1 | PPG seed 2 | PPO seed 1 | PPO seed 2 | PPG, L_KL, seed 1 |")
    steps = {"100k": 100_000, "250k": 250_000, "500k": 500_000}
    runs = [f"BreakoutNoFrameskip-v4__{method}__{seed}__*" for method in ("ppg", "ppo") for seed in (1, 2)]
    runs.append("breakout-ppgkl/BreakoutNoFrameskip-v4__ppgkl__1__*")
    for column, pattern in enumerate(runs):
        (run,) = (ROOT / "docs" / "logs").glob(pattern)
        found = summarised_returns(run, steps.values(), monkeypatch, capsys)
        for at, step in steps.items():
            expected = f"{found[step]:.2f}" if step in found else "-"
            assert table[at][column] == expected, (pattern, at)


def test_readme_starpilot_table_comes_from_the_committed_logs(monkeypatch, capsys):
    """The README's starpilot table is what the committed logs hold: each return cell is what tools/summarise_run.py
    reads from the run's event files in docs/logs/starpilot-cpu; the wall time and env steps/s sum the "phase N done in
    S s" lines of its train.log (a phase done twice, stopped before its checkpoint, counts its last time)."""
    import re

    table = readme_table("| env steps | PPG seed 1 | PPO seed 1 |")
    steps = {"0.5M (524,288)": 524_288, "1M (1,048,576)": 1_048_576, "2.1M (2,097,152)": 2_097_152}
    phase_steps = 32 * 64 * 256  # N_pi rollouts of 64 envs x 256 steps, the defaults both runs keep
    for column, method in enumerate(("ppg", "ppo")):
        run = ROOT / "docs" / "logs" / "starpilot-cpu" / f"starpilot__{method}__1"
        found = summarised_returns(run, steps.values(), monkeypatch, capsys)
        for row, step in steps.items():
            assert table[row][column] == f"{found[step]:.2f}", (method, row)
        seconds = {}
        for match in re.finditer(r"^phase (\d+) done in ([\d.]+)s", (run / "train.log").read_text(), re.M):
            seconds[int(match[1])] = float(match[2])
        assert sorted(seconds) == [1, 2, 3, 4], method
        minutes = round(sum(seconds.values()) / 60)
        rate = 4 * phase_steps / sum(seconds.values())
        assert table["wall time (env steps/s)"][column] == f"{minutes // 60} h {minutes % 60} min ({rate:.1f})", method


@pytest.mark.parametrize("page", ["docs/results.md", "docs/logs/generalization-cpu/README.md"])
def test_generalization_demonstration_table_comes_from_the_committed_logs(page, monkeypatch, capsys):
    """The tables of the generalization demonstration (docs/results.md's and its logs' README's): each train and test
    return of PPG and PPO is what tools/summarise_run.py reads from the run's event files in
    docs/logs/generalization-cpu, or "-" at a step the run has not reached; where a copy of openai/train-procgen is
    found ($PPG_TRAIN_PROCGEN, else ../train-procgen), each of its cells is the lowest to highest of its three runs at
    the row at or below the step (tools/train_procgen.py)."""
    header = "| env steps | PPG train | PPG test | PPO train | PPO test | train-procgen's PPO train | its test |"
    table = readme_table(header, page)
    # each row's step: "0.25M (262,144)" or "311,296"
    steps = {row: int(re.findall(r"[\d,]{5,}", row)[-1].replace(",", "")) for row in table}
    if page == "docs/results.md":
        assert sorted(table) == ["0.25M (262,144)", "0.5M (524,288)", "1M (1,048,576)"]
    for column, method in enumerate(("ppg", "ppo")):
        run = ROOT / "docs" / "logs" / "generalization-cpu" / f"starpilot__{method}-demo__1"
        spec = importlib.util.spec_from_file_location("summarise_run", ROOT / "tools" / "summarise_run.py")
        summarise = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(summarise)
        monkeypatch.setattr(sys, "argv", ["summarise_run.py", str(run), "--at", *map(str, steps.values())])
        summarise.main()
        found = {}
        for line in capsys.readouterr().out.splitlines():
            # "  524,288 steps: mean return    3.63 over the last 100 episodes; test 2.81 over the last 100"
            if "mean return" in line:
                at, words = line.split("steps:")
                found[int(at.replace(",", ""))] = (words.split()[2], words.split("; test ")[1].split()[0])
        for row, step in steps.items():
            train, test = found.get(step, ("-", "-"))
            assert table[row][2 * column : 2 * column + 2] == [train, test], (method, row)
    given = pathlib.Path(os.environ.get("PPG_TRAIN_PROCGEN", str(ROOT.parent / "train-procgen")))
    if not (given / "train_procgen" / "results" / "easy-200-run0").is_dir():
        pytest.skip(f"no copy of openai/train-procgen at {given} ($PPG_TRAIN_PROCGEN): its columns not recomputed")
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    import train_procgen

    for row, step in steps.items():
        runs = train_procgen.at_step(given, "starpilot", step)
        for column, figures in ((4, [r[2] for r in runs]), (5, [r[1] for r in runs])):
            assert table[row][column] == f"{min(figures):.2f} to {max(figures):.2f}", (row, column)
