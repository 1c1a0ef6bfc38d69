"""tools/sweep.py: a grid of games x seeds x methods through submitit, on this machine (the local executor) and, with
sbatch replaced by a recording stand-in, on SLURM. Each run's folder decides what a start does: done, resume, start."""

import contextlib
import errno
import functools
import importlib.util
import fcntl
import json
import os
import pathlib
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import types

import pytest
import torch

from conftest import PATIENCE_S, ROOT, SWEEP_GAMES, SWEEP_TINY, sweep


def starts_and_ends(folder: pathlib.Path) -> list:
    """(start, end) of each start of a run, from the times its job wrote into train.log."""
    text = (folder / "train.log").read_text()
    starts = [float(t) for t in re.findall(r"^# start ([\d.]+)", text, re.M)]
    ends = [float(t) for t in re.findall(r"^# end ([\d.]+)", text, re.M)]
    return list(zip(starts, ends))


def final_step(folder: pathlib.Path) -> int:
    (path,) = folder.glob("runs/*/checkpoint.pt")
    return torch.load(path, weights_only=True)["global_step"]


def logged_steps(folder: pathlib.Path) -> list:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (run,) = folder.glob("runs/*/")
    acc = EventAccumulator(str(run), size_guidance={"scalars": 0})
    acc.Reload()
    return [e.step for e in acc.Scalars("losses/value_loss")]


def test_a_grid_runs_to_the_end_with_at_most_two_jobs_at_once(sweep_grid):
    folders = sorted(p.name for p in sweep_grid.folder.iterdir() if not p.name.startswith("."))
    expected = sorted(f"{g}__{m}__{s}" for g in SWEEP_GAMES for m in ("ppg", "ppo") for s in (1, 2))
    assert folders == expected and "4 runs, 0 done, 4 to run" in sweep_grid.stdout
    intervals = []
    for name in folders:
        folder = sweep_grid.folder / name
        assert final_step(folder) == 192 and logged_steps(folder) == [64, 128, 192], name
        state = torch.load(next(folder.glob("runs/*/checkpoint.pt")), weights_only=True)
        game, method, seed = name.split("__")
        assert (state["args"]["env_id"], state["args"]["seed"], state["args"]["exp_name"]) == (game, int(seed), method)
        assert state["args"]["e_aux"] == (0 if method == "ppo" else 2)  # the method's flags win over the common ones
        intervals += starts_and_ends(folder)
    assert len(intervals) == 4  # one start each
    most = max(sum(start <= t < end for start, end in intervals) for t, _ in intervals)
    assert most == 2  # never more than --jobs at once, and two did run side by side


def test_a_finished_sweep_run_again_starts_nothing(sweep_grid):
    before = {p: p.stat().st_mtime for p in sweep_grid.folder.rglob("*") if p.is_file()}
    done = sweep(sweep_grid.root, *sweep_grid.argv, "--", *SWEEP_TINY)
    assert done.returncode == 0 and "4 runs, 4 done, 0 to run" in done.stdout, done.stderr[-2000:]
    assert {p: p.stat().st_mtime for p in sweep_grid.folder.rglob("*") if p.is_file()} == before


def mains_in_one_process(root: pathlib.Path, argvs: list) -> list:
    """(what it stopped with, or None; what it printed) of the tool's main() with each of these command lines, as the
    command line calls it, in one process started for them all (one start of Python, torch and the script)."""
    code = f"""
import contextlib, importlib.util, io, json, sys
spec = importlib.util.spec_from_file_location("sweep_tool", {str(ROOT / "tools" / "sweep.py")!r})
tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tool)
for argv in json.loads(sys.argv[1]):
    printed, stop = io.StringIO(), None
    try:
        with contextlib.redirect_stdout(printed):
            tool.main(["--root", {str(root)!r}, *argv])
    except SystemExit as e:
        stop = str(e.code)
    print(json.dumps([stop, printed.getvalue()]))
"""
    done = subprocess.run(
        [sys.executable, "-c", code, json.dumps(argvs)], capture_output=True, text=True, timeout=PATIENCE_S
    )
    results = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(results) == len(argvs), done.stdout + done.stderr[-2000:]
    return results


def test_dry_run_and_bad_input_submit_nothing(tmp_path):
    """--dry-run prints the jobs (as a user runs it); bad input stops in one line before any job or folder exists (in
    this process: the same main() the command line runs)."""
    argv = ["--name", "x", "--games", "dodgeball", "--seeds", "1", "--methods", "ppg", "ppo"]
    budget = SWEEP_TINY.index("--total-timesteps")
    tiny = [*SWEEP_TINY[:budget], *SWEEP_TINY[budget + 2 :], "--total-timesteps=192"]  # the budget as --flag=value
    done = sweep(tmp_path, *argv, "--dry-run", "--", *tiny)
    assert done.returncode == 0 and done.stdout.count("start  ") == 2 and "2 runs, 0 done, 2 to run" in done.stdout
    assert "--arch shared --e-aux 0 --e-pi 3 --e-v 3" in done.stdout  # ppo: the paper's baseline
    # the budget given is the one the runs take: the script's default is not added after it (where it would win)
    assert done.stdout.count("--total-timesteps") == 2 and done.stdout.count("--total-timesteps=192") == 2
    done = sweep(tmp_path, "--name", "x", "--games", "all", "--seeds", "1", "--methods", "ppg", "--dry-run")
    assert done.returncode == 0 and "16 runs, 0 done, 16 to run" in done.stdout and "starpilot__ppg__1" in done.stdout
    cases = [
        (["--games", "pong"], "error: --games: ['pong'] are not Procgen games"),
        (["--games", "dodgeball", "--methods", "ppx"], "error: --methods: unknown ['ppx']"),
        (
            ["--games", "dodgeball", "--", "--num-minibatches", "7"],
            "error: dodgeball ppg: --num-minibatches must divide",
        ),
        (["--games", "dodgeball", "--", "--arch", "triple"], "error: flags after --: "),
        (
            ["--games", "dodgeball", "--method", "mine=--e-aux -1", "--methods", "mine"],
            "error: dodgeball mine: --e-aux",
        ),
        (["--games", "dodgeball", "--jobs", "0"], "error: --jobs must be at least 1"),
        # one folder a run: a value given twice would start two jobs in the same folder at once
        (["--games", "dodgeball", "--seeds", "1", "2", "1"], "error: --seeds: 1 given twice"),
        (["--games", "dodgeball", "dodgeball"], "error: --games: dodgeball given twice"),
        (["--games", "dodgeball", "--methods", "ppo", "ppo"], "error: --methods: ppo given twice"),
        (
            ["--games", "dodgeball", "--method", "a__b=--e-aux 1", "--methods", "a__b"],
            "error: --method 'a__b=--e-aux 1'",
        ),
        (["--games", "dodgeball", "--threads", "-1"], "error: --threads must be at least 0"),
        # a flag of the sweep after --, which the script would refuse in tyro's words
        (["--games", "dodgeball", "--", "--status"], "error: --status after --: a flag of tools/sweep.py, not of the"),
        (["--games", "dodgeball", "--", "--cpus_per_job=4"], "error: --cpus_per_job after --: a flag of tools/sweep"),
        # the grid's own flags, in either form, after -- or in a method: they would win over the grid's values while
        # the run's folder is named by the grid's
        (["--games", "dodgeball", "--", "--seed", "5"], "error: --seed after --: the grid gives each run its own"),
        (["--games", "dodgeball", "--", "--env-id=bigfish"], "error: --env-id after --: the grid gives each run"),
        (["--games", "dodgeball", "--", "--exp-name", "mine"], "error: --exp-name after --: the grid gives each"),
        (
            ["--games", "dodgeball", "--method", "mine=--seed=3", "--methods", "mine"],
            "error: --method mine: --seed is the grid's",
        ),
    ]
    # --dry-run: were a refusal missing, nothing would start (each refusal comes before the dry run's listing)
    results = mains_in_one_process(tmp_path, [["--name", "bad", "--dry-run", *argv] for argv, _ in cases])
    for (argv, needle), (message, _) in zip(cases, results):
        assert message is not None and message.startswith(needle) and "\n" not in message, (argv, message)
    assert not (tmp_path / "bad").exists() and not (tmp_path / "x").exists()  # nothing submitted, no folder made


def test_flags_are_judged_as_the_script_parses_them(tmp_path):
    """tyro takes --total_timesteps for --total-timesteps and --env_id for --env-id, and the later of two flags wins:
    the budget given in either spelling is the one every run gets (the default is not added after it, where it would
    win), and a grid flag in either spelling, after -- or in a method, stops the sweep in one line."""
    import tyro

    from conftest import load_script

    budget = SWEEP_TINY.index("--total-timesteps")
    tiny = [*SWEEP_TINY[:budget], *SWEEP_TINY[budget + 2 :]]
    argv = ["--name", "x", "--dry-run", "--games", "dodgeball", "--seeds", "1", "--methods", "ppg", "ppo"]
    argvs = [
        [*argv, "--", *tiny, "--total_timesteps", "2000000"],
        [*argv, "--", *tiny, "--env_id", "coinrun"],
        [*argv, "--", *tiny, "--exp_name=mine"],
        [*argv, "--method", "ppo=--arch shared --env_id coinrun", "--", *tiny],
    ]
    (stop, printed), *refused = mains_in_one_process(tmp_path, argvs)
    commands = [line.split(": ", 1)[1] for line in printed.splitlines() if line.startswith("start ")]
    assert stop is None and len(commands) == 2, (stop, printed)
    Args = load_script("ppg_procgen.py").Args
    for command in commands:  # what each run's command gives the script, as the script parses it
        assert tyro.cli(Args, args=shlex.split(command)[2:]).total_timesteps == 2_000_000, command
    needles = [
        "error: --env-id after --: the grid gives each run its own",
        "error: --exp-name after --: the grid gives each run its own",
        "error: --method ppo: --env-id is the grid's",
    ]
    for (message, _), needle in zip(refused, needles):
        assert message is not None and message.startswith(needle) and "\n" not in message, message
    assert not (tmp_path / "x").exists()


def test_a_method_defined_is_run_or_refused(tmp_path):
    """--method eaux2="--e-aux 2", as docs/sweeps.md gives it, adds a method that runs beside the built-in ones where
    --methods is left out; where --methods leaves it out, or it is defined twice, the sweep stops in one line."""
    argv = ["--name", "x", "--dry-run", "--games", "dodgeball", "--seeds", "1"]
    argvs = [
        [*argv, "--method", "eaux2=--e-aux 2", "--", *SWEEP_TINY],
        [*argv, "--method", "eaux2=--e-aux 2", "--methods", "ppg", "--", *SWEEP_TINY],
        [*argv, "--method", "eaux2=--e-aux 2", "--method", "eaux2=--e-aux 3", "--", *SWEEP_TINY],
    ]
    (stop, printed), (left_out, _), (twice, _) = mains_in_one_process(tmp_path, argvs)
    assert stop is None and "3 runs, 0 done, 3 to run" in printed, (stop, printed)
    started = sorted(re.findall(r"^start +\S+/(dodgeball__\S+__1):", printed, re.M))
    assert started == ["dodgeball__eaux2__1", "dodgeball__ppg__1", "dodgeball__ppo__1"], printed
    assert re.search(r"--exp-name eaux2 .* --e-aux 2$", printed, re.M), printed  # its flags, last
    assert left_out == "error: --method eaux2: defined but not run: add it to --methods, or leave --methods out"
    assert twice == "error: --method eaux2: defined twice"
    assert not (tmp_path / "x").exists()


# The released README's seven experiments, read from it by hand: each variant's flags as ours (its --n_epoch_pi is
# --e-pi, --n_epoch_vf --e-v, --n_aux_epochs --e-aux, --clip_param --clip-coef), and the runs of each (results/<folder>:
# ppg-run0..2, 3 seeds; e-pi-N, 1 run a value)
RELEASED = {
    "ppg": {"ppg": {}},
    "ppo": {"ppo": dict(arch="shared", e_aux=0, e_pi=3, e_v=3)},
    "ppgkl": {"ppgkl": dict(clip_coef=0.0, kl_penalty=1.0)},
    "ppg-single-network": {"ppgsingle": dict(arch="detach")},
    "e-pi": {f"e-pi-{n}": dict(e_pi=n) for n in (1, 2, 3, 4, 5, 6)},
    "e-aux": {f"e-aux-{n}": dict(e_aux=n) for n in (1, 2, 3, 6, 9)},
    "n-pi": {f"n-pi-{n}": dict(n_pi=n) for n in (2, 4, 8, 16, 32)},
}
RELEASED_SEEDS = {
    name: [1, 2, 3] if name in ("ppg", "ppo", "ppgkl", "ppg-single-network") else [1] for name in RELEASED
}
# The paper's protocol, as every released run has it (the released code's 4 workers x 64 envs in one process), and no
# KL guard (the released code has none)
PROTOCOL = dict(distribution_mode="hard", num_envs=256, aux_mb_trajectories=16, total_timesteps=100_000_000)
PROTOCOL.update(aux_kl_stop=0.0)


def test_each_released_experiment_is_one_command(tmp_path):
    """--experiment NAME runs the released README's experiment NAME: each of the 16 games with each variant (a method
    with its flags) and the released run count, in <root>/NAME/<game>__<variant>__<seed>, each run's command parsed by
    the script to the paper's protocol, the variant's flags and every other flag at its default. Flags after -- may
    change where a run trains, not what it learns; what conflicts with an experiment stops it in one line."""
    import tyro

    from conftest import load_script

    script = load_script("ppg_procgen.py")
    defaults = vars(script.Args())
    allowed = ["--experiment", "ppg", "--name", "mine", "--", "--no-cuda", "--micro_batch_size", "64", "--num-envs=256"]
    refused = [
        (["--experiment", "ppx"], "error: --experiment ppx: unknown; known: ppg, ppo, ppgkl, ppg-single-network, e-pi"),
        (["--experiment", "ppg", "--games", "bigfish"], "error: --games with --experiment: an experiment runs the"),
        (["--experiment", "ppg", "--seeds", "1"], "error: --seeds with --experiment: "),
        (["--experiment", "ppg", "--methods", "ppg"], "error: --methods with --experiment: "),
        (["--experiment", "e-aux", "--method", "x=--e-aux 4"], "error: --method with --experiment: "),
        (["--experiment", "ppg", "--", "--env_id", "coinrun"], "error: --env-id after --: experiment ppg gives each"),
        (
            ["--experiment", "ppg", "--", "--total_timesteps", "2000000"],
            "error: --experiment ppg: --total-timesteps 2000000 after -- changes its runs (the paper's protocol sets "
            "--total-timesteps 100000000); after -- it takes only --cuda, --micro-batch-size,",
        ),
        (
            ["--experiment", "e-pi", "--", "--e_pi", "5"],
            "error: --experiment e-pi: --e-pi 5 after -- changes its runs (variant e-pi-1 sets --e-pi 1)",
        ),
        (
            ["--experiment", "ppo", "--", "--e-aux", "2"],
            "error: --experiment ppo: --e-aux 2 after -- changes its runs (variant ppo sets --e-aux 0)",
        ),
        (
            ["--experiment", "ppg", "--", "--aux-kl-stop", "0.01"],
            "error: --experiment ppg: --aux-kl-stop 0.01 after -- changes its runs (its runs have --aux-kl-stop 0.0)",
        ),
    ]
    argvs = [["--experiment", name] for name in RELEASED] + [allowed] + [argv for argv, _ in refused]
    results = mains_in_one_process(tmp_path, [["--dry-run", *argv] for argv in argvs])
    for (name, variants), (stop, printed) in zip([*RELEASED.items(), ("mine", RELEASED["ppg"])], results):
        seeds = RELEASED_SEEDS.get(name, [1, 2, 3])
        runs = len(script.PROCGEN_GAMES) * len(variants) * len(seeds)
        assert stop is None and f"\n{runs} runs, 0 done, {runs} to run\n" in printed, (name, stop, printed[-500:])
        started = dict(line.split(": ", 1) for line in printed.splitlines() if line.startswith("start "))
        folders = {f"{tmp_path / name}/{g}__{v}__{s}" for g in script.PROCGEN_GAMES for v in variants for s in seeds}
        assert {folder.split()[-1] for folder in started} == folders, name
        parsed = {}  # the flags after the grid's, of each variant: one parse each (a parse takes tens of ms)
        for folder, command in started.items():
            game, variant, seed = pathlib.Path(folder.split()[-1]).name.split("__")
            flags = shlex.split(command)[2:]
            assert flags[:6] == ["--env-id", game, "--seed", seed, "--exp-name", variant], command
            names = {flag[2:].split("=")[0].replace("_", "-") for flag in flags[6:] if flag.startswith("--")}
            assert not names & {"env-id", "seed", "exp-name", "resume"}, command  # only the grid's give them
            if tuple(flags[6:]) not in parsed:  # as the script parses the command
                parsed[tuple(flags[6:])] = vars(tyro.cli(script.Args, args=flags))
            args = dict(parsed[tuple(flags[6:])], env_id=game, seed=int(seed), exp_name=variant)
            expected = dict(defaults, **PROTOCOL, **variants[variant], env_id=game, seed=int(seed), exp_name=variant)
            if name == "mine":  # flags after -- that change where and how a run trains, not what it learns
                expected.update(cuda=False, micro_batch_size=64)
            assert args == expected, (folder, command)
    for (argv, needle), (stop, _) in zip(refused, results[len(RELEASED) + 1 :]):
        assert stop is not None and stop.startswith(needle) and "\n" not in stop, (argv, stop)
    assert not list(tmp_path.iterdir())  # dry runs and refusals: no folder made


# train-procgen's generalization protocol (its README's easy-200 command: one training worker of 64 envs, easy mode,
# levels 0 to 199), 25M env steps, the paper's PPO beside PPG; 4 aux trajectories, as the paper's 16 per 256 envs
GENERALIZATION = dict(distribution_mode="easy", num_levels=200, start_level=0, num_envs=64, aux_mb_trajectories=4)
GENERALIZATION.update(total_timesteps=25_000_000)


def test_the_generalization_experiment_is_one_command_with_train_procgens_protocol(tmp_path):
    """--experiment generalization: 16 games x PPG and the paper's PPO x seeds 1 2 3, each run's command parsed by the
    script to train-procgen's protocol (not the paper's hard mode, 100M steps, 256 envs), every other flag at its
    default; the dry run names each job's resources and each method's memory; --status follows the same runs; a flag
    after -- that changes the protocol stops it in one line naming train-procgen's value."""
    import tyro

    from conftest import load_script

    script = load_script("ppg_procgen.py")
    defaults = vars(script.Args())
    variants = {"ppg": {}, "ppo": dict(arch="shared", e_aux=0, e_pi=3, e_v=3)}
    argv = ["--experiment", "generalization", "--cluster", "slurm", "--partition", "gpu"]
    results = mains_in_one_process(
        tmp_path, [[*argv, "--dry-run"], [*argv, "--status"], [*argv, "--dry-run", "--", "--num-levels", "0"]]
    )
    (stop, printed), (stop_status, status), (refused, _) = results
    assert stop is None and "\n96 runs, 0 done, 96 to run\n" in printed, (stop, printed[-500:])
    assert printed.count("each job asks SLURM for: partition gpu, GPUs 1, CPUs 8, time 1440 min,") == 1, printed
    assert [line.split(":")[0] for line in printed.splitlines() if line.startswith("memory a run")] == [
        "memory a run (ppg)",
        "memory a run (ppo)",
    ]
    started = dict(line.split(": ", 1) for line in printed.splitlines() if line.startswith("start "))
    folders = {
        f"{tmp_path}/generalization/{g}__{v}__{s}" for g in script.PROCGEN_GAMES for v in variants for s in (1, 2, 3)
    }
    assert len(folders) == 16 * 2 * 3 and {folder.split()[-1] for folder in started} == folders
    parsed = {}
    for folder, command in started.items():
        game, variant, seed = pathlib.Path(folder.split()[-1]).name.split("__")
        flags = shlex.split(command)[2:]
        if tuple(flags[6:]) not in parsed:
            parsed[tuple(flags[6:])] = vars(tyro.cli(script.Args, args=flags[6:]))
        expected = dict(defaults, **GENERALIZATION, **variants[variant])
        assert parsed[tuple(flags[6:])] == expected, (folder, command)
    assert len(parsed) == 2 and not any(
        r["num_envs"] == 256 or r["distribution_mode"] == "hard" for r in parsed.values()
    )
    assert stop_status is None and status.count("not started ") == 96 and "96 runs: 96 not started" in status, status
    assert refused == (
        "error: --experiment generalization: --num-levels 0 after -- changes its runs (train-procgen's protocol sets "
        "--num-levels 200); after -- it takes only --cuda, --micro-batch-size, --track, --wandb-project-name, "
        "--wandb-entity (other flags: a sweep of --games, --seeds and --method)"
    )
    assert not (tmp_path / "generalization").exists()  # a dry run, a status and a refusal make no folder


def test_the_experiments_table_is_the_released_readme(monkeypatch):
    """tools/experiments.py against the released code itself: each experiment of its README (the train command's flags,
    by our names; the graph's --experiment_name, hyphenated, is ours) has the same variants, and the released results
    folders it names are those of the README's results/<name>-runN or <name>-N, one per run of each variant."""
    import tyro

    from conftest import load_script
    from released_shims import released_root

    root, why_not = released_root()
    if root is None:
        pytest.skip(why_not)
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    from experiments import RELEASED_EXPERIMENTS as EXPERIMENTS  # generalization has no released runs

    ours = {"--n_epoch_pi": "--e-pi", "--n_epoch_vf": "--e-v", "--n_aux_epochs": "--e-aux", "--n_pi": "--n-pi"}
    ours.update({"--clip_param": "--clip-coef", "--kl_penalty": "--kl-penalty", "--arch": "--arch"})
    Args = load_script("ppg_procgen.py").Args
    results = root / "phasic_policy_gradient" / "results"
    pattern = r"\(results/([\w-]+?)(runN|N)\):\s*```\s*mpiexec -np 4 python -m phasic_policy_gradient\.train(.*)\n"
    pattern += r"python -m phasic_policy_gradient\.graph --experiment_name (\w+)"
    found = re.findall(pattern, (root / "README.md").read_text())
    assert len(found) == 7 and sorted(name.replace("_", "-") for *_, name in found) == sorted(EXPERIMENTS)
    for prefix, runs, flags, name in found:
        experiment = EXPERIMENTS[name.replace("_", "-")]
        flags = [ours.get(token, token) for token in flags.split()]
        folders = sorted(p.name for p in results.glob(f"{prefix}*") if p.is_dir())
        if runs == "runN":  # one variant, a folder a run
            values, released = [None], {prefix.removesuffix("-"): folders}
        else:  # a variant a value N, one run each
            values = sorted(int(folder.removeprefix(prefix)) for folder in folders)
            released = {f"{prefix}{n}": [f"{prefix}{n}"] for n in values}
        assert experiment["released"] == released and set(experiment["variants"]) == set(released), name
        for value, variant in zip(values, released):
            given = [str(value) if token == "N" else token for token in flags]
            mine = shlex.split(experiment["variants"][variant])
            assert tyro.cli(Args, args=mine) == tyro.cli(Args, args=given), (name, variant)
            assert len(experiment["seeds"]) == len(released[variant]) and len(released[variant]) in (1, 3), variant
            for folder in released[variant]:
                assert len(list((results / folder).glob("progress-*.csv"))) == 16, folder


def test_a_resume_passes_the_runs_flags_and_a_changed_one_stops_the_sweep(sweep_grid):
    """A run with a checkpoint resumes with the flags it started with (the budget raised): the script keeps a resumed
    run's training flags, so one changed since its start stops the sweep in one line, before anything is submitted,
    instead of being silently ignored, given by its name (here a flag and --e-pi), or left out
    (back at its default). The same holds for a done run: a finished sweep run again with a changed flag does not
    report its old runs as done. (--dry-run on the shared grid's finished runs: nothing is written.)"""
    argv = [*sweep_grid.argv, "--dry-run", "--", *SWEEP_TINY, "--total-timesteps", "256"]
    at = SWEEP_TINY.index("--n-pi")
    left_out = [*sweep_grid.argv, "--dry-run", "--", *SWEEP_TINY[:at], *SWEEP_TINY[at + 2 :]]  # --n-pi: 32 again
    finished = [*sweep_grid.argv, "--dry-run", "--", *SWEEP_TINY, "--ent-coef", "0.02"]  # the budget as it was: done
    argvs = [argv, [*argv, "--ent-coef", "0.02"], [*argv, "--e-pi", "2"], left_out, finished]
    (same, printed), (changed, _), (aliased, _), (omitted, _), (done, _) = mains_in_one_process(sweep_grid.root, argvs)
    assert same is None and "4 runs, 0 done, 4 to run" in printed, printed
    resumes = [line for line in printed.splitlines() if line.startswith("resume ")]
    assert len(resumes) == 4 and all(
        re.search(r" --resume \S+/runs/\S+ --env-id dodgeball --seed \d", r) for r in resumes
    )
    assert all(r.endswith("--total-timesteps 256") or "--arch shared" in r for r in resumes)  # ppo: its flags last
    assert changed.startswith(
        "error: dodgeball__ppg__1 has a checkpoint (change no training flag, or use a new --name)"
    )
    assert "--ent-coef 0.02: a resumed run keeps its flags (0.01)" in changed and "\n" not in changed, changed
    assert aliased and "--e-pi 2: a resumed run keeps its flags (1)" in aliased and "\n" not in aliased, aliased
    assert omitted and "--n-pi 32: a resumed run keeps its flags (2)" in omitted and "\n" not in omitted, omitted
    assert done and "--ent-coef 0.02: a resumed run keeps its flags (0.01)" in done and "\n" not in done, done


def job_process(root: pathlib.Path) -> int:
    """The pid of the submitit job process (`python -m submitit.core._submit`) that runs a sweep under root."""
    for cmdline in pathlib.Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):
            text = cmdline.read_bytes().replace(b"\0", b" ").decode()
            if "submitit.core._submit" in text and str(root) in text:
                return int(cmdline.parent.name)
    raise AssertionError(f"no submitit job process under {root}")


# slow: three starts of a sweep and its training process, about 45 s on 2 idle cores, which would take the suite past
# 6 minutes; the suite keeps each stop's pieces: a sweep's resume, its flags, a run's SIGTERM, Ctrl-C and kill -9
@pytest.mark.slow
def test_a_sweep_signalled_stopped_and_killed_resumes_each_time(tmp_path):
    """One run through every way a sweep stops, each after the run's next phase checkpoint: the job is signalled as
    submitit's controller signals it --signal-delay-s before --time-min (SIGUSR2: the job is requeued and resumes in the
    same sweep); the sweep gets SIGTERM (`kill -TERM` of its process alone: it passes it to the run and waits for it,
    exit 143, no traceback; --status says the run stopped); every process of it is killed (SIGKILL, a lost machine: the
    training process, in a process group of its own, is stopped by its parent-death signal). Each new run of the command resumes, and the run ends at
    its planned step, each step logged once. (The signal is sent by hand, so the test does not hang on this machine's
    speed; that --time-min and --signal-delay-s reach the controller is read from the job's environment. Each stop
    waits for a checkpoint of the start it stops, read from the files, not from the time: a loaded machine runs the
    test and the jobs at any speed.)"""
    argv = ["--name", "k", "--games", "dodgeball", "--seeds", "1", "--methods", "ppg", "--time-min", "30"]
    # 10 rollouts in 5 phases: the last stop (after the third start's first checkpoint: phase 3, or 4 on a slow
    # Ctrl-C) leaves at least a phase to run
    argv += ["--signal-delay-s", "7", "--", *SWEEP_TINY, "--total-timesteps", "640"]
    command = [sys.executable, str(ROOT / "tools" / "sweep.py"), "--root", str(tmp_path), *argv]
    folder = tmp_path / "k" / "dodgeball__ppg__1"
    # its own process group, which Ctrl-C reaches, with SIGINT deliverable (a shell's background job would ignore it)
    interactive = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    interactive["preexec_fn"] = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)

    def checkpoint_of_start(start: int) -> bool:
        """Whether the run's start number `start` (1, 2, ...) has written a checkpoint."""
        log = folder / "train.log"
        starts = [float(t) for t in re.findall(r"^# start ([\d.]+)", log.read_text(), re.M)] if log.exists() else []
        found = list(folder.glob("runs/*/checkpoint.pt"))
        return len(starts) >= start and bool(found) and found[0].stat().st_mtime > starts[start - 1]

    def wait_for_checkpoint(proc, start: int):
        deadline = time.time() + PATIENCE_S  # a hang guard only
        while not checkpoint_of_start(start):
            assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-2000:]
            time.sleep(0.1)
        time.sleep(0.3)  # into the next phase

    def wait_until_gone(proc):
        """Until every process of the ended sweep's process group (its jobs') and its training process have ended."""
        deadline = time.time() + PATIENCE_S
        while True:
            try:
                os.killpg(proc.pid, 0)  # raises once no process of the group is left
            except ProcessLookupError:
                if not processes_in(tmp_path):
                    return
            assert time.time() < deadline, "a process of the sweep outlived it"
            time.sleep(0.2)

    proc = subprocess.Popen(command, **interactive)
    wait_for_checkpoint(proc, 1)
    job = job_process(tmp_path)
    environ = dict(v.split("=", 1) for v in pathlib.Path(f"/proc/{job}/environ").read_text().split("\0") if "=" in v)
    assert (environ["SUBMITIT_LOCAL_TIMEOUT_S"], environ["SUBMITIT_LOCAL_SIGNAL_DELAY_S"]) == ("1800", "7")
    os.kill(job, signal.SIGUSR2)  # what the controller sends at 30 min - 7 s
    wait_for_checkpoint(proc, 2)  # the requeued start's first
    log = (folder / "train.log").read_text()
    assert "stopped by SIGTERM; resume with" in log and re.search(
        r"^\$ .* --resume .* --total-timesteps 640$", log, re.M
    )
    os.kill(proc.pid, signal.SIGTERM)  # kill -TERM of the sweep alone
    out, err = proc.communicate(timeout=PATIENCE_S)
    assert proc.returncode == 143 and "run the same command to resume" in out and "Traceback" not in err, err
    assert not processes_in(tmp_path)  # the sweep waited for its run to stop
    assert starts_and_ends(folder)[-1] and (folder / "train.log").read_text().rstrip().endswith(
        f"to resume it, run the sweep again: cd {shlex.quote(os.getcwd())} && "
        + shlex.join([sys.executable, str(ROOT / "tools" / "sweep.py"), "--root", str(tmp_path), *argv])
    )
    assert final_step(folder) < 640
    at = argv.index("--")  # --status as a sweep's flag, before --; or with --name alone
    for status in (sweep(tmp_path, *argv[:at], "--status", *argv[at:]), sweep(tmp_path, "--name", "k", "--status")):
        line = re.search(r"^stopped +dodgeball__ppg__1: step \d+ of 640 .*$", status.stdout, re.M)
        assert line and re.search(r"; stopped at step \d+ by SIGTERM: rerun the sweep to resume$", line[0]), (
            status.stdout
        )

    proc = subprocess.Popen(command, **interactive)
    wait_for_checkpoint(proc, 3)
    os.killpg(proc.pid, signal.SIGKILL)  # every process of the sweep at once
    proc.communicate(timeout=PATIENCE_S)
    wait_until_gone(proc)
    assert final_step(folder) < 640
    done = sweep(tmp_path, *argv)
    assert done.returncode == 0 and "resume " in done.stdout, done.stdout + done.stderr[-2000:]
    starts = re.findall(r"^# start", (folder / "train.log").read_text(), re.M)
    assert len(starts) == 4  # the first, the requeue's, after Ctrl-C, after SIGKILL
    assert final_step(folder) == 640 and logged_steps(folder) == list(range(64, 641, 64))


def test_the_slurm_path_submits_an_array_with_resources_command_and_requeue(tmp_path):
    """sbatch replaced by a stand-in on PATH that records what it is given: the job script's resources, the command
    that runs the pickled TrainRun of each run, the USR2 signal before the time limit that submitit requeues on."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(f'#!/bin/sh\ncp "$1" {tmp_path}/submitted.sh\necho "Submitted batch job 4242"\n')
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 0\n")  # submitit looks for it, to know it is on SLURM
    for tool in ("sbatch", "srun"):
        (bin_dir / tool).chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}")
    argv = ["--name", "s", "--games", "dodgeball", "--seeds", "1", "2", "--methods", "ppg", "--cluster", "slurm"]
    argv += ["--partition", "gpu", "--gpus-per-job", "1", "--cpus-per-job", "8", "--time-min", "1440", "--mem-gb", "32"]
    done = sweep(tmp_path / "runs", *argv, "--", *SWEEP_TINY, env=env)
    assert done.returncode == 0 and "submitted 2 jobs: 4242_0, 4242_1" in done.stdout, done.stderr[-2000:]
    asked = "each job asks SLURM for: partition gpu, GPUs 1, CPUs 8, time 1440 min, 32 GiB of memory; 8 OMP threads"
    assert done.stdout.count(asked) == 1, done.stdout  # once, before the runs
    script = (tmp_path / "submitted.sh").read_text()
    for line in ["--partition=gpu", "--gpus-per-node=1", "--cpus-per-task=8", "--time=1440", "--signal=USR2@120"]:
        assert f"#SBATCH {line}" in script, line
    assert "#SBATCH --mem=32768M" in script
    record = json.loads((tmp_path / "runs" / "s" / "dodgeball__ppg__1" / "sweep.json").read_text())
    assert (record["total"], record["threads"], record["script"]) == (192, 8, "ppg_procgen.py")
    assert "#SBATCH --array=0-1%" in script and "submitit.core._submit" in script
    # what each array task runs: a TrainRun (a submitit Checkpointable: requeued on the signal) of one run's folder
    import cloudpickle

    pickled = sorted((tmp_path / "runs" / "s" / ".submitit").glob("*_submitted.pkl"))
    assert [p.name for p in pickled] == ["4242_0_submitted.pkl", "4242_1_submitted.pkl"]
    delayed = cloudpickle.loads(pickled[0].read_bytes())
    assert delayed.function.__class__.__name__ == "TrainRun" and hasattr(delayed.function, "checkpoint")
    script_path, folder, flags, total, threads = delayed.args
    assert script_path == str(ROOT / "ppg_procgen.py") and folder.endswith("s/dodgeball__ppg__1")
    assert flags[:6] == ["--env-id", "dodgeball", "--seed", "1", "--exp-name", "ppg"] and total == 192 and threads == 8


def load_sweep():
    spec = importlib.util.spec_from_file_location("sweep_tool", ROOT / "tools" / "sweep.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_slots_with_a_faked_gpu_count(tmp_path, capsys, monkeypatch):
    """Local, 2 GPUs (faked): one job a GPU at once, each job told its own GPU through visible_gpus, all jobs run,
    each with its share of the cores as OpenMP threads (16 cores faked: 8 a job), which its training process gets."""
    tool, log, running = load_sweep(), [], set()
    monkeypatch.setattr(tool, "POLL_S", 0.01)
    monkeypatch.setattr(tool.os, "cpu_count", lambda: 16)

    class Job:
        def __init__(self, gpus):
            self.gpus, self.job_id, self.polls = gpus, str(len(log)), 0

        def done(self):
            self.polls += 1
            if self.polls >= 2:
                running.discard(self.gpus)
            return self.polls >= 2

        def result(self):
            return f"job {self.job_id} done"

    class Executor:
        folder = tmp_path

        def update_parameters(self, visible_gpus=()):
            self.gpus = visible_gpus

        def submit(self, function, script, folder, flags, total, threads):
            assert self.gpus not in running and threads == 8  # its GPU is free; half the cores
            running.add(self.gpus)
            log.append(self.gpus)
            return Job(self.gpus)

    opts = types.SimpleNamespace(gpus=2, jobs=1, threads=0, cluster="local", command="python tools/sweep.py", cwd="/")
    jobs = [(tmp_path / f"run{i}", [], 1) for i in range(5)]
    assert tool.run_local(opts, "ppg_procgen.py", jobs, Executor()) == 0
    assert len(log) == 5 and set(log) == {(0,), (1,)} and log[:2] == [(0,), (1,)]
    assert "GPU 1" in capsys.readouterr().out
    assert json.loads((tmp_path / "run0" / "sweep.json").read_text())["threads"] == 8  # recorded for its resumes
    # what a job runs gets them: OMP_NUM_THREADS in its training process (a stand-in script that prints it)
    script = tmp_path / "script.py"
    script.write_text("import os; print('OMP_NUM_THREADS', os.environ.get('OMP_NUM_THREADS'))\n")
    assert tool.TrainRun()(str(script), str(tmp_path / "run"), [], 1, 8) == "run: trained to step 1"
    assert "OMP_NUM_THREADS 8" in (tmp_path / "run" / "train.log").read_text()


def test_a_run_trained_by_a_live_process_is_not_started_again(tmp_path):
    """A sweep started twice, or a requeue while the previous process lives: the job finds the run's lock held (here
    by this test, as process 4242), leaves the folder as it is and starts nothing; the first trains on alone."""
    tool = load_sweep()
    run = tmp_path / "run" / "runs" / "dodgeball__ppg__1__1000"
    run.mkdir(parents=True)
    (run / "events.out.tfevents.1").write_bytes(b"the first process's log")
    script = tmp_path / "script.py"
    script.write_text("raise SystemExit('a second process started')\n")
    with open(run / "lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.write("4242")
        held.flush()
        message = tool.TrainRun()(str(script), str(tmp_path / "run"), [], 1, 1)
    assert message == "run: being trained by process 4242; not started again"
    assert sorted(p.name for p in run.iterdir()) == ["events.out.tfevents.1", "lock"]


def test_checkpoint_stops_the_training_process_and_resubmits_the_same_call(tmp_path):
    """What submitit calls on the time limit or a preemption signal: the running training process gets SIGTERM (the
    scripts stop at once, keeping their last checkpoint), and the same call is resubmitted with a fresh TrainRun."""
    tool = load_sweep()
    run = tool.TrainRun()
    run.process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    resubmitted = run.checkpoint("script.py", str(tmp_path), ["--seed", "1"], 192, 1)
    assert run.process.returncode == -signal.SIGTERM
    assert isinstance(resubmitted.function, tool.TrainRun) and resubmitted.function is not run
    assert resubmitted.args == ("script.py", str(tmp_path), ["--seed", "1"], 192, 1)


def test_a_failed_job_is_one_line_and_the_queue_goes_on(tmp_path, capsys, monkeypatch):
    """A job that fails (the script's own exit, or submitit's controller giving up on it) is reported in one line that
    says why and how to go on; the other jobs still run, and the sweep exits with 1."""
    tool = load_sweep()
    monkeypatch.setattr(tool, "POLL_S", 0.01)
    errors = [
        "Job 7 (task: 0) with path /x/7_0_result.pkl\nhas not produced any output (state: FINISHED)\nError stream: ...",
        "Traceback ...\nRuntimeError: run1: the script exited with 1 (see its train.log)\n",
        None,
    ]

    class Job:
        def __init__(self, error):
            self.error, self.job_id = error, "7"

        def done(self):
            return True

        def result(self):
            if self.error:
                raise RuntimeError(self.error)
            return "run2: trained"

    class Executor:
        folder = tmp_path

        def update_parameters(self, **kwargs):
            pass

        def submit(self, function, *args):
            return Job(errors.pop(0))

    opts = types.SimpleNamespace(gpus=0, jobs=1, threads=1, cluster="local", command="python tools/sweep.py", cwd="/")
    jobs = [(tmp_path / f"run{i}", [], 1) for i in range(3)]
    assert tool.run_local(opts, "ppg_procgen.py", jobs, Executor()) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[1] == (
        "failed run0: Job 7 (task: 0) with path /x/7_0_result.pkl has not produced any output (state: FINISHED); run "
        "the command again to resume"
    )
    assert (
        out[3]
        == "failed run1: RuntimeError: run1: the script exited with 1 (see its train.log); run the command again to resume"
    )
    assert out[5] == "run2: trained"


def test_status_says_where_each_run_stands_from_its_folder(sweep_grid, tmp_path, capsys, monkeypatch):
    """--status, without a scheduler: the shared grid's runs are done (and nothing is written); from a run's train.log
    and the job written down for it, a run is failed (its last start's exit and last line, and the env step it
    reached), stopped (a stop, before the script's handler too; killed, by kill -9 or with no exit logged: what
    resumes it), running (a job holds its lock, whatever a start refused since wrote down; a local job whose process
    lives; a SLURM job that squeue lists as running), queued (a SLURM job waiting, with its reason), unknown (a SLURM job where no squeue answers), not started, or to resume (a budget raised
    after its last start ended well). tests/test_slurm.py reads it off a real scheduler."""
    tool = load_sweep()
    before = {p: p.stat().st_mtime for p in sweep_grid.folder.rglob("*") if p.is_file()}
    monkeypatch.setitem(sys.modules, "ppg_procgen", sys.modules.get("ppg_procgen"))  # sweep.py loads its own
    tool.main(["--root", str(sweep_grid.root), *sweep_grid.argv, "--status", "--", *SWEEP_TINY])
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == "4 runs: 4 done" and all(
        re.match(r"done +dodgeball__pp[go]__\d: step 192 of 192$", x) for x in lines[:4]
    )
    assert {p: p.stat().st_mtime for p in sweep_grid.folder.rglob("*") if p.is_file()} == before
    progress = "phase 1/3 iter 1/3 step 64 SPS 10 ETA 3s return - (none ended yet) policy_loss 0.1 value_loss 0.2"
    log = f"\n# start 1.0\n$ python ppg_procgen.py\n{progress}\nerror: non-finite loss\n"
    cases = [  # (train.log, the job written down, what squeue says, what --status says)
        (log + "# end 2.0 exit 1\n", None, None, ("failed", "step 64 of 192", "; exit 1: error: non-finite loss")),
        (
            log,
            None,
            None,
            ("stopped", "step 64 of 192", "; killed (no exit logged) at step 64: rerun the sweep to start it afresh"),
        ),
        (  # SIGTERM before the script's handler (its first seconds): a stop all the same
            log + "# end 2.0 exit -15\n",
            None,
            None,
            ("stopped", "step 64 of 192", "; stopped at step 64 by SIGTERM: rerun the sweep to start it afresh"),
        ),
        (log, f"local {os.getpid()}", None, ("running", "step 64 of 192", f"; local job {os.getpid()}")),
        (log, "slurm 9_1", {"9_1": ("RUNNING", "None")}, ("running", "step 64 of 192", "; job 9_1 RUNNING")),
        (
            log,
            "slurm 9_1",
            {"9_1": ("PENDING", "BeginTime")},
            ("queued", "step 64 of 192", "; job 9_1 PENDING, BeginTime"),
        ),
        (
            log + "stopped by SIGTERM; resume with: python ppg_procgen.py --resume /x\n# end 2.0 exit 143\n",
            "slurm 9_1",
            {},
            ("stopped", "step 64 of 192", "; stopped at step 64 by SIGTERM: rerun the sweep to start it afresh"),
        ),
        (
            log + "# end 2.0 exit 130\n# stopped by SIGINT, a run of a sweep: to resume it, run the sweep again\n",
            f"local {2**22 + 1}",  # past Linux's largest pid: its process has ended
            None,
            ("stopped", "step 64 of 192", "; stopped at step 64 by SIGINT: rerun the sweep to start it afresh"),
        ),
        (
            log,
            "slurm 9_1",
            None,
            (
                "unknown",
                "step 64 of 192",
                "; job 9_1: no squeue answers here, for SLURM's state; its log's last line: error: non-finite loss",
            ),
        ),
        (None, None, None, ("not started", "step 0 of 192", "")),
    ]
    for i, (text, job, squeue, expected) in enumerate(cases):
        folder = tmp_path / str(i)
        folder.mkdir()
        if text is not None:
            (folder / "train.log").write_text(text)
        if job is not None:
            (folder / "job_id").write_text(job)
        assert tool.run_status(folder, 192, squeue) == expected, i
    done = sweep_grid.folder / "dodgeball__ppg__1"  # its checkpoint at 192, the budget raised to 256
    assert tool.run_status(done, 256, None) == ("to resume", "step 192 of 256", "")
    # a lost machine: the sweep and the training process killed (kill -9) after a checkpoint; the job lived to log it
    killed = tmp_path / "killed"
    shutil.copytree(done, killed)
    with open(killed / "train.log", "a") as written:
        written.write(
            f"\n# start 3.0\n$ python ppg_procgen.py --resume x\n{progress.replace('64', '256')}\n# end 4.0 exit -9\n"
        )
    resume = "rerun the sweep to resume from step 192"
    expected = (
        "stopped",
        "step 256 of 320 (checkpoint at 192)",
        f"; killed by SIGKILL (exit -9) at step 256: {resume}",
    )
    assert tool.run_status(killed, 320, None) == expected
    # a run that a job holds (its JOB_LOCK) runs, whatever a later start, refused, wrote down: here a job id of a
    # process that has ended, and a log without its end
    with open(killed / "job.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.write("4242\n")
        held.flush()
        (killed / "job_id").write_text(f"local {2**22 + 1}\n")
        (killed / "train.log").write_text(log)
        assert tool.run_status(killed, 320, None) == ("running", "step 192 of 320", "; trained by process 4242")
    # --name NAME --status alone: every run of the sweep, from its folder, as recorded at its submission
    tool.main(["--root", str(sweep_grid.root), "--name", "grid", "--status"])
    assert capsys.readouterr().out.splitlines() == lines
    copy = tmp_path / "sweeps" / "old"  # a run submitted before plans were recorded: its checkpoint's flags plan it
    shutil.copytree(done, copy / done.name)
    (copy / done.name / "sweep.json").unlink()
    tool.main(["--root", str(tmp_path / "sweeps"), "--name", "old", "--status"])
    assert capsys.readouterr().out.splitlines() == [lines[0], "1 runs: 1 done"]


# A stand-in training script that stops as the scripts stop (128 + the signal, its stop line) and writes down every
# signal it gets, and that it has started: a sweep's stop is read from it without a training run
STAND_IN = """
import os, signal, sys, time
def stop(signum, frame):
    with open("signals", "a") as f:
        f.write(signal.Signals(signum).name + "\\n")
    print("stopped by " + signal.Signals(signum).name, flush=True)
    time.sleep(1)  # a stop takes a while: a second signal within it is written down too
    sys.exit(128 + signum)
signal.signal(signal.SIGTERM, stop)
signal.signal(signal.SIGINT, stop)
open("started", "w").close()
while True:
    time.sleep(0.1)
"""

# The local queue of 3 runs (or as many as a fourth argument says), 2 at once, in a process of its own (as
# tools/sweep.py runs it), on the stand-in script
LOCAL_QUEUE = """
import importlib.util, sys, types, submitit
spec = importlib.util.spec_from_file_location("sweep_tool", sys.argv[1])
tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tool)
root, script, runs = sys.argv[2], sys.argv[3], int(sys.argv[4]) if len(sys.argv) > 4 else 3
opts = types.SimpleNamespace(gpus=0, jobs=2, threads=1, cluster="local", command="python tools/sweep.py ...", cwd=root)
executor = submitit.LocalExecutor(root + "/.submitit")
executor.update_parameters(timeout_min=60)
sys.exit(tool.run_local(opts, script, [(tool.pathlib.Path(root, f"run{i}"), [], 1) for i in range(runs)], executor))
"""
# The stop's note in a run's train.log, the queue's command after it as the sweep writes it: from any folder
QUEUE_NOTE = "a run of a sweep: to resume it, run the sweep again: cd {root} && python tools/sweep.py ..."


def processes_in(folder: pathlib.Path) -> list:
    """The pids of the processes whose working directory lies in folder."""
    found = []
    for proc in pathlib.Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):
            if (proc / "cwd").resolve().is_relative_to(folder):
                found.append(int(proc.name))
    return found


@pytest.mark.parametrize("how", ["SIGTERM", "Ctrl-C", "SIGHUP"])
def test_a_stopped_sweep_passes_the_signal_to_its_runs_and_waits_for_them(tmp_path, how):
    """SIGTERM to the sweep's process alone (`kill -TERM`), SIGINT to its whole process group (a terminal's Ctrl-C), or
    SIGHUP to its whole process group (a terminal closed, which reaches submitit's controller and job process too):
    each running training process gets the signal once (SIGHUP as SIGTERM, which the scripts stop on), stops as the
    scripts stop (128 + the signal, logged in its train.log with the sweep's command that resumes it), the queue starts
    no other run, and the sweep exits with 128 + the signal it got once no training process is left. (A stand-in
    script: the real scripts' stop and resume are test_a_sweep_signalled_stopped_and_killed_...'s.)"""
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    # its output to a file, not a pipe, which a job left running would hold open: the test waits for the sweep alone
    printed = open(tmp_path / "printed", "w+")
    interactive = dict(stdout=printed, stderr=subprocess.STDOUT, start_new_session=True)
    interactive["preexec_fn"] = functools.partial(signal.signal, signal.SIGINT, signal.SIG_DFL)  # as at a terminal
    command = [sys.executable, "-c", LOCAL_QUEUE, str(ROOT / "tools" / "sweep.py"), str(tmp_path), str(script)]
    proc = subprocess.Popen(command, **interactive)
    deadline = time.time() + PATIENCE_S  # a hang guard only
    while not all((tmp_path / f"run{i}" / "started").exists() for i in (0, 1)):
        assert proc.poll() is None and time.time() < deadline, (tmp_path / "printed").read_text()
        time.sleep(0.1)
    signum = dict(SIGTERM=signal.SIGTERM, SIGHUP=signal.SIGHUP).get(how, signal.SIGINT)
    passed = signal.SIGINT if how == "Ctrl-C" else signal.SIGTERM  # what the runs get
    if how == "SIGTERM":
        os.kill(proc.pid, signum)
    else:
        os.killpg(proc.pid, signum)
    proc.wait(timeout=PATIENCE_S)
    out, left = (tmp_path / "printed").read_text(), processes_in(tmp_path)
    for pid in left:  # nothing left running by a failed test
        os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 128 + signum and not left, out  # no training process outlives the sweep
    assert f"stopped by {signum.name}: 2 jobs stopped; run the same command to resume" in out, out
    for i in (0, 1):
        run = tmp_path / f"run{i}"
        assert (run / "signals").read_text() == f"{passed.name}\n", i  # once: not from the terminal and the sweep
        log = (run / "train.log").read_text()
        assert re.search(rf"^# end [\d.]+ exit {128 + passed}$", log, re.M), log
        assert log.endswith(f"# stopped by {passed.name}, {QUEUE_NOTE.format(root=tmp_path)}\n"), log
    assert not (tmp_path / "run2").exists()  # the queue's third run never started


def left_of_queues(root: pathlib.Path) -> list:
    """The pids of the processes that local queues under root left: the queues themselves, submitit's controllers and
    job processes (each names root in its command line) and the training processes (whose working directory lies in
    root)."""
    found = set(processes_in(root))
    for cmdline in pathlib.Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):
            if (
                str(root) in cmdline.read_bytes().replace(b"\0", b" ").decode()
                and int(cmdline.parent.name) != os.getpid()
            ):
                found.add(int(cmdline.parent.name))
    return sorted(found)


def wait_until_gone(root: pathlib.Path, seconds: float) -> list:
    """Wait until no process of the queues under root is left, at most `seconds`: what is left then."""
    deadline = time.time() + seconds
    while (left := left_of_queues(root)) and time.time() < deadline:
        time.sleep(0.2)
    return left


def test_a_sweep_started_twice_trains_once_and_a_kill_of_it_alone_stops_its_run(tmp_path):
    """The same sweep of one run started twice, 0.3 s apart, each submitting its job before the other's has started
    the run: one training process (the job that runs a run holds the run folder's lock from its first moment, its
    training process with it; the script's own lock comes seconds after its start, here never); the other's job starts
    nothing and its sweep ends; --status says the run is running, whatever the refused one wrote down. Then kill -9 of
    the training sweep's process alone, not its group (its controller and job process live on): its job stops the run
    with SIGTERM, as the sweep's own stop would, and logs the end and the sweep's command that resumes it; --status
    says stopped, and no process of either sweep is left. (A stand-in script, which runs until a signal stops it.)"""
    tool = load_sweep()
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    command = [sys.executable, "-c", LOCAL_QUEUE, str(ROOT / "tools" / "sweep.py"), str(tmp_path), str(script), "1"]
    run, sweeps = tmp_path / "run0", []
    try:
        for i in (0, 1):
            printed = open(tmp_path / f"printed{i}", "w+")
            sweeps.append(subprocess.Popen(command, stdout=printed, stderr=subprocess.STDOUT, start_new_session=True))
            time.sleep(0.3)
        deadline = time.time() + PATIENCE_S  # a hang guard only: the sweeps start at the machine's speed
        while not (run / "started").exists():
            assert time.time() < deadline and all(p.poll() is None for p in sweeps)
            time.sleep(0.1)
        deadline = time.time() + 60  # the refused sweep ends within seconds of its job's start; without the lock, never
        while all(p.poll() is None for p in sweeps) and time.time() < deadline:
            time.sleep(0.1)
        ended = [i for i, p in enumerate(sweeps) if p.poll() is not None]
        assert len(ended) == 1, "both sweeps train the run"
        refused, kept = sweeps[ended[0]], sweeps[1 - ended[0]]
        out = (tmp_path / f"printed{ended[0]}").read_text()
        assert refused.returncode == 0 and re.search(
            r"^run0: being trained by process \d+; not started again$", out, re.M
        )
        assert len(processes_in(run)) == 1 and (run / "train.log").read_text().count("# start ") == 1
        status = tool.run_status(run, 1, None)
        assert status[0] == "running" and status[2].startswith("; trained by process "), status
        os.kill(kept.pid, signal.SIGKILL)  # the sweep's process alone
        kept.wait(timeout=PATIENCE_S)
        left = wait_until_gone(tmp_path, 60)
        assert not left, f"processes left after the sweep's kill -9: {left}"
    finally:
        for pid in left_of_queues(tmp_path):  # nothing left running by a failed test
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert (run / "signals").read_text() == "SIGTERM\n"
    log = (run / "train.log").read_text()
    assert re.search(r"^# end [\d.]+ exit 143$", log, re.M), log
    assert log.endswith(f"# stopped by SIGTERM, {QUEUE_NOTE.format(root=tmp_path)}\n"), log
    stopped = "; stopped at step 0 by SIGTERM: rerun the sweep to start it afresh"
    assert tool.run_status(run, 1, None) == ("stopped", "step 0 of 1", stopped)


def test_a_stop_in_the_first_seconds_and_on_slurm_say_what_resumes_the_run(tmp_path, monkeypatch):
    """What a job writes after its script stopped on a signal. A SIGTERM before the script has set its handler (its
    first seconds: exit -15) is a stop like any other, with the sweep's command, and --status says stopped. On SLURM,
    SIGTERM comes from `scontrol requeue` or a preemption (SLURM requeues the job, which resumes the run by itself) or
    from scancel (nothing does): the line says both. A stop for submitit's requeue (checkpoint(), on the time limit's
    warning signal) says that the requeued job resumes the run, not to run the sweep again."""
    tool = load_sweep()
    record = dict(command=shlex.join([sys.executable, "/x/tools/sweep.py", "--name", "n"]), cwd="/a folder")
    hint = f"cd '/a folder' && {record['command']}"
    early = tmp_path / "early.py"
    early.write_text("import os, signal\nos.kill(os.getpid(), signal.SIGTERM)\n")
    stand_in = tmp_path / "stand_in.py"
    stand_in.write_text(STAND_IN)

    def stopped_log(name: str, script: pathlib.Path, run=None) -> str:
        folder = tmp_path / name
        folder.mkdir()
        (folder / "sweep.json").write_text(json.dumps(record))
        with pytest.raises(RuntimeError, match="the script exited with (-15|143)"):
            (run or tool.TrainRun())(str(script), str(folder), [], 1, 1)
        return (folder / "train.log").read_text()

    log = stopped_log("early", early)
    assert log.endswith(
        f"exit -15\n# stopped by SIGTERM, a run of a sweep: to resume it, run the sweep again: {hint}\n"
    )
    stopped = "; stopped at step 0 by SIGTERM: rerun the sweep to start it afresh"
    assert tool.run_status(tmp_path / "early", 1, None) == ("stopped", "step 0 of 1", stopped)
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")  # as submitit's job script on SLURM sets it, in a job of SLURM's
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    log = stopped_log("slurm", early)
    assert log.endswith(
        "# stopped by SIGTERM, a run of a sweep on SLURM: where SLURM requeued its job (scontrol requeue, a "
        f"preemption) the job resumes it by itself (--status says queued); where it did not (scancel), run the sweep "
        f"again: {hint}\n"
    ), log
    run = tool.TrainRun()

    def requeue():  # submitit's handler of the time limit's signal, once the run has started
        while not (tmp_path / "requeued" / "started").exists():
            time.sleep(0.05)
        run.checkpoint(str(stand_in), str(tmp_path / "requeued"), [], 1, 1)

    thread = threading.Thread(target=requeue)
    thread.start()
    log = stopped_log("requeued", stand_in, run)
    thread.join()
    assert log.endswith(
        "exit 143\n# stopped by SIGTERM for a requeue of its job: the requeued job resumes it by itself\n"
    )
    assert (tmp_path / "requeued" / "job_id").read_text() == "slurm 77\n"  # the job that ran it, written by itself


def test_locks_work_on_nfs_and_a_filesystem_without_them_stops_in_one_line(tmp_path, monkeypatch):
    """NFS grants flock only on a file open for writing: the sweep opens every lock it takes or tests for reading and
    writing, so a run that the script trains by hand is seen. The lock files it creates have mode 0644, whatever the
    umask. A filesystem that refuses locks (ENOSYS: Lustre without -o flock) stops the sweep, or a job, in one line."""
    tool = load_sweep()
    run = tmp_path / "run" / "runs" / "dodgeball__ppg__1__1000"
    run.mkdir(parents=True)
    held = open(run / "lock", "w")  # the script's lock, held as the script holds it
    fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
    held.write("4242")
    held.flush()
    flock = fcntl.flock

    def nfs_flock(fd, how):  # as on NFS: a file open for reading alone gets no lock
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY:
            raise OSError(errno.EBADF, os.strerror(errno.EBADF))
        flock(fd, how)

    monkeypatch.setattr(fcntl, "flock", nfs_flock)
    assert tool.trained_by_hand(tmp_path / "run") == "4242"
    umask = os.umask(0)
    try:
        lock = tool.take_job_lock(tmp_path / "run")
    finally:
        os.umask(umask)
    assert lock is not None and (tmp_path / "run" / "job.lock").stat().st_mode & 0o777 == 0o644
    assert tool.holder(tmp_path / "run" / "job.lock") == str(os.getpid())
    os.close(lock)
    held.close()

    def no_locks(fd, how):
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    path = tmp_path / "run" / "job.lock"
    with pytest.raises(RuntimeError) as refused:
        tool.take_job_lock(tmp_path / "run")
    with pytest.raises(SystemExit) as stopped:
        tool.holder(path)
    line = f"error: {path}: its filesystem refuses file locks (Function not implemented), which keep a run to one"
    for message in (str(refused.value), str(stopped.value.code)):
        assert message.startswith(line) and "\n" not in message, message


def test_the_sweeps_hints_name_its_interpreter_and_work_from_any_folder(tmp_path, monkeypatch):
    """The command that resumes a sweep's runs (train.log's note, --status's last line) is the folder it was typed in,
    then the interpreter that ran it and the sweep's whole path: `python tools/sweep.py` from another folder, or with
    another python on PATH, fails."""
    tool = load_sweep()
    monkeypatch.chdir(tmp_path)
    argv = ["--name", "x", "--games", "dodgeball", "--", "--n-pi", "2"]
    opts, _ = tool.read_command(argv)
    hint = tool.resume_hint(dict(command=opts.command, cwd=opts.cwd))
    assert shlex.split(hint) == ["cd", str(tmp_path), "&&", sys.executable, str(ROOT / "tools" / "sweep.py"), *argv]


def test_no_flag_of_the_sweep_is_a_flag_of_a_script():
    """A flag of the sweep after -- is refused as the sweep's: none may be a script's flag too, which it would take."""
    from conftest import SCRIPTS, load_script

    tool = load_sweep()
    for name in SCRIPTS:
        fields = {f"--{field.replace('_', '-')}" for field in vars(load_script(name).Args())}
        assert not fields & tool.sweep_options(), name


def test_a_dry_run_shows_each_jobs_resources_and_each_runs_memory(tmp_path):
    """The paper's batch on a GPU job: B (8,192 trajectories x 256 steps, each step a 64x64x3 uint8 frame and 38 bytes
    of other fields, and 15 logits: 24.18 GiB) and its activations, as the script plans them; on a CPU partition the
    runs' RAM, in chunks of 256 states. Each job's request, once."""
    argvs = [
        ["--experiment", "ppg", "--cluster", "slurm", "--partition", "gpu", "--dry-run"],
        ["--experiment", "ppo", "--cluster", "slurm", "--gpus-per-job", "0", "--cpus-per-job", "4", "--dry-run"],
    ]
    (stop, gpu), (stop_cpu, cpu) = mains_in_one_process(tmp_path, argvs)
    assert stop is None and stop_cpu is None, (stop, stop_cpu)
    assert gpu.count("each job asks SLURM for: partition gpu, GPUs 1, CPUs 8, time 1440 min, the cluster's") == 1
    step_bytes = 64 * 64 * 3 + 8 + 4 + 4 + 4 + 4 + 1 + 4 + 4 + 15 * 4  # obs, actions, 6 floats, ended, logits
    assert f"B {8192 * 256 * step_bytes / 2**30:.2f} GiB" == "B 24.18 GiB"
    memory = [line for line in gpu.splitlines() if line.startswith("memory a run")]
    assert memory[0].startswith("memory a run (ppg): B 24.18 GiB + activations ") and "GiB of GPU memory" in memory[0]
    assert len(memory) == 1 and "(whole minibatches)" in memory[0], memory
    assert cpu.count("partition the cluster's default, GPUs 0, CPUs 4,") == 1, cpu
    assert re.search(
        r"^memory a run \(ppo\): B [\d.]+ GiB \+ activations [\d.]+ GiB \(chunks of 256 states\) = [\d.]+ GiB of RAM$",
        cpu,
        re.M,
    ), cpu


def test_a_run_keeps_the_threads_it_started_with(sweep_grid, tmp_path, capsys, monkeypatch):
    """A run with a checkpoint resumes at the thread count recorded at its start, whatever --threads, --jobs or the
    cores say now; a run without one takes today's count. The dry run names a run that keeps another count."""
    tool = load_sweep()
    run = tmp_path / "run"
    shutil.copytree(sweep_grid.folder / "dodgeball__ppg__1", run)
    record = json.loads((run / "sweep.json").read_text())
    assert record["threads"] == max(1, (os.cpu_count() or 1) // 2)  # the grid's --jobs 2: half the cores
    (run / "sweep.json").write_text(json.dumps(dict(record, threads=3)))
    assert tool.kept_threads(run, 8) == 3
    shutil.rmtree(run / "runs")  # no checkpoint: a fresh start, at today's count
    assert tool.kept_threads(run, 8) == 8
    at = sweep_grid.argv.index("--jobs")
    argv = [*sweep_grid.argv[:at], "--jobs", "1", "--threads", "5", "--dry-run", "--", *SWEEP_TINY]
    argv += ["--total-timesteps", "256"]  # the grid's runs to resume
    monkeypatch.setitem(sys.modules, "ppg_procgen", sys.modules.get("ppg_procgen"))  # sweep.py loads its own
    tool.main(["--root", str(sweep_grid.root), *argv])
    resumes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("resume ")]
    expected = f"(its {record['threads']} threads, as at its start): "
    assert len(resumes) == 4 and all(expected in line for line in resumes), resumes
