"""Data-parallel training under torchrun: 2 CPU workers (gloo), tiny settings; every run is bounded by a
timeout, so a worker left waiting fails its test instead of hanging the suite."""

import contextlib
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import ROOT, SCRIPTS, TINY_FLAGS, aux_buffers, dp_check_setup, load_script, refusal, torchrun


def flags(name: str, **changes) -> list:
    """The script's tiny flags with some values replaced (--total-timesteps 384: 3 rollouts of 2 workers)."""
    out = list(TINY_FLAGS[name])
    for key, value in {"total_timesteps": 384, **changes}.items():
        flag = "--" + key.replace("_", "-")
        if flag in out:
            out[out.index(flag) + 1] = str(value)
        else:
            out += [flag, str(value)]
    return out


def scalars_with_steps(run_dir) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.mark.parametrize("name", SCRIPTS)
def test_two_workers_train_as_one_run(name, tmp_path, monkeypatch):
    """One 2-worker run a script, also the KL guard's test: --aux-kl-stop 1e-9 fires after the first aux epoch of
    3; the guard reads the epoch mean over all workers, so both stop together and the run ends (a worker that
    stopped alone would leave the other waiting in its next all-reduce)."""
    proc = torchrun(2, str(ROOT / name), *flags(name, e_aux=3, aux_kl_stop=1e-9), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    # rank 0 alone prints; the plan counts both workers' envs and steps
    assert [line for line in proc.stdout.splitlines() if line.startswith("run ")] == [
        line
        for line in proc.stdout.splitlines()
        if "3 rollouts of 2 workers x 2 envs x 32 steps = 384 env steps" in line
    ]
    assert "PPO minibatch 2 workers x 64 states" in proc.stdout and "1 auxiliary phases" in proc.stdout
    (run,) = (tmp_path / "runs").iterdir()  # one run directory, written by rank 0
    scalars = scalars_with_steps(run)
    # global steps count every worker: 3 rollouts x 2 workers x 2 envs x 32 steps
    assert [step for step, _ in scalars["losses/value_loss"]] == [128, 256, 384]
    for tag in ("charts/episodic_return", "losses/approx_kl", "aux/clone_kl", "timing/grad_allreduce_s"):
        assert tag in scalars, tag
    steps = [step for step, _ in scalars["charts/episodic_return"]]
    assert steps == sorted(steps) and len(set(steps)) > 1  # both workers' episodes, in step order
    assert scalars["timing/grad_allreduce_s"][0][1] > 0  # the first phase averaged gradients
    if (
        name == "ppg_procgen.py"
    ):  # (the tiny Atari games are all cut at 25 steps with 0 points: alike whatever the seed)
        # each worker plays its own levels: with one seed for both, every episode would come twice (same step, length, return)
        episodes = list(zip(scalars["charts/episodic_return"], scalars["charts/episodic_length"]))
        assert len(set(episodes)) > len(episodes) // 2 + 1, episodes
    assert "auxiliary phase stopped after epoch" in proc.stdout
    (epochs,) = [value for _, value in scalars["charts/aux_epochs"]]
    assert epochs < 3 and len(scalars["aux/clone_kl"]) == epochs
    state = load_script(name).load_checkpoint(str(run))
    assert state["workers"] == 2 and state["global_step"] == 384
    # a run of 2 workers resumes with 2: one process (here, this one) is refused in one line, before any env exists
    (tmp_path / "elsewhere").mkdir()
    assert "had 2 workers" in refusal(load_script(name), ["--resume", str(run)], tmp_path / "elsewhere", monkeypatch)


@pytest.fixture(scope="module")
def dp_results(tmp_path_factory):
    """One 2-worker launch of dp_update_check.py for both scripts: its folder of per-script, per-rank results."""
    out = tmp_path_factory.mktemp("dp")
    proc = torchrun(2, str(ROOT / "tests" / "dp_update_check.py"), str(out), *SCRIPTS, cwd=out, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.mark.parametrize("name", SCRIPTS)
def test_data_parallel_update_equals_one_process_on_the_whole_batch(name, dp_results):
    """Two workers with half the batch each (the script's own update functions, SGD, in a 2-process gloo group)
    end with identical parameters, equal to those of one process given the whole batch."""
    stem = pathlib.Path(name).stem
    workers = [torch.load(dp_results / f"{stem}.rank{r}.pt", weights_only=False) for r in (0, 1)]
    script = load_script(name)
    start = [p.detach().clone() for p in dp_check_setup(script, 1)[0].parameters()]
    agent, args, batch, obs_buffer, returns_buffer, values = dp_check_setup(script, 1)
    stats = script.policy_phase_update(
        agent, torch.optim.SGD(agent.parameters(), lr=0.1), batch, args, script.make_plan(args)
    )
    buffers = aux_buffers(script, obs_buffer, returns_buffer)
    aux = script.auxiliary_phase(agent, torch.optim.SGD(agent.parameters(), lr=0.1), buffers, args)
    assert all(torch.equal(a, b) for a, b in zip(workers[0]["params"], workers[1]["params"]))  # bitwise in sync
    for p, q, s in zip(agent.parameters(), workers[0]["params"], start):
        assert bool(torch.count_nonzero(p.detach() - s))  # every parameter moved
        step = p.detach() - s  # the same step, up to float rounding (summation order) carried through both updates
        assert float((q - s - step).norm()) <= 1e-3 * float(step.norm())
    for got in workers:
        assert got["stats"] == pytest.approx(stats, rel=1e-4, abs=1e-7)
        assert got["aux"][0] == pytest.approx(aux[0], rel=1e-4, abs=1e-7)
        n, mean, var = got["moments"]
        assert (
            n == 32
            and mean == pytest.approx(float(values.double().mean()))
            and var == pytest.approx(float(values.double().var(unbiased=False)))
        )
        assert got["gathered"] == [0, "worker 0", 1, "worker 1"]
        # the KL guard's epoch mean: 0.01 on one worker and 0.03 on the other read 0.02 on both (not 0.01 vs 0.03
        # on either side of an --aux-kl-stop 0.02: a guard on local means would stop one worker alone)
        assert got["means"] == {"clone_kl": pytest.approx(0.02)}


@pytest.mark.parametrize("name", ["ppg_atari.py"])  # prepare() is the same text in both scripts
def test_bad_flags_are_reported_once(name, tmp_path):
    proc = torchrun(2, str(ROOT / name), *flags(name, num_minibatches=7), cwd=tmp_path, timeout=120)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode != 0 and len(errors) == 1 and "--num-minibatches 7" in errors[0], proc.stderr[-2000:]
    assert not (tmp_path / "runs").exists()


@contextlib.contextmanager
def training_workers(name: str, tmp_path):
    """A 2-worker torchrun run of `name` that has finished its first phase (a checkpoint exists): yields the
    launcher (its stdout piped) and the pid of rank 1. On the way out, the launcher and its workers (in
    sessions of their own) are killed, whatever happened."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(ROOT / name),
            *flags(name, total_timesteps=10**6),
        ],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    children = []
    try:
        deadline = time.time() + 120
        while not list(tmp_path.glob("runs/*/checkpoint.pt")):  # phase 1 is done: both workers are training
            assert time.time() < deadline and launcher.poll() is None
            time.sleep(0.2)
        children = [
            int(pid)
            for path in pathlib.Path(f"/proc/{launcher.pid}/task").glob("*/children")
            for pid in path.read_text().split()
        ]
        (rank1,) = [pid for pid in children if b"\0RANK=1\0" in pathlib.Path(f"/proc/{pid}/environ").read_bytes()]
        yield launcher, rank1
    finally:
        for pid in [launcher.pid, *children]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        launcher.wait()


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="finds the workers through /proc")
def test_a_killed_worker_takes_the_run_down(tmp_path):
    """SIGKILL to rank 1 mid-run: rank 0's next all-reduce fails and torchrun stops; nothing waits forever."""
    with training_workers("ppg_atari.py", tmp_path) as (launcher, rank1):
        os.kill(rank1, signal.SIGKILL)
        launcher.communicate(timeout=90)
        assert launcher.returncode != 0


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="finds the workers through /proc")
def test_sigterm_to_one_worker_stops_all_at_the_same_boundary(tmp_path):
    """SIGTERM reaches rank 1 only: the workers agree on stopping after each rollout, so both stop at the
    same rollout boundary, the phase-1 checkpoint stays and rank 0 prints the torchrun resume command."""
    name = "ppg_atari.py"
    with training_workers(name, tmp_path) as (launcher, rank1):
        os.kill(rank1, signal.SIGTERM)
        out, _ = launcher.communicate(timeout=90)
    (run,) = (tmp_path / "runs").iterdir()
    assert f"resume with: torchrun --standalone --nproc-per-node 2 {name} --resume runs/{run.name}" in out, out[-2000:]
    stopped = int(out.split("stopped by SIGTERM at step ")[1].split(";")[0].replace(",", ""))
    assert stopped % 128 == 0 and stopped < 10**6  # whole rollouts of both workers (2 x 2 envs x 32 steps)
    assert launcher.returncode != 0 and load_script(name).load_checkpoint(str(run))["global_step"] <= stopped
