"""Many runs: a released experiment, or a grid of games x seeds x methods; one submitit job a run, on SLURM or here.

    python tools/sweep.py --experiment ppg --cluster slurm --partition gpu --gpus-per-job 1 --cpus-per-job 8 \\
        --time-min 1440                            # the released PPG runs: 16 hard-mode games x 3 seeds at 100M steps
    python tools/sweep.py --experiment e-aux --dry-run   # the jobs, their folders and what each would do
    python tools/sweep.py --experiment ppg --status      # where each run stands: done, running, queued or failed
    python tools/sweep.py --name small --games bigfish --seeds 1 2 --cluster local --jobs 2 -- --total-timesteps 2000000

An experiment is one of the seven that the released code's README reproduces (tools/experiments.py: ppg, ppo, ppgkl,
ppg-single-network, e-pi, e-aux, n-pi). --experiment NAME runs its variants as the sweep's methods, on the 16 games,
with its released run count (3 seeds, or 1 a value), at the paper's protocol (experiments.PAPER_PROTOCOL) and the
script's defaults otherwise, in runs/NAME/ (or --name's). --games, --seeds, --methods, --method and --script are the
experiment's; after `--` it takes only flags that change no training flag (MACHINE_FIELDS).

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
left at its default, stops the sweep in one line. Do not run the command again while its jobs still run (--status
says which do): it would start each unfinished run a second time.

--cluster slurm submits every job as one job array and returns; a job that reaches its time limit, or that the cluster
preempts (with its warning signal, or with SIGTERM as `scontrol requeue` does), is requeued and resumes from its last
phase checkpoint. --gpus-per-job 0 asks for no GPU (a CPU partition). --cluster local runs the jobs here and holds the
queue in the foreground: at most one job a GPU at once (each sees only its own GPU), or --jobs N without GPUs; Ctrl-C
stops them (each run keeps its last checkpoint) and the next run of the command resumes them. Every flag is checked
against the script before any job is submitted: a bad one stops the sweep in one line.

The steps of main(), in the order of this file: read the command; plan every run, checked against the script (what a
job does with a run's folder comes next: TrainRun); with --status, say where each run stands; say what each run would
do; run the runs that are not done, here or on SLURM.
"""

import argparse
import contextlib
import dataclasses
import glob
import importlib.util
import io
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
from experiments import EXPERIMENTS, PAPER_PROTOCOL  # noqa: E402
from helptext import DefaultsHelpFormatter  # noqa: E402

METHODS = {"ppg": "", "ppo": "--arch shared --e-aux 0 --e-pi 3 --e-v 3"}
# What flags after -- may change in an experiment's runs: what the script lets a resume change too (resume_args), as
# none changes what a run learns: where it trains, the chunks of its minibatches (the same update) and what it saves
MACHINE_FIELDS = ("cuda", "micro_batch_size", "track", "wandb_project_name", "wandb_entity")
# The grid's own: the first three name a run's folder, and each start of a job resumes the run in it by itself
GRID_FIELDS = ("env_id", "seed", "exp_name", "resume")
GRID_FIX = "(use --games, --seeds or --methods; a run resumes from its folder by itself)"
RELEASED_FIX = "(the released runs' game, seed and name; a run resumes from its folder by itself)"
POLL_S = 0.5  # how often the local queue looks at its jobs
JOB_FILE = "job_id"  # in a run's folder: "<cluster> <job id>" of the job last submitted for it, read by --status
QUEUED = ("PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "SUSPENDED")  # SLURM's states of a job not running now


# ---- 1. The command: the sweep's own options, each checked on its own ----


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter)
    parser.add_argument(
        "--experiment",
        default=None,
        metavar="NAME",
        help=f"one of the released experiments, as released: {', '.join(EXPERIMENTS)} (tools/experiments.py)",
    )
    parser.add_argument("--name", help="the sweep's name: its runs go to <root>/<name>/ (an experiment's: its name)")
    parser.add_argument(
        "--script", choices=("ppg_procgen.py", "ppg_atari.py"), help="the training script (default: ppg_procgen.py)"
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
    parser.add_argument("--time-min", type=float, default=60 * 24, help="a job's time limit, in minutes")
    parser.add_argument("--signal-delay-s", type=int, default=120, help="the stop signal comes this long before it")
    parser.add_argument("--max-requeues", type=int, default=10, help="requeues after the time limit, at most")
    parser.add_argument("--dry-run", action="store_true", help="print the jobs and what each would do, submit none")
    parser.add_argument(
        "--status",
        action="store_true",
        help="print where each run stands (done, running, queued, failed) and its env step, submit none",
    )
    return parser


def read_command(argv: list):
    """The sweep's options, and the flags after `--` that go to every run. Exits with one line where an option is out
    of range or does not go with another (the flags after -- are the script's to judge: plan_jobs)."""
    common = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    opts = make_parser().parse_args(argv)
    least = dict(jobs=1, gpus_per_job=0, cpus_per_job=1, max_requeues=0, threads=0, gpus=0)
    for name, value in least.items():
        if getattr(opts, name) is not None and getattr(opts, name) < value:
            sys.exit(f"error: --{name.replace('_', '-')} must be at least {value}")
    if not opts.time_min > 0 or opts.signal_delay_s < 0:
        sys.exit("error: --time-min must be > 0 and --signal-delay-s >= 0")
    if opts.experiment is not None:
        if opts.experiment not in EXPERIMENTS:
            sys.exit(f"error: --experiment {opts.experiment}: unknown; known: {', '.join(EXPERIMENTS)}")
        for name in ("script", "games", "seeds", "methods", "method"):  # an experiment's own: the released runs
            if getattr(opts, name):
                sys.exit(
                    f"error: --{name} with --experiment: an experiment runs the released games, seeds and variants "
                    f"(leave --{name} out, or --experiment for a sweep of your own)"
                )
        opts.name = opts.name or opts.experiment
    elif opts.name is None or opts.games is None:
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
    if opts.experiment is not None:  # the released runs: its variants, its seeds, the 16 games
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
    MACHINE_FIELDS: the paper's protocol, the variant's own flags, or any other training flag."""
    flags = EXPERIMENTS[name]["variants"][variant]
    released = parsed_args(module, [*shlex.split(PAPER_PROTOCOL), *shlex.split(flags)], f"--experiment {name}")
    bad = [field for field in vars(args) if getattr(args, field) != getattr(released, field)]
    if not (bad := [field for field in bad if field not in MACHINE_FIELDS]):
        return
    field, value = bad[0], getattr(released, bad[0])
    if field in fields_of(flags):
        whose = f"variant {variant} sets {flag_text(field, value)}"
    elif field in fields_of(PAPER_PROTOCOL):
        whose = f"the paper's protocol sets {flag_text(field, value)}"
    else:
        whose = f"its runs have {flag_text(field, value)}"
    allowed = ", ".join(flag(field) for field in MACHINE_FIELDS)
    sys.exit(
        f"error: --experiment {name}: {flag_text(field, getattr(args, field))} after -- changes its runs ({whose}); "
        f"after -- it takes only {allowed} (other flags: a sweep of --games, --seeds and --method)"
    )


def plan_jobs(opts, common: list):
    """Every (game, method, seed) as (folder, flags, planned steps), each checked against the script."""
    script = ROOT / opts.script
    module = load_script(script)
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
    protocol = shlex.split(PAPER_PROTOCOL) if opts.experiment else []
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
    return str(script), jobs


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


class TrainRun(submitit.helpers.Checkpointable):
    """One run as a submitit job: each call (a first start, or a start after a requeue) does what job_command says,
    in the run's folder. On a time limit or preemption submitit calls checkpoint(): the training process is stopped
    (SIGTERM: it keeps its last phase checkpoint) and the same call is resubmitted, so it resumes."""

    def __init__(self):
        self.process = None

    def __call__(self, script: str, folder: str, flags: list, total: int, threads: int) -> str:
        folder = pathlib.Path(folder)
        command = job_command(script, folder, flags, total)
        if command is None:
            return f"{folder.name}: done before this start"
        if "--resume" not in command and (folder / "runs").exists():
            shutil.rmtree(folder / "runs")  # a start without a checkpoint: nothing of it is kept
        folder.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        with open(folder / "train.log", "a") as log:  # each start: its command, its output, when it ran
            log.write(f"\n# start {time.time():.3f}\n$ {shlex.join(command)}\n")
            log.flush()
            # SLURM's warning signal (USR2) reaches every process of the job: the training process ignores it and is
            # stopped by checkpoint() below, with SIGTERM, which it handles (it closes its log and says how to resume)
            self.process = subprocess.Popen(
                command,
                cwd=folder,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                preexec_fn=lambda: signal.signal(signal.SIGUSR2, signal.SIG_IGN),
            )
            try:
                while self.process.poll() is None:  # polled, not wait(): the signal handler may stop it meanwhile
                    time.sleep(0.2)
            finally:  # also where a signal ends this start from within the loop: submitit's handler, to requeue it
                # (its checkpoint() has stopped the script), or Ctrl-C, which reached the script too: it ends at once
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.process.wait(timeout=30)
                if self.process.returncode is not None:
                    log.write(f"# end {time.time():.3f} exit {self.process.returncode}\n")
        if self.process.returncode:
            raise RuntimeError(f"{folder.name}: the script exited with {self.process.returncode} (see its train.log)")
        return f"{folder.name}: trained to step {total:,}"  # the script exits with 0 only at its planned step

    def checkpoint(self, *args, **kwargs):
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)  # the script stops at once; its last checkpoint stays
            while self.process.poll() is None:
                time.sleep(0.1)
        return submitit.helpers.DelayedSubmission(TrainRun(), *args, **kwargs)


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
        return ("running", f"local job {job_id}") if pathlib.Path(f"/proc/{job_id}").exists() else None
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
    output = [line for line in start if line.strip() and not line.startswith(("$ ", "# end "))]
    return (steps[-1] if steps else 0), (output[-1].strip() if output else "(no output)"), (ends[-1] if ends else None)


def run_status(folder: pathlib.Path, total: int, slurm):
    """(what the run is, the env step it reached, what more to say): done, running or queued (its scheduler's state),
    failed (the last line its script wrote), not started, to resume (its last start ended well, before a budget raised
    since); or unknown where a SLURM job was submitted for it and no squeue answers here. The step: its last start's
    last progress line, or its checkpoint's step where that is later."""
    _, state = last_checkpoint(folder)
    saved, start, job = (state["global_step"] if state else 0), last_start(folder), job_state(folder, slurm)
    reached = max(saved, start[0] if start else 0)
    step = f"step {reached:,} of {total:,}" + (f" (checkpoint at {saved:,})" if saved not in (0, reached) else "")
    if saved >= total:
        return "done", step, ""
    if job is not None:
        last = f"; its log's last line: {start[1]}" if job[0] == "unknown" and start else ""
        return job[0], step, f"; {job[1]}{last}"
    if start is None:
        submitted = (folder / JOB_FILE).exists()  # a job that failed before the script started: submitit's log says why
        return "not started", step, " (submitted; no start logged: see the sweep's .submitit/ logs)" * submitted
    if start[2] == "0":  # it ended well short of these steps: the budget was raised since
        return "to resume", step, ""
    how = f"exit {start[2]}" if start[2] is not None else "killed (no exit logged)"
    return "failed", step, f"; {how}: {start[1]}"


def print_status(opts, jobs: list) -> None:
    """A line a run, and how many runs stand where."""
    slurm, counts = slurm_jobs(opts.name), {}
    for folder, _, total in jobs:
        status, step, detail = run_status(folder, total, slurm)
        counts[status] = counts.get(status, 0) + 1
        print(f"{status:11} {folder.name}: {step}{detail}")
    print(f"{len(jobs)} runs: " + ", ".join(f"{n} {status}" for status, n in counts.items()), flush=True)


# ---- 4. What each run would do: the listing of --dry-run, and of every submission ----


def print_plan(opts, script: str, jobs: list) -> list:
    """Print what each run would do (start, resume; and, with --dry-run, done) and return the runs to submit."""
    if opts.experiment is not None:  # what the runs are: the command's whole meaning
        variants = EXPERIMENTS[opts.experiment]["variants"]
        listed = ", ".join(f"{name} ({flags or 'the defaults'})" for name, flags in variants.items())
        print(
            f"experiment {opts.experiment}: {len(opts.games)} games x variants {listed} x seeds {opts.seeds}; "
            f"every run: {PAPER_PROTOCOL}"
        )
    todo = []
    for folder, flags, total in jobs:
        command = job_command(script, folder, flags, total)
        state = "done" if command is None else "resume" if "--resume" in command else "start"
        if opts.dry_run or state != "done":
            print(f"{state:6} {folder}: {shlex.join(command or flags)}")
        if command is not None:
            todo.append((folder, flags, total))
    print(f"{len(jobs)} runs, {len(jobs) - len(todo)} done, {len(todo)} to run", flush=True)
    return todo


# ---- 5. Running the jobs: here, holding the queue in the foreground, or on SLURM, as one job array ----


def gpu_count(opts) -> int:
    import torch

    return opts.gpus if opts.gpus is not None else torch.cuda.device_count()


def run_local(opts, script: str, jobs: list, executor) -> int:
    """Hold the queue in the foreground: at most one job a slot (a GPU, or one of --jobs) at once. Returns the exit
    code: 0 when every job ended well, 1 when one failed, 130 on Ctrl-C."""
    gpus = gpu_count(opts)
    slots = list(range(gpus)) if gpus else list(range(opts.jobs))
    # each job its share of the cores, with GPUs too: torch's CPU work would otherwise take every core in every job
    threads = opts.threads or max(1, (os.cpu_count() or 1) // len(slots))
    pending, running, failed = list(jobs), {}, 0
    try:
        while pending or running:
            for slot in [s for s in slots if s not in running][: len(pending)]:
                folder, flags, total = pending.pop(0)
                executor.update_parameters(visible_gpus=(slot,) if gpus else ())
                # submitit's controller inherits stderr, where a stop (its SIGINT) ends in a traceback: a file takes it
                saved = os.dup(2)
                with open(pathlib.Path(executor.folder) / "controllers.log", "a") as log:
                    os.dup2(log.fileno(), 2)
                    try:
                        job = executor.submit(TrainRun(), script, str(folder), flags, total, threads)
                    finally:
                        os.dup2(saved, 2)
                        os.close(saved)
                record_job(folder, "local", job.job_id)
                running[slot] = (job, folder)
                print(f"started {folder.name} (job {job.job_id}{f', GPU {slot}' if gpus else ''})", flush=True)
            time.sleep(POLL_S)
            for slot, (job, folder) in list(running.items()):
                if job.done():
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
    except KeyboardInterrupt:  # a terminal's Ctrl-C reaches every job too: let them stop, then cancel any left
        deadline = time.time() + 5
        while time.time() < deadline and not all(job.done() for job, _ in running.values()):
            time.sleep(POLL_S)
        for job, _ in running.values():
            if not job.done():
                job.cancel()
        print(f"\nstopped {len(running)} running jobs (each keeps its last checkpoint); run the same command to resume")
        return 130
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
    threads = opts.threads or opts.cpus_per_job
    try:  # submitit prints sbatch's refusal to stderr before it raises it: the one line below says it instead
        with contextlib.redirect_stderr(io.StringIO()), executor.batch():  # one job array
            submitted = [executor.submit(TrainRun(), script, str(f), flags, total, threads) for f, flags, total in todo]
    except submitit.core.utils.FailedJobError as e:  # sbatch's refusal: an unknown partition, more than a node has
        reason = " ".join(line.strip() for line in str(e).splitlines() if "error" in line.lower()) or str(e)
        sys.exit(f"error: --cluster slurm: sbatch refused the jobs: {reason[:300]}")
    for (folder, _, _), job in zip(todo, submitted):
        record_job(folder, "slurm", job.job_id)
    print(f"submitted {len(submitted)} jobs: {', '.join(job.job_id for job in submitted)}")


def main(argv=None) -> None:
    """The sweep, step by step (the sections of this file, in order)."""
    opts, common = read_command(sys.argv[1:] if argv is None else argv)  # 1. the command
    script, jobs = plan_jobs(opts, common)  # 2. every run, checked against the script
    if opts.status:  # 3. where each run stands; nothing is submitted
        print_status(opts, jobs)
        return
    todo = print_plan(opts, script, jobs)  # 4. what each run would do
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
