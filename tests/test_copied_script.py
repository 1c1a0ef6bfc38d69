"""A hacked copy keeps its tools: a copy of ppg_procgen.py under another name, outside the checkout and changed (a
head the original lacks, so that only the copy's own classes can load its weights), is swept with tools/sweep.py
--script PATH; tools/evaluate.py evaluates its checkpoint with the copy's classes and tools/report.py reports its runs,
naming the copy as what keeps them from being the released run."""

import contextlib
import importlib.util
import io
import json
import pathlib
import subprocess
import sys
import types

import pytest
import torch

from conftest import PATIENCE_S, ROOT, SWEEP_TINY, main_in_process

HEAD = "        self.extra_heads = nn.ModuleDict()\n"
NAME = "ppg_procgen_vlam.py"


def load_tool(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_tool", ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_copy(root):
    """The hacked copy, in a folder of its own: a head the original lacks, so only the copy's classes load its weights."""
    text = (ROOT / "ppg_procgen.py").read_text()
    assert text.count(HEAD) == 1
    hack = HEAD + '        self.extra_heads["probe"] = normed_init_(nn.Linear(width, 1), 0.1)  # the hack\n'
    (root / "hacks").mkdir()
    (root / "hacks" / NAME).write_text(text.replace(HEAD, hack))
    return root / "hacks" / NAME


def sweep_argv(root, copy) -> list:
    argv = ["--root", str(root / "runs"), "--name", "vlam", "--script", str(copy)]
    return argv + ["--games", "dodgeball", "--seeds", "1", "--methods", "ppg", "--", *SWEEP_TINY]


@pytest.fixture(scope="module")
def copied_sweep(tmp_path_factory):
    """A one-run sweep of the copy: the job's command as the sweep's dry run plans it, then that command's training
    run in this process, in the sweep's folder for it (the real sweep of a copy: test_a_real_sweep_trains_the_copy)."""
    root = tmp_path_factory.mktemp("copy")
    copy = make_copy(root)
    sweep = load_tool("sweep")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        sweep.main([*sweep_argv(root, copy)[: -1 - len(SWEEP_TINY)], "--dry-run", "--", *SWEEP_TINY])
    (start,) = [line for line in out.getvalue().splitlines() if line.startswith("start ")]
    folder, command = start.removeprefix("start").strip().split(": ", 1)
    assert pathlib.Path(folder).is_absolute(), start  # the run's folder is made below, never under the checkout
    words = command.split()
    assert words[:2] == [sys.executable, str(copy)], command  # the job runs the copy, by the sweep's interpreter
    spec = importlib.util.spec_from_file_location("copied_script", copy)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    pathlib.Path(folder).mkdir(parents=True)
    with pytest.MonkeyPatch.context() as mp:
        main_in_process(module, words[2:], pathlib.Path(folder), mp)
    (run,) = (pathlib.Path(folder) / "runs").iterdir()
    return types.SimpleNamespace(root=root, copy=copy, sweep=root / "runs" / "vlam", run=run)


def test_sweep_runs_a_copy_given_by_its_path(copied_sweep, tmp_path, monkeypatch, capsys):
    state = torch.load(copied_sweep.run / "checkpoint.pt", weights_only=True)
    assert (state["script"], state["base_script"], state["global_step"]) == (NAME, "ppg_procgen.py", 192)
    assert "extra_heads.probe.weight" in state["agent"]  # trained by the copy
    sweep = load_tool("sweep")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.py").write_text("x = 1\n")
    for script, stop in [
        ("missing.py", "error: --script missing.py: no such file, here or in the repository root"),
        ("notes.py", "error: --script notes.py: not ppg_procgen.py, ppg_atari.py or a copy of either"),
    ]:
        with pytest.raises(SystemExit) as stopped:
            sweep.main(["--name", "x", "--script", script, "--games", "dodgeball", "--dry-run"])
        assert str(stopped.value.code) == stop
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.py"]  # refused before any folder was made


@pytest.mark.slow  # a real local sweep of a copy (22 s to 88 s); the fixture above runs its planned command in process
def test_a_real_sweep_trains_the_copy(tmp_path):
    copy = make_copy(tmp_path)
    argv = [sys.executable, str(ROOT / "tools" / "sweep.py"), *sweep_argv(tmp_path, copy)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=PATIENCE_S)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    (run,) = (tmp_path / "runs" / "vlam" / "dodgeball__ppg__1" / "runs").iterdir()
    state = torch.load(run / "checkpoint.pt", weights_only=True)
    assert (state["script"], state["global_step"]) == (NAME, 192) and "extra_heads.probe.weight" in state["agent"]


def evaluate(monkeypatch, capsys, cwd, *argv: str):
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "argv", ["evaluate.py", *argv, "--episodes", "2", "--cpu"])
    load_tool("evaluate").main()
    return capsys.readouterr().out


def test_evaluate_finds_the_copy_or_is_given_its_path(copied_sweep, tmp_path, monkeypatch, capsys):
    """The copy is found in the current folder (here: its own), or given with --script PATH; elsewhere the tool says to
    give it. A checkpoint written before base_script was recorded is told by the copy's name."""
    checkpoint = copied_sweep.run / "checkpoint.pt"
    out = evaluate(monkeypatch, capsys, copied_sweep.copy.parent, str(checkpoint))
    assert out.startswith(f"{NAME} dodgeball, run {copied_sweep.run.name}, step 192"), out
    (report,) = copied_sweep.run.glob("checkpoint.eval-step192-2ep-*.json")
    assert (json.loads(report.read_text())["script"], json.loads(report.read_text())["base_script"]) == (
        NAME,
        "ppg_procgen.py",
    )
    with pytest.raises(SystemExit) as stopped:
        evaluate(monkeypatch, capsys, tmp_path, str(checkpoint), "--seed", "1")
    assert str(stopped.value.code).endswith(
        f"written by {NAME}, not found beside its run, here or in the repository root: give its file with --script PATH"
    )
    state = torch.load(checkpoint, weights_only=True)
    del state["base_script"]  # as a copy of an older version wrote it
    torch.save(state, tmp_path / "older.pt")
    out = evaluate(monkeypatch, capsys, tmp_path, str(tmp_path / "older.pt"), "--script", str(copied_sweep.copy))
    assert "training distribution = all levels: mean return" in out and "normalised" in out  # Procgen's sets


def test_base_script_is_recorded_or_told_by_the_name():
    from checkpoints import base_script

    assert base_script(dict(script="mine.py", base_script="ppg_atari.py")) == "ppg_atari.py"
    assert base_script(dict(script="ppg_procgen.py")) == "ppg_procgen.py"
    assert base_script(dict(script="ppg_procgen_vlam.py")) == "ppg_procgen.py"
    assert base_script(dict(script="ppg_atari_rnd.py")) == "ppg_atari.py"
    assert base_script(dict(script="mine.py")) is None


def test_report_reports_a_copys_runs_and_names_the_copy(copied_sweep, tmp_path, monkeypatch, capsys):
    report = load_tool("report")
    (run,) = report.read_runs(copied_sweep.sweep)
    assert report.differences_from_released(run)[0] == f"--script {NAME} (released: ppg_procgen.py)"
    monkeypatch.setattr(
        sys, "argv", ["report.py", str(copied_sweep.sweep), "--reps", "20", "--out", str(tmp_path / "r")]
    )
    monkeypatch.setenv("PPG_RELEASED_CODE", str(tmp_path))  # no released code: no released column
    report.main()
    assert "| dodgeball |" in capsys.readouterr().out
