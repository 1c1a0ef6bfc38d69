"""Shared test functions: load each training script as a module (so the tests call the very code
that trains), run it as a subprocess or in this process, and read back its TensorBoard scalars.

The suite's budget is a few minutes on a 2-core CPU without native bf16, so work is shared: `tiny_run` trains
each script once, as a user starts it, and several tests read that run's folder; tests that need no process
boundary call main() in this process (`main_in_process`, `refusal`)."""

import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys
import types

# The suite is CPU-only, in this process and in every process it starts: its exact checks were calibrated on CPU
# kernels. GPU_ENV keeps the environment as it came, for test_gpu.py's one run where a GPU is visible.
GPU_ENV = dict(os.environ)
os.environ["CUDA_VISIBLE_DEVICES"] = ""

import pytest  # noqa: E402
import torch  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
# The tools' modules, which tests import (tools/released.py: where the released code is)
sys.path.insert(0, str(ROOT / "tools"))
SCRIPTS = ["ppg_procgen.py", "ppg_atari.py"]
# How long a test waits for a process it started: a guard against a hang, never a speed check. On a loaded 2-core
# machine (here: beside a training run that the CPU's scheduler favoured) one tiny run took over 20 minutes.
PATIENCE_S = 3600

# The smallest runs that still exercise every phase: 3 rollouts in 2 phases, so one auxiliary
# phase runs (and none after the last rollout). Finished episodes must be logged even in a run
# this short: dodgeball ends random episodes within ~10 steps; Atari games are cut after 100 frames.
# One PPO minibatch per rollout and one aux minibatch per epoch, so each logged approx_kl is a first
# minibatch's (ratio 1) and the first aux epoch's clone KL is the first minibatch's (pi_old = pi).
_TINY = [
    "--num-envs",
    "2",
    "--num-steps",
    "32",
    "--n-pi",
    "2",
    "--total-timesteps",
    "192",
    "--num-minibatches",
    "1",
    "--aux-mb-trajectories",
    "4",
    "--e-aux",
    "2",
    "--micro-batch-size",
    "8",
]
TINY_FLAGS = {
    "ppg_procgen.py": ["--env-id", "dodgeball", *_TINY],
    "ppg_atari.py": ["--env-id", "BreakoutNoFrameskip-v4", "--max-episode-frames", "100", *_TINY],
}
# The shared run's optional features: training levels (Procgen's alone) or, on Atari, the reward
# normaliser (off by default there), so that a resume of the shared run restores a used normaliser; and a seed near
# the top of its range, so that a resumed phase's and tools/evaluate.py's seeds wrap.
TOP_SEED = 2**31 - 100
SHARED_EXTRA = {
    "ppg_procgen.py": ["--num-levels", "10", "--seed", str(TOP_SEED)],
    "ppg_atari.py": ["--norm-reward", "--seed", str(TOP_SEED)],
}

_modules = {}


def load_script(name: str):
    """Import a training script by file name (once per test session). A path outside the checkout (a scratch copy
    with a mistake: $PPG_SCRIPT of test_whole_run.py) is imported under a name of its own."""
    if name not in _modules:
        path = ROOT / name  # an absolute path stays itself
        spec = importlib.util.spec_from_file_location(path.stem if path.parent == ROOT else f"{path.stem}_copy", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # so that inspect (tyro's help text) finds its source
        spec.loader.exec_module(module)
        _modules[name] = module
    return _modules[name]


@pytest.fixture(params=SCRIPTS)
def script(request):
    return load_script(request.param)


def run_script(name: str, *flags: str, cwd, timeout: float = PATIENCE_S) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run(
        [sys.executable, str(ROOT / name), *flags], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def read_scalars(run_dir) -> dict:
    """{tag: [values]} of the one run under run_dir/runs/."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (logdir,) = list(pathlib.Path(run_dir, "runs").iterdir())
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def random_obs(module, n: int) -> torch.Tensor:
    return torch.randint(0, 256, (n, *module.OBS_SHAPE), dtype=torch.uint8)


def aux_buffers(module, obs: torch.Tensor, returns: torch.Tensor, num_actions: int = 6) -> dict:
    """Buffers as main() hands them to auxiliary_phase: every field of the script's buffer_fields, (trajectories,
    steps, ...), with these frames and V_hat (the rest zeros; pi_old_logits is the phase's to write)."""
    fields = module.buffer_fields(num_actions).items()
    buffers = {k: torch.zeros((*returns.shape, *shape), dtype=dtype) for k, (shape, dtype) in fields}
    buffers.update(obs=obs, returns=returns)
    return buffers


def random_batch(module, n: int, num_actions: int) -> dict:
    """A rollout-shaped batch as main() hands it to policy_phase_update (the fields its loss reads)."""
    g = torch.Generator().manual_seed(0)
    return dict(
        obs=torch.randint(0, 256, (n, *module.OBS_SHAPE), dtype=torch.uint8, generator=g),
        actions=torch.randint(0, num_actions, (n,), generator=g),
        logprobs=torch.full((n,), -float(torch.log(torch.tensor(float(num_actions))))),
        advantages=torch.randn(n, generator=g),
        returns=torch.randn(n, generator=g),
    )


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """tiny_run(name): the one tiny fp32 run of each script (TINY_FLAGS + SHARED_EXTRA), made as a user starts it,
    once per test session: a namespace of cwd, run_dir, stdout, stderr, returncode, scalars. Its folder is read
    only: a test that writes (evaluation reports, a resume) works on copy_run(...) of it."""
    runs = {}

    def get(name: str):
        if name not in runs:
            cwd = tmp_path_factory.mktemp(pathlib.Path(name).stem)
            proc = run_script(name, *TINY_FLAGS[name], *SHARED_EXTRA[name], cwd=cwd)
            assert proc.returncode == 0, proc.stderr[-3000:]
            (run_dir,) = (cwd / "runs").iterdir()
            runs[name] = types.SimpleNamespace(
                cwd=cwd,
                run_dir=run_dir,
                stdout=proc.stdout,
                stderr=proc.stderr,
                returncode=proc.returncode,
                scalars=read_scalars(cwd),
            )
        return runs[name]

    return get


def copy_run(run, cwd: pathlib.Path) -> pathlib.Path:
    """A copy of a shared run's folder as cwd/runs/<its name>, for a test that writes into it."""
    target = cwd / "runs" / run.run_dir.name
    shutil.copytree(run.run_dir, target)
    return target


def assert_same(a, b, where: str) -> None:
    """a == b exactly, through dicts, lists and tuples: the same keys and lengths, tensors of one dtype and shape with
    every element equal, other values of one type and equal (1 and 1.0 differ). A dict and an OrderedDict of the same
    items are the same (a module's state_dict() against a copy of it)."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a.cpu(), b.cpu()), f"{where}: differs by up to {(a.double() - b.double()).abs().max():.3g}"
    else:
        assert type(a) is type(b) and a == b, where


def refusal(script, flags, cwd, monkeypatch) -> str:
    """What the command line `python SCRIPT flags...` stops with, in this process: main() as the __main__ block calls
    it. Asserts it stopped with one line before any run folder (env, buffer, log) existed, and returns that line."""
    import tyro

    monkeypatch.chdir(cwd)
    with pytest.raises(SystemExit) as stopped:
        script.main(tyro.cli(script.Args, args=list(flags)), script.named_flags(flags))
    message = str(stopped.value.code)
    assert message.startswith("error: ") and "\n" not in message, (flags, message)
    assert not (pathlib.Path(cwd) / "runs").exists(), flags
    return message


def main_in_process(script, flags, cwd, monkeypatch):
    """script.main(flags) in this process, as the __main__ block calls it (so a test can patch the very functions it
    calls), in cwd, with the signal handlers it installs put back afterwards."""
    import signal

    import tyro

    monkeypatch.chdir(cwd)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return script.main(tyro.cli(script.Args, args=list(flags)), script.named_flags(flags))
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)


# tools/sweep.py's tests: the tiny config, on a game whose random episodes end within it (so every run logs returns);
# one game keeps the shared grid at 4 runs (a report over several games is test_report.py's, on written runs)
SWEEP_GAMES = ["dodgeball"]
SWEEP_TINY = _TINY


def sweep(root, *argv: str, timeout: float = PATIENCE_S, **popen) -> subprocess.CompletedProcess:
    """`python tools/sweep.py --root ROOT argv...`, as a user runs it."""
    command = [sys.executable, str(ROOT / "tools" / "sweep.py"), "--root", str(root), *argv]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, **popen)


@pytest.fixture(scope="session")
def sweep_grid(tmp_path_factory):
    """The one 1-game x 2-seed x 2-method local sweep of the suite (tiny runs, 2 jobs at once): its root, name and
    what the sweep printed. Read only: a test that writes works on a sweep of its own."""
    root = tmp_path_factory.mktemp("sweeps") / "runs"
    argv = ["--name", "grid", "--games", *SWEEP_GAMES, "--seeds", "1", "2", "--methods", "ppg", "ppo", "--jobs", "2"]
    done = sweep(root, *argv, "--", *SWEEP_TINY)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return types.SimpleNamespace(root=root, folder=root / "grid", argv=argv, stdout=done.stdout)


# The comparisons with the authors' released code skip where it is absent, so the suite's last lines say whether they
# ran: one line after the test results, with the command that enables them when they skipped.
RELEASED_TEST_FILES = {"test_released_code.py", "test_whole_run.py"}


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    import released_shims as rs

    outcomes, reasons = {}, []
    for category in ["passed", "failed", "error", "skipped", "xfailed", "xpassed"]:
        for report in terminalreporter.stats.get(category, []):
            nodeid = getattr(report, "nodeid", "")
            if pathlib.Path(nodeid.split("::")[0]).name not in RELEASED_TEST_FILES:
                continue
            if report.skipped:
                outcomes.setdefault(nodeid, "skipped")
                if isinstance(report.longrepr, tuple):
                    reasons.append(report.longrepr[2].removeprefix("Skipped: "))
            elif report.failed:
                outcomes[nodeid] = "failed"  # a failed setup, call or teardown fails the test
            elif report.when == "call":
                outcomes.setdefault(nodeid, "passed")
    if not outcomes:
        return  # a selection without them: nothing to say
    count = {k: list(outcomes.values()).count(k) for k in ["passed", "failed", "skipped"]}
    slow = sum(
        pathlib.Path(item.nodeid.split("::")[0]).name in RELEASED_TEST_FILES
        for item in terminalreporter.stats.get("deselected", [])
    )
    if count["skipped"] == len(outcomes):
        why = "; ".join(dict.fromkeys(reasons)) or "skipped"
        fix = rs.CLONE_COMMAND
        if os.environ.get(rs.ENV_VAR):
            fix = f"set {rs.ENV_VAR} to a clone of the released code, or unset it and {fix}"
        line = f"released code: all {len(outcomes)} comparisons skipped: {why}; to run them: {fix}"
        terminalreporter.write_line(line, yellow=True, bold=True)
        return
    path, _ = rs.released_root()
    # a folder beside the checkout as the clone command names it; any other as given
    beside = path and pathlib.Path(path).resolve().is_relative_to(ROOT.parent)
    where = os.path.relpath(path, ROOT) if beside else str(path)
    commit = rs.released_commit(path) if path else None
    if commit and commit != rs.COMMIT:
        where += f" at commit {commit[:7]}, not {rs.COMMIT[:7]} where the comparisons were measured"
    parts = [f"{count['passed']} of {count['passed'] + count['failed']} comparisons passed"]
    parts += [f"{count[k]} {k}" for k in ["failed", "skipped"] if count[k]]
    line = f"released code: {', '.join(parts)} (test_released_code.py, test_whole_run.py; against {where})"
    if slow:
        line += f"; {slow} slow ones run with -m slow"
    terminalreporter.write_line(line, green=not count["failed"], red=bool(count["failed"]), bold=True)


def wrap(monkeypatch, owner, name, before=None, after=None):
    """Replace owner.name by a function that calls before(*args), the original, then after(result, *args), with the
    call's positional arguments (the tests record what main() hands the script's functions)."""
    real = getattr(owner, name)

    def wrapped(*args, **kwargs):
        if before:
            before(*args)
        result = real(*args, **kwargs)
        if after:
            after(result, *args)
        return result

    monkeypatch.setattr(owner, name, wrapped)
