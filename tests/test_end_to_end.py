"""Tiny runs of each script as a user runs it, and the one-line errors for bad input."""

import math
import sys

import pytest
import torch

from conftest import SCRIPTS, TINY_FLAGS, load_script, main_in_process, read_scalars, refusal, run_script

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
    "aux/joint_loss",
    "aux/value_loss",
    "timing/rollout_s",
    "timing/policy_update_s",
    "timing/snapshot_s",
    "timing/aux_epochs_s",
]
ARCH_FLAGS = {  # the in-process fp32 run of each other arch also exercises one optional feature
    "detach": ["--e-v", "2"],  # E_V > E_pi: value-only epochs first, with an Adam of their own
    "shared": ["--max-grad-norm", "0.5"],
}


def check_tiny_run(stdout: str, scalars: dict, precision: str) -> None:
    """What every tiny run must show: the plan, every tag, finite losses, an aux phase in phase 1 alone, and a
    first minibatch whose ratio is 1 and a first aux epoch whose clone KL is 0."""
    assert "3 rollouts" in stdout and "1 auxiliary phases" in stdout
    assert f"precision {precision}; " in stdout
    missing = [t for t in EXPECTED_TAGS if t not in scalars]
    assert not missing, missing
    for tag, values in scalars.items():
        if tag.startswith(("losses/", "aux/")):
            assert all(math.isfinite(v) for v in values), (tag, values)
    # 2 phases: the first ends with an auxiliary phase, the last (after the last rollout) does not
    assert len(scalars["timing/aux_epochs_s"]) == 2
    assert scalars["timing/aux_epochs_s"][0] > 0 and scalars["timing/aux_epochs_s"][1] == 0
    assert 1 <= len(scalars["aux/clone_kl"]) <= 2  # E_aux = 2, fewer only if the KL guard fired
    # The rollout's log-probs and pi_old come from the same computation as the update's (same
    # precision): the first minibatch's ratio is 1 and its clone KL 0. Exactly so in bf16, whose
    # rounding of the trunk's features absorbs the last-bit differences that fp32 CPU kernels
    # show between batch sizes (the rollout steps 2 states at a time, the update 8).
    tolerance = 0.0 if precision == "bf16" else 1e-6
    assert max(abs(v) for v in scalars["losses/approx_kl"]) <= tolerance
    assert max(scalars["losses/clipfrac"]) == 0.0
    assert abs(scalars["aux/clone_kl"][0]) <= tolerance


@pytest.mark.parametrize("name", SCRIPTS)
def test_tiny_run(name, tiny_run):
    """The shared run, as a user starts it (dual, fp32, --save-model; Procgen with unseen-level evaluation)."""
    run = tiny_run(name)
    assert "Traceback" not in run.stderr and "Gym has been unmaintained" not in run.stderr
    check_tiny_run(run.stdout, run.scalars, "fp32")
    if name == "ppg_procgen.py":  # once per phase, on seeds wrapped below 2^31 (the run's seed is 2^31 - 100)
        assert len(run.scalars["eval/episodic_return"]) == 2
    # --save-model: the final weights, as the last checkpoint holds them, and the flags
    saved = run.run_dir / f"{name[:-3]}.pt"
    model, checkpoint = (torch.load(p, weights_only=True) for p in (saved, saved.with_name("checkpoint.pt")))
    assert model["args"]["save_model"] and model["args"]["num_envs"] == 2
    assert model["agent"].keys() == checkpoint["agent"].keys()
    assert all(torch.equal(model["agent"][k], checkpoint["agent"][k]) for k in model["agent"])


@pytest.mark.parametrize("arch", ["detach", "shared"])
@pytest.mark.parametrize("name", SCRIPTS)
def test_tiny_run_of_each_arch(name, arch, tmp_path, monkeypatch, capsys):
    """The other archs at fp32, in this process (the shared run is dual)."""
    script = load_script(name)
    main_in_process(script, [*TINY_FLAGS[name], "--arch", arch, *ARCH_FLAGS[arch]], tmp_path, monkeypatch)
    check_tiny_run(capsys.readouterr().out, read_scalars(tmp_path), "fp32")
    (run,) = (tmp_path / "runs").iterdir()
    state = script.load_checkpoint(str(run))
    assert state["args"]["arch"] == arch
    # main() hands the value epochs' Adam to the update when E_pi != E_V (detach here), and checkpoints it
    assert bool(state["value_optimizer"]["state"]) == (arch == "detach") and state["policy_optimizer"]["state"]


@pytest.mark.parametrize("name", SCRIPTS)
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
    # one aux epoch and chunks of 32 states: the least work that still shows all of it (CPUs without native bf16
    # emulate it, several times slower than fp32)
    flags = [*TINY_FLAGS[name], "--precision", "bf16", "--e-aux", "1", "--micro-batch-size", "32"]
    main_in_process(script, flags, tmp_path, monkeypatch)
    assert dtypes == {torch.bfloat16}
    check_tiny_run(capsys.readouterr().out, read_scalars(tmp_path), "bf16")


BAD_FLAGS = {
    "ppg_procgen.py": [
        (["--env-id", "pong"], "--env-id"),
        (["--num-minibatches", "7"], "--num-minibatches"),
        (["--n-pi", "0"], "--n-pi"),
        (["--beta-clone", "-1"], "--beta-clone"),
        (["--arch", "triple"], "--arch"),
        (["--num-steps", "10000000000"], "GiB"),  # 64 x 1e10 frames (7.9 PB): no machine holds it
        (["--learning-rate", "inf"], "--learning-rate must be a finite number"),
        (["--ent-coef", "inf"], "--ent-coef must be a finite number"),
        (["--beta-clone", "nan"], "--beta-clone must be a finite number"),
        (["--seed", "-1"], "--seed must lie in [0, 2^31)"),
        (["--seed", "2147483648"], "--seed must lie in [0, 2^31)"),
    ],
    "ppg_atari.py": [
        (["--env-id", "BrakeoutNoFrameskip-v4"], "did you mean BreakoutNoFrameskip-v4"),
        (["--env-id", "ALE/Foo-v5"], "--env-id"),
        (["--env-id", "Breakout-v4"], "did you mean BreakoutNoFrameskip-v4"),  # registered, but no vector env
        (["--num-minibatches", "3"], "--num-minibatches"),
        (["--e-v", "0"], "--e-v"),
        (["--arch", "triple"], "--arch"),
        (["--repeat-action-probability", "1.5"], "--repeat-action-probability"),
        (["--num-steps", "10000000000"], "GiB"),  # 8 x 1e10 frame stacks (2.3 PB): no machine holds it
        (["--learning-rate", "inf"], "--learning-rate must be a finite number"),
        (["--ent-coef", "inf"], "--ent-coef must be a finite number"),
        (["--beta-clone", "nan"], "--beta-clone must be a finite number"),
        (["--seed", "-1"], "--seed must lie in [0, 2^31)"),
        (["--seed", "2147483648"], "--seed must lie in [0, 2^31)"),
    ],
}


@pytest.mark.parametrize("name", SCRIPTS)
def test_bad_input_gives_one_line(name, tmp_path, monkeypatch):
    """Each refusal in this process (the parser and the plan refuse before any env exists), then one as a user
    meets it (the parser's on Procgen, the plan's on Atari): one line on stderr, no traceback, no run folder."""
    script = load_script(name)
    for flags, needle in BAD_FLAGS[name]:
        assert needle in refusal(script, flags, tmp_path, monkeypatch), flags
    for flags, needle in (
        [(["--arch", "triple"], "--arch")] if name == "ppg_procgen.py" else [(["--seed", "-1"], "--seed")]
    ):
        proc = run_script(name, *flags, cwd=tmp_path, timeout=60)
        assert proc.returncode != 0, flags
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and needle in errors[0], (flags, proc.stderr[-2000:])
        assert "Traceback" not in proc.stderr
        assert not (tmp_path / "runs").exists()  # it stopped before any env, buffer or log existed


@pytest.mark.parametrize("name", SCRIPTS)
def test_derived_seeds_stay_in_range_for_any_phase_and_worker_count(name):
    """Whatever the phase count, worker count, evaluation offset and --seed in its range, every derived seed (and
    ALE's seed + i of env i) is one the envs take; small seeds are left as they are (no change of arithmetic)."""
    module = load_script(name)
    assert module.derived_seed(1, 100_003 * 3 + 64, 64) == 1 + 100_003 * 3 + 64
    for seed in (0, 1, 2**31 - 100, 2**31 - 1):
        for shift in (0, 1_000_003, 2_000_003 + 2**31 - 1, 100_003 * 10**6 + 1023 * 64):
            for num_envs in (1, 2, 64, 4096):
                derived = module.derived_seed(seed, shift, num_envs)
                assert 0 <= derived and derived + num_envs - 1 < 2**31 - 1, (seed, shift, num_envs)


@pytest.mark.parametrize("name", SCRIPTS)
def test_invalid_combinations_are_rejected_in_process(name):
    module = load_script(name)
    cases = [
        dict(num_envs=0),
        dict(num_steps=-1),
        dict(e_pi=0),
        dict(e_v=0),
        dict(e_aux=-1),
        dict(learning_rate=0.0),
        dict(gamma=1.5),
        dict(aux_kl_stop=-0.1),
        dict(micro_batch_size=-2),
        dict(num_envs=4, n_pi=1, aux_mb_trajectories=3, total_timesteps=10**6),
    ]
    for overrides in cases:
        with pytest.raises(module.ArgError):
            module.make_plan(module.Args(**overrides))
    module.make_plan(module.Args())  # the defaults are valid


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_flag_has_help_text(name, monkeypatch, capsys):
    """`--help` gives each flag its own text (tyro reads the comment beside each field), not just a default: the
    __main__ block's parse_args in this process, as `python SCRIPT --help` prints it."""
    import re

    module = load_script(name)
    monkeypatch.setattr(sys, "argv", [name, "--help", "--no-use-color"])
    monkeypatch.setenv("COLUMNS", "120")
    with pytest.raises(SystemExit) as done:
        module.parse_args()
    assert not done.value.code
    stdout = capsys.readouterr().out
    text = " ".join(line.strip("│ ") for line in stdout.splitlines())
    flags = [f.name.replace("_", "-") for f in __import__("dataclasses").fields(module.Args)]
    for flag in flags:
        match = re.search(rf"--(?:no-)?{flag}\b[^-]*?(?:\{{[^}}]*\}}|[A-Z]+)?\s+(.*?)\(default", text)
        assert match and len(match.group(1).split()) >= 3, (flag, match and match.group(1))


def test_stop_message_before_and_after_the_first_checkpoint():
    script = load_script("ppg_procgen.py")
    assert script.stop_message(15, 64, None, "runs/x", 1) == (
        "stopped by SIGTERM at step 64; no checkpoint had been written yet"
    )
    assert script.stop_message(2, 640, (2, 512), "runs/x", 1).endswith(
        "the checkpoint after phase 2 (step 512) stays; resume with: python ppg_procgen.py --resume runs/x"
    )
