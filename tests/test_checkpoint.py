"""Runs that survive: checkpoints round-trip bitwise, a killed run resumes to exactly its planned
step count, SIGTERM stops cleanly, a NaN stops the run before it spoils a checkpoint, and bad input
(truncated or foreign checkpoints, conflicting or non-finite flags) gets one line."""

import dataclasses
import math
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import tyro

from conftest import (
    ROOT,
    SCRIPTS,
    TINY_FLAGS,
    TOP_SEED,
    copy_run,
    load_script,
    main_in_process,
    random_batch,
    refusal,
    run_script,
)

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


def wait_for_checkpoint(proc, cwd, timeout=120) -> pathlib.Path:
    deadline = time.time() + timeout
    while time.time() < deadline:
        found = list(pathlib.Path(cwd).glob("runs/*/checkpoint.pt"))
        if found:
            return found[0]
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        time.sleep(0.02)
    raise AssertionError("no checkpoint appeared")


@pytest.mark.parametrize("name", SCRIPTS)
def test_kill_9_then_resume_finishes_the_planned_steps_once(name, tmp_path, monkeypatch, capsys):
    proc = start(name, tmp_path)
    checkpoint = wait_for_checkpoint(proc, tmp_path)
    proc.send_signal(signal.SIGSTOP)  # held where it is (in phase 2 of 2, however fast the machine)
    assert load_script(name).load_checkpoint(str(checkpoint))["phase"] < 2
    proc.kill()  # SIGKILL: no handler runs, as in an out-of-memory kill
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    main_in_process(
        load_script(name), ["--resume", str(checkpoint.parent)], tmp_path, monkeypatch
    )  # no need of a process
    assert "resumed from" in capsys.readouterr().out
    state = load_script(name).load_checkpoint(str(checkpoint))
    assert state["global_step"] == 256 and state["phase"] == 2
    # the stopped run's steps after its checkpoint are purged: each rollout is logged exactly once
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(checkpoint.parent), size_guidance={"scalars": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("losses/policy_loss")] == list(range(64, 257, 64))
    assert len(list(checkpoint.parent.glob("events.out.tfevents.*"))) == 2  # the same run folder, appended
    assert len(acc.Tensors("hyperparameters/text_summary")) == 1  # the flags were written once, not again on resume


@pytest.mark.parametrize("name", ["ppg_procgen.py"])  # ppg_atari.py's: test_distributed's SIGTERM to one worker
def test_sigterm_stops_at_a_rollout_boundary_with_the_resume_command(name, tmp_path):
    proc = start(name, tmp_path, "--total-timesteps", str(10**6))  # far too long to finish before the signal
    checkpoint = wait_for_checkpoint(proc, tmp_path)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-2000:]
    assert "Traceback" not in err
    assert f"resume with: python {name} --resume runs/{checkpoint.parent.name}" in out
    state = load_script(name).load_checkpoint(str(checkpoint))
    assert 1 <= state["phase"] and state["global_step"] < 10**6
    stopped = int(out.split("stopped by SIGTERM at step ")[1].split(";")[0].replace(",", ""))
    assert stopped % 64 == 0 and stopped >= state["global_step"]  # at a rollout boundary, after the checkpoint


@pytest.mark.parametrize("name", SCRIPTS)
def test_resume_of_a_copied_run_writes_into_the_copy(name, tiny_run, tmp_path, monkeypatch, capsys):
    """--resume runs/X_copy continues in runs/X_copy: the original run folder is left as it was."""
    import shutil

    run = copy_run(tiny_run(name), tmp_path)
    copy = run.with_name(run.name + "_copy")
    shutil.copytree(run, copy)
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    main_in_process(
        load_script(name), ["--resume", f"runs/{copy.name}", "--total-timesteps", "320"], tmp_path, monkeypatch
    )
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before  # the original: untouched
    assert load_script(name).load_checkpoint(str(copy))["global_step"] == 320
    out = capsys.readouterr().out
    assert len(list(copy.glob("events.out.tfevents.*"))) == 2 and f"resumed from runs/{copy.name}/" in out
    # the shared run's seed is 2^31 - 100: the resumed phase's seed wraps (said in one line) and the run trains on;
    # on Procgen its unseen-level evaluation (seed + 1,000,003) wrapped in the shared run and does again here
    assert f"seed: --seed {TOP_SEED:,} + 200,006 (phases done, worker) wraps around to " in out


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_resumed_run_keeps_its_wandb_id_and_a_copy_drops_it(name, tiny_run, tmp_path, monkeypatch):
    """resume_args: the run's own folder, named as a folder, as its checkpoint file or as "." from inside it, keeps
    the W&B id (and its run name); a copy under another name is a run of its own, with no W&B id."""
    import shutil

    script, run = load_script(name), copy_run(tiny_run(name), tmp_path)
    state = script.load_checkpoint(str(run))
    script.save_checkpoint(str(run / "checkpoint.pt"), dict(state, wandb_id="abc123"))
    shutil.copytree(run, run.with_name(run.name + "_copy"))
    for resume in [f"runs/{run.name}", f"runs/{run.name}/checkpoint.pt", "."]:
        monkeypatch.chdir(run if resume == "." else tmp_path)
        _, ckpt, run_dir = script.resume_args(script.Args(resume=resume), given={"resume"})
        assert ckpt["wandb_id"] == "abc123" and os.path.basename(run_dir) == run.name, resume
    monkeypatch.chdir(tmp_path)
    _, ckpt, run_dir = script.resume_args(script.Args(resume=f"runs/{run.name}_copy"), given={"resume"})
    assert ckpt["wandb_id"] is None and run_dir == f"runs/{run.name}_copy"


def test_checkpoint_round_trip_is_bitwise(script, tmp_path):
    args = script.Args(num_envs=2, num_steps=8, num_minibatches=2, micro_batch_size=0)
    torch.manual_seed(0)
    agent = script.PPGAgent("dual", script.OBS_SHAPE, 6)
    opts = [torch.optim.Adam(agent.parameters(), lr=1e-3) for _ in range(2)]
    script.policy_phase_update(agent, opts[0], random_batch(script, 16, 6), args, script.make_plan(args))
    normalizer = script.RewardNormalizer(2, 0.99)
    normalizer(np.random.default_rng(0).normal(size=(2, 8)).astype(np.float32), np.zeros((2, 8), dtype=bool))
    path = str(tmp_path / "checkpoint.pt")
    script.save_checkpoint(
        path,
        dict(
            script.model_file(args, "run", agent),
            policy_optimizer=opts[0].state_dict(),
            aux_optimizer=opts[1].state_dict(),
            reward_normalizer=normalizer.state_dict(),
        ),
    )
    state = script.load_checkpoint(path)
    assert script.Args(**state["args"]) == args
    restored = script.PPGAgent("dual", script.OBS_SHAPE, 6)
    restored.load_state_dict(state["agent"])
    assert all(torch.equal(a, b) for a, b in zip(agent.state_dict().values(), restored.state_dict().values()))
    opt = torch.optim.Adam(restored.parameters(), lr=1e-3)
    opt.load_state_dict(state["policy_optimizer"])
    for a, b in zip(opts[0].state.values(), opt.state.values()):
        assert all(torch.equal(a[k], b[k]) for k in ("exp_avg", "exp_avg_sq", "step"))
    other = script.RewardNormalizer(2, 0.99)
    other.load_state_dict(state["reward_normalizer"])
    assert (other.mean, other.var, other.count) == (normalizer.mean, normalizer.var, normalizer.count)
    assert not other.ret.any() and normalizer.ret.any()  # running returns are the envs' and restart with them


def test_bad_checkpoints_and_conflicting_flags_get_one_line(tmp_path, monkeypatch):
    procgen, atari = load_script("ppg_procgen.py"), load_script("ppg_atari.py")
    torch.manual_seed(0)
    path = tmp_path / "checkpoint.pt"
    args = procgen.Args(num_envs=4)
    procgen.save_checkpoint(str(path), procgen.model_file(args, "run", procgen.PPGAgent("dual", procgen.OBS_SHAPE, 15)))
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    cases = [
        (["--resume", str(truncated)], "not a readable checkpoint"),
        (["--resume", str(tmp_path / "missing.pt")], "no such file"),
        (["--resume", str(path), "--num-envs", "8"], "--num-envs 8 conflicts with the checkpoint's 4"),
        (["--resume", str(path), "--arch", "detach"], "--arch detach conflicts"),
        (["--resume", str(path), "--total-timesteps", "1000"], "--total-timesteps may only be raised"),
    ]
    for flags, needle in cases:  # in this process, as the command line would stop
        assert needle in refusal(procgen, flags, tmp_path, monkeypatch), flags
    proc = run_script("ppg_procgen.py", *cases[0][0], cwd=tmp_path, timeout=60)  # and one as a user meets it
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode != 0 and len(errors) == 1 and cases[0][1] in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    with pytest.raises(atari.ArgError, match="written by ppg_procgen.py, not by ppg_atari.py"):
        atari.load_checkpoint(str(path))
    old = dict(torch.load(path, weights_only=True), format=0)
    torch.save(old, tmp_path / "old.pt")
    with pytest.raises(procgen.ArgError, match="format 0"):
        procgen.load_checkpoint(str(tmp_path / "old.pt"))
    other = dict(torch.load(path, weights_only=True))  # written by a version with a flag this one lacks
    other["args"] = dict(other["args"], num_eval_envs=64)
    torch.save(other, tmp_path / "other.pt")
    with pytest.raises(procgen.ArgError, match=r"with flags this one lacks \(num_eval_envs\)"):
        procgen.load_checkpoint(str(tmp_path / "other.pt"))
    # flags that do not change what is trained may be given
    resumed, _, _ = procgen.resume_args(procgen.Args(resume=str(path), total_timesteps=10**8, micro_batch_size=64))
    assert resumed.num_envs == 4 and resumed.total_timesteps == 10**8 and resumed.micro_batch_size == 64
    # the flags named on the command line count, also at their default values (the __main__ block passes them)
    no_cuda = tmp_path / "no_cuda.pt"
    procgen.save_checkpoint(
        str(no_cuda),
        procgen.model_file(procgen.Args(cuda=False, e_aux=0), "run", procgen.PPGAgent("dual", procgen.OBS_SHAPE, 15)),
    )
    resumed, _, _ = procgen.resume_args(procgen.Args(resume=str(no_cuda), cuda=True), given={"resume", "cuda"})
    assert resumed.cuda and resumed.e_aux == 0
    with pytest.raises(procgen.ArgError, match="--e-aux 6 conflicts with the checkpoint's 0"):
        procgen.resume_args(procgen.Args(resume=str(no_cuda), e_aux=6), given={"resume", "e_aux"})


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_checkpoint_from_before_a_new_flag_resumes_and_evaluates(name, tiny_run, tmp_path, monkeypatch, capsys):
    """The shared run's checkpoint and model file as a version before --anneal-lr wrote them (one flag fewer): the
    flag takes its default, one line says so, and the run resumes and tools/evaluate.py reads both files."""
    from test_evaluate import run_tool

    run = copy_run(tiny_run(name), tmp_path)
    for file in (run / "checkpoint.pt", run / f"{name[:-3]}.pt"):
        state = torch.load(file, weights_only=True)
        del state["args"]["anneal_lr"]
        torch.save(state, file)
        out = run_tool(monkeypatch, capsys, str(file), "--episodes", "2", "--cpu")
        assert f"{file}: written before --anneal-lr: default values taken" in out and "mean return" in out
    main_in_process(load_script(name), ["--resume", str(run), "--total-timesteps", "256"], tmp_path, monkeypatch)
    assert "written before --anneal-lr: default values taken" in capsys.readouterr().out
    state = load_script(name).load_checkpoint(str(run))
    assert state["global_step"] == 256 and state["args"]["anneal_lr"] is False


def test_injected_nan_stops_the_run_and_leaves_the_last_checkpoint_intact(script, tmp_path, monkeypatch):
    """value_loss turns NaN once the first checkpoint exists: the run stops in phase 2 with one line,
    and the phase-1 checkpoint is still there, finite and loadable."""
    saved = []
    real_save, real_value_loss = script.save_checkpoint, script.value_loss
    monkeypatch.setattr(script, "save_checkpoint", lambda path, state: saved.append(path) or real_save(path, state))
    monkeypatch.setattr(script, "value_loss", lambda v, r: real_value_loss(v, r) * (math.nan if saved else 1.0))
    monkeypatch.chdir(tmp_path)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    args = tyro.cli(script.Args, args=TINY_FLAGS[pathlib.Path(script.__file__).name] + LONG)
    try:
        with pytest.raises(SystemExit) as stopped:
            script.main(args)
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    message = str(stopped.value.code)
    assert message.startswith("error: phase 2, iteration 3: non-finite gradient (value_loss); stopped before that step")
    assert "\n" not in message
    state = script.load_checkpoint(saved[0])
    assert state["phase"] == 1 and all(torch.isfinite(v).all() for v in state["agent"].values())


def test_every_float_flag_must_be_finite(script):
    floats = [f.name for f in dataclasses.fields(script.Args) if isinstance(getattr(script.Args(), f.name), float)]
    assert "learning_rate" in floats and "beta_clone" in floats and len(floats) >= 9
    for name in floats:
        for bad in (math.nan, math.inf, -math.inf):
            with pytest.raises(script.ArgError, match=f"--{name.replace('_', '-')} must be a finite number"):
                script.make_plan(script.Args(**{name: bad}))
