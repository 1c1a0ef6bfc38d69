"""Many runs: a released experiment, or a grid of games x seeds x methods; one submitit job a run, on SLURM or here.

    python tools/sweep.py --experiment ppg --cluster slurm --partition gpu --gpus-per-job 1 --cpus-per-job 8 \\
        --time-min 1440                            # the released PPG runs: 16 hard-mode games x 3 seeds at 100M steps
    python tools/sweep.py --experiment e-aux --dry-run   # the jobs, their folders and what each would do
    python tools/sweep.py --experiment ppg --status      # where each run stands: done, running, stopped, failed...
    python tools/sweep.py --name ppg --status            # the same, read from the sweep's folder alone
    python tools/sweep.py --name small --games bigfish --seeds 1 2 --cluster local --jobs 2 -- --total-timesteps 2000000

An experiment is one of the seven that the released code's README reproduces (tools/experiments.py: ppg, ppo, ppgkl,
ppg-single-network, e-pi, e-aux, n-pi), or generalization (train-procgen's protocol). --experiment NAME runs its
variants as the sweep's methods, on the 16 games, with its run count (the released one: 3 seeds, or 1 a value), at its
protocol (the seven: the paper's, experiments.PAPER_PROTOCOL) and the script's defaults otherwise, in runs/NAME/ (or
--name's). --games, --seeds, --methods, --method and --script are the experiment's; after `--` it takes only flags
that change no training flag (MACHINE_FIELDS).

A method is a set of flags: `ppg` (the script's defaults) and `ppo` (`--arch shared --e-aux 0 --e-pi 3 --e-v 3`, the
paper's baseline) are built in; `--method NAME="FLAGS"` adds one, and runs it: --methods, where given, must name it.
Flags after `--` go to every run (a method's own flags win over them; the grid's own, --env-id, --seed, --exp-name and
--resume, are refused there). Flags are judged by what the script parses, as tyro does: --total_timesteps is
--total-timesteps, and the later of two wins. Each run has a fixed folder, runs/<name>/<game>__<method>__<seed>, and
runs in it as its working directory (the script writes its runs/<run_name>/ there). Each start of a job looks at that
folder: a run whose checkpoint reached the planned steps is done and starts nothing; a run with a checkpoint resumes
from it (`--resume` with the same flags); a folder without one is emptied and the run starts afresh. So the same
command, run again, finishes what was stopped and leaves what is done. Where a folder has a checkpoint, done or not, the
command must describe that run: the budget may rise, but a training flag that differs from the checkpoint's, given or
left at its default, stops the sweep in one line. Run again while its jobs still run, it starts no run twice: a job
holds a lock in its run's folder (JOB_LOCK) from its first moment, and a run whose lock is held is left out.

--cluster slurm submits every job as one job array and returns; a job that reaches its time limit, or that the cluster
preempts (with its warning signal, or with SIGTERM as `scontrol requeue` does), is requeued and resumes from its last
phase checkpoint. --gpus-per-job 0 asks for no GPU (a CPU partition). --cluster local runs the jobs here and holds the
queue in the foreground: at most one job a GPU at once (each sees only its own GPU), or --jobs N without GPUs; SIGTERM
or Ctrl-C is passed to the running runs, which stop keeping their last checkpoint; the sweep waits for them and the
next run of the command resumes them, each at the thread count it started with (recorded in its folder's sweep.json). Every flag is checked
against the script before any job is submitted: a bad one stops the sweep in one line.

The steps of main(), in the order of this file: read the command; plan every run, checked against the script (what a
job does with a run's folder comes next: TrainRun); with --status, say where each run stands; say what each run would
do; run the runs that are not done, here or on SLURM.
"""

import argparse
import contextlib
import ctypes
import dataclasses
import fcntl
import functools
import glob
import importlib.util
import io
import json
import math
import os
import pathlib
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time

import submitit

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))  # the tools' own modules
from checkpoints import base_script  # noqa: E402
from experiments import EXPERIMENTS  # noqa: E402
from helptext import DefaultsHelpFormatter  # noqa: E402

METHODS = {"ppg": "", "ppo": "--arch shared --e-aux 0 --e-pi 3 --e-v 3"}
# What flags after -- may change in an experiment's runs: what the script lets a resume change too (resume_args), as
# none changes what a run learns: where it trains, the chunks of its minibatches (the same update) and what it saves
MACHINE_FIELDS = ("cuda", "micro_batch_size", "track", "wandb_project_name", "wandb_entity")
# The grid's own: the first three name a run's folder, and each start of a job resumes the run in it by itself
GRID_FIELDS = ("env_id", "seed", "exp_name", "resume")
GRID_FIX = "(use --games, --seeds or --methods; a run resumes from its folder by itself)"
RELEASED_FIX = "(the experiment's game, seed and name; a run resumes from its folder by itself)"
POLL_S = 0.5  # how often the local queue looks at its jobs
JOB_FILE = "job_id"  # in a run's folder: "<cluster> <job id>" of the job last submitted for it, read by --status
# In a run's folder: what the sweep planned for it (its command, the script, its planned steps, the threads it started
# with), written at each submission and read back by the next: --status needs no command to read it, and a resume keeps
# the run's thread count
RECORD_FILE = "sweep.json"
STOPS = (signal.SIGINT, signal.SIGTERM)  # the signals the scripts stop on, keeping their last checkpoint
# The signals that stop a local sweep: each is passed on to its runs, SIGHUP (a closed terminal) as SIGTERM
SWEEP_STOPS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# In a run's folder: the lock a job holds while it runs the run, and its training process with it (one process a run,
# from the job's first moment: the script takes its own lock seconds after its start)
JOB_LOCK = "job.lock"
PR_SET_PDEATHSIG = 1  # prctl's option (linux/prctl.h): a signal the kernel sends a process when its parent ends
QUEUED = ("PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "SUSPENDED")  # SLURM's states of a job not running now


# ---- 1. The command: the sweep's own options, each checked on its own ----


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter)
    parser.add_argument(
        "--experiment",
        default=None,
        metavar="NAME",
        help=f"one of the experiments, with its own runs: {', '.join(EXPERIMENTS)} (tools/experiments.py)",
    )
    parser.add_argument("--name", help="the sweep's name: its runs go to <root>/<name>/ (an experiment's: its name)")
    parser.add_argument(
        "--script",
        metavar="PATH",
        help="the training script: ppg_procgen.py, ppg_atari.py or a copy of either (a name not found here is looked "
        "for in the repository root; default: ppg_procgen.py)",
    )
    parser.add_argument("--games", nargs="+", help="env ids (Procgen games, or Atari ids); all: the 16 Procgen games")
    parser.add_argument("--seeds", nargs="+", type=int, help="each run's --seed (default: 1 2 3)")
    parser.add_argument(
        "--methods",
        nargs="+",
        default=None,
        help="the methods to run (default: ppg, ppo and each one --method defines); built in: ppg, ppo",
    )
    parser.add_argument(
        "--method", action="append", default=[], metavar='NAME="FLAGS"', help="define a method (and run it)"
    )
    parser.add_argument("--root", default="runs", help="where the sweep's folder goes")
    parser.add_argument("--cluster", choices=("local", "slurm"), default="local", help="where the jobs run")
    parser.add_argument("--jobs", type=int, default=1, help="local, without GPUs: jobs at once")
    parser.add_argument("--gpus", type=int, default=None, help="local: GPUs to use (default: all visible)")
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="OMP threads a job; 0: local, the cores / jobs at once; slurm, --cpus-per-job",
    )
    parser.add_argument("--partition", default=None, help="slurm: the partition")
    parser.add_argument("--gpus-per-job", type=int, default=1, help="slurm: GPUs a job (0: none, a CPU partition)")
    parser.add_argument("--cpus-per-job", type=int, default=8, help="slurm: CPUs a job")
    parser.add_argument(
        "--mem-gb", type=float, default=None, help="slurm: memory a job, in GiB (default: the cluster's)"
    )
    parser.add_argument("--time-min", type=float, default=60 * 24, help="a job's time limit, in minutes")
    parser.add_argument("--signal-delay-s", type=int, default=120, help="the stop signal comes this long before it")
    parser.add_argument("--max-requeues", type=int, default=10, help="requeues after the time limit, at most")
    parser.add_argument("--dry-run", action="store_true", help="print the jobs and what each would do, submit none")
    parser.add_argument(
        "--status",
        action="store_true",
        help="print where each run stands (done, running, queued, stopped, failed) and its env step, submit none; "
        "--name NAME --status alone: every run in the sweep's folder",
    )
    return parser


def sweep_options() -> set:
    """The sweep's own flags, as written on its command line."""
    return {name for action in make_parser()._actions for name in action.option_strings if name.startswith("--")}


def read_command(argv: list):
    """The sweep's options, and the flags after `--` that go to every run. Exits with one line where an option is out
    of range or does not go with another (the flags after -- are the script's to judge: plan_jobs)."""
    common = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    # a flag of the sweep after -- would reach the script, which refuses it in tyro's words: say where it goes instead
    # (no flag of the sweep is one of the scripts', tests/test_sweep.py checks: --seed is the script's, --seeds ours)
    for token in common:
        if token.split("=")[0].replace("_", "-") in sweep_options() - {"--help"}:
            sys.exit(
                f"error: {token.split('=')[0]} after --: a flag of tools/sweep.py, not of the script: put it before --"
            )
    opts = make_parser().parse_args(argv)
    # the command as typed, with the interpreter that runs it and this file's whole path, and the folder it was typed
    # in: the hints that resume a stopped run (resume_hint) work from any folder
    typed = [sys.executable, str(pathlib.Path(__file__).resolve()), *argv]
    if common:
        typed += ["--", *common]
    opts.command, opts.cwd = shlex.join(typed), os.getcwd()
    least = dict(jobs=1, gpus_per_job=0, cpus_per_job=1, max_requeues=0, threads=0, gpus=0)
    for name, value in least.items():
        if getattr(opts, name) is not None and getattr(opts, name) < value:
            sys.exit(f"error: --{name.replace('_', '-')} must be at least {value}")
    if opts.mem_gb is not None and not opts.mem_gb > 0:
        sys.exit("error: --mem-gb must be > 0")
    if not opts.time_min > 0 or opts.signal_delay_s < 0:
        sys.exit("error: --time-min must be > 0 and --signal-delay-s >= 0")
    if opts.experiment is not None:
        if opts.experiment not in EXPERIMENTS:
            sys.exit(f"error: --experiment {opts.experiment}: unknown; known: {', '.join(EXPERIMENTS)}")
        for name in ("script", "games", "seeds", "methods", "method"):  # an experiment's own: the released runs
            if getattr(opts, name):
                sys.exit(
                    f"error: --{name} with --experiment: an experiment runs the games, seeds and variants it defines "
                    f"(leave --{name} out, or --experiment for a sweep of your own)"
                )
        opts.name = opts.name or opts.experiment
    # --name NAME --status alone: the runs in the sweep's folder, as they were recorded (main)
    opts.from_folders = opts.experiment is None and opts.status and opts.name is not None and opts.games is None
    if opts.experiment is None and not opts.from_folders and (opts.name is None or opts.games is None):
        sys.exit("error: --name and --games are needed (or --experiment NAME: a released experiment)")
    opts.script, opts.seeds = opts.script or "ppg_procgen.py", opts.seeds or [1, 2, 3]
    return opts, common


# ---- 2. The plan: every run's folder, flags and planned steps, each checked against the script ----


def load_script(path: pathlib.Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # tyro reads the flags' help through inspect
    spec.loader.exec_module(module)
    return module


def flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def flag_text(field: str, value) -> str:
    """A parsed value as the flag that gives it."""
    if isinstance(value, bool):
        return flag(field) if value else flag(f"no_{field}")
    return f"{flag(field)} {value}"


def one_line(what: str, call):
    """call()'s result, or exit with one line: tyro's refusal or the script's own, after `what`."""
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            return call()
    except SystemExit as e:
        lines = [line.strip("│╭╮╰╯─ ") for line in stderr.getvalue().splitlines()]
        reason = str(e.code) if isinstance(e.code, str) else " ".join(line for line in lines if line)[:300]
        sys.exit(f"error: {what}: {reason.removeprefix('error: ')}")


def parsed_args(module, flags: list, what: str):
    """The script's Args for these flags as its parser, tyro, reads them: in every spelling it takes (--total_timesteps
    is --total-timesteps, --seed=5 is --seed 5), the later of two flags winning. Flags are judged by these, not by how
    they are spelled."""
    import tyro

    return one_line(what, lambda: tyro.cli(module.Args, args=flags))


def checked_args(module, args, what: str):
    """A run's Args as the script itself checks them (make_plan; on --resume, resume_args: a resumed run keeps the
    training flags of its checkpoint, and each training flag of the command, named or left at its default, must equal
    the checkpoint's: a sweep's command describes its runs whole), or exit with the script's refusal in one line."""

    def check():
        run_args = module.resume_args(args, set(vars(args)))[0] if args.resume else args
        module.make_plan(run_args)
        return run_args

    return one_line(what, check)


def grid_fields_set(module, flags: list, what: str) -> list:
    """The grid's own fields that these flags set, in whatever spelling: parsed after two probes that differ in each of
    those fields, a field the flags set comes out the same after both."""
    games = getattr(module, "PROCGEN_GAMES", ("PongNoFrameskip-v4", "BreakoutNoFrameskip-v4"))
    probes = [["--env-id", games[i], "--seed", str(i), "--exp-name", f"p{i}", "--resume", f"p{i}"] for i in (0, 1)]
    first, second = (parsed_args(module, [*probe, *flags], what) for probe in probes)
    return [field for field in GRID_FIELDS if getattr(first, field) == getattr(second, field)]


def last_checkpoint(folder: pathlib.Path):
    """(run folder, checkpoint) of the run in a job's folder, or (None, None)."""
    found = sorted(glob.glob(f"{folder}/runs/*/checkpoint.pt"))
    if not found:
        return None, None
    import torch  # here, not at the top: a job's process that starts a run afresh need not import it

    return pathlib.Path(found[-1]).parent, torch.load(found[-1], map_location="cpu", weights_only=True)


def planned_steps(module, args) -> int:
    """The env steps the run will take: --total-timesteps rounded up to whole rollouts, by the script's own plan."""
    return module.make_plan(args)["num_iterations"] * args.num_envs * args.num_steps


def fields_of(flags: str) -> set:
    """The fields an experiment's own flags set (written by us as `--name value`: their spelling is known)."""
    return {token[2:].replace("-", "_") for token in shlex.split(flags) if token.startswith("--")}


def define_methods(opts) -> dict:
    """name -> flags of the methods to run; opts.methods, opts.seeds and opts.games as the sweep runs them."""
    if opts.experiment is not None:  # its runs: its variants, its seeds, the 16 games
        experiment = EXPERIMENTS[opts.experiment]
        opts.methods, opts.seeds, opts.games = list(experiment["variants"]), list(experiment["seeds"]), ["all"]
        return dict(experiment["variants"])
    methods, defined = dict(METHODS), []
    for item in opts.method:
        if "=" not in item:
            sys.exit(f'error: --method {item!r}: give it as NAME="FLAGS"')
        name, flags = item.split("=", 1)
        if "__" in name or "/" in name:  # the run's folder is <game>__<method>__<seed>
            sys.exit(f"error: --method {item!r}: a name without '__' or '/' (it names the runs' folders)")
        if name in defined:  # the later would silently replace the earlier
            sys.exit(f"error: --method {name}: defined twice")
        defined.append(name)
        methods[name] = flags
    if opts.methods is None:  # the built-in ones and every method defined: a method defined is one to run
        opts.methods = [*METHODS, *[name for name in defined if name not in METHODS]]
    elif left_out := [name for name in defined if name not in opts.methods]:
        sys.exit(f"error: --method {left_out[0]}: defined but not run: add it to --methods, or leave --methods out")
    return methods


def check_experiment(module, name: str, variant: str, args) -> None:
    """Exit with one line where the flags after -- change a field of an experiment's runs that is not one of
    MACHINE_FIELDS: the experiment's protocol, the variant's own flags, or any other training flag."""
    flags, protocol = EXPERIMENTS[name]["variants"][variant], EXPERIMENTS[name]["protocol"]
    released = parsed_args(module, [*shlex.split(protocol), *shlex.split(flags)], f"--experiment {name}")
    bad = [field for field in vars(args) if getattr(args, field) != getattr(released, field)]
    if not (bad := [field for field in bad if field not in MACHINE_FIELDS]):
        return
    field, value = bad[0], getattr(released, bad[0])
    if field in fields_of(flags):
        whose = f"variant {variant} sets {flag_text(field, value)}"
    elif field in fields_of(protocol):
        whose = f"{EXPERIMENTS[name]['named']} protocol sets {flag_text(field, value)}"
    else:
        whose = f"its runs have {flag_text(field, value)}"
    allowed = ", ".join(flag(field) for field in MACHINE_FIELDS)
    sys.exit(
        f"error: --experiment {name}: {flag_text(field, getattr(args, field))} after -- changes its runs ({whose}); "
        f"after -- it takes only {allowed} (other flags: a sweep of --games, --seeds and --method)"
    )


def plan_jobs(opts, common: list):
    """Every (game, method, seed) as (folder, flags, planned steps), each checked against the script."""
    script = pathlib.Path(opts.script).resolve() if pathlib.Path(opts.script).is_file() else ROOT / opts.script
    if not script.is_file():
        sys.exit(f"error: --script {opts.script}: no such file, here or in the repository root")
    module = load_script(script)
    if not all(hasattr(module, name) for name in ("Args", "make_plan", "resume_args")):
        sys.exit(f"error: --script {opts.script}: not ppg_procgen.py, ppg_atari.py or a copy of either")
    methods = define_methods(opts)
    for name in ("games", "seeds", "methods"):  # one folder a run: a value given twice would run two jobs in one folder
        if twice := sorted({str(v) for v in getattr(opts, name) if getattr(opts, name).count(v) > 1}):
            sys.exit(f"error: --{name}: {', '.join(twice)} given twice")
    if unknown := [m for m in opts.methods if m not in methods]:
        sys.exit(f"error: --methods: unknown {unknown}; known: {sorted(methods)} (add one with --method NAME=FLAGS)")
    if opts.games == ["all"] and hasattr(module, "PROCGEN_GAMES"):
        opts.games = list(module.PROCGEN_GAMES)  # the paper's 16
    if hasattr(module, "PROCGEN_GAMES") and (unknown := [g for g in opts.games if g not in module.PROCGEN_GAMES]):
        sys.exit(f"error: --games: {unknown} are not Procgen games ({', '.join(module.PROCGEN_GAMES)})")
    protocol = shlex.split(EXPERIMENTS[opts.experiment]["protocol"]) if opts.experiment else []
    if bad := grid_fields_set(module, common, "flags after --"):
        if opts.experiment:
            sys.exit(
                f"error: {flag(bad[0])} after --: experiment {opts.experiment} gives each run its own {RELEASED_FIX}"
            )
        sys.exit(f"error: {flag(bad[0])} after --: the grid gives each run its own {GRID_FIX}")
    # the budget in every run's command, so that a resume keeps it: the script's default where the flags leave it there
    default_budget = module.Args().total_timesteps
    given = parsed_args(module, [*protocol, *common], "flags after --")
    budget = [] if given.total_timesteps != default_budget else ["--total-timesteps", str(default_budget)]
    rest, parsed = {}, {}  # a method's flags but the grid's, and what the script parses from them
    for method in opts.methods:
        own = shlex.split(methods[method])
        if bad := grid_fields_set(module, own, f"--method {method}"):
            sys.exit(f"error: --method {method}: {flag(bad[0])} is the grid's {GRID_FIX}")
        # a sweep's method's own flags last: they win; an experiment's flags after -- last: what they change shows
        rest[method] = [*protocol, *own, *common] if opts.experiment else [*common, *budget, *own]
        parsed[method] = parsed_args(module, rest[method], f"--method {method}")
        if opts.experiment:
            check_experiment(module, opts.experiment, method, parsed[method])
    jobs = []
    for game in opts.games:
        for method in opts.methods:
            for seed in opts.seeds:
                flags = ["--env-id", game, "--seed", str(seed), "--exp-name", method, *rest[method]]
                # what the script parses from flags: no other flag sets the grid's fields (checked above)
                args = dataclasses.replace(parsed[method], env_id=game, seed=seed, exp_name=method)
                checked_args(module, args, f"{game} {method}")
                folder = (pathlib.Path(opts.root) / opts.name / f"{game.replace('/', '-')}__{method}__{seed}").resolve()
                run, _ = last_checkpoint(folder)
                if run is not None:  # done or to resume: the run in the folder must be the one these flags describe
                    resumed = f"{folder.name} has a checkpoint (change no training flag, or use a new --name)"
                    checked_args(module, dataclasses.replace(args, resume=str(run)), resumed)
                total = planned_steps(module, args)
                jobs.append((folder, flags, total))
    methods_args = {method: (parsed[method], rest[method]) for method in opts.methods}  # for the dry run's memory plan
    return str(script), module, jobs, methods_args


# ---- A job, at each of its starts: the run's folder decides what it does (nothing, a resume, a fresh start) ----


def job_command(script: str, folder: pathlib.Path, flags: list, total: int):
    """What a start of the job runs: None if the run is done, else the script's command line (fresh or --resume)."""
    run, state = last_checkpoint(folder)
    if state is None:
        return [sys.executable, script, *flags]
    if state["global_step"] >= total:
        return None
    # the run's flags, as at its start: the script refuses a changed training flag; the budget may raise the run's
    return [sys.executable, script, "--resume", str(run), *flags]


def lock_refused(path, error: OSError) -> str:
    """One line for a lock that the filesystem refuses (flock raising anything but "held by another")."""
    return (
        f"error: {path}: its filesystem refuses file locks ({error.strerror or error}), which keep a run to one "
        "process: on Lustre mount it with -o flock, on NFS run its lock service (lockd), or give --root a folder on a "
        "local disk"
    )


def holder(path: pathlib.Path):
    """The pid written in a lock file that a live process holds, or None where none holds it (or it does not exist).
    Taking the lock shared for a moment tells, and changes nothing: a job taking it retries (take_job_lock). Opened for
    reading and writing: NFS grants flock only so. Exits with one line where the filesystem refuses locks."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # released as the file closes
        return None
    except BlockingIOError:
        return os.pread(fd, 32, 0).decode().strip() or "?"
    except OSError as e:
        sys.exit(lock_refused(path, e))
    finally:
        os.close(fd)


def trained_by_hand(folder: pathlib.Path):
    """The pid of a live process that trains a run in this folder outside the sweep (the script started by hand, which
    holds its run's runs/<run>/lock), or None. The kernel holds a lock for its process alone, until that ends (kill -9
    too). The sweep's own jobs hold the folder's JOB_LOCK (take_job_lock)."""
    for lock in folder.glob("runs/*/lock"):
        if pid := holder(lock):
            return pid
    return None


def take_job_lock(folder: pathlib.Path):
    """The folder's JOB_LOCK, taken for this job (an open file descriptor, with this process's pid in it), or None
    where another process holds it. A check of the lock (holder: --status, another sweep) holds it for a moment, so a
    refusal is tried again within a second before it stands. Created with mode 0644; a filesystem that refuses locks
    ends the job with one line."""
    path = folder / JOB_LOCK
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    for attempt in range(5):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            time.sleep(0.2)
            continue
        except OSError as e:
            os.close(fd)
            raise RuntimeError(lock_refused(path, e)) from None
        write_holder(fd, os.getpid())
        return fd
    os.close(fd)
    return None


def write_holder(fd: int, pid: int) -> None:
    """Write the pid of the process that trains the run into its held JOB_LOCK."""
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{pid}\n".encode(), 0)


def process_start(pid: int):
    """When a process started (its start time in /proc, in clock ticks since boot), or None where it has ended: a pid
    with its start time names one process, never a later one given the same pid."""
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def living(pid: int) -> bool:
    """Whether a process lives: it exists and has not ended (a process that ended stays in /proc, a zombie, until its
    parent reaps it, and a local job's controller whose sweep was killed may have a parent that never does)."""
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def job_environment():
    """(cluster, job id) of the submitit job this process runs, as the sweep writes them down (JOB_FILE), or None
    outside a job (a test that calls TrainRun itself)."""
    try:
        env = submitit.JobEnvironment()
        return env.cluster, env.job_id
    except RuntimeError:
        return None


def read_record(folder: pathlib.Path) -> dict:
    """What the sweep recorded for the run in this folder (RECORD_FILE), or {} where nothing was."""
    path = folder / RECORD_FILE
    return json.loads(path.read_text()) if path.exists() else {}


def kept_threads(folder: pathlib.Path, threads: int) -> int:
    """The OMP threads of the run's next start: where it has a checkpoint to resume, the count it started with, as
    recorded (torch sums in another order at another count, so a resume at another one is not the run unbroken); a
    fresh start, or a run whose start was not recorded, takes `threads`."""
    recorded = read_record(folder).get("threads")
    has_checkpoint = bool(glob.glob(f"{folder}/runs/*/checkpoint.pt"))
    return recorded if has_checkpoint and recorded else threads


def record_run(folder: pathlib.Path, opts, script: str, total: int, threads: int) -> None:
    """Write down what the sweep submits for a run: read back by --status and by the next submission (kept_threads)."""
    folder.mkdir(parents=True, exist_ok=True)
    record = dict(command=opts.command, cwd=opts.cwd, script=pathlib.Path(script).name, total=total, threads=threads)
    (folder / RECORD_FILE).write_text(json.dumps(record) + "\n")


def signal_name(number: int) -> str:
    """SIGKILL for 9; the number itself where no signal has it."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def stop_signal_name(code) -> str:
    """SIGTERM or SIGINT where a script's exit code (as logged: text) is a stop's, else '': 128 + the signal where the
    script's handler stopped it, minus the signal where it came before the script had set its handler (its first
    seconds). Either way the run's last checkpoint, if any, is whole: the script writes one only at a phase's end."""
    names = {str(128 + s): signal.Signals(s).name for s in STOPS}
    names.update({str(-s): signal.Signals(s).name for s in STOPS})
    return names.get(str(code), "")


def resume_hint(record: dict) -> str:
    """The command that resumes a sweep's runs, from any folder: the folder it was typed in, then the command as
    recorded (the interpreter that ran it and the sweep's whole path)."""
    return f"cd {shlex.quote(record['cwd'])} && {record['command']}"


def stop_note(stopped: str, folder: pathlib.Path, requeued: bool) -> str:
    """The line a job writes into train.log after its script stopped on a signal, saying what resumes the run: the
    script's own hint is a --resume, while a sweep's run resumes through its sweep, or through its requeued job."""
    if requeued:  # checkpoint(): submitit requeues this very job, which resumes the run
        return f"# stopped by {stopped} for a requeue of its job: the requeued job resumes it by itself"
    how = resume_hint(read_record(folder))
    if os.environ.get("SUBMITIT_EXECUTOR") == "slurm":  # SLURM's SIGTERM: a requeue or a preemption, or scancel
        return (
            f"# stopped by {stopped}, a run of a sweep on SLURM: where SLURM requeued its job (scontrol requeue, a "
            f"preemption) the job resumes it by itself (--status says queued); where it did not (scancel), run the "
            f"sweep again: {how}"
        )
    return f"# stopped by {stopped}, a run of a sweep: to resume it, run the sweep again: {how}"


def in_the_training_process(parent: int, libc) -> None:
    """Run in the training process before it runs the script (preexec_fn). SLURM's warning signal (USR2) reaches every
    process of a job: the script ignores it and is stopped by TrainRun.checkpoint, with SIGTERM, which it handles.
    SIGINT and SIGHUP as at any start (the job process ignores them, which the script would inherit): a stop before
    the script's handler ends it at once. Its parent's end sends it SIGTERM, so that it stops, keeping its last
    checkpoint, rather than train on alone where its job is killed (a kill -9 of the job's process group, a lost
    controller)."""
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # the job ended before prctl took hold: no signal will come
        os.kill(os.getpid(), signal.SIGTERM)


class TrainRun(submitit.helpers.Checkpointable):
    """One run as a submitit job: each call (a first start, or a start after a requeue) does what job_command says,
    in the run's folder, holding the folder's JOB_LOCK from its first moment, its training process with it, so that a
    second start of the run (a sweep started twice, within a second too) starts nothing. On a time limit or preemption
    submitit calls checkpoint(): the training process is stopped (SIGTERM: it keeps its last phase checkpoint) and the
    same call is resubmitted, so it resumes.

    sweep: (pid, start time) of the local sweep that submitted the job, or None (SLURM: the sweep returns once it has
    submitted). A local job watches it: where the sweep has ended without stopping its runs (kill -9 of its process
    alone; the job's own process, submitit's, lives on), the job stops its training process with SIGTERM, as the
    sweep's own stop would, and a job whose run had not started yet starts nothing."""

    def __init__(self, sweep=None):
        self.process, self.sweep, self.requeued = None, sweep, False

    def sweep_ended(self) -> bool:
        pid, start = self.sweep or (None, None)
        return pid is not None and not (living(pid) and process_start(pid) == start)

    def __call__(self, script: str, folder: str, flags: list, total: int, threads: int) -> str:
        folder = pathlib.Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        lock = take_job_lock(folder)
        if lock is None:  # a sweep started twice, or a requeue while the previous process lives: it trains on alone
            return f"{folder.name}: being trained by process {holder(folder / JOB_LOCK)}; not started again"
        try:
            return self.train(script, folder, flags, total, threads, lock)
        finally:
            os.close(lock)  # the training process has ended: the lock is free

    def train(self, script: str, folder: pathlib.Path, flags: list, total: int, threads: int, lock: int) -> str:
        if job := job_environment():  # the job that runs the run, written down by the job itself: --status reads it
            record_job(folder, *job)
        if self.sweep_ended():
            return f"{folder.name}: its sweep has ended; not started"
        command = job_command(script, folder, flags, total)
        if command is None:
            return f"{folder.name}: done before this start"
        pid = trained_by_hand(folder)
        if pid:  # the script started by hand (--resume) in the sweep's folder: it trains on alone
            return f"{folder.name}: being trained by process {pid}; not started again"
        if "--resume" not in command and (folder / "runs").exists():
            shutil.rmtree(folder / "runs")  # a start without a checkpoint: nothing of it is kept
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        with open(folder / "train.log", "a") as log:  # each start: its command, its output, when it ran
            log.write(f"\n# start {time.time():.3f} threads {threads}\n$ {shlex.join(command)}\n")
            log.flush()
            # A process group of its own (setsid): a terminal's Ctrl-C reaches the sweep alone, which passes it on
            # once (a second signal would stop the script within its stop). The job's lock goes with it (pass_fds):
            # held until both have ended
            self.process = subprocess.Popen(
                command,
                cwd=folder,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                pass_fds=(lock,),
                # libc loaded here, not between fork and exec, nor kept on the module, which submitit pickles
                preexec_fn=functools.partial(in_the_training_process, os.getpid(), ctypes.CDLL(None)),
            )
            write_holder(lock, self.process.pid)
            try:
                stopping = False
                while self.process.poll() is None:  # polled, not wait(): the signal handler may stop it meanwhile
                    if not stopping and self.sweep_ended():  # killed alone: stop as its stop would have
                        self.process.send_signal(signal.SIGTERM)
                        stopping = True
                    time.sleep(0.2)
            finally:  # also where a signal ends this start from within the loop: submitit's handler, to requeue it
                # (its checkpoint() has stopped the script)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.process.wait(timeout=30)
                if self.process.returncode is not None:
                    log.write(f"# end {time.time():.3f} exit {self.process.returncode}\n")
                stopped = stop_signal_name(self.process.returncode)
                if stopped and read_record(folder):
                    log.write(stop_note(stopped, folder, self.requeued) + "\n")
        if self.process.returncode:
            raise RuntimeError(f"{folder.name}: the script exited with {self.process.returncode} (see its train.log)")
        return f"{folder.name}: trained to step {total:,}"  # the script exits with 0 only at its planned step

    def checkpoint(self, *args, **kwargs):
        self.requeued = True  # the stop's note says so: submitit requeues the job, no need to run the sweep again
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)  # the script stops at once; its last checkpoint stays
            while self.process.poll() is None:
                time.sleep(0.1)
        return submitit.helpers.DelayedSubmission(TrainRun(self.sweep), *args, **kwargs)


# ---- 3. --status: where each run stands, from its folder and its scheduler, submitting nothing ----


def record_job(folder: pathlib.Path, cluster: str, job_id: str) -> None:
    """Write down the job submitted for a run, for --status."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / JOB_FILE).write_text(f"{cluster} {job_id}\n")


def slurm_jobs(name: str):
    """job id -> SLURM's state (and why it waits) of the sweep's jobs that SLURM holds now; None where squeue does not
    answer. Each array task on its own line (--array): 4242_0, 4242_1."""
    if shutil.which("squeue") is None:
        return None
    command = ["squeue", "--noheader", "--array", "--name", f"ppg-{name}", "--format", "%i %T %r"]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        return None
    return {
        job_id: (state, reason)
        for job_id, state, reason in (line.split(maxsplit=2) for line in done.stdout.splitlines())
    }


def job_state(folder: pathlib.Path, slurm):
    """(running or queued, what the scheduler says) of the job last submitted for the run, while its scheduler holds it;
    else None. A local job is running while its process (submitit's local job id) lives."""
    if not (folder / JOB_FILE).exists():
        return None
    cluster, job_id = (folder / JOB_FILE).read_text().split()
    if cluster == "local":
        return ("running", f"local job {job_id}") if living(int(job_id)) else None
    if slurm is None:
        return "unknown", f"job {job_id}: no squeue answers here, for SLURM's state"
    if job_id not in slurm:
        return None  # ended, or left SLURM's memory: the run's folder says how it ended
    state, reason = slurm[job_id]
    waits = f", {reason}" if state in QUEUED and reason != "None" else ""
    return ("queued" if state in QUEUED else "running"), f"job {job_id} {state}{waits}"


def last_start(folder: pathlib.Path):
    """(env step reached, last line of output, exit code or None where no end was logged) of the run's last start,
    from its train.log; None before any start."""
    log = folder / "train.log"
    if not log.exists() or "# start " not in log.read_text():
        return None
    start = log.read_text().rsplit("# start ", 1)[1].splitlines()[1:]  # the start's command, output and end
    steps = [int(s.replace(",", "")) for s in re.findall(r" step ([\d,]+) SPS ", "\n".join(start))]
    ends = [line.rsplit(" exit ", 1)[1] for line in start if line.startswith("# end ")]
    output = [line for line in start if line.strip() and not line.startswith(("$ ", "# end ", "# stopped "))]
    return (steps[-1] if steps else 0), (output[-1].strip() if output else "(no output)"), (ends[-1] if ends else None)


def run_status(folder: pathlib.Path, total, slurm):
    """(what the run is, the env step it reached, what more to say): done, running or queued (its scheduler's state),
    stopped (by SIGTERM or Ctrl-C: its last start ended with 128 + the signal, or minus it in the script's first seconds;
    or killed by another signal, or with no exit logged (its job killed too): its checkpoint is whole either way),
    failed (the script's own error exit, with the last line it wrote), not started, to resume (its last start ended
    well, before a budget raised since); or unknown where a SLURM job was submitted for it and no squeue answers here.
    Running first: while a job holds the run's JOB_LOCK, it runs, whatever a later start refused wrote down. The step: its last start's last progress line, or its checkpoint's step
    where that is later. total: the planned steps, or None where no plan was recorded."""
    _, state = last_checkpoint(folder)
    saved, start, job = (state["global_step"] if state else 0), last_start(folder), job_state(folder, slurm)
    pid = holder(folder / JOB_LOCK)
    reached = max(saved, start[0] if start else 0)
    step = f"step {reached:,} of {total:,}" if total is not None else f"step {reached:,} (no plan recorded)"
    if saved not in (0, reached):
        step += f" (checkpoint at {saved:,})"
    if total is not None and saved >= total:
        return "done", step, ""
    if pid is not None:  # a job holds the run: whatever a later, refused start wrote down, it runs
        where = f"; {job[1]}" if job is not None and job[0] == "running" else ""
        return "running", step, f"; trained by process {pid}{where}"
    if job is not None:
        last = f"; its log's last line: {start[1]}" if job[0] == "unknown" and start else ""
        return job[0], step, f"; {job[1]}{last}"
    if start is None:
        submitted = (folder / JOB_FILE).exists()  # a job that failed before the script started: submitit's log says why
        return "not started", step, " (submitted; no start logged: see the sweep's .submitit/ logs)" * submitted
    if start[2] == "0":  # it ended well short of these steps: the budget was raised since
        return "to resume", step, ""
    resume = f"rerun the sweep to resume from step {saved:,}" if saved else "rerun the sweep to start it afresh"
    if stop_signal_name(start[2]):  # stopped, its last checkpoint kept: not a failure
        return "stopped", step, f"; stopped at step {reached:,} by {stop_signal_name(start[2])}: {resume}"
    if start[2] is None or start[2].startswith("-"):  # killed (kill -9, a lost machine): its last checkpoint is whole
        how = f"by {signal_name(-int(start[2]))} (exit {start[2]})" if start[2] else "(no exit logged)"
        return "stopped", step, f"; killed {how} at step {reached:,}: {resume}"
    return "failed", step, f"; exit {start[2]}: {start[1]}"


def print_status(opts, jobs: list) -> None:
    """A line a run, how many runs stand where, and the sweep's command (as recorded) that resumes those to resume."""
    slurm, counts, resume = slurm_jobs(opts.name), {}, {}
    for folder, _, total in jobs:
        status, step, detail = run_status(folder, total, slurm)
        counts[status] = counts.get(status, 0) + 1
        print(f"{status:11} {folder.name}: {step}{detail}")
        record = read_record(folder)
        if status in ("stopped", "failed", "to resume", "not started") and record:
            resume[record["command"]] = record["cwd"]
    print(f"{len(jobs)} runs: " + ", ".join(f"{n} {status}" for status, n in counts.items()), flush=True)
    for command, cwd in resume.items():  # one line a command: experiments may share a sweep's folder
        print(f"to resume: {resume_hint(dict(command=command, cwd=cwd))}")


def recorded_jobs(opts) -> list:
    """(folder, flags, planned steps or None) of every run in the sweep's folder, from the folders themselves: the plan
    recorded at submission, else the checkpoint's flags, as the script plans them. For --name NAME --status alone."""
    sweep_folder = pathlib.Path(opts.root) / opts.name
    if not sweep_folder.is_dir():
        sys.exit(f"error: {sweep_folder}: no such sweep (--root and --name name its folder)")
    jobs = []
    for folder in sorted(p.resolve() for p in sweep_folder.iterdir() if p.is_dir() and not p.name.startswith(".")):
        total = read_record(folder).get("total")
        _, state = last_checkpoint(folder)
        if total is None and state is not None:  # a run submitted before plans were recorded
            module = load_script(ROOT / (base_script(state) or state["script"]))  # a copy plans as its original
            known = {k: v for k, v in state["args"].items() if k in {f.name for f in dataclasses.fields(module.Args)}}
            total = planned_steps(module, dataclasses.replace(module.Args(), **known))
        jobs.append((folder, [], total))
    return jobs


# ---- 4. What each run would do: the listing of --dry-run, and of every submission ----


def gpu_count(opts) -> int:
    import torch

    return opts.gpus if opts.gpus is not None else torch.cuda.device_count()


def job_threads(opts, gpus: int) -> int:
    """The OMP threads of a job's training process that starts afresh: --threads, else on SLURM the CPUs a job asks
    for, here an equal share of the cores, GPU runs too (torch's CPU work would otherwise take every core in every job).
    A run with a checkpoint keeps the count it started with (kept_threads)."""
    if opts.threads:
        return opts.threads
    if opts.cluster == "slurm":
        return opts.cpus_per_job
    return max(1, (os.cpu_count() or 1) // (gpus or opts.jobs))


def resources_line(opts, gpus: int) -> str:
    """What each job asks for, said once."""
    threads = f"{job_threads(opts, gpus)} OMP threads (a resumed run: as at its start)"
    if opts.cluster == "slurm":
        partition = opts.partition or "the cluster's default"
        memory = f"{opts.mem_gb:g} GiB of memory" if opts.mem_gb else "the cluster's default memory"
        return (
            f"each job asks SLURM for: partition {partition}, GPUs {opts.gpus_per_job}, CPUs {opts.cpus_per_job}, time "
            f"{max(1, math.ceil(opts.time_min))} min, {memory}; {threads}; requeued at most {opts.max_requeues} times"
        )
    where = f"one GPU of {gpus}" if gpus else f"no GPU, {opts.jobs} jobs at once"
    return f"each job runs here: {where}, {threads}, a time limit of {opts.time_min:g} min"


def memory_lines(module, methods_args: dict, on_gpu: bool) -> list:
    """The memory each method's run allocates, by the script's own plan (make_plan, memory_plan): its buffer B and a
    chunk's activations, in GiB; on a GPU, as a GPU with room for whole minibatches runs it."""
    plenty = float(2**60)  # free memory that no plan exceeds: the plan the run makes where all of it fits
    lines = {}
    for method, (args, _) in methods_args.items():
        on_device = on_gpu and args.cuda  # --no-cuda: the CPU's RAM, even on a GPU job
        plan = module.make_plan(args)
        rows = (plan["trajectories"], args.num_steps)  # B's rows, as the script's main() allocates it
        chunk, buffer_bytes, activation_bytes = module.memory_plan(args, rows, plenty, on_device)
        chunks = f"chunks of {chunk:,} states" if chunk else "whole minibatches"
        where = "GPU memory" if on_device else "RAM"
        line = (
            f"B {buffer_bytes / 2**30:.2f} GiB + activations {activation_bytes / 2**30:.2f} GiB ({chunks}) = "
            f"{(buffer_bytes + activation_bytes) / 2**30:.2f} GiB of {where}"
        )
        if on_device and args.micro_batch_size is None:  # the script chooses the chunks from the memory free
            line += "; with less free, the run takes smaller chunks (B must fit)"
        lines.setdefault(line, []).append(method)
    return [f"memory a run ({', '.join(methods)}): {line}" for line, methods in lines.items()]


def print_plan(opts, script: str, jobs: list, module, methods_args: dict) -> list:
    """Print each job's resources, each run's memory, what each run would do (start, resume; and, with --dry-run,
    done) and return the runs to submit: not those that a job holds now (the same sweep started before: its JOB_LOCK
    is held), which are said to be running."""
    if opts.experiment is not None:  # what the runs are: the command's whole meaning
        variants = EXPERIMENTS[opts.experiment]["variants"]
        listed = ", ".join(f"{name} ({flags or 'the defaults'})" for name, flags in variants.items())
        print(
            f"experiment {opts.experiment}: {len(opts.games)} games x variants {listed} x seeds {opts.seeds}; "
            f"every run: {EXPERIMENTS[opts.experiment]['protocol']}"
        )
    gpus = opts.gpus_per_job if opts.cluster == "slurm" else gpu_count(opts)
    print(resources_line(opts, gpus))
    for line in memory_lines(module, methods_args, gpus > 0):
        print(line)
    todo, threads, running = [], job_threads(opts, gpus), 0
    for folder, flags, total in jobs:
        command = job_command(script, folder, flags, total)
        if command is not None and (pid := holder(folder / JOB_LOCK)):  # a job of this sweep, started before
            print(f"running {folder}: being trained by process {pid}; not submitted again")
            running += 1
            continue
        state = "done" if command is None else "resume" if "--resume" in command else "start"
        kept = kept_threads(folder, threads)
        at_start = f" (its {kept} threads, as at its start)" if command is not None and kept != threads else ""
        if opts.dry_run or state != "done":
            print(f"{state:6} {folder}{at_start}: {shlex.join(command or flags)}")
        if command is not None:
            todo.append((folder, flags, total))
    elsewhere = f", {running} running" if running else ""
    print(f"{len(jobs)} runs, {len(jobs) - len(todo) - running} done{elsewhere}, {len(todo)} to run", flush=True)
    return todo


# ---- 5. Running the jobs: here, holding the queue in the foreground, or on SLURM, as one job array ----


def training_processes(controller: int, script: str) -> list:
    """The training processes under a local job's controller (submitit's, whose pid is the job's id): each leads a
    process group of its own (TrainRun starts it in one of its own), runs the script (not a child between fork
    and exec, which a signal would not stop), and is a descendant of the controller."""
    parents, groups = {}, {}
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after the command's name, which may hold spaces
            parents[int(stat.parent.name)], groups[int(stat.parent.name)] = int(fields[1]), int(fields[2])
    found = []
    for pid, group in groups.items():
        ancestor = parents.get(pid)
        while ancestor not in (None, 0, 1, controller):
            ancestor = parents.get(ancestor)
        if ancestor == controller and group == pid:
            with contextlib.suppress(OSError):
                if script in pathlib.Path(f"/proc/{pid}/cmdline").read_text():
                    found.append(pid)
    return found


def say(line: str) -> None:
    """Print a line of the sweep's stop: where its terminal has gone (SIGHUP), the stop goes on unsaid."""
    with contextlib.suppress(OSError):
        print(line, flush=True)


def stop_jobs(running: dict, script: str, signum: int) -> int:
    """Pass a stop signal to each running job's training process, once, and wait until every job has ended: each
    script stops as a stopped run stops (its last checkpoint kept, 128 + the signal). SIGHUP (a closed terminal) is
    passed on as SIGTERM, which the scripts stop on. A job whose training process has not started yet gets it once it
    has. Returns 128 + the signal the sweep got, its exit code."""
    name, signalled = signal.Signals(signum).name, set()
    passed = signum if signum in STOPS else signal.SIGTERM
    say(f"\n{name}: stopping {len(running)} running jobs (each keeps its last checkpoint)")
    while not all(job.done() for job, _ in running.values()):
        for job, _ in running.values():
            for pid in training_processes(int(job.job_id), script):
                if pid not in signalled:
                    with contextlib.suppress(ProcessLookupError):  # it may have ended since
                        os.killpg(pid, passed)  # its group, as a terminal's Ctrl-C would reach it
                    signalled.add(pid)
        time.sleep(POLL_S)
    say(f"stopped by {name}: {len(running)} jobs stopped; run the same command to resume")
    return 128 + signum


def run_local(opts, script: str, jobs: list, executor) -> int:
    """Hold the queue in the foreground: at most one job a slot (a GPU, or one of --jobs) at once. Returns the exit
    code: 0 when every job ended well, 1 when one failed, 128 + the signal on SIGTERM or Ctrl-C (SIGINT), which is
    passed to the running jobs' training processes (SIGHUP as SIGTERM); the sweep waits for them to stop, and starts
    no other. Each job watches the sweep: where it ends otherwise (kill -9), each job stops its run itself."""
    gpus = gpu_count(opts)
    slots = list(range(gpus)) if gpus else list(range(opts.jobs))
    threads = job_threads(opts, gpus)
    pending, running, failed, stopping = list(jobs), {}, 0, []

    def stop(signum, frame):  # noted, then handled in the loop: a signal mid-submission loses no job
        stopping.append(signum)

    previous = {s: signal.signal(s, stop) for s in SWEEP_STOPS}
    me = (os.getpid(), process_start(os.getpid()))  # the sweep, as its jobs watch it
    try:
        while (pending or running) and not stopping:
            for slot in [s for s in slots if s not in running][: len(pending)]:
                folder, flags, total = pending.pop(0)
                executor.update_parameters(visible_gpus=(slot,) if gpus else ())
                kept = kept_threads(folder, threads)
                record_run(folder, opts, script, total, kept)
                # submitit's controller inherits stderr, where it would log a stop: a file takes it. It and the job
                # process inherit SIGINT and SIGHUP ignored: a terminal's Ctrl-C, or its SIGHUP as it closes, reaches
                # its whole process group, and would have the controller kill the job process a second later (or
                # end both at once), before its run had stopped and its end was logged; the sweep passes it on
                # instead (a Ctrl-C within this submission is lost: press it again)
                saved = os.dup(2)
                with open(pathlib.Path(executor.folder) / "controllers.log", "a") as log:
                    os.dup2(log.fileno(), 2)
                    signal.signal(signal.SIGINT, signal.SIG_IGN)
                    signal.signal(signal.SIGHUP, signal.SIG_IGN)
                    try:
                        job = executor.submit(TrainRun(me), script, str(folder), flags, total, kept)
                    finally:
                        signal.signal(signal.SIGINT, stop)
                        signal.signal(signal.SIGHUP, stop)
                        os.dup2(saved, 2)
                        os.close(saved)
                record_job(folder, "local", job.job_id)
                running[slot] = (job, folder)
                print(f"started {folder.name} (job {job.job_id}{f', GPU {slot}' if gpus else ''})", flush=True)
            time.sleep(POLL_S)
            for slot, (job, folder) in list(running.items()):
                if job.done() and not stopping:  # a job ended by the stop is the stop's to report
                    del running[slot]
                    try:
                        print(job.result(), flush=True)
                    except Exception as e:  # the job's own error, one line, then the next job
                        failed += 1
                        lines = str(e).strip().splitlines()
                        reason = next((line for line in lines if "exited with" in line), " ".join(lines[:2]) or e)
                        print(
                            f"failed {folder.name}: {str(reason).strip()}; run the command again to resume", flush=True
                        )
        if stopping:
            return stop_jobs(running, script, stopping[0])
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 1 if failed else 0


def submit_slurm(opts, script: str, todo: list, folder: pathlib.Path) -> None:
    """Submit every run as one task of a job array, and return."""
    if shutil.which("sbatch") is None or shutil.which("srun") is None:
        sys.exit("error: --cluster slurm: no sbatch or srun on PATH (run it on the cluster's login node)")
    executor = submitit.SlurmExecutor(folder, max_num_timeout=opts.max_requeues)
    executor.update_parameters(
        job_name=f"ppg-{opts.name}", partition=opts.partition, time=max(1, math.ceil(opts.time_min))
    )
    executor.update_parameters(cpus_per_task=opts.cpus_per_job, signal_delay_s=opts.signal_delay_s)
    if opts.gpus_per_job:  # 0: a CPU partition, where a job asks for no GPU at all
        executor.update_parameters(gpus_per_node=opts.gpus_per_job)
    if opts.mem_gb:  # else the cluster's default
        executor.update_parameters(mem=f"{math.ceil(opts.mem_gb * 1024)}M")
    threads = [kept_threads(folder, job_threads(opts, opts.gpus_per_job)) for folder, _, _ in todo]
    for (folder, _, total), kept in zip(todo, threads):
        record_run(folder, opts, script, total, kept)
    try:  # submitit prints sbatch's refusal to stderr before it raises it: the one line below says it instead
        with contextlib.redirect_stderr(io.StringIO()), executor.batch():  # one job array
            submitted = [
                executor.submit(TrainRun(), script, str(f), flags, total, kept)
                for (f, flags, total), kept in zip(todo, threads)
            ]
    except submitit.core.utils.FailedJobError as e:  # sbatch's refusal: an unknown partition, more than a node has
        reason = " ".join(line.strip() for line in str(e).splitlines() if "error" in line.lower()) or str(e)
        sys.exit(f"error: --cluster slurm: sbatch refused the jobs: {reason[:300]}")
    for (folder, _, _), job in zip(todo, submitted):
        record_job(folder, "slurm", job.job_id)
    print(f"submitted {len(submitted)} jobs: {', '.join(job.job_id for job in submitted)}")


def main(argv=None) -> None:
    """The sweep, step by step (the sections of this file, in order)."""
    opts, common = read_command(sys.argv[1:] if argv is None else argv)  # 1. the command
    if opts.from_folders:  # --name NAME --status alone: the runs in the sweep's folder, as they were recorded
        print_status(opts, recorded_jobs(opts))
        return
    script, module, jobs, methods_args = plan_jobs(opts, common)  # 2. every run, checked against the script
    if opts.status:  # 3. where each run stands; nothing is submitted
        print_status(opts, jobs)
        return
    todo = print_plan(opts, script, jobs, module, methods_args)  # 4. what each run would do
    if opts.dry_run or not todo:
        return
    folder = pathlib.Path(opts.root) / opts.name / ".submitit"  # 5. run them; submitit's own files go here
    if opts.cluster == "local":
        executor = submitit.LocalExecutor(folder, max_num_timeout=opts.max_requeues)
        executor.update_parameters(timeout_min=opts.time_min, signal_delay_s=opts.signal_delay_s)
        sys.exit(run_local(opts, script, todo, executor))
    submit_slurm(opts, script, todo, folder)


if __name__ == "__main__":
    main()
