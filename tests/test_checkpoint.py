"""Runs that survive: one live process a run; a killed run resumes to exactly its planned step count, logging each
step once; SIGTERM and
Ctrl-C print the resume command and exit with 128 + the signal; a NaN stops the run before it spoils a checkpoint;
bad input (truncated or foreign checkpoints, conflicting or non-finite flags) gets one line."""

import dataclasses
import math
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import PATIENCE_S, ROOT, SCRIPTS, TINY_FLAGS, copy_run, load_script, main_in_process, refusal, run_script

# 4 rollouts of 64 steps in 2 phases of N_pi = 2: long enough to be stopped between its two checkpoints.
LONG = ["--total-timesteps", "256"]


def start(name, cwd, *flags):
    return subprocess.Popen(
        [sys.executable, str(ROOT / name), *TINY_FLAGS[name], *(flags or LONG)],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def wait_for_checkpoint(proc, cwd, timeout=PATIENCE_S) -> pathlib.Path:
    deadline = time.time() + timeout
    while time.time() < deadline:
        found = list(pathlib.Path(cwd).glob("runs/*/checkpoint.pt"))
        if found:
            return found[0]
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        time.sleep(0.02)
    raise AssertionError("no checkpoint appeared")


def checkpoint(path) -> dict:
    return torch.load(pathlib.Path(path) / "checkpoint.pt", weights_only=True)


def scalars_with_steps(run_dir, tag: str) -> list:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return [e.step for e in acc.Scalars(tag)], acc


# Procgen's: tests/test_resume.py, whose resumed run must log every scalar as the run unbroken does; the refusal of a
# second process on a live run: tests/test_guards.py, in this process
@pytest.mark.slow
@pytest.mark.parametrize("name", ["ppg_atari.py"])
def test_kill_9_then_resume_finishes_the_planned_steps_once(name, tmp_path, monkeypatch, capsys):
    proc = start(name, tmp_path)
    saved = wait_for_checkpoint(proc, tmp_path)
    time.sleep(0.3)  # a moment into phase 2
    proc.send_signal(signal.SIGSTOP)  # held where it is (in phase 2 of 2, however fast the machine)
    assert checkpoint(saved.parent)["phase"] < 2
    with pytest.raises(SystemExit) as stopped:  # a second process on the live run: refused, naming the first
        main_in_process(load_script(name), ["--resume", str(saved.parent)], tmp_path, monkeypatch)
    assert str(stopped.value.code) == f"error: {saved.parent} is being trained by process {proc.pid}"
    proc.kill()  # SIGKILL: no handler runs, as in an out-of-memory kill; its lock goes with it
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    main_in_process(load_script(name), ["--resume", str(saved.parent)], tmp_path, monkeypatch)
    assert "resumed from" in capsys.readouterr().out
    state = checkpoint(saved.parent)
    assert state["global_step"] == 256 and state["phase"] == 2
    # the stopped run's steps after its checkpoint are purged: each rollout is logged exactly once
    steps, acc = scalars_with_steps(saved.parent, "losses/policy_loss")
    assert steps == list(range(64, 257, 64))
    assert [e.step for e in acc.Scalars("aux_phase/clone_kl")] == [128]  # one aux phase, logged once
    assert len(list(saved.parent.glob("events.out.tfevents.*"))) == 2  # the same run folder, appended


KILLED_AT_ROLLOUT_3 = """
import importlib.util, os, signal, sys, tyro
spec = importlib.util.spec_from_file_location("script", sys.argv[1])
script = importlib.util.module_from_spec(spec)
sys.modules["script"] = script
spec.loader.exec_module(script)
real, calls = script.compute_gae, []
def gae(*a):  # rollout 3 is phase 2's first: phase 1's boundary (checkpoint, aux/ scalars) is behind it
    calls.append(1)
    if len(calls) == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    return real(*a)
script.compute_gae = gae
script.main(tyro.cli(script.Args, args=sys.argv[2:]), script.named_flags(sys.argv[2:]))
"""


@pytest.mark.slow  # tests/test_resume.py kills a run right after a checkpoint and compares every scalar
def test_a_kill_just_after_a_phase_boundary_keeps_that_phases_log(tmp_path):
    """SIGKILL at the start of phase 2: what phase 1 logged, its aux_phase/ scalars too (flushed before its
    checkpoint, so that a resume from it, which never redoes them, finds them), is on disk."""
    argv = [sys.executable, "-c", KILLED_AT_ROLLOUT_3, str(ROOT / "ppg_atari.py"), *TINY_FLAGS["ppg_atari.py"], *LONG]
    done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=PATIENCE_S)
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    (run,) = (tmp_path / "runs").iterdir()
    assert checkpoint(run)["phase"] == 1
    steps, acc = scalars_with_steps(run, "losses/policy_loss")
    assert steps == [64, 128] and [e.step for e in acc.Scalars("aux_phase/clone_kl")] == [128]


@pytest.mark.slow  # tests/test_resume.py stops runs after logging past a checkpoint and compares every scalar
def test_a_resume_hides_what_the_stopped_run_logged_after_its_checkpoint(tiny_run, tmp_path, monkeypatch):
    """The shared finished run (3 rollouts, steps 64..192 logged) with its checkpoint taken back to phase 1, as if the
    run had been killed in phase 2 after logging rollout 3: the resumed run logs rollout 3 again, and TensorBoard
    shows each step once (purge_step hides the stopped run's step 192)."""
    script = load_script("ppg_atari.py")
    run = copy_run(tiny_run("ppg_atari.py"), tmp_path)
    state = checkpoint(run)
    torch.save(dict(state, phase=1, global_step=128), run / "checkpoint.pt")
    assert scalars_with_steps(run, "losses/policy_loss")[0] == [64, 128, 192]  # the stopped run's log
    main_in_process(script, ["--resume", str(run)], tmp_path, monkeypatch)
    assert checkpoint(run)["global_step"] == 192
    steps, acc = scalars_with_steps(run, "losses/policy_loss")
    assert steps == [64, 128, 192]


# SIGTERM: tests/test_resume.py stops a Procgen run with it and resumes it, and tests/test_run_features.py runs the
# stop line's command from another folder; Ctrl-C (SIGINT) goes through the same handler, hence slow
@pytest.mark.slow
@pytest.mark.parametrize("name, signum", [("ppg_atari.py", signal.SIGINT)])
def test_sigterm_and_ctrl_c_print_the_resume_command_and_exit_128_plus_the_signal(name, signum, tmp_path):
    proc = start(name, tmp_path, "--total-timesteps", str(10**6))  # far too long to finish before the signal
    saved = wait_for_checkpoint(proc, tmp_path)
    time.sleep(0.5)  # past the rename: the checkpoint is whole
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=PATIENCE_S)
    assert proc.returncode == 128 + signum, err[-2000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    # the interpreter and absolute paths: the command works from any folder
    assert f"stopped by {signal.Signals(signum).name}; resume with: {sys.executable} {ROOT / name} --resume " in out
    assert out.strip().endswith(f"runs/{saved.parent.name}")
    state = checkpoint(saved.parent)
    assert state["phase"] >= 1 and state["global_step"] < 10**6


def test_a_signal_before_the_first_checkpoint_says_there_is_none(tmp_path, monkeypatch, capfd):
    """SIGTERM during the first rollout (in this process, at its GAE): exit 143, and no resume command."""
    script = load_script("ppg_procgen.py")
    real = script.compute_gae
    monkeypatch.setattr(script, "compute_gae", lambda *a: os.kill(os.getpid(), signal.SIGTERM) or real(*a))
    with pytest.raises(SystemExit) as stopped:
        main_in_process(script, TINY_FLAGS["ppg_procgen.py"], tmp_path, monkeypatch)
    assert stopped.value.code == 143
    assert "stopped by SIGTERM; no checkpoint had been written yet" in capfd.readouterr().out


# Procgen's case is slow (11 s): the code that writes into the copy is the same in both scripts
@pytest.mark.parametrize("name", [pytest.param("ppg_procgen.py", marks=pytest.mark.slow), "ppg_atari.py"])
def test_resume_of_a_copied_run_writes_into_the_copy(name, tiny_run, tmp_path, monkeypatch, capsys):
    """--resume runs/X_copy continues in runs/X_copy: the original run folder is left as it was. The shared run's seed
    is 2^31 - 100, so the resumed phase's seed (shifted by the phases done) wraps below 2^31 and the run trains on."""
    run = copy_run(tiny_run(name), tmp_path)
    copy = run.with_name(run.name + "_copy")
    shutil.copytree(run, copy)
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    main_in_process(
        load_script(name), ["--resume", f"runs/{copy.name}", "--total-timesteps", "320"], tmp_path, monkeypatch
    )
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before  # the original: untouched
    assert checkpoint(copy)["global_step"] == 320
    assert len(list(copy.glob("events.out.tfevents.*"))) == 2
    (resumed,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("resumed from")]
    # what a resume keeps, in one line: Procgen all; ale-py cannot save its emulators
    how = "bit for bit the run unbroken" if name == "ppg_procgen.py" else "not exact: each env starts a new game"
    assert resumed == f"resumed from {copy}/checkpoint.pt after phase 2, step 192: {how}"


def test_bad_checkpoints_and_conflicting_flags_get_one_line(tiny_run, tmp_path, monkeypatch):
    procgen = load_script("ppg_procgen.py")
    run = copy_run(tiny_run("ppg_procgen.py"), tmp_path)
    path, state = run / "checkpoint.pt", checkpoint(run)
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    torch.save(dict(state, args=dict(state["args"], num_eval_envs=64)), tmp_path / "later.pt")  # a later version's
    torch.save(dict(state["agent"]), tmp_path / "weights.pt")  # not a checkpoint at all
    cases = [
        (["--resume", str(truncated)], "not a readable checkpoint of ppg_procgen.py"),
        (["--resume", str(tmp_path / "missing.pt")], "not a readable checkpoint of ppg_procgen.py (FileNotFoundError"),
        (["--resume", str(tmp_path / "weights.pt")], "not a readable checkpoint of ppg_procgen.py (KeyError"),
        (["--resume", str(tmp_path / "later.pt")], "with flags this version lacks: ['num_eval_envs']"),
        (["--resume", str(run), "--num-envs", "8"], "--num-envs 8: a resumed run keeps its flags (2)"),
        (["--resume", str(run), "--arch", "detach"], "--arch detach: a resumed run keeps its flags (dual)"),
        (["--resume", str(run), "--total-timesteps", "100"], "--total-timesteps may only be raised on --resume"),
        (["--resume", str(run), "--num-envs", "64"], "--num-envs 64: a resumed run keeps"),  # a default, but given
    ]
    elsewhere = tmp_path / "elsewhere"  # a folder with no runs/ yet: the refusals must not make one
    elsewhere.mkdir()
    for flags, needle in cases:  # in this process, as the command line would stop
        assert needle in refusal(procgen, flags, elsewhere, monkeypatch), flags
    proc = run_script("ppg_atari.py", "--resume", str(run), cwd=elsewhere)  # and one as a user meets it
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert (
        len(errors) == 1
        and "not a readable checkpoint of ppg_atari.py (ValueError: written by ppg_procgen.py" in errors[0]
    )
    # the flags a resume may give, at any value, as the command line names them
    given = {"resume", "total_timesteps", "micro_batch_size"}
    resumed, _, run_dir = procgen.resume_args(
        procgen.Args(resume=str(run), total_timesteps=10**8, micro_batch_size=64), given
    )
    assert resumed.num_envs == 2 and resumed.total_timesteps == 10**8 and resumed.micro_batch_size == 64
    assert run_dir == str(run) and resumed.seed == state["args"]["seed"]
    resumed, _, _ = procgen.resume_args(procgen.Args(resume=str(path), cuda=False), given={"resume", "cuda"})
    assert not resumed.cuda and resumed.num_levels == 10


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_checkpoint_from_before_a_new_flag_resumes_and_evaluates(name, tiny_run, tmp_path, monkeypatch, capsys):
    """The shared run's checkpoint as a version before --aux-kl-stop wrote it (one flag fewer): the new flag takes its
    default, and the run resumes and tools/evaluate.py reads the file (saying so in one line)."""
    from test_evaluate import run_tool

    run = copy_run(tiny_run(name), tmp_path)
    state = torch.load(run / "checkpoint.pt", weights_only=True)
    del state["args"]["aux_kl_stop"]
    torch.save(state, run / "checkpoint.pt")
    out = run_tool(monkeypatch, capsys, str(run / "checkpoint.pt"), "--episodes", "2", "--cpu")
    assert "written before --aux-kl-stop: its default taken" in out and "mean return" in out
    main_in_process(load_script(name), ["--resume", str(run), "--total-timesteps", "256"], tmp_path, monkeypatch)
    state = checkpoint(run)
    assert state["global_step"] == 256 and state["args"]["aux_kl_stop"] == 0.0


@pytest.mark.parametrize("phase", ["policy", "auxiliary"])
def test_a_nan_stops_the_run_in_one_line_and_leaves_the_last_checkpoint_intact(phase, tmp_path, monkeypatch):
    """A loss turns NaN once the phase-1 checkpoint exists (policy: in rollout 3; auxiliary: a run with a second aux
    phase): the run stops with one line, found on the means each update logs, and the phase-1 checkpoint is whole."""
    script, rollouts = load_script("ppg_atari.py"), []
    real_collect, real_loss = script.collect_rollout, script.policy_phase_loss
    real_aux = script.aux_phase_loss
    monkeypatch.setattr(script, "collect_rollout", lambda *a: rollouts.append(1) or real_collect(*a))

    def poisoned(real):  # the loss, and its logged value_loss, NaN from rollout 3 on
        def loss(*a, **kw):
            total, stats = real(*a, **kw)
            if len(rollouts) < 3:
                return total, stats
            return total * math.nan, dict(stats, value_loss=stats["value_loss"] * math.nan)

        return loss

    if phase == "policy":
        monkeypatch.setattr(script, "policy_phase_loss", poisoned(real_loss))
        flags = LONG
    else:
        monkeypatch.setattr(script, "aux_phase_loss", poisoned(real_aux))
        flags = ["--total-timesteps", "320"]  # 5 rollouts: aux phases after rollouts 2 and 4
    with pytest.raises(SystemExit) as stopped:
        main_in_process(script, [*TINY_FLAGS["ppg_atari.py"], *flags], tmp_path, monkeypatch)
    message = str(stopped.value.code)
    assert message.startswith("error: non-finite ") and f"in the {phase} phase" in message and "\n" not in message
    assert "value_loss" in message
    (run,) = (tmp_path / "runs").iterdir()
    state = checkpoint(run)
    assert state["phase"] == 1 and all(torch.isfinite(v).all() for v in state["agent"].values())


def test_every_float_flag_must_be_finite(script):
    floats = [f.name for f in dataclasses.fields(script.Args) if isinstance(getattr(script.Args(), f.name), float)]
    assert "learning_rate" in floats and "beta_clone" in floats and len(floats) >= 9
    for name in floats:
        for bad in (math.nan, math.inf, -math.inf):
            with pytest.raises(SystemExit, match=f"--{name.replace('_', '-')} must be a finite number"):
                script.make_plan(script.Args(**{name: bad}))


def test_micro_batch_size_is_checkpointed_as_given_so_a_resume_takes_its_devices_default(
    tiny_run, tmp_path, monkeypatch, capsys
):
    """A run started without --micro-batch-size keeps None in its checkpoint (main() fills in the device's default,
    256 states on a CPU, for that start only), so a run resumed on another device takes that device's default; a
    value the user gave is kept. The shared run gave 8: its checkpoint is made as if the flag had not been given."""
    script = load_script("ppg_procgen.py")
    run = copy_run(tiny_run("ppg_procgen.py"), tmp_path)
    assert checkpoint(run)["args"]["micro_batch_size"] == 8  # given at the start: kept
    state = checkpoint(run)
    state["args"]["micro_batch_size"] = None
    torch.save(dict(state, phase=1, global_step=128), run / "checkpoint.pt")
    main_in_process(script, ["--resume", str(run)], tmp_path, monkeypatch)
    assert "chunks of 256 states" in capsys.readouterr().out  # this device's default for this start
    assert checkpoint(run)["args"]["micro_batch_size"] is None  # not frozen into the checkpoint


def test_a_raised_budget_after_a_short_last_phase_starts_a_new_phase_at_the_checkpoint(
    tiny_run, tmp_path, monkeypatch, capsys
):
    """The shared run ended after 3 rollouts at N_pi 2: phase 1 (rollouts 1-2, then its aux phase) and a short phase
    2 (rollout 3, no aux phase: it was the last). Raised to 6 rollouts, the resumed run begins phase 3 at its
    checkpoint: phases 3 (rollouts 4-5, then an aux phase) and 4 (rollout 6), 4 phases in all, counted as such. B is
    not checkpointed, so rollout 3 never enters an aux phase (docs/runs.md)."""
    script = load_script("ppg_procgen.py")
    run = copy_run(tiny_run("ppg_procgen.py"), tmp_path)
    main_in_process(script, ["--resume", str(run), "--total-timesteps", "384"], tmp_path, monkeypatch)
    out = capsys.readouterr().out
    assert "phases: 4 of N_pi=2 rollouts; rollouts: 6 of" in out and "aux phases: 2 (1 still to run)\n" in out
    progress = [line.split(" step ")[0] for line in out.splitlines() if " iter " in line]
    assert progress == ["phase 3/4 iter 4/6", "phase 3/4 iter 5/6", "phase 4/4 iter 6/6"]
    assert out.index("aux epoch 1/2") > out.index("iter 5/6") and out.index("aux epoch 1/2") < out.index("iter 6/6")
    assert checkpoint(run)["phase"] == 4 and checkpoint(run)["global_step"] == 384
