"""Tiny runs of each script as a user runs it, and the one-line errors for bad input."""

import math
import sys

import pytest
import torch

from conftest import ROOT, SCRIPTS, TINY_FLAGS, load_script, main_in_process, read_scalars, refusal, run_script

EXPECTED_TAGS = [
    "charts/episodic_return",
    "charts/episodic_length",
    "charts/SPS",
    "losses/policy_loss",
    "losses/value_loss",
    "losses/entropy",
    "losses/approx_kl",
    "losses/clipfrac",
    "losses/explained_variance",
    "aux/aux_value_loss",
    "aux/clone_kl",
    "aux_phase/aux_value_loss",
    "aux_phase/clone_kl",
    "aux_phase/joint_loss",
    "aux_phase/value_loss",
]
ARCH_FLAGS = {  # the in-process fp32 run of each other arch also exercises one optional feature
    "detach": ["--e-v", "2"],  # E_V > E_pi: value-only epochs first, with an Adam of their own
    "shared": ["--max-grad-norm", "0.5"],
}


def check_tiny_run(stdout: str, scalars: dict, precision: str) -> None:
    """What every tiny run must show: the plan, every tag, finite losses, an aux phase in phase 1 alone, and a
    first minibatch whose ratio is 1 and a first aux epoch whose clone KL is 0 (the console's, to 5 decimals)."""
    assert "rollouts: 3 of" in stdout and "aux phases: 1\n" in stdout
    # a line per rollout with its ETA, a line per aux epoch, and where the checkpoint is and how to evaluate it
    progress = [line for line in stdout.splitlines() if " iter " in line and " ETA " in line]
    assert len(progress) == 3 and progress[-1].split(" ETA ")[1].startswith("0s ")  # under a minute: in seconds
    assert len([line for line in stdout.splitlines() if line.startswith("aux epoch ")]) in (1, 2)
    assert f"/checkpoint.pt; evaluate it: {sys.executable} {ROOT / 'tools' / 'evaluate.py'} /" in stdout
    assert f"precision {precision}\n" in stdout
    missing = [t for t in EXPECTED_TAGS if t not in scalars]
    assert not missing, missing
    for tag, values in scalars.items():
        if tag.startswith(("losses/", "aux_phase/")):
            assert all(math.isfinite(v) for v in values), (tag, values)
    # 2 phases: the first ends with an auxiliary phase, the last (after the last rollout) does not
    assert len(scalars["aux_phase/clone_kl"]) == 1  # one aux phase: its last epoch's means
    assert len(scalars["losses/value_loss"]) == 3  # one point a rollout: the mean over its minibatches
    # The rollout's log-probs and pi_old come from the same computation as the update's (same
    # precision): the first minibatch's ratio is 1 and its clone KL 0. Exactly so in bf16, whose
    # rounding of the trunk's features absorbs the last-bit differences that fp32 CPU kernels
    # show between batch sizes (the rollout steps 2 states at a time, the update 8).
    tolerance = 0.0 if precision == "bf16" else 1e-6
    assert max(abs(v) for v in scalars["losses/approx_kl"]) <= tolerance
    assert max(scalars["losses/clipfrac"]) == 0.0
    first_epoch = next(line for line in stdout.splitlines() if line.startswith("aux epoch 1/"))
    assert abs(float(first_epoch.split(" clone_kl ")[1].split()[0])) <= 1e-5, first_epoch


@pytest.mark.parametrize("name", SCRIPTS)
def test_tiny_run(name, tiny_run):
    """The shared run, as a user starts it (dual, fp32; Procgen on 10 training levels)."""
    run = tiny_run(name)
    assert "Traceback" not in run.stderr and "Gym has been unmaintained" not in run.stderr
    check_tiny_run(run.stdout, run.scalars, "fp32")
    # CleanRL's --save-model file is the last checkpoint: the final weights, which rebuild the agent, and the flags
    assert list(run.run_dir.glob("*.pt")) == [run.run_dir / "checkpoint.pt"]
    checkpoint = torch.load(run.run_dir / "checkpoint.pt", weights_only=True)
    assert checkpoint["global_step"] == 192 and checkpoint["args"]["num_envs"] == 2
    script = load_script(name)
    num_actions = checkpoint["agent"]["pi_head.weight"].shape[0]
    agent = script.PPGAgent(script.Args(**checkpoint["args"]), script.OBS_SHAPE, num_actions)
    agent.load_state_dict(checkpoint["agent"])  # strict: every weight there, none missing


@pytest.mark.parametrize("arch", ["detach", "shared"])
@pytest.mark.parametrize("name", SCRIPTS)
def test_tiny_run_of_each_arch(name, arch, tmp_path, monkeypatch, capsys):
    """The other archs at fp32, in this process (the shared run is dual)."""
    script = load_script(name)
    main_in_process(script, [*TINY_FLAGS[name], "--arch", arch, *ARCH_FLAGS[arch]], tmp_path, monkeypatch)
    check_tiny_run(capsys.readouterr().out, read_scalars(tmp_path), "fp32")
    (run,) = (tmp_path / "runs").iterdir()
    state = torch.load(run / "checkpoint.pt", weights_only=True)
    assert state["args"]["arch"] == arch
    # main() hands the value epochs' Adam to the update when E_pi != E_V (detach here), and checkpoints it
    assert bool(state["value_optimizer"]["state"]) == (arch == "detach") and state["policy_optimizer"]["state"]


# Procgen's case is slow (12 s of emulated bf16 on CPUs without it): PPGAgent.forward's autocast is the same in both
@pytest.mark.parametrize("name", [pytest.param("ppg_procgen.py", marks=pytest.mark.slow), "ppg_atari.py"])
def test_bf16_run(name, tmp_path, monkeypatch, capsys):
    """One tiny bf16 run a script (bf16 is slow on CPUs without native support): --precision bf16 reaches the
    agent main() builds, whose trunks' convolutions all output bf16, and the run shows what every run shows,
    with the first ratio exactly 1 and the first clone KL exactly 0."""
    script, dtypes = load_script(name), set()
    real = script.collect_rollout

    def hook_once(agent, *a, **k):
        if not dtypes:
            for m in agent.modules():
                if isinstance(m, torch.nn.Conv2d):
                    m.register_forward_hook(lambda mod, inp, out: dtypes.add(out.dtype))
        return real(agent, *a, **k)

    monkeypatch.setattr(script, "collect_rollout", hook_once)
    # 16 steps a rollout (3 rollouts still), one aux epoch and chunks of 32 states: the least work that still shows
    # all of it (CPUs without native bf16 emulate it, several times slower than fp32)
    flags = [*TINY_FLAGS[name], "--num-steps", "16", "--total-timesteps", "96", "--precision", "bf16", "--e-aux", "1"]
    flags += ["--micro-batch-size", "32"]
    main_in_process(script, flags, tmp_path, monkeypatch)
    assert dtypes == {torch.bfloat16}
    check_tiny_run(capsys.readouterr().out, read_scalars(tmp_path), "bf16")


# Values tyro accepts but the run cannot use: refused by main() in one line before any env, buffer or log exists
BAD_FLAGS = {
    "ppg_procgen.py": [
        (["--num-minibatches", "7"], "--num-minibatches"),
        (["--n-pi", "0"], "--n-pi"),
        (["--beta-clone", "-1"], "--beta-clone"),
        (["--num-levels", "-1"], "--num-levels"),
        (["--num-steps", "10000000000"], "GiB"),  # 64 x 1e10 frames (7.9 PB): no machine holds it
        (["--learning-rate", "inf"], "--learning-rate must be a finite number"),
        (["--ent-coef", "inf"], "--ent-coef must be a finite number"),
        (["--beta-clone", "nan"], "--beta-clone must be a finite number"),
        (["--seed", "-1"], "--seed must be a finite number in [0, 2^31)"),
        (["--seed", "2147483648"], "--seed must be a finite number in [0, 2^31)"),
        (["--num-envs", "4", "--aux-mb-trajectories", "3", "--total-timesteps", "100000"], "--aux-mb-trajectories"),
        (["--resume", "nowhere"], "--resume nowhere: not a readable checkpoint"),
    ],
    "ppg_atari.py": [
        (["--env-id", "BrakeoutNoFrameskip-v4"], "not an ale-py game id, as BreakoutNoFrameskip-v4 or ALE/Breakout-v5"),
        (["--env-id", "ALE/Foo-v5"], "--env-id"),
        (["--env-id", "Breakout-v4"], "--env-id Breakout-v4: not an ale-py game id"),  # registered, but no vector env
        (["--num-minibatches", "3"], "--num-minibatches"),
        (["--e-v", "0"], "--e-v"),
        (["--repeat-action-probability", "1.5"], "--repeat-action-probability"),
        (["--max-episode-frames", "0"], "--max-episode-frames"),
        (["--num-steps", "10000000000"], "GiB"),  # 8 x 1e10 frame stacks (2.3 PB): no machine holds it
        (["--learning-rate", "inf"], "--learning-rate must be a finite number"),
        (["--gamma", "1.5"], "--gamma must be a finite number in [0, 1]"),
        (["--micro-batch-size", "-2"], "--micro-batch-size must be a finite number >= 0"),
        (["--seed", "-1"], "--seed must be a finite number in [0, 2^31)"),
    ],
}
# Values tyro itself refuses: its own message, naming the flag (exit code 2)
PARSE_ERRORS = {"ppg_procgen.py": (["--env-id", "pong"], "--env-id"), "ppg_atari.py": (["--arch", "triple"], "--arch")}


@pytest.mark.parametrize("name", SCRIPTS)
def test_bad_input_gives_one_line(name, tmp_path, monkeypatch):
    """Each refusal in this process, then one as a user meets it: one line on stderr, no traceback, no run folder;
    and a value tyro refuses keeps tyro's own message, naming the flag."""
    script = load_script(name)
    for flags, needle in BAD_FLAGS[name]:
        assert needle in refusal(script, flags, tmp_path, monkeypatch), flags
    stderrs = []
    for flags, needle in [BAD_FLAGS[name][0], PARSE_ERRORS[name]]:
        proc = run_script(name, *flags, cwd=tmp_path)
        assert proc.returncode != 0 and "Traceback" not in proc.stderr, (flags, proc.stderr[-2000:])
        assert needle in proc.stderr and not (tmp_path / "runs").exists()  # stopped before any env, buffer or log
        stderrs.append(proc.stderr)
    errors = [line for line in stderrs[0].splitlines() if line]  # our refusal: one line and nothing else
    assert len(errors) == 1 and errors[0].startswith("error: ")


@pytest.mark.parametrize("name", SCRIPTS)
def test_the_defaults_are_valid(name):
    module = load_script(name)
    plan = module.make_plan(module.Args())
    assert plan["num_iterations"] * 64 * 256 >= 25_000_000 if name == "ppg_procgen.py" else plan["aux_phases"] > 0


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_flag_has_help_text(name, monkeypatch, capsys):
    """`--help` gives each flag its own text (tyro reads the comment beside each field), not just a default: tyro in
    this process, as `python SCRIPT --help` prints it."""
    import re

    import tyro

    module = load_script(name)
    monkeypatch.setenv("COLUMNS", "120")
    with pytest.raises(SystemExit) as done:
        tyro.cli(module.Args, args=["--help", "--no-use-color"])
    assert not done.value.code
    stdout = capsys.readouterr().out
    text = " ".join(line.strip("│ ") for line in stdout.splitlines())
    flags = [f.name.replace("_", "-") for f in __import__("dataclasses").fields(module.Args)]
    for flag in flags:
        match = re.search(rf"--(?:no-)?{flag}\b[^-]*?(?:\{{[^}}]*\}}|[A-Z]+)?\s+(.*?)\(default", text)
        assert match and len(match.group(1).split()) >= 3, (flag, match and match.group(1))
