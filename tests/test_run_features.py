"""The run's features beside the algorithm, in both scripts where both have them: Procgen's test envs (the
generalization protocol), the explained variance, the hyperparameters text, the per-epoch aux scalars, --anneal-lr,
the progress lines, CleanRL's flag names, the messages of a start, a resume and a stop, the exactness that a
checkpoint remembers, and the lock and memory fallbacks.

Most tests read a few tiny runs made once in this process (module-scoped `runs`): per script, a fresh run stopped just
before its second checkpoint (so it has logged past its first one) and that run resumed to its end; on Procgen also
the same run unbroken and once more with its test envs turned off."""

import contextlib
import dataclasses
import errno
import io
import itertools
import math
import os
import pathlib
import re
import shlex
import signal
import subprocess
import sys
import time
import types
from collections import defaultdict

import numpy as np
import pytest
import torch
import tyro

from conftest import PATIENCE_S, ROOT, SCRIPTS, TINY_FLAGS, assert_same, load_script, main_in_process, refusal, wrap

# 3 rollouts of 2 envs x 16 steps, one per phase (N_pi 1): aux phases after phases 1 and 2 (2 epochs of one minibatch
# each), none after phase 3. Every run here anneals its learning rate, so that the rate is logged and resumed too.
COMMON = ["--num-envs", "2", "--num-steps", "16", "--n-pi", "1", "--total-timesteps", "96", "--num-minibatches", "1"]
COMMON += ["--aux-mb-trajectories", "2", "--e-aux", "2", "--micro-batch-size", "0", "--anneal-lr"]
BATCH, ROLLOUTS, E_AUX = 32, 3, 2
# Procgen trains on 10 levels from level 5, so its test envs play the full distribution; bossfight ends random
# episodes within tens of steps, and with this seed the test envs end some before the first checkpoint and some after
# it. Atari's games are cut after 100 frames.
FLAGS = {
    "ppg_procgen.py": ["--env-id", "bossfight", "--num-levels", "10", "--start-level", "5", *COMMON, "--seed", "4"],
    "ppg_atari.py": ["--env-id", "BreakoutNoFrameskip-v4", "--max-episode-frames", "100", *COMMON, "--seed", "3"],
}
AUX_NAMES = ["aux_value_loss", "clone_kl", "joint_loss", "value_loss"]


def train(script, flags, cwd, stop_at_checkpoint=0, fast_clock=False, interrupt=False):
    """main(flags) in this process, recording what the run computes: the env step after each rollout (`steps`),
    compute_targets' explained variance, each optimizer's learning rate at each update, each aux phase's epoch means,
    the finished episodes, and Procgen's envs as built and the test envs' finished episodes. stop_at_checkpoint n: the run stops (SystemExit,
    as on a signal) at its n-th checkpoint, before writing it. fast_clock: the script's clock moves 25 s per reading.
    interrupt: the run stops (SystemExit(130), as on Ctrl-C) at its first rollout. Returns a namespace of stdout, the records and the run's folder."""
    rec, test_env_ids, test_step = defaultdict(list), set(), [0]
    with pytest.MonkeyPatch.context() as mp:
        wrap(mp, script, "compute_targets", after=lambda ev, *a: rec["explained_variance"].append(ev))

        def lrs(agent, optimizer, batch, args, value_optimizer, *rest):
            groups = [*optimizer.param_groups, *value_optimizer.param_groups]
            rec["policy_lr"].append([g["lr"] for g in groups])

        wrap(mp, script, "policy_phase_update", before=lrs)
        wrap(mp, script, "auxiliary_phase", before=lambda a, opt, *r: rec["aux_lr"].append(opt.param_groups[0]["lr"]))
        wrap(mp, script, "auxiliary_phase", after=lambda epochs, *a: rec["aux"].append((rec["steps"][-1], epochs)))
        if hasattr(script, "TestEnvs"):

            def built(env, args, num_envs, num_levels, start_level, seed):
                rec["envs"].append((num_envs, num_levels, start_level, seed))
                if num_levels == 0:
                    test_env_ids.add(id(env))

            def stepped(out, env, actions):
                if id(env) in test_env_ids:
                    rec["test_episodes"] += [(test_step[0], ret, length) for _, ret, length in out[3]]

            wrap(mp, script.ProcgenVecEnv, "__init__", before=built)
            wrap(mp, script.ProcgenVecEnv, "step", after=stepped)
            wrap(mp, script.TestEnvs, "step", before=lambda envs, agent, step: test_step.__setitem__(0, step))
        if stop_at_checkpoint:
            real_save, saves = script.save_checkpoint, []

            def save(*args):
                saves.append(1)
                if len(saves) == stop_at_checkpoint:
                    raise SystemExit(128 + signal.SIGTERM)
                real_save(*args)

            mp.setattr(script, "save_checkpoint", save)
        if interrupt:

            def interrupted(*args, **kwargs):
                raise SystemExit(128 + signal.SIGINT)

            mp.setattr(script, "collect_rollout", interrupted)
        wrap(mp, script, "collect_rollout", before=lambda a, e, o, ro, step, *r: rec["steps"].append(step + BATCH))
        wrap(mp, script, "collect_rollout", after=lambda out, *a: rec["episodes"].extend(out[2]))
        if fast_clock:
            clock = itertools.count(time.time(), 25.0)
            mp.setattr(script, "time", types.SimpleNamespace(time=lambda: next(clock)))
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.ExitStack() as stack:
            if stop_at_checkpoint or interrupt:
                stack.enter_context(pytest.raises(SystemExit))
            main_in_process(script, flags, cwd, mp)
    folders = list((pathlib.Path(cwd) / "runs").iterdir())
    held = [fd for folder in folders for fd in lock_fds(folder)]
    for folder in folders:
        release_lock(folder)
    run_dir = folders[0] if len(folders) == 1 else None
    return types.SimpleNamespace(stdout=out.getvalue(), rec=rec, dir=run_dir, held_lock=bool(held))


def lock_fds(run_dir) -> list:
    """This process's file descriptors open on the run's lock file."""
    lock = os.path.realpath(pathlib.Path(run_dir) / "lock")
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{fd}") == lock:
                fds.append(int(fd))
    return fds


def release_lock(run_dir) -> None:
    """Closes any descriptor of this process still open on the run's lock (main() closes its own as it returns, which
    test_main_lets_go_of_its_lock_when_it_returns checks), so that this process can resume the run."""
    for fd in lock_fds(run_dir):
        os.close(fd)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """runs(name): the tiny runs of one script, made once: `stopped` (fresh, its clock sped up, stopped at its second
    checkpoint: phase 2 logged, its checkpoint not written) and `resumed` (that run resumed to its end, in the same
    folder; Atari's checkpoint is first edited to say it was written with 99 threads); on Procgen also `unbroken`
    (the same flags never stopped) and `unwatched` (unbroken with --num-test-envs 0). Read only."""
    made = {}

    def get(name):
        if name not in made:
            script, cwd = load_script(name), tmp_path_factory.mktemp(pathlib.Path(name).stem)
            ns = types.SimpleNamespace(script=script)
            ns.stopped = train(script, FLAGS[name], cwd, stop_at_checkpoint=2, fast_clock=True)
            if name == "ppg_atari.py":
                state = torch.load(ns.stopped.dir / "checkpoint.pt", weights_only=True)
                state["same"]["threads"] = 99
                torch.save(state, ns.stopped.dir / "checkpoint.pt")
            ns.resumed = train(script, ["--resume", str(ns.stopped.dir)], cwd)
            if name == "ppg_procgen.py":
                ns.unbroken = train(script, FLAGS[name], tmp_path_factory.mktemp("unbroken"))
                ns.unwatched = train(script, [*FLAGS[name], "--num-test-envs", "0"], tmp_path_factory.mktemp("off"))
            made[name] = ns
        return made[name]

    return get


def events(run_dir):
    """The run's TensorBoard log as TensorBoard shows it: a resumed run's purge_step hides what the stopped run logged
    after its checkpoint."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def scalars(run_dir) -> dict:
    """{tag: [(step, value)]}, as TensorBoard shows them."""
    acc = events(run_dir)
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def float32(x) -> float:
    return float(np.float32(x))


def checkpoint(run_dir) -> dict:
    return torch.load(pathlib.Path(run_dir) / "checkpoint.pt", weights_only=True)


def logged_by_step(*records):
    """[(step, value)] of several processes' records of one run, in order: a later process's value at a step replaces
    the earlier one (a resume redoes the steps after its checkpoint), as purge_step makes TensorBoard show them."""
    merged = {}
    for pairs in records:
        merged.update(dict(pairs))
    return sorted(merged.items())


# Test envs: the generalization protocol (Procgen) -------------------------------------------------
def test_test_envs_play_the_full_distribution_beside_the_training_levels(runs):
    """With --num-levels above 0 and --num-test-envs unset, the run builds as many test envs as training envs, playing
    the full distribution (0 levels) from the same start level with the seed + 1; --num-test-envs 0 builds none."""
    procgen = runs("ppg_procgen.py")
    assert procgen.unbroken.rec["envs"] == [(2, 10, 5, 4), (2, 0, 5, 5)]
    assert procgen.unwatched.rec["envs"] == [(2, 10, 5, 4)]


def test_make_test_envs_counts_and_turns_off(monkeypatch):
    """--num-test-envs N builds N test envs; --num-levels 0 (the full distribution is trained on) builds none, whatever
    --num-test-envs says."""
    script = load_script("ppg_procgen.py")
    built = []
    monkeypatch.setattr(script, "TestEnvs", lambda args, count, seed, device, writer: built.append(count) or count)
    cpu = torch.device("cpu")
    assert script.make_test_envs(script.Args(num_levels=10, num_envs=4), 7, cpu, None) == 4
    assert script.make_test_envs(script.Args(num_levels=10, num_envs=4, num_test_envs=3), 7, cpu, None) == 3
    assert script.make_test_envs(script.Args(num_levels=10, num_test_envs=0), 7, cpu, None) is None
    assert script.make_test_envs(script.Args(num_levels=0), 7, cpu, None) is None
    assert script.make_test_envs(script.Args(num_levels=0, num_test_envs=3), 7, cpu, None) is None
    assert built == [4, 3]


def test_test_episodes_are_logged_on_the_env_step_axis(runs):
    """Each episode the test envs finish is logged as charts/test_episodic_return and charts/test_episodic_length at
    the training env step of the vector step that ended it; the console's per-rollout line names their mean return."""
    unbroken = runs("ppg_procgen.py").unbroken
    played = unbroken.rec["test_episodes"]
    assert played and {step for step, _, _ in played} <= set(range(2, 97, 2))  # ended within the run's 96 steps
    logged = scalars(unbroken.dir)
    assert logged["charts/test_episodic_return"] == [(step, float32(ret)) for step, ret, _ in played]
    assert logged["charts/test_episodic_length"] == [(step, float(length)) for step, _, length in played]
    lines = [line for line in unbroken.stdout.splitlines() if line.startswith("phase ") and " iter " in line]
    assert len(lines) == ROLLOUTS and all(re.search(r" return .+ test return (-|-?\d+\.\d\d)$", line) for line in lines)
    assert "test return" not in runs("ppg_procgen.py").unwatched.stdout


def test_watching_never_changes_training(runs):
    """The same flags and seed with the test envs on (the default) and with --num-test-envs 0 train bit-identically:
    the test envs draw from random streams of their own."""
    procgen = runs("ppg_procgen.py")
    watched, unwatched = checkpoint(procgen.unbroken.dir), checkpoint(procgen.unwatched.dir)
    assert "test_envs" in watched and "test_envs" not in unwatched
    for key in ("agent", "policy_optimizer", "aux_optimizer", "reward_normalizer", "envs", "torch_rng"):
        assert_same(watched[key], unwatched[key], key)
    assert procgen.unbroken.rec["explained_variance"] == procgen.unwatched.rec["explained_variance"]


def test_a_resumed_run_continues_the_test_curve_exactly(runs):
    """The run stopped after its first phase (having played and logged part of phase 2) and resumed logs the same test
    episodes, step for step, as the run unbroken, and ends with the same test envs' state (games, action stream,
    recent returns), the whole checkpoint bit-identical."""
    procgen = runs("ppg_procgen.py")
    resumed, unbroken = scalars(procgen.resumed.dir), scalars(procgen.unbroken.dir)
    for tag in ("charts/test_episodic_return", "charts/test_episodic_length"):
        assert resumed[tag] == unbroken[tag], tag
    assert resumed["charts/test_episodic_return"]
    ours, theirs = checkpoint(procgen.resumed.dir), checkpoint(procgen.unbroken.dir)
    assert_same(ours["test_envs"], theirs["test_envs"], "test_envs")
    for state in (ours, theirs):
        for key in ("run_name", "wandb_id"):
            state.pop(key)
        state["args"].pop("resume")
    assert_same(ours, theirs, "checkpoint")


# The explained variance -----------------------------------------------------------------------------------------
def test_compute_targets_returns_the_explained_variance_of_v_hat(script):
    """1 - Var(V_hat - V) / Var(V_hat) over the whole rollout (population variances), V_hat being the value targets
    it writes into B; nan when V_hat does not vary."""
    g = np.random.default_rng(0)
    envs, steps = 3, 5
    values = g.normal(size=(envs, steps)).astype(np.float32)
    rewards = g.normal(size=(envs, steps)).astype(np.float32)
    ended = g.random((envs, steps)) < 0.3
    next_value = g.normal(size=envs).astype(np.float32)
    args = script.Args(norm_reward=False, gamma=0.9, gae_lambda=0.8)

    def rollout(values, rewards):
        ro = {k: torch.zeros(envs, steps) for k in ("rewards", "returns", "advantages")}
        ro.update(values=torch.from_numpy(values), raw_rewards=torch.from_numpy(rewards), ended=torch.from_numpy(ended))
        return ro

    ro = rollout(values, rewards)
    ev = script.compute_targets(ro, torch.from_numpy(next_value), args, script.RewardNormalizer(envs, 0.99))
    # V_hat by GAE, in numpy
    v_hat, last = np.zeros((envs, steps)), np.zeros(envs)
    for t in reversed(range(steps)):
        following = next_value if t == steps - 1 else values[:, t + 1]
        alive = 1.0 - ended[:, t]
        delta = rewards[:, t] + 0.9 * following * alive - values[:, t]
        last = delta + 0.9 * 0.8 * alive * last
        v_hat[:, t] = last + values[:, t]
    assert np.allclose(ro["returns"].numpy(), v_hat, atol=1e-5)
    assert ev == pytest.approx(1 - np.var(v_hat - values) / np.var(v_hat), rel=1e-5)
    zeros = np.zeros((envs, steps), np.float32)
    ev = script.compute_targets(rollout(zeros, zeros), torch.zeros(envs), args, script.RewardNormalizer(envs, 0.99))
    assert math.isnan(ev)


@pytest.mark.parametrize("name", SCRIPTS)
def test_explained_variance_is_logged_once_per_rollout(runs, name):
    """losses/explained_variance: at each rollout's last env step, compute_targets' value for it, once per step after a
    resume too."""
    made = runs(name)
    stopped, resumed = made.stopped, made.resumed
    expected = logged_by_step(
        list(zip(stopped.rec["steps"], stopped.rec["explained_variance"])),
        list(zip(resumed.rec["steps"], resumed.rec["explained_variance"])),
    )
    assert [step for step, _ in expected] == [32, 64, 96]
    assert scalars(resumed.dir)["losses/explained_variance"] == [(step, float32(ev)) for step, ev in expected]


# The hyperparameters text ------------------------------------------------------------------------------------------
def hyperparameters(run_dir):
    """[(step, {flag: value})] of each start's hyperparameters text, in order."""
    tables = []
    for event in events(run_dir).Tensors("hyperparameters/text_summary"):
        lines = event.tensor_proto.string_val[0].decode().splitlines()
        assert lines[:2] == ["|param|value|", "|-|-|"], lines[:2]
        rows = [line.split("|") for line in lines[2:]]
        assert all(len(row) == 4 and row[0] == row[3] == "" for row in rows), rows
        names = [row[1] for row in rows]
        assert len(set(names)) == len(names)
        tables.append((event.step, {row[1]: row[2] for row in rows}))
    return tables


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_start_logs_every_flag_as_hyperparameters_text(runs, name):
    """The text `hyperparameters` holds one row per field of Args with the value the process runs with: the fresh
    start's at step 0, the resumed start's (its --resume too) at the step it resumes from."""
    made = runs(name)
    script, run_dir = made.script, made.resumed.dir
    fresh = vars(tyro.cli(script.Args, args=FLAGS[name]))
    assert [f.name for f in dataclasses.fields(script.Args)] == list(fresh)
    resumed = dict(fresh, resume=str(run_dir))
    expected = [(0, {k: str(v) for k, v in fresh.items()}), (BATCH, {k: str(v) for k, v in resumed.items()})]
    assert hyperparameters(run_dir) == expected


# The per-epoch aux scalars ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", SCRIPTS)
def test_each_aux_epoch_is_logged_at_the_steps_before_its_checkpoint(runs, name):
    """Epoch k of the aux phase that ends at env step S is logged as aux/<name> at step S - E_aux + k, its means as
    auxiliary_phase returned them; the resumed run (which redid phase 2's aux phase) shows each step once."""
    made = runs(name)
    stopped, resumed = made.stopped, made.resumed
    assert [step for step, _ in stopped.rec["aux"]] == [32, 64] and [s for s, _ in resumed.rec["aux"]] == [64]
    logged = scalars(resumed.dir)
    for stat in AUX_NAMES:
        expected = logged_by_step(
            *(
                [
                    (step - E_AUX + k, means[stat])
                    for step, epochs in run.rec["aux"]
                    for k, means in enumerate(epochs, 1)
                ]
                for run in (stopped, resumed)
            )
        )
        assert [step for step, _ in expected] == [31, 32, 63, 64]
        assert logged["aux/" + stat] == [(step, float32(value)) for step, value in expected], stat


EPISODE_TAGS = {
    "charts/episodic_return": ("episodes", 1),
    "charts/episodic_length": ("episodes", 2),
    "charts/test_episodic_return": ("test_episodes", 1),
    "charts/test_episodic_length": ("test_episodes", 2),
}


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_resumed_run_logs_each_step_once_in_every_tag(runs, name):
    """The stopped run logged phase 2 (rollout 2 and its aux phase) past its checkpoint: in the resumed run's log, as
    TensorBoard reads it, no tag has a step twice, but for the episodes (several may end at one step): those are the
    stopped run's up to its checkpoint, then the resumed run's."""
    made = runs(name)
    stopped, resumed = made.stopped.rec, made.resumed.rec
    logged = scalars(made.resumed.dir)
    assert {"losses/policy_loss", "charts/SPS", "aux/clone_kl", "aux_phase/clone_kl"} <= logged.keys()
    for tag, pairs in logged.items():
        if tag in EPISODE_TAGS:
            record, field = EPISODE_TAGS[tag]
            episodes = [e for e in stopped[record] if e[0] <= BATCH] + resumed[record]
            assert pairs == [(e[0], float32(e[field])) for e in episodes], tag
            continue
        if tag == "charts/learning_rate":
            continue  # test_the_learning_rate_is_logged_once_per_rollout_after_a_resume
        steps = [step for step, _ in pairs]
        assert len(set(steps)) == len(steps), (tag, steps)
    assert logged["charts/episodic_length"]
    for tag in ("losses/policy_loss", "losses/value_loss", "charts/SPS"):
        assert [step for step, _ in logged[tag]] == [32, 64, 96], tag


# --anneal-lr -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", SCRIPTS)
def test_anneal_lr_falls_linearly_per_rollout(runs, name):
    """With --anneal-lr, the rate at rollout i (1-based) of N is learning_rate * (1 - (i - 1) / N): set in every
    optimizer (the policy phase's and the value epochs' at each update, the aux phase's after it), logged as
    charts/learning_rate once per rollout, and after a resume it goes on falling as in the run unbroken."""
    made = runs(name)
    lr0 = made.script.Args().learning_rate
    expected = [lr0 * (1 - (i - 1) / ROLLOUTS) for i in range(1, ROLLOUTS + 1)]
    stopped, resumed = made.stopped.rec, made.resumed.rec
    assert [set(lrs) for lrs in stopped["policy_lr"]] == [{lr} for lr in expected[:2]]  # rollouts 1 and 2
    assert [set(lrs) for lrs in resumed["policy_lr"]] == [{lr} for lr in expected[1:]]  # rollouts 2 and 3 again
    assert stopped["aux_lr"] == expected[:2] and resumed["aux_lr"] == expected[1:2]  # after rollouts 1 and 2
    # one value per logged step (a step logged twice: test_the_learning_rate_is_logged_once_per_rollout_after_a_resume)
    logged = dict(scalars(made.resumed.dir)["charts/learning_rate"])
    assert [logged[step] for step in sorted(logged)] == [float32(lr) for lr in expected]


@pytest.mark.parametrize("name", SCRIPTS)
def test_the_learning_rate_is_logged_once_per_rollout_after_a_resume(runs, name):
    """The stopped run logged rollout 2's rate before it stopped; the resumed run redoes rollout 2: TensorBoard must
    show its rate once."""
    steps = [step for step, _ in scalars(runs(name).resumed.dir)["charts/learning_rate"]]
    assert len(steps) == ROLLOUTS and len(set(steps)) == ROLLOUTS, steps


def test_without_anneal_lr_no_learning_rate_is_logged(tiny_run):
    """The rate is constant without the flag: no charts/learning_rate (the suite's shared tiny run)."""
    logged = scalars(tiny_run("ppg_procgen.py").run_dir)
    assert "losses/policy_loss" in logged and "charts/learning_rate" not in logged


# Progress lines --------------------------------------------------------------------------------------------------
class Clock:
    def __init__(self, now=1000.0):
        self.now = now

    def time(self):
        return self.now


def test_progress_ticks_every_20_seconds_with_the_time_left(script, monkeypatch, capsys):
    """Within long work, Progress.tick prints a line once 20 s have passed since the last line: done of total, and the
    time left at the rate measured since this work began; rollout_done prints the per-rollout line."""
    clock = Clock()
    monkeypatch.setattr(script, "time", clock)
    plan = dict(num_iterations=4, num_phases=2)
    progress = script.Progress(plan, 64, 0)
    # the work begins 50 s after the start, at 2 of 32 steps: its rate is measured from there, not from the start
    for at, done in [(50, 2), (60, 12), (70, 14), (81, 20)]:
        clock.now = 1000.0 + at
        progress.tick("rollout", done, 32, "env steps")
    # at 60 s: 10 steps in 10 s, 20 more take 20 s; at 70 s no line (10 s since the last); at 81 s, 18 steps in 31 s
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["  rollout: 12 of 32 env steps, about 20s left", "  rollout: 20 of 32 env steps, about 21s left"]
    clock.now = 1100.0  # a rollout of 64 env steps done 100 s after the start

    class Writer:
        def add_scalar(self, tag, value, step):
            logged.append((tag, value, step))

    logged = []
    test_envs = types.SimpleNamespace(recent_returns=[1.0, 2.0])
    kwargs = dict(test_envs=test_envs) if hasattr(script, "TestEnvs") else {}
    progress.rollout_done(Writer(), 1, 1, 64, [3.0, 4.0], **kwargs)
    line = capsys.readouterr().out
    test = " test return 1.50" if kwargs else ""
    # 64 env steps in 100 s: 0.64 per second, so the 3 rollouts left take 300 s
    assert line == f"phase 1/2 iter 1/4 step 64 SPS 1 ETA 0h05m return 3.50{test}\n"
    assert logged == [("charts/SPS", 0, 64)]


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_slow_rollout_prints_progress_lines_inside_it(runs, name):
    """A real run whose clock moves 25 s per reading prints 'rollout:' lines between its per-rollout lines."""
    lines = runs(name).stopped.stdout.splitlines()
    first_rollout = lines.index(next(line for line in lines if line.startswith("phase 1/3 iter 1/3")))
    ticks = [line for line in lines[:first_rollout] if line.startswith("  rollout: ")]
    assert ticks and all(re.fullmatch(r"  rollout: \d+ of 32 env steps, about \S+ left", line) for line in ticks)


@pytest.mark.parametrize("name", SCRIPTS)
def test_the_plan_says_where_the_next_checkpoint_comes(runs, name):
    """A fresh run's next checkpoint is at the end of its first phase; a resumed run's at the end of the phase it
    starts; the resumed plan counts its aux phases in all and those still to run."""
    made = runs(name)
    assert "a checkpoint at the end of each phase; the next at env step 32\n" in made.stopped.stdout
    assert "a checkpoint at the end of each phase; the next at env step 64\n" in made.resumed.stdout
    assert "; aux phases: 2\n" in made.stopped.stdout
    assert "; aux phases: 2 (1 still to run)\n" in made.resumed.stdout


# CleanRL's flags -------------------------------------------------------------------------------------------------
def test_cleanrl_flag_names_stop_before_anything_runs(tmp_path):
    """`python SCRIPT --n-iteration 4` (CleanRL's name of N_pi) stops with one line naming --n-pi, before any run
    folder exists."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = {
        name: subprocess.Popen(
            [sys.executable, str(ROOT / name), "--n-iteration", "4"],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name in SCRIPTS
    }
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=PATIENCE_S)
        assert proc.returncode != 0 and out == "", (name, err)
        assert err.count("\n") == 1 and err.startswith("error: --n-iteration ") and "--n-pi" in err, (name, err)
    assert not (tmp_path / "runs").exists()


def test_every_cleanrl_flag_is_answered_in_one_line(script):
    """Each of CleanRL's flag names, with a value or as a --no- switch, gets its one-line answer; none of them is a
    flag of this script, so none hides one."""
    names = [*script.CLEANRL_FLAGS, *script.CLEANRL_AS_RELEASED]
    assert not set(names) & {f.name for f in dataclasses.fields(script.Args)}
    for name in names:
        flag = "--" + name.replace("_", "-")
        for argv in ([flag, "4"], [f"{flag}=4"], ["--no-" + flag[2:]], ["--num-envs", "2", flag]):
            with pytest.raises(SystemExit) as stopped:
                script.answer_cleanrl_flags(argv)
            message = str(stopped.value.code)
            assert message.startswith(f"error: {flag} ") and "\n" not in message, (argv, message)
    script.answer_cleanrl_flags(["--num-envs", "2", "--n-pi", "4"])  # this script's own flags pass


# Messages ----------------------------------------------------------------------------------------------------------
def test_procgen_missing_is_named_with_its_package(tmp_path, monkeypatch):
    """Without procgen installed, a start stops in one line that names the package to install, before any folder."""
    import importlib.util

    script, real = load_script("ppg_procgen.py"), importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "procgen" else real(name, *a))
    message = refusal(script, FLAGS["ppg_procgen.py"], tmp_path, monkeypatch)
    assert "procgen is not installed" in message and "procgen-mirror" in message


def test_resume_of_a_folder_of_runs_names_one_of_them(script, tmp_path, monkeypatch):
    """--resume runs (the folder that holds the runs) stops in one line that names one of its runs as the example."""
    for run in ("a", "b"):
        (tmp_path / "runs" / run).mkdir(parents=True)
        (tmp_path / "runs" / run / "checkpoint.pt").touch()
    with pytest.raises(SystemExit) as stopped:
        main_in_process(script, ["--resume", "runs"], tmp_path, monkeypatch)
    message = str(stopped.value.code)
    example = message.rsplit(" ", 1)[1]
    assert message.startswith("error: --resume runs: a folder of runs") and example in ("runs/a", "runs/b")


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_finished_run_resumed_with_its_budget_says_to_raise_it(runs, name, monkeypatch, capsys):
    """Resumed with its own --total-timesteps, a finished run trains nothing, writes nothing, and says which flag
    trains it on."""
    run_dir = runs(name).resumed.dir
    before = sorted((p.name, p.stat().st_mtime_ns) for p in run_dir.iterdir())
    main_in_process(load_script(name), ["--resume", str(run_dir)], run_dir.parent, monkeypatch)
    assert "is trained to step 96: nothing to do (raise --total-timesteps above it to go on)" in capsys.readouterr().out
    assert sorted((p.name, p.stat().st_mtime_ns) for p in run_dir.iterdir()) == before


@pytest.mark.parametrize("where", ["envs", "collect_rollout"])
def test_a_run_stopped_before_training_leaves_no_folder(script, where, tmp_path, monkeypatch, capsys):
    """Stopped (as by Ctrl-C: SystemExit(130)) while its envs are being created, right after the run's folder was
    opened, or at its first rollout, a fresh run removes its folder."""

    def interrupted(*args, **kwargs):
        raise SystemExit(130)

    if where == "envs":
        where = "ProcgenVecEnv" if script.SCRIPT == "ppg_procgen.py" else "AtariVecEnv"
    monkeypatch.setattr(script, where, interrupted)
    with pytest.raises(SystemExit):
        main_in_process(script, FLAGS[script.SCRIPT], tmp_path, monkeypatch)
    assert not list((tmp_path / "runs").iterdir())
    assert "removed: the run stopped before its first rollout ended" in capsys.readouterr().out


@pytest.mark.parametrize("name", SCRIPTS)
def test_the_resume_line_says_whether_the_run_is_the_run_unbroken(runs, name):
    """Procgen's resume under the same conditions is the run unbroken, bit for bit; Atari's says why it is not: the
    checkpoint says 99 threads, and each env starts a new game."""
    resumed = runs(name).resumed
    line = next(line for line in resumed.stdout.splitlines() if line.startswith("resumed from "))
    assert line.startswith(f"resumed from {resumed.dir}/checkpoint.pt after phase 1, step 32: ")
    if name == "ppg_procgen.py":
        assert line.endswith(": bit for bit the run unbroken")
    else:
        assert line.endswith(f": not exact: threads 99 -> {torch.get_num_threads()}; each env starts a new game")


# Exactness memory (Procgen) -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def not_exact_resumes(runs, tmp_path_factory):
    """The unbroken Procgen run (a copy), resumed for one more rollout where the CPU's kernels differ, then resumed
    again for one more under the original conditions and stopped at its first rollout: both processes' stdout and the
    checkpoint the first wrote."""
    import shutil

    script, unbroken = load_script("ppg_procgen.py"), runs("ppg_procgen.py").unbroken.dir
    cwd = tmp_path_factory.mktemp("kernels")
    run_dir = cwd / "runs" / unbroken.name
    shutil.copytree(unbroken, run_dir)
    unbroken_state = checkpoint(run_dir)
    original = torch.backends.cpu.get_cpu_capability()
    other = "AVX512" if original != "AVX512" else "AVX2"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.backends.cpu, "get_cpu_capability", lambda: other)
        first = train(script, ["--resume", str(run_dir), "--total-timesteps", "128"], cwd)
    written = checkpoint(run_dir)
    second = train(script, ["--resume", str(run_dir), "--total-timesteps", "160"], cwd, interrupt=True)
    return types.SimpleNamespace(
        original=original, other=other, unbroken=unbroken_state, first=first, written=written, second=second
    )


def resume_line(stdout: str) -> str:
    return next(line for line in stdout.splitlines() if line.startswith("resumed from "))


def test_other_cpu_kernels_make_a_resume_not_exact_and_the_checkpoint_remembers(not_exact_resumes):
    """The checkpoint records torch's CPU kernels (AVX2 and AVX512 ones round differently); a resume on other kernels
    says so, its checkpoint records exact False, and a later resume on the original kernels is still not exact."""
    r = not_exact_resumes
    assert r.unbroken["same"]["cpu_kernels"] == r.original and r.unbroken["exact"] is True
    assert resume_line(r.first.stdout).endswith(f": not exact: cpu_kernels {r.original} -> {r.other}")
    assert r.written["global_step"] == 128 and r.written["exact"] is False
    assert r.written["same"]["cpu_kernels"] == r.other
    line = resume_line(r.second.stdout)
    assert ": not exact: " in line and line.endswith("an earlier resume was not exact"), line


def test_a_resumed_plan_counts_the_aux_phases_the_run_has(not_exact_resumes):
    """The finished run (2 aux phases, none after its third and last phase) trained on for one rollout (a fourth
    phase, the last, with no aux phase after it): it has 2 aux phases in all, none still to run."""
    r = not_exact_resumes
    assert len(scalars(r.first.dir)["aux_phase/clone_kl"]) == 2 and not r.first.rec["aux"]
    assert "; aux phases: 2 (0 still to run)\n" in r.first.stdout


@pytest.mark.parametrize("name", SCRIPTS)
def test_main_lets_go_of_its_lock_when_it_returns(runs, name):
    """main() called in a process (a notebook, a test) that goes on after it closes the run's lock file."""
    assert not runs(name).resumed.held_lock


# The lock and the memory fallback -----------------------------------------------------------------------------------
def test_the_lock_file_is_readable_by_all_whatever_the_umask(script, tmp_path):
    """The lock file is made with mode 0644, not the 0666 that a umask of 0 would leave writable by all."""
    old = os.umask(0)
    try:
        script.open_run_folder(script.Args(), None, str(tmp_path / "runs" / "a"), "a")
    finally:
        os.umask(old)
        release_lock(tmp_path / "runs" / "a")
    assert (tmp_path / "runs" / "a" / "lock").stat().st_mode & 0o777 == 0o644


def test_a_filesystem_without_flock_stops_in_one_line_and_leaves_no_folder(script, tmp_path, monkeypatch):
    """flock failing with ENOSYS (Lustre without -o flock, some NFS mounts) stops a fresh run in one line that says it
    cannot lock, and removes the folder it had made."""

    def no_flock(fd, operation):
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))

    monkeypatch.setattr(script.fcntl, "flock", no_flock)
    with pytest.raises(SystemExit) as stopped:
        main_in_process(script, FLAGS[script.SCRIPT], tmp_path, monkeypatch)
    message = str(stopped.value.code)
    assert re.fullmatch(r"error: cannot lock runs/\S+/lock \(Function not implemented\): .*flock", message), message
    assert not list((tmp_path / "runs").iterdir())


def test_free_memory_is_unbounded_without_proc_meminfo(script, monkeypatch):
    """Without /proc/meminfo (macOS), free memory reads inf and the memory plan checks nothing: CPU chunks of 256
    states, or whole minibatches on a GPU."""
    import builtins

    real_open = builtins.open

    def no_proc(path, *args, **kwargs):
        if path == "/proc/meminfo":
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", no_proc)
    free = script.free_memory(torch.device("cpu"))
    assert free == math.inf
    args = script.Args(num_envs=64, num_steps=256, n_pi=32)
    rows = (args.n_pi * args.num_envs, args.num_steps)
    assert script.memory_plan(args, rows, free, on_gpu=False).chunk_size == 256
    assert script.memory_plan(args, rows, free, on_gpu=True).chunk_size == 0


# The stop line ------------------------------------------------------------------------------------------------------
# 4 rollouts in 2 phases (N_pi 2): the first checkpoint leaves 2 rollouts, time enough for a SIGTERM to land
SIGTERM_FLAGS = [*TINY_FLAGS["ppg_procgen.py"], "--total-timesteps", "256"]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


@pytest.fixture(scope="module")
def sigterm_run(tmp_path_factory):
    """A Procgen run (no --anneal-lr) started as a user starts it, stopped by SIGTERM once its first checkpoint is
    there, then resumed by running the command its stop line printed, from another folder."""
    cwd = tmp_path_factory.mktemp("sigterm")
    argv = [sys.executable, str(ROOT / "ppg_procgen.py"), *SIGTERM_FLAGS]
    proc = subprocess.Popen(argv, cwd=cwd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + PATIENCE_S
    while not list(cwd.glob("runs/*/checkpoint.pt")):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=PATIENCE_S)
    (run_dir,) = (cwd / "runs").iterdir()
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    hint = out.strip().splitlines()[-1].partition("resume with: ")[2]
    resumed = subprocess.run(
        shlex.split(hint), cwd=elsewhere, env=ENV, capture_output=True, text=True, timeout=PATIENCE_S
    )
    return types.SimpleNamespace(
        dir=run_dir, stdout=out, stderr=err, returncode=proc.returncode, hint=hint, resumed=resumed, elsewhere=elsewhere
    )


# tests/test_resume.py runs the stop line's command from another folder too, with a run stopped at its worst moment
@pytest.mark.slow
def test_the_stop_line_is_a_command_that_resumes_from_anywhere(sigterm_run):
    """On SIGTERM after a checkpoint, the last line names this Python, the script's absolute path and the run's
    absolute folder; that command, run from another folder, resumes the run to its end."""
    r = sigterm_run
    assert r.returncode == 128 + signal.SIGTERM and "Traceback" not in r.stderr, r.stderr[-3000:]
    folder = os.path.realpath(r.dir)
    assert r.stdout.rstrip("\n").endswith(
        f"\nstopped by SIGTERM; resume with: {sys.executable} {ROOT / 'ppg_procgen.py'} --resume {folder}"
    )
    assert r.resumed.returncode == 0, r.resumed.stderr[-3000:]
    said = r.resumed.stdout
    resumed = f"resumed from {folder}/checkpoint.pt " in said and ": bit for bit the run unbroken\n" in said
    assert resumed or f"{folder} is trained to step 256" in said, said
    assert checkpoint(r.dir)["global_step"] == 256 and not list(r.elsewhere.iterdir())


def test_the_stop_line_quotes_a_folder_with_a_space(script, tmp_path, monkeypatch, capfd):
    """The stop line's command, split as a shell splits it, names the run's folder whole."""
    run_dir = tmp_path / "my runs" / "a"
    run_dir.mkdir(parents=True)
    (run_dir / "checkpoint.pt").touch()
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        script.stop_on_signals(types.SimpleNamespace(dir=str(run_dir)))
        with pytest.raises(SystemExit):
            signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    hint = capfd.readouterr().out.strip().partition("resume with: ")[2]
    assert shlex.split(hint) == [sys.executable, str(ROOT / script.SCRIPT), "--resume", str(run_dir)]


# Older checkpoints ---------------------------------------------------------------------------------------------------
def test_older_checkpoints_resume_as_what_they_hold(tiny_run, tmp_path, monkeypatch, capsys):
    """A checkpoint without random streams (versions before cea22d9) is refused in one line; one that recorded fewer
    conditions (no CPU kernels) resumes saying which were not recorded; a Procgen run from before the test envs goes
    on without them. The test envs' generator lives on the host, so its state resumes on a CPU or a GPU alike."""
    from conftest import copy_run

    script = load_script("ppg_procgen.py")
    run = copy_run(tiny_run("ppg_procgen.py"), tmp_path)
    state = torch.load(run / "checkpoint.pt", weights_only=True)
    assert state["test_envs"]["generator"].dtype == torch.uint8 and state["test_envs"]["generator"].numel() == 5056
    torch.save({k: v for k, v in state.items() if k != "torch_rng"}, run / "checkpoint.pt")
    (tmp_path / "elsewhere").mkdir()
    message = refusal(script, ["--resume", str(run)], tmp_path / "elsewhere", monkeypatch)
    assert message.endswith("holds no env or random state to go on from (tools/evaluate.py reads it)"), message
    older = dict(state, same={k: v for k, v in state["same"].items() if k != "cpu_kernels"})
    older["args"] = {k: v for k, v in state["args"].items() if k != "num_test_envs"}
    torch.save(older, run / "checkpoint.pt")
    main_in_process(script, ["--resume", str(run), "--total-timesteps", "256"], tmp_path, monkeypatch)
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("resumed from")]
    assert line.endswith(": not exact: conditions not recorded: cpu_kernels"), line
    resumed = torch.load(run / "checkpoint.pt", weights_only=True)
    assert resumed["args"]["num_test_envs"] == 0 and "test_envs" not in resumed and resumed["exact"] is False
