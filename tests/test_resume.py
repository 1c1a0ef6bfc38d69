"""Exact resume (ppg_procgen.py): a run stopped anywhere (kill -9, SIGTERM) and resumed from its last checkpoint ends
bit-identical at fp32 to the run unbroken: every tensor of the final checkpoint (weights, the three Adam states, each
env's Procgen state, the random streams, the reward normaliser) and every logged scalar, at every step, but SPS (a
wall-clock rate). A checkpoint from before exact resume is refused in one line."""

import contextlib
import io
import os
import pathlib
import shlex
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from conftest import PATIENCE_S, ROOT, assert_same, load_script, main_in_process, refusal

# 3 rollouts of 2 envs x 16 steps, one a phase (N_pi 1): checkpoints after phases 1 and 2 (each after its aux phase of
# 2 epochs, 2 minibatches each) and 3. Dodgeball ends random episodes within a rollout; 2 PPO minibatches a rollout.
FLAGS = ["--env-id", "dodgeball", "--num-envs", "2", "--num-steps", "16", "--n-pi", "1", "--total-timesteps", "96"]
FLAGS += ["--num-minibatches", "2", "--aux-mb-trajectories", "1", "--e-aux", "2", "--micro-batch-size", "16"]
FLAGS += ["--seed", "1"]
# one thread in every process: the unbroken and the resumed runs add up their sums in the same order
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
NOT_COMPARED = {"run_name", "wandb_id"}  # each run's own


def start(cwd, *flags) -> subprocess.Popen:
    argv = [sys.executable, str(ROOT / "ppg_procgen.py"), *flags]
    return subprocess.Popen(argv, cwd=cwd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen) -> str:
    out, err = proc.communicate(timeout=PATIENCE_S)
    assert proc.returncode == 0, err[-3000:]
    return out


@pytest.fixture(scope="module")
def unbroken(tmp_path_factory) -> pathlib.Path:
    """The run never stopped: its folder, shared by the tests below (read only)."""
    cwd = tmp_path_factory.mktemp("unbroken")
    finish(start(cwd, *FLAGS))
    (run,) = (cwd / "runs").iterdir()
    return run


def scalars(run: pathlib.Path) -> dict:
    """{tag: [(step, value)]} as TensorBoard shows the run (purged as it purges), SPS left out."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run), size_guidance={"scalars": 0})
    acc.Reload()
    tags = [tag for tag in acc.Tags()["scalars"] if tag != "charts/SPS"]
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in tags}


def assert_the_unbroken_run(run: pathlib.Path, unbroken: pathlib.Path) -> None:
    ours, theirs = (torch.load(r / "checkpoint.pt", weights_only=True) for r in (run, unbroken))
    assert ours["phase"] == 3 and ours["global_step"] == 96
    for state in (ours, theirs):
        for key in NOT_COMPARED:
            state.pop(key)
        state["args"].pop("resume")  # the resumed start's flag
    assert_same(ours, theirs, "checkpoint")
    ours, theirs = scalars(run), scalars(unbroken)
    assert theirs["charts/episodic_return"] and len(theirs["aux_phase/clone_kl"]) == 2  # episodes ended; 2 aux phases
    assert ours.keys() == theirs.keys()
    for tag in theirs:
        assert ours[tag] == theirs[tag], tag


def wait_for_checkpoint(proc, cwd) -> pathlib.Path:
    deadline = time.time() + PATIENCE_S
    while not (found := list(pathlib.Path(cwd).glob("runs/*/checkpoint.pt"))):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.01)
    return found[0].parent


# The script, stopped by SIGTERM in its second checkpoint's rename: phase 2's log (aux_phase/*) is flushed, its checkpoint
# not yet in place, so the resume goes on from phase 1's and redoes phase 2, logging its aux epochs again
SIGTERM_AT_CHECKPOINT_2 = """
import os, runpy, signal, sys
real, renames = os.replace, []
def replace(src, dst):
    renames.append(dst)
    if len(renames) == 2:
        os.kill(os.getpid(), signal.SIGTERM)
    real(src, dst)
os.replace = replace
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_a_run_killed_anywhere_and_resumed_is_the_run_unbroken(unbroken, tmp_path):
    """kill -9 from outside as soon as the first checkpoint is there (phase 2 of 3 under way), then a resume as a user
    starts it."""
    proc = start(tmp_path, *FLAGS)
    run = wait_for_checkpoint(proc, tmp_path)
    proc.kill()
    proc.communicate(timeout=PATIENCE_S)
    assert proc.returncode == -signal.SIGKILL  # killed, not finished
    assert torch.load(run / "checkpoint.pt", weights_only=True)["phase"] < 3
    out = finish(start(tmp_path, "--resume", str(run)))
    assert ": bit for bit the run unbroken\n" in out
    assert_the_unbroken_run(run, unbroken)


def test_a_run_stopped_by_sigterm_before_a_checkpoint_lands_resumes_as_the_run_unbroken(unbroken, tmp_path):
    """SIGTERM at the worst moment for the log: phase 2's scalars are written and flushed, its checkpoint not yet
    renamed into place. The resume hides them (TensorBoard's purge_step) and logs phase 2 again: each scalar once. The
    resume is the command the stop line printed, run as a shell splits it, from another folder."""
    argv = [sys.executable, "-c", SIGTERM_AT_CHECKPOINT_2, str(ROOT / "ppg_procgen.py"), *FLAGS]
    done = subprocess.run(argv, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=PATIENCE_S)
    assert done.returncode == 128 + signal.SIGTERM, done.stderr[-3000:]
    (run,) = (tmp_path / "runs").iterdir()
    assert torch.load(run / "checkpoint.pt", weights_only=True)["phase"] == 1
    assert len(scalars(run)["aux_phase/clone_kl"]) == 2  # phases 1 and 2's: on disk when the signal came
    hint = f"stopped by SIGTERM; resume with: {sys.executable} {ROOT / 'ppg_procgen.py'} --resume {run}"
    assert done.stdout.strip().endswith(hint)  # the interpreter and absolute paths: it works from any folder
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    command = shlex.split(done.stdout.strip().splitlines()[-1].partition("resume with: ")[2])
    resumed = subprocess.run(command, cwd=elsewhere, env=ENV, capture_output=True, text=True, timeout=PATIENCE_S)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Traceback" not in done.stderr and ": bit for bit the run unbroken\n" in resumed.stdout
    assert not list(elsewhere.iterdir())  # the resume wrote into the run's own folder, nothing where it was typed
    assert_the_unbroken_run(run, unbroken)


def test_a_checkpoint_of_an_older_version_with_a_retired_flag_at_another_value_is_refused_in_one_line(
    unbroken, tmp_path, monkeypatch
):
    """The unbroken run's checkpoint as a version before this one wrote it (--torch-deterministic, retired since at
    True, here off, and no env states or random streams): a resume stops in one line naming the flag and its value,
    before any env exists. (At True it resumes: tests/test_older_checkpoints.py.)"""
    run = tmp_path / "runs" / unbroken.name
    shutil.copytree(unbroken, run)
    state = torch.load(run / "checkpoint.pt", weights_only=True)
    for key in ("envs", "python_rng", "numpy_rng", "torch_rng", "recent_returns"):
        state.pop(key)
    state["args"]["torch_deterministic"] = False
    torch.save(state, run / "checkpoint.pt")
    (tmp_path / "elsewhere").mkdir()
    message = refusal(load_script("ppg_procgen.py"), ["--resume", str(run)], tmp_path / "elsewhere", monkeypatch)
    assert message.endswith("written with --torch-deterministic False, a retired flag this version fixes at True")


def test_the_reward_normaliser_goes_on_with_each_envs_running_return(script):
    """Its checkpointed state holds each env's discounted return so far (`ret`), so a restored normaliser scales the
    next rollout exactly as the one never stopped. The end-to-end runs above cannot show this: dodgeball rewards only an
    episode's last step, after which `ret` is 0, so it is 0 at every checkpoint there."""
    rewards, dones = np.array([[0.0, 1.0, 0.5], [2.0, 0.0, 0.0]]), np.zeros((2, 3), bool)  # mid-episode rewards
    unbroken = script.RewardNormalizer(2, 0.99)
    unbroken(rewards, dones)
    state = unbroken.state_dict()
    assert all(state["ret"])  # episodes under way: running returns to go on with
    restored = script.RewardNormalizer(2, 0.99)
    restored.load_state_dict(state)
    assert (restored(rewards, dones) == unbroken(rewards, dones)).all()


def test_a_resume_says_what_differs_from_the_run_unbroken_and_atari_restarts_each_return(
    tiny_run, tmp_path, monkeypatch
):
    """A checkpoint records what bit-identity needs (threads, torch, the chunk size, the device, the CPU's kernels): a
    resume under other conditions (here: the checkpoint says 99 threads) says it is not exact, names them and goes on. Procgen's envs go on with
    their episodes, so the normaliser's running returns go on too; ppg_atari.py's envs start new games on resume, so
    their running returns restart at 0, as the released code starts each episode's."""
    import conftest

    for name in conftest.SCRIPTS:
        script = load_script(name)
        run = tmp_path / name / "runs" / tiny_run(name).run_dir.name
        shutil.copytree(tiny_run(name).run_dir, run)
        state = torch.load(run / "checkpoint.pt", weights_only=True)
        state["same"]["threads"] = 99
        state["reward_normalizer"]["ret"] = [0.5, -1.5]  # episodes under way, as a checkpoint may hold them
        torch.save(state, run / "checkpoint.pt")
        seen = []
        real = script.RewardNormalizer.__call__
        monkeypatch.setattr(script.RewardNormalizer, "__call__", lambda n, *a: seen.append(n.ret.copy()) or real(n, *a))
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            main_in_process(script, ["--resume", str(run), "--total-timesteps", "256"], tmp_path / name, monkeypatch)
        assert f"not exact: threads 99 -> {torch.get_num_threads()}" in out.getvalue()
        if name == "ppg_atari.py":
            assert seen[0].tolist() == [0.0, 0.0]  # new games
        else:
            assert seen[0].tolist() == [0.5, -1.5], "Procgen runs only with --norm-reward (its default)"
