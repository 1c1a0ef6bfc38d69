"""tools/sweep.py on a real SLURM scheduler: a one-node cluster on this machine (tools/slurm/start.sh, which .ci/run
runs first). Without one, these tests skip and the suite's last lines say how to start it.

One sweep of four tiny Procgen runs is submitted as one job array, on a CPU partition (--gpus-per-job 0), and each
run meets one way a job stops, all at once (a requeued job waits about 2 minutes before SLURM starts it again, so
they must overlap; the test starts a requeued job as soon as SLURM can, with `scontrol update StartTime=now`):
- seed 1 reaches its time limit: after its first checkpoint the job's limit is lowered to 3 minutes past the minutes
  it has run, so that SLURM sends its warning signal (USR2, --signal-delay-s before the limit) at its next check, and
  submitit requeues the job.
  The training process is paused (SIGSTOP) from its first checkpoint until the signal has come: a fast machine would
  otherwise end the tiny run before it;
- seed 2 is preempted by `scontrol requeue` (SIGTERM to every process of the job) after its first checkpoint;
- seed 3 is requeued the same way before its first checkpoint (a loaded machine's time limit can come that early);
- seed 4 fails: its training process is killed (SIGKILL, as the kernel's OOM killer does) after its first checkpoint.
A second sweep runs seeds 1 and 2 unbroken beside them. Every wait below reads files or SLURM's state, not the clock
(the machine may run the jobs at any speed), but one lower bound: a requeued job is started at least 2 s after its
requeue, as SLURM refuses a start within the requeue's second."""

import contextlib
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time
import types

import pytest
import torch

from conftest import PATIENCE_S, ROOT, assert_same, sweep

START = "sudo tools/slurm/start.sh"
SKIP_LINE = f"no SLURM scheduler answers here (sinfo); to run them: {START} (a one-node SLURM from Debian's packages)"
# Tiny runs, one rollout a phase, so that each phase ends in a checkpoint within seconds: 8 phases of 2 envs x 16 steps
TOTAL = 256
FLAGS = ["--num-envs", "2", "--num-steps", "16", "--n-pi", "1", "--e-aux", "1", "--e-pi", "1", "--num-minibatches", "1"]
FLAGS += ["--aux-mb-trajectories", "2", "--total-timesteps", str(TOTAL)]
SEEDS = dict(time_limit=1, requeued=2, requeued_early=3, killed=4)


def scheduler_up() -> bool:
    """Whether a SLURM controller answers and has a node that takes jobs."""
    if shutil.which("sinfo") is None or shutil.which("sbatch") is None:
        return False
    try:  # an installed SLURM whose controller is down answers after about 10 s of retries: 5 s is enough
        done = subprocess.run(
            ["sinfo", "--noheader", "--states=idle,mixed,allocated"], capture_output=True, text=True, timeout=5
        )
    except subprocess.TimeoutExpired:
        return False
    return done.returncode == 0 and bool(done.stdout.strip())


class SkipLine:
    """After the test results, one line: the SLURM tests skipped, and how to run them (pytest -q shows no reasons)."""

    def pytest_terminal_summary(self, terminalreporter):
        line = f"SLURM: the tests of tests/test_slurm.py skipped: {SKIP_LINE}"
        terminalreporter.write_line(line, yellow=True, bold=True)


def slurm(*argv: str) -> str:
    return subprocess.run(argv, capture_output=True, text=True, check=True).stdout


def job_id(folder: pathlib.Path) -> str:
    """The SLURM job (an array task: 4242_0) that tools/sweep.py wrote down for the run in this folder."""
    cluster, job = (folder / "job_id").read_text().split()
    assert cluster == "slurm"
    return job


def queued(name: str) -> dict:
    """job id (4242_0) -> (SLURM's own number of the job, its state, the reason it waits) of a sweep's jobs that SLURM
    still holds."""
    out = slurm("squeue", "--noheader", "--array", "--name", f"ppg-{name}", "--format", "%i %A %T %r")
    return {
        job: (number, state, reason) for job, number, state, reason in (x.split(maxsplit=3) for x in out.splitlines())
    }


def steps_alive(number: str) -> bool:
    """Whether a process of the job's last start is still there (slurmstepd names each: "slurmstepd: [24.batch]")."""
    for proc in pathlib.Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):
            if (proc / "cmdline").read_text().startswith(f"slurmstepd: [{number}."):
                return True
    return False


def starts(folder: pathlib.Path) -> list:
    """Each start of the run, from its train.log: its command line, its output and its end."""
    log = folder / "train.log"
    return log.read_text().split("\n# start ")[1:] if log.exists() else []


def checkpoint_of_start(folder: pathlib.Path, start: int) -> bool:
    """Whether the run's start number `start` (1, 2, ...) has written a checkpoint."""
    log = folder / "train.log"
    began = [float(t) for t in re.findall(r"^# start ([\d.]+)", log.read_text(), re.M)] if log.exists() else []
    found = list(folder.glob("runs/*/checkpoint.pt"))
    return len(began) >= start and bool(found) and found[0].stat().st_mtime > began[start - 1]


def training_process(folder: pathlib.Path) -> int:
    """The pid of the training script that runs in this folder (its working directory)."""
    for proc in pathlib.Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):
            if "ppg_procgen.py" in (proc / "cmdline").read_text() and (proc / "cwd").resolve() == folder:
                return int(proc.name)
    raise AssertionError(f"no training process in {folder}")


def sweep_status(root: pathlib.Path, argv: list) -> str:
    """What `tools/sweep.py ... --status` prints for the sweep of this command line."""
    done = sweep(root, *argv, "--status", "--", *FLAGS)
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    return done.stdout


def final_state(folder: pathlib.Path) -> dict:
    (path,) = folder.glob("runs/*/checkpoint.pt")
    return torch.load(path, weights_only=True)


def logged_steps(folder: pathlib.Path) -> list:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (run,) = folder.glob("runs/*/")
    acc = EventAccumulator(str(run), size_guidance={"scalars": 0})
    acc.Reload()
    return [e.step for e in acc.Scalars("losses/value_loss")]


@pytest.fixture(scope="module")
def slurm_runs(request, tmp_path_factory):
    """The two sweeps, submitted and driven through every stop to their end (see the module's docstring): their
    folders, what the sweeps printed, --status while a requeued job waited and at the end, the requeue delays SLURM
    set (seconds from a requeue to its BeginTime)."""
    if not scheduler_up():
        if not request.config.pluginmanager.has_plugin("slurm-skip-line"):
            request.config.pluginmanager.register(SkipLine(), "slurm-skip-line")
        pytest.skip(SKIP_LINE)
    began, root, tag = time.time(), tmp_path_factory.mktemp("slurm") / "runs", os.getpid()
    names = dict(scenarios=f"scenarios-{tag}", unbroken=f"unbroken-{tag}")  # SLURM's job names: ppg-<name>
    common = ["--games", "dodgeball", "--methods", "ppg", "--cluster", "slurm", "--gpus-per-job", "0"]
    common += ["--cpus-per-job", "1", "--time-min", "30", "--signal-delay-s", "180"]
    argv = dict(
        scenarios=["--name", names["scenarios"], *common, "--seeds", *map(str, SEEDS.values())],
        unbroken=["--name", names["unbroken"], *common, "--seeds", "1", "2"],
    )
    command = [sys.executable, str(ROOT / "tools" / "sweep.py"), "--root", str(root)]
    submit = {
        k: subprocess.Popen([*command, *v, "--", *FLAGS], stdout=subprocess.PIPE, text=True) for k, v in argv.items()
    }
    printed = {k: p.communicate(timeout=PATIENCE_S)[0] for k, p in submit.items()}
    assert all(p.returncode == 0 for p in submit.values()), printed
    folder = {seed: root / names["scenarios"] / f"dodgeball__ppg__{seed}" for seed in SEEDS.values()}
    job = {seed: job_id(folder[seed]) for seed in SEEDS.values()}
    one, two, three, four = (folder[SEEDS[k]] for k in ("time_limit", "requeued", "requeued_early", "killed"))
    paused = []

    def lower_time_limit():  # pause the run at its first checkpoint, and bring its job's time limit near
        paused.append(training_process(one))
        os.kill(paused[0], signal.SIGSTOP)
        elapsed = slurm("squeue", "--noheader", "--jobs", job[1], "--format", "%M").strip()  # [h:]m:ss
        minutes = int(elapsed.split(":")[-2])
        # 3 minutes past the whole minutes it has run: the limit is over 2 minutes away and at most --signal-delay-s
        # (180 s) away, so that SLURM sends the warning signal at its next check of time limits (every 30 s), at
        # least 90 s before the limit
        slurm("scontrol", "update", f"JobId={job[1]}", f"TimeLimit={minutes + 3}")

    def signal_came() -> bool:  # submitit's log in the job says so
        logs = (root / names["scenarios"] / ".submitit").glob(f"{job[1]}_*_log.err")
        return any("Caught signal SIGUSR2" in log.read_text() for log in logs)

    def running_before_checkpoint(run) -> bool:
        with contextlib.suppress(AssertionError):
            return training_process(run) > 0 and not list(run.glob("runs/*/checkpoint.pt"))
        return False

    # (what, when, do): each done once, in whatever order the runs get there
    steps = [
        ("time limit", lambda: checkpoint_of_start(one, 1), lower_time_limit),
        ("signalled", lambda: paused and signal_came(), lambda: os.kill(paused[0], signal.SIGCONT)),
        ("requeue", lambda: checkpoint_of_start(two, 1), lambda: slurm("scontrol", "requeue", job[2])),
        ("early requeue", lambda: running_before_checkpoint(three), lambda: slurm("scontrol", "requeue", job[3])),
        ("kill", lambda: checkpoint_of_start(four, 1), lambda: os.kill(training_process(four), signal.SIGKILL)),
    ]
    done, delays, waiting = set(), [], None
    deadline = time.time() + PATIENCE_S  # a hang guard only
    try:
        while queued(names["scenarios"]) or queued(names["unbroken"]):
            assert time.time() < deadline, "the SLURM jobs did not end"
            for what, when, do in steps:
                if what not in done and when():
                    do()
                    done.add(what)
            for job_name, (number, state, reason) in queued(names["scenarios"]).items():
                # a requeued job, once its last start has gone: one started again while its last start's batch script
                # still ends would be ended with it (a requeue from within the job, as submitit's, lists it as
                # waiting before that)
                if state != "PENDING" or reason != "BeginTime" or steps_alive(number):
                    continue
                # first, once, --status while it waits (in the background: the runs go on)
                waiting = waiting or subprocess.Popen(
                    [*command, *argv["scenarios"], "--status", "--", *FLAGS], stdout=subprocess.PIPE, text=True
                )
                if waiting.poll() is None:
                    continue
                shown = slurm("scontrol", "show", "job", job_name)  # a requeue sets its SubmitTime anew
                requeued, eligible = (
                    time.mktime(time.strptime(re.search(rf"{k}=(\S+)", shown).group(1), "%Y-%m-%dT%H:%M:%S"))
                    for k in ("SubmitTime", "EligibleTime")
                )
                # Not within the requeue's second: SLURM revoked the job's credentials as of the second its last start
                # was killed, and refuses a start whose new credential dates from that second or before (its log says
                # "Job credential revoked"; the job then ends, never started again). A lower bound on the wait only.
                if time.time() < requeued + 2:
                    continue
                delays.append(round(eligible - requeued))
                # start it now rather than at its BeginTime, with 30 minutes again (the time-limit job's were lowered)
                slurm("scontrol", "update", f"JobId={job_name}", "StartTime=now", "TimeLimit=30")
            time.sleep(0.2)
    finally:
        for name in names.values():  # nothing left running by a failed test
            subprocess.run(["scancel", "--name", f"ppg-{name}"], capture_output=True)
        for pid in paused:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    assert done == {what for what, _, _ in steps}, f"steps not taken: {done}"
    final_status = sweep_status(root, argv["scenarios"])
    print(f"SLURM tests: requeue delays set by SLURM {delays} s; {time.time() - began:.0f} s in all")
    return types.SimpleNamespace(
        root=root,
        names=names,
        folder=folder,
        unbroken={seed: root / names["unbroken"] / f"dodgeball__ppg__{seed}" for seed in (1, 2)},
        job=job,
        printed=printed,
        waiting_status=waiting.communicate()[0] if waiting else None,
        final_status=final_status,
        delays=delays,
    )


def assert_ends_right(run: pathlib.Path):
    """The run ended at its planned step, each env step of its log logged once."""
    assert final_state(run)["global_step"] == TOTAL, run
    assert logged_steps(run) == list(range(32, TOTAL + 1, 32)), run


def test_the_sweep_submits_one_array_that_asks_for_no_gpu(slurm_runs):
    (job,) = {name.split("_")[0] for name in slurm_runs.job.values()}
    assert f"submitted 4 jobs: {job}_0, {job}_1, {job}_2, {job}_3" in slurm_runs.printed["scenarios"]
    script = (slurm_runs.root / slurm_runs.names["scenarios"] / ".submitit" / f"{job}_submission.sh").read_text()
    for line in ["--array=0-3", "--cpus-per-task=1", "--time=30", "--signal=USR2@180", "--job-name=ppg-scenarios-"]:
        assert f"#SBATCH {line}" in script, line
    assert "gpu" not in script.lower() and "gres" not in script  # a CPU partition: no GPU asked for


@pytest.mark.parametrize("how", ["time_limit", "requeued"])  # SLURM's USR2 before the limit; `scontrol requeue`
def test_a_job_requeued_after_its_first_checkpoint_resumes_from_it(slurm_runs, how):
    run = slurm_runs.folder[SEEDS[how]]
    first, second = starts(run)
    assert "stopped by SIGTERM; resume with:" in first and "exit 143" in first[-1000:], first[-500:]
    # the job's note: the requeued job resumes the run (running the sweep again would submit a second job for it)
    note = {
        "time_limit": "# stopped by SIGTERM for a requeue of its job: the requeued job resumes it by itself",
        "requeued": "# stopped by SIGTERM, a run of a sweep on SLURM: where SLURM requeued its job (scontrol requeue",
    }
    assert note[how] in first and "to resume it, run the sweep again" not in first, first[-800:]
    assert " --resume " in second.splitlines()[1] and "resumed from " in second and second.rstrip().endswith("exit 0")
    assert_ends_right(run)


def test_a_job_requeued_before_its_first_checkpoint_starts_afresh(slurm_runs):
    run = slurm_runs.folder[SEEDS["requeued_early"]]
    first, second = starts(run)
    assert not first.rstrip().endswith("exit 0") and " --resume " not in second.splitlines()[1]
    assert second.rstrip().endswith("exit 0")
    assert_ends_right(run)


def test_status_shows_a_queued_job_and_reports_a_failed_one(slurm_runs):
    """--status, while a requeued job waited for its BeginTime and at the end: the killed run (SIGKILL of its training
    process) is stopped, killed, with the env step it reached and what resumes it; the others are done."""
    waiting = slurm_runs.waiting_status
    assert re.search(
        r"^queued +dodgeball__ppg__\d: step \d+ of 256.*; job \d+_\d PENDING, BeginTime$", waiting, re.M
    ), waiting
    lines = slurm_runs.final_status.splitlines()
    for seed in (1, 2, 3):
        assert f"done        dodgeball__ppg__{seed}: step 256 of 256" in lines, slurm_runs.final_status
    killed = [line for line in lines if "dodgeball__ppg__4" in line]
    pattern = (
        r"stopped +dodgeball__ppg__4: step \d+ of 256.*; killed by SIGKILL \(exit -9\) at step \d+: rerun the sweep"
    )
    assert len(killed) == 1 and re.match(pattern, killed[0]), killed
    assert "4 runs: 3 done, 1 stopped" in lines


def test_the_runs_unbroken_end_right(slurm_runs):
    for run in slurm_runs.unbroken.values():
        assert len(starts(run)) == 1
        assert_ends_right(run)


def test_without_a_scheduler_the_tests_skip_saying_how_to_start_one():
    """Where no SLURM answers (here: none on PATH), the test command's last lines say that these tests skipped and the
    command that starts a scheduler."""
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_slurm.py", "-k", "not skip"]
    env = dict(os.environ, PATH=os.path.dirname(sys.executable))
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=PATIENCE_S)
    lines = done.stdout.splitlines()
    assert done.returncode == 0 and re.match(r"\d+ skipped, 1 deselected in ", lines[-1]), done.stdout[-2000:]
    assert f"SLURM: the tests of tests/test_slurm.py skipped: {SKIP_LINE}" in lines, done.stdout[-2000:]


# The exact resume of ppg_procgen.py (its checkpoint holds each env's state and every random generator's) makes a
# requeued run the run unbroken; the tests above show that it did resume (from its checkpoint, no step logged twice)
def test_a_requeued_run_ends_bit_identical_to_the_run_unbroken(slurm_runs):
    for seed in (SEEDS["time_limit"], SEEDS["requeued"]):
        resumed, unbroken = (final_state(f) for f in (slurm_runs.folder[seed], slurm_runs.unbroken[seed]))
        for part in ("agent", "policy_optimizer", "aux_optimizer", "value_optimizer"):
            assert_same(resumed[part], unbroken[part], f"seed {seed}: {part}")
