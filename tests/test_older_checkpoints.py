"""A checkpoint written by an older version of ppg_procgen.py, that of commit 6c6e5c6 (kept compressed in tests/data:
the suite runs on checkouts without history). That version had --torch-deterministic (now always on: a retired flag)
and --anneal-lr, and recorded neither the script a run derives from nor the conditions of a bit-identical resume. The
current script resumes its checkpoint, tools/evaluate.py evaluates it, a rerun of tools/sweep.py resumes it, and
tools/report.py counts the retired flag as the released value; a retired flag at another value is refused, named."""

import importlib.util
import json
import lzma
import os
import shutil
import subprocess
import sys
import types

import pytest
import torch
import tyro

from conftest import PATIENCE_S, ROOT, load_script, main_in_process, refusal

OLD_SCRIPT = ROOT / "tests" / "data" / "ppg_procgen_6c6e5c6.py.xz"
# 3 rollouts of 2 envs x 16 steps, an aux phase after the second: a checkpoint after each of the 2 phases
FLAGS = ["--num-envs", "2", "--num-steps", "16", "--n-pi", "2", "--e-aux", "1", "--num-minibatches", "1"]
FLAGS += ["--aux-mb-trajectories", "2"]


def load_tool(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_tool", ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def old_run(tmp_path_factory):
    """A sweep's folder with one run that the old script trained, as a sweep of that version left it:
    <root>/old/dodgeball__ppg__1/runs/<run_name>/. The old script runs under its own name, ppg_procgen.py."""
    root = tmp_path_factory.mktemp("older")
    script = root / "old_version" / "ppg_procgen.py"
    script.parent.mkdir()
    script.write_bytes(lzma.decompress(OLD_SCRIPT.read_bytes()))
    job = root / "old" / "dodgeball__ppg__1"
    job.mkdir(parents=True)
    argv = [sys.executable, str(script), "--env-id", "dodgeball", "--seed", "1", "--exp-name", "ppg", *FLAGS]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(
        [*argv, "--total-timesteps", "96"], cwd=job, env=env, capture_output=True, text=True, timeout=PATIENCE_S
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (run,) = (job / "runs").iterdir()
    state = torch.load(run / "checkpoint.pt", weights_only=True)
    # what makes it an older version's: both flags, and no base_script or resume conditions
    assert (state["args"]["torch_deterministic"], state["args"]["anneal_lr"], state["phase"]) == (True, False, 2)
    assert state["script"] == "ppg_procgen.py" and "base_script" not in state and "same" not in state
    return types.SimpleNamespace(root=root, sweep=root / "old", run=run)


def copied(run, folder):
    """A copy of the run's folder in `folder`/runs/ (the tools write beside the checkpoint; the shared run stays)."""
    copy = folder / "runs" / run.name
    shutil.copytree(run, copy)
    return copy


def test_the_current_script_resumes_it(old_run, tmp_path, monkeypatch, capsys):
    run = copied(old_run.run, tmp_path)
    flags = ["--resume", str(run), "--total-timesteps", "160"]
    main_in_process(load_script("ppg_procgen.py"), flags, tmp_path, monkeypatch)
    assert f"resumed from {run}/checkpoint.pt after phase 2, step 96" in capsys.readouterr().out
    state = torch.load(run / "checkpoint.pt", weights_only=True)
    assert (state["global_step"], state["script"], state["base_script"]) == (160, "ppg_procgen.py", "ppg_procgen.py")
    assert "torch_deterministic" not in state["args"] and state["args"]["anneal_lr"] is False


def test_tools_evaluate_evaluates_it(old_run, tmp_path, monkeypatch, capsys):
    run = copied(old_run.run, tmp_path)
    monkeypatch.setattr(sys, "argv", ["evaluate.py", str(run / "checkpoint.pt"), "--episodes", "2", "--cpu"])
    load_tool("evaluate").main()
    report = json.loads((run / "checkpoint.eval-step96-2ep-seed0.json").read_text())
    assert (report["script"], report["base_script"], report["sets"]["all_levels"]["n"]) == (
        "ppg_procgen.py",
        "ppg_procgen.py",
        2,
    )


def test_a_rerun_of_its_sweep_resumes_it(old_run):
    """The sweep's command run again with a raised budget plans the run's resume (the dry run: nothing is written)."""
    argv = ["--root", str(old_run.root), "--name", "old", "--games", "dodgeball", "--seeds", "1", "--methods", "ppg"]
    command = [sys.executable, str(ROOT / "tools" / "sweep.py"), *argv, "--dry-run", "--", *FLAGS]
    done = subprocess.run([*command, "--total-timesteps", "160"], capture_output=True, text=True, timeout=PATIENCE_S)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert f"--resume {old_run.run}" in done.stdout, done.stdout


def test_tools_report_counts_its_retired_flag_as_the_released_value(old_run, tmp_path, monkeypatch, capsys):
    report = load_tool("report")
    (run,) = report.read_runs(old_run.sweep)
    differences = report.differences_from_released(run)  # the tiny run's flags, but none for the two old flags
    assert "--num-envs 2 (released: 256)" in differences and not [d for d in differences if "deterministic" in d]
    assert not [d for d in differences if "anneal" in d], differences
    protocol = load_tool("experiments").PAPER_PROTOCOL.split()
    released = vars(tyro.cli(load_script("ppg_procgen.py").Args, args=protocol))
    older = dict(released, torch_deterministic=True, anneal_lr=False)  # the paper's protocol, saved by the old version
    assert report.differences_from_released(dict(method="ppg", flags=older)) == []
    del older["anneal_lr"]  # a checkpoint of the versions without --anneal-lr: a constant rate
    assert report.differences_from_released(dict(method="ppg", flags=older)) == []
    older["torch_deterministic"] = False
    assert report.differences_from_released(dict(method="ppg", flags=older)) == [
        "--torch-deterministic False (released: True)"
    ]
    # the whole report of the old sweep, as a user runs it
    monkeypatch.setattr(sys, "argv", ["report.py", str(old_run.sweep), "--reps", "20", "--out", str(tmp_path / "r")])
    monkeypatch.setenv("PPG_RELEASED_CODE", str(tmp_path))  # no released code: no released column
    report.main()
    assert "| dodgeball |" in capsys.readouterr().out


def test_a_retired_flag_at_another_value_is_refused_naming_it(old_run, tmp_path, monkeypatch):
    run = copied(old_run.run, tmp_path)
    state = torch.load(run / "checkpoint.pt", weights_only=True)
    state["args"]["torch_deterministic"] = False
    torch.save(state, run / "checkpoint.pt")
    (tmp_path / "elsewhere").mkdir()
    message = refusal(load_script("ppg_procgen.py"), ["--resume", str(run)], tmp_path / "elsewhere", monkeypatch)
    assert message.endswith("written with --torch-deterministic False, a retired flag this version fixes at True")
    monkeypatch.setattr(sys, "argv", ["evaluate.py", str(run / "checkpoint.pt"), "--episodes", "2", "--cpu"])
    with pytest.raises(SystemExit) as stopped:
        load_tool("evaluate").main()
    assert str(stopped.value.code).endswith(
        "written with --torch-deterministic False, a flag ppg_procgen.py has fixed at another value"
    )
