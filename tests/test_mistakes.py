"""The mistakes PPG implementations make, each caught through the code that trains: main() on a tiny config, with
the script's own functions wrapped to record what they are handed, or the very functions main() calls."""

import copy
import math
import pathlib
import sys
from collections import Counter, defaultdict

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

from conftest import TINY_FLAGS, assert_same, copy_run, load_script, main_in_process, wrap


def tiny(script, *extra):
    return [*TINY_FLAGS[pathlib.Path(script.__file__).name], "--precision", "fp32", *extra]


class DeviceWaits(TorchFunctionMode):
    """Counts the tensor calls that make the host wait for a GPU (item, bool, tolist, cpu, float, int; numpy is not
    among them: on a GPU tensor it raises, so its wait is the cpu() before it), each under the function main() called
    that it came from; those inside torch.optim are left out (Adam reads its step count on the host). Also counts
    the writes (setitem, copy_) into each of main()'s buffers (`buffers`, once allocated), by part and buffer."""

    WAITS = {torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.tolist, torch.Tensor.cpu}
    WAITS |= {torch.Tensor.__float__, torch.Tensor.__int__}

    def __init__(self, script_file: str):
        super().__init__()
        self.file, self.counts, self.writes, self.buffers = script_file, Counter(), Counter(), {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.WAITS and (part := self.part()):
            self.counts[part] += 1
        if func in (torch.Tensor.__setitem__, torch.Tensor.copy_):
            storage = args[0].untyped_storage().data_ptr()
            for name, buffer in self.buffers.items():
                if buffer.untyped_storage().data_ptr() == storage:
                    self.writes[self.part(), name] += 1
        return func(*args, **(kwargs or {}))

    def part(self):
        frame, below = sys._getframe(2), "outside main()"
        while frame:
            if "/torch/optim/" in frame.f_code.co_filename:
                return None
            if frame.f_code.co_filename == self.file:
                if frame.f_code.co_name == "main":
                    return below
                below = frame.f_code.co_name
            frame = frame.f_back
        return "outside main()"


RECORDED_EXTRA = {"ppg_procgen.py": ["--num-levels", "10", "--start-level", "5"], "ppg_atari.py": []}
NO_ENV_WAIT = ("collect_rollout", "policy_phase_update", "auxiliary_phase")


@pytest.fixture(scope="module", params=["ppg_procgen.py", "ppg_atari.py"])
def recorded(request, tmp_path_factory):
    """One tiny fp32 run of main() per script in this process, with the script's own functions wrapped to record
    what they are handed and return: the tests below read one recording instead of each training its own run."""
    script, rec = load_script(request.param), defaultdict(list)
    phase = ["policy"]
    cwd = tmp_path_factory.mktemp("recorded")
    with pytest.MonkeyPatch.context() as mp:
        wrap(mp, script, "policy_phase_update", before=lambda agent, opt, batch, *a: rec["batches"].append(batch))
        wrap(mp, script, "policy_phase_update", before=lambda *a: phase.__setitem__(0, "policy"))
        wrap(mp, script, "auxiliary_phase", before=lambda *a: phase.__setitem__(0, "aux"))
        wrap(
            mp,
            script,
            "auxiliary_phase",
            before=lambda agent, opt, buffers, *a, **kw: rec["targets"].append(buffers["returns"].clone()),
        )
        wrap(mp, script, "gradient_step", before=lambda agent, opt, *a: rec["steps"].append((phase[0], opt)))
        wrap(mp, script, "compute_gae", before=lambda rewards, *a: rec["gae_rewards"].append(rewards.clone()))
        wrap(mp, script, "compute_gae", after=lambda out, *a: rec["returns"].append(out[1].clone()))
        wrap(mp, script, "compute_gae", after=lambda out, r, values, *a: rec["gae"].append((out[0], values.clone())))
        wrap(mp, script.RewardNormalizer, "__call__", before=lambda self, raw, *a: rec["raw"].append(raw.copy()))
        wrap(mp, script.RewardNormalizer, "__call__", after=lambda out, *a: rec["scaled"].append(out.copy()))
        if request.param == "ppg_procgen.py":
            wrap(
                mp,
                script.ProcgenVecEnv,
                "__init__",
                before=lambda self, args, n, num_levels, start_level, seed: rec["envs"].append(
                    (num_levels, start_level, seed)
                ),
            )
        wrap(mp, script, "auxiliary_phase", after=lambda epochs, *a: rec["aux_epochs"].append(len(epochs)))
        with DeviceWaits(script.__file__) as waits:  # B's buffers: the rows each rollout writes into
            wrap(
                mp,
                script,
                "collect_rollout",
                before=lambda a, e, o, ro, *rest: waits.buffers.update(
                    {k: v for k, v in ro.items() if k not in waits.buffers}
                ),
            )
            main_in_process(script, tiny(script, *RECORDED_EXTRA[request.param]), cwd, mp)
        rec["waits"], rec["writes"] = waits.counts, waits.writes
    (run,) = (cwd / "runs").iterdir()
    return script, rec, run


def test_no_needless_device_waits_in_the_hot_loops(recorded):
    """Counted from outside the loop on the CPU, calls that would each make the host wait for a GPU: per vector env
    step only the actions' copy (the envs need them; Procgen's recorded run has test envs, whose actions are a second
    copy); none per optimizer step, one per policy update and aux epoch (the means of its statistics, which the NaN
    check reads too); per rollout a handful (the host-side targets)."""
    script, rec, _ = recorded
    waits, rollouts, steps = dict(rec["waits"]), len(rec["batches"]), 3 * 32  # 3 rollouts of 32 vector steps
    print(f"device waits by part of main(): {waits}")
    assert waits.pop("collect_rollout") == steps * (2 if script.SCRIPT == "ppg_procgen.py" else 1)
    updates = rollouts + sum(rec["aux_epochs"])  # policy updates and aux epochs: one mean over minibatches each
    assert waits.pop("policy_phase_update") + waits.pop("auxiliary_phase", 0) == updates  # none per minibatch
    setup = waits.pop("outside main()", 0)
    assert sum(waits.values()) <= 10 * rollouts, (waits, setup)
    # uploads: a frame batch per env step (the next step's input); the env's rewards and ends once a rollout
    writes = {name: n for (part, name), n in rec["writes"].items() if part == "collect_rollout"}
    assert writes["obs"] == steps and writes["raw_rewards"] == writes["ended"] == rollouts, writes


def test_advantages_reach_the_update_normalised_per_rollout(recorded):
    _, rec, _ = recorded
    assert len(rec["batches"]) == 3  # one update per rollout
    for batch in rec["batches"]:  # mean 0 and population std 1 over the whole rollout (64 states)
        adv = batch["advantages"].double()
        assert abs(float(adv.mean())) < 1e-6 and float(adv.std(unbiased=False)) == pytest.approx(1.0, abs=1e-5)


def test_each_phase_steps_its_own_adam_and_the_checkpoint_holds_both(recorded):
    """Two Adam instances: the policy phase steps one, the aux phase the other, and each keeps its state."""
    script, rec, run = recorded
    steps = rec["steps"]
    policy_opts = {id(opt) for where, opt in steps if where == "policy"}
    aux_opts = {id(opt) for where, opt in steps if where == "aux"}
    assert len(policy_opts) == 1 and len(aux_opts) == 1 and policy_opts != aux_opts
    state = torch.load(run / "checkpoint.pt", weights_only=True)
    count = {where: sum(1 for w, _ in steps if w == where) for where in ("policy", "aux")}
    assert count == {"policy": 3, "aux": 2}  # 3 rollouts x 1 minibatch; E_aux = 2 epochs x 1 minibatch
    # every parameter has the moments of its steps: all but the aux value head's (which the policy phase leaves
    # alone) in the policy Adam; all of them in the aux Adam
    for name, where, untouched in (("policy_optimizer", "policy", 2), ("aux_optimizer", "aux", 0)):
        moments = state[name]["state"]
        assert len(moments) == len(state["agent"]) - untouched
        assert {float(m["step"]) for m in moments.values()} == {float(count[where])}


# Procgen's case is slow (5 s): tests/test_resume.py's resumed runs must end bit-identical to the runs unbroken
@pytest.mark.parametrize("name", [pytest.param("ppg_procgen.py", marks=pytest.mark.slow), "ppg_atari.py"])
def test_resume_restores_every_state_the_stopped_run_held(name, tiny_run, tmp_path, monkeypatch):
    """The shared finished 2-phase run (its reward normaliser on), resumed with a larger budget: at its first use,
    each restored piece (weights, both Adams' moments and steps, the reward normaliser) equals what the checkpoint
    holds, tensor by tensor."""
    script = load_script(name)
    run = copy_run(tiny_run(script.SCRIPT), tmp_path)
    saved = torch.load(run / "checkpoint.pt", weights_only=True)
    assert saved["phase"] == 2 and saved["aux_optimizer"]["state"] and saved["policy_optimizer"]["state"]
    seen = {}

    def first(name, value):
        seen.setdefault(name, value)

    def at_update(agent, optimizer, *a):
        first("agent", {k: v.clone() for k, v in agent.state_dict().items()})
        first("policy_optimizer", copy.deepcopy(optimizer.state_dict()))  # its tensors change in place

    wrap(monkeypatch, script, "policy_phase_update", before=at_update)
    wrap(
        monkeypatch,
        script,
        "auxiliary_phase",
        before=lambda agent, opt, *a: first("aux_optimizer", copy.deepcopy(opt.state_dict())),
    )
    wrap(
        monkeypatch, script.RewardNormalizer, "__call__", before=lambda self, *a: first("normalizer", self.state_dict())
    )
    main_in_process(script, ["--resume", str(run), "--total-timesteps", "448"], tmp_path, monkeypatch)

    assert seen["normalizer"] == saved["reward_normalizer"] and saved["reward_normalizer"]["count"] > 1
    assert_same(seen["agent"], saved["agent"], "agent")
    # the policy update is the first use after the resume, so it sees the checkpoint's Adam state as it was
    assert_same(seen["policy_optimizer"]["state"], saved["policy_optimizer"]["state"], "policy_optimizer")
    # the aux phase comes 2 rollouts later: its Adam has not stepped since the checkpoint
    assert_same(seen["aux_optimizer"]["state"], saved["aux_optimizer"]["state"], "aux_optimizer")
    assert len(seen["aux_optimizer"]["state"]) == len(saved["agent"])


def test_rewards_are_normalised_before_gae(recorded):
    """ppg_procgen.py normalises rewards by default: GAE sees each rollout's rewards as the normaliser returned
    them, once per rollout (ppg_atari.py's default is off: its normaliser never runs)."""
    script, rec, _ = recorded
    if script.SCRIPT == "ppg_atari.py":
        assert not rec["scaled"] and len(rec["gae_rewards"]) == 3
        return
    assert len(rec["scaled"]) == len(rec["gae_rewards"]) == 3
    for out, rewards in zip(rec["scaled"], rec["gae_rewards"]):
        assert np.array_equal(out, rewards.numpy())
    # the normaliser changed some reward (else GAE on the raw rewards would pass the check above too)
    assert any(not np.array_equal(out, raw) for out, raw in zip(rec["scaled"], rec["raw"]))


def test_max_grad_norm_clips_each_network_separately(script):
    torch.manual_seed(0)
    agent = script.PPGAgent(script.Args(), script.OBS_SHAPE, 6)
    for p in agent.policy_parameters():
        p.grad = torch.full_like(p, 1e-4)
    for p in agent.value_parameters():
        p.grad = torch.full_like(p, 10.0)
    policy_norm = float(torch.cat([p.grad.flatten() for p in agent.policy_parameters()]).norm())
    seen = {}

    class Recorder:
        def step(self):
            for name, params in (("pi", agent.policy_parameters()), ("v", agent.value_parameters())):
                seen[name] = float(torch.cat([p.grad.flatten() for p in params]).norm())

        def zero_grad(self, set_to_none=True):
            agent.zero_grad(set_to_none=set_to_none)

    def no_loss(out, chunk, args, policy, value):  # the step's gradients are those set above
        return torch.zeros((), requires_grad=True), {}

    mb = dict(obs=torch.zeros(4, *script.OBS_SHAPE, dtype=torch.uint8))
    script.gradient_step(agent, Recorder(), mb, script.Args(max_grad_norm=0.5), 0, no_loss, True, True)
    assert seen["v"] == pytest.approx(0.5, rel=1e-3)  # the value network's gradient is clipped to the norm
    assert seen["pi"] == pytest.approx(policy_norm, rel=1e-5) and policy_norm < 0.5  # the policy's is untouched


def test_entropy_bonus_is_added_with_its_coefficient(script):
    """The policy-phase loss is pg_loss - ent_coef * entropy: with advantages 0, one SGD step raises the entropy,
    and the gradient is ent_coef times the entropy's."""
    from conftest import random_batch

    grads = {}
    for coef in (0.0, 0.01, 0.02):
        torch.manual_seed(0)
        agent = script.PPGAgent(script.Args(), script.OBS_SHAPE, 6)
        batch = dict(random_batch(script, 16, 6), advantages=torch.zeros(16))
        args = script.Args(num_envs=2, num_steps=8, num_minibatches=1, micro_batch_size=0, ent_coef=coef, e_v=1)
        recorded = {}

        class Recorder:
            def step(self):
                recorded.update({id(p): p.grad.clone() for p in agent.pi_head.parameters()})

            def zero_grad(self, set_to_none=True):
                agent.zero_grad(set_to_none=True)

        script.policy_phase_update(agent, Recorder(), batch, args)
        grads[coef] = torch.cat([g.flatten() for g in recorded.values()])
    assert torch.count_nonzero(grads[0.0]) == 0  # zero advantages: no policy-gradient signal at all
    with torch.no_grad():
        logits = agent(batch["obs"], value=False).logits
        entropy = torch.distributions.Categorical(logits=logits).entropy().mean()
    assert float(entropy) < math.log(6)  # not at the maximum, so the bonus has a direction to push
    assert torch.allclose(grads[0.02], 2 * grads[0.01], rtol=1e-4, atol=1e-9)
    # the step direction raises the entropy: gradient descent on -coef * entropy
    torch.manual_seed(0)
    agent = script.PPGAgent(script.Args(), script.OBS_SHAPE, 6)
    logits = agent(batch["obs"], value=False).logits
    (-torch.distributions.Categorical(logits=logits).entropy().mean()).backward()
    expected = torch.cat([p.grad.flatten() for p in agent.pi_head.parameters()])
    assert torch.allclose(grads[0.01], 0.01 * expected, rtol=1e-3, atol=1e-9)


def test_aux_targets_are_v_hat_the_rollout_returns(recorded):
    """The aux phase regresses on V_hat = V + A of each rollout (GAE's returns), not on the values V."""
    _, rec, _ = recorded
    (buffer,) = rec["targets"]  # one aux phase, after rollouts 1 and 2 (slots 0 and 1: 2 envs each)
    assert torch.equal(buffer, torch.cat(rec["returns"][:2]))
    for returns, (advantages, values) in zip(rec["returns"][:2], rec["gae"][:2]):  # GAE's returns are A + V, not V
        assert torch.equal(returns, advantages + values) and not torch.equal(returns, values)


def test_training_levels_are_the_flags_and_the_env_is_seeded(recorded):
    script, rec, _ = recorded
    if script.SCRIPT != "ppg_procgen.py":
        pytest.skip("levels are Procgen's alone")
    # training: levels 5..14, the level sequence seeded by --seed; the test envs: every level from 5 on, seed + 1
    assert rec["envs"] == [(10, 5, 1), (0, 5, 2)]


def test_the_memory_check_counts_what_main_allocates(script, tmp_path, monkeypatch):
    """The check compares B's bytes, from buffer_fields as main() allocates them (frames uint8), and a chunk's
    activations with free memory: a run that does not fit stops in one line before any env exists, naming the flags
    that shrink it."""
    from conftest import refusal

    fields = script.buffer_fields(script.NUM_ACTIONS)
    assert fields["obs"] == (script.OBS_SHAPE, torch.uint8)
    per_step = sum(math.prod(shape) * dtype.itemsize for shape, dtype in fields.values())
    # a B of exactly 1 GiB, 4 envs x N_pi 8: refused with 0.5 GiB free, and its size said as main() computes it
    steps = 2**30 // (per_step * 32)
    meminfo = f"MemTotal: 1 kB\nMemAvailable: {2**19} kB\n"
    real_open = open
    monkeypatch.setattr(
        "builtins.open",
        lambda f, *a, **k: __import__("io").StringIO(meminfo) if f == "/proc/meminfo" else real_open(f, *a, **k),
    )
    flags = [
        "--num-envs",
        "4",
        "--n-pi",
        "8",
        "--num-steps",
        str(steps),
        "--num-minibatches",
        "1",
        "--aux-mb-trajectories",
        "1",
    ]
    message = refusal(script, flags, tmp_path, monkeypatch)
    chunk = f"chunks of 256 states {256 * 2 * script.ACTIVATION_BYTES / 2**30:.1f} GiB"  # a CPU's chunk, two trunks
    fix = "lower --n-pi, --num-envs or --micro-batch-size"
    assert message == f"error: B {32 * steps * per_step / 2**30:.1f} GiB, {chunk}: over 0.5 GiB free: {fix}"
