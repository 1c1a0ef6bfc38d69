"""Unit tests of the pieces each script trains with: losses, GAE, init, reward normaliser,
chunked gradients, gradient isolation between the phases, the pi_old snapshot, the KL guard."""

import dataclasses
import math

import numpy as np
import pytest
import torch

from conftest import aux_buffers, load_script, random_batch, random_obs

A = 6  # actions of the test agents


def small_args(module, **overrides):
    base = dict(
        num_envs=2,
        num_steps=8,
        num_minibatches=2,
        n_pi=2,
        aux_mb_trajectories=2,
        e_aux=2,
        micro_batch_size=0,
        total_timesteps=10_000,
    )
    base.update(overrides)
    return module.Args(**base)


def make_agent(module, arch, seed=0):
    torch.manual_seed(seed)
    return module.PPGAgent(module.Args(arch=arch), module.OBS_SHAPE, A)


def test_seed_worked_example(script):
    """ppg-seed.txt: logits [1,0] -> [1.1,-0.1], V_aux 2.50 vs target 3.50, through aux_phase_loss itself."""
    old = torch.tensor([[1.0, 0.0]])
    new = torch.tensor([[1.1, -0.1]])
    out = script.AgentOutput(logits=new, value=torch.tensor([3.5]), aux_value=torch.tensor([2.5]))
    loss, stats = script.aux_phase_loss(out, dict(returns=torch.tensor([3.5]), pi_old_logits=old), script.Args())
    joint, l_aux, l_clone = stats["joint_loss"], stats["aux_value_loss"], stats["clone_kl"]
    assert float(loss) == float(joint) and float(stats["value_loss"]) == 0.0  # V = V_hat: L_value is 0
    assert round(float(l_aux), 4) == 0.5000
    assert round(float(l_clone), 4) == 0.0038
    assert round(float(joint), 4) == 0.5038
    # KL(old || new), not KL(new || old): to 4 decimals 0.0038 against 0.0037, and exactly the formula's value
    p, q = torch.softmax(old, -1)[0].double(), torch.softmax(new, -1)[0].double()
    assert float(l_clone) == pytest.approx(float((p * (p / q).log()).sum()), abs=1e-7)
    assert round(float(script.kl_divergence(new, old)), 4) == 0.0037  # KL(p || q)


def test_gae_with_episode_boundary(script):
    rewards = torch.tensor([[1.0, 2.0, 3.0]])
    values = torch.tensor([[0.5, 1.0, 1.5]])
    ended = torch.tensor([[False, True, False]])  # step 1 ended its episode: no bootstrap, no carry
    adv, ret = script.compute_gae(rewards, values, ended, torch.tensor([2.0]), gamma=0.9, lam=0.8)
    # t=2: 3 + 0.9*2.0 - 1.5 = 3.3;  t=1: 2 - 1.0 = 1.0;  t=0: 1 + 0.9*1.0 - 0.5 + 0.9*0.8*1.0 = 2.12
    assert torch.allclose(adv, torch.tensor([[2.12, 1.0, 3.3]]))
    assert torch.allclose(ret, torch.tensor([[2.62, 2.0, 4.8]]))


def test_ppo_clipped_loss(script):
    logits = torch.zeros(2, 2)  # pi(a=0) = 0.5 in both states
    actions = torch.tensor([0, 0])
    old_logprobs = torch.log(torch.tensor([0.5 / 1.5, 0.5 / 0.5]))  # ratios 1.5 and 0.5
    advantages = torch.tensor([1.0, -1.0])
    out = script.AgentOutput(logits=logits, value=None, aux_value=None)
    mb = dict(actions=actions, logprobs=old_logprobs, advantages=advantages)
    loss, stats = script.policy_phase_loss(out, mb, script.Args(clip_coef=0.2, ent_coef=0.01), value=False)
    entropy, approx_kl, clipfrac = stats["entropy"], stats["approx_kl"], stats["clipfrac"]
    # state 0: min(1.5, 1.2) * 1 = 1.2 -> -1.2;  state 1: max(0.5, 0.8) * 1 -> 0.8
    assert float(stats["policy_loss"]) == pytest.approx((-1.2 + 0.8) / 2)
    assert float(loss) == pytest.approx((-1.2 + 0.8) / 2 - 0.01 * math.log(2)) and "value_loss" not in stats
    assert float(entropy) == pytest.approx(math.log(2))
    assert float(clipfrac) == 1.0
    k3 = ((1.5 - 1) - math.log(1.5) + (0.5 - 1) - math.log(0.5)) / 2
    assert float(approx_kl) == pytest.approx(k3)


@pytest.mark.parametrize("arch", ["dual", "detach"])
def test_normed_init_norms(arch):
    """Procgen's IMPALA trunk (ppg_atari.py's orthogonal init is tested in test_atari.py)."""
    script = load_script("ppg_procgen.py")
    agent = make_agent(script, arch)

    def row_norms(layer):
        return layer.weight.detach().flatten(1).norm(dim=1)

    convs = [m for m in agent.pi_trunk.modules() if isinstance(m, torch.nn.Conv2d)]
    residual = {
        id(c)
        for block in agent.pi_trunk.modules()
        if isinstance(block, script.ResidualBlock)
        for c in block.modules()
        if isinstance(c, torch.nn.Conv2d)
    }
    assert len(convs) == 15 and len(residual) == 12  # 3 stacks x (1 conv + 2 blocks x 2 convs)
    res_scale = math.sqrt(1 / math.sqrt(3) / math.sqrt(2))
    for layer in convs:
        expected = res_scale if id(layer) in residual else 1.0
        assert torch.allclose(row_norms(layer), torch.full((layer.out_channels,), expected), atol=1e-5), layer
        assert torch.count_nonzero(layer.bias) == 0
    dense = [m for m in agent.pi_trunk.modules() if isinstance(m, torch.nn.Linear)]
    for layer in dense:
        assert torch.allclose(row_norms(layer), torch.tensor(1.4), atol=1e-5)
    for head in [agent.pi_head, agent.aux_value_head, agent.value_head]:
        assert torch.allclose(row_norms(head), torch.tensor(0.1), atol=1e-6)
        assert torch.count_nonzero(head.bias) == 0


def test_reward_normalizer(script):
    rng = np.random.default_rng(0)
    norm = script.RewardNormalizer(num_envs=3, gamma=0.9)
    ret, seen, out = np.zeros(3), [], None
    for rollout in range(25):  # rollouts of 20 steps, as main() hands them over
        r = rng.normal(1.0, 2.0, size=(3, 20)).astype(np.float32)
        d = rng.random((3, 20)) < 0.05
        out = norm(r, d)
        for t in range(20):
            ret = ret * 0.9 + r[:, t]
            seen.append(ret.copy())
            ret[d[:, t]] = 0.0
    # its variance is the variance of every discounted return seen (no mean subtraction of rewards)
    assert norm.var == pytest.approx(np.var(np.concatenate(seen)), rel=1e-3)
    assert np.allclose(out, np.clip(r / np.sqrt(norm.var + 1e-8), -10, 10), atol=1e-6)
    assert out.dtype == np.float32 and out.shape == (3, 20)
    huge = norm(np.full((3, 2), 1e6, dtype=np.float32), np.zeros((3, 2), dtype=bool))
    assert np.all(huge == 10.0)


def test_reward_normalizer_scales_a_rollout_by_statistics_that_include_it(script):
    """The released code's order: the whole rollout's returns update the variance, then the whole
    rollout is scaled by it, its first step too (a per-step update would scale the first rewards
    by the prior variance of 1 alone)."""
    norm = script.RewardNormalizer(num_envs=1, gamma=0.0)  # gamma 0: each return is its reward
    rewards = np.array([[2.0, 4.0, 6.0, 8.0]], dtype=np.float32)
    out = norm(rewards, np.zeros((1, 4), dtype=bool))
    # returns 2, 4, 6, 8 (mean 5, variance 5) merged with the prior (mean 0, variance 1, count 1e-4)
    count = 1e-4 + 4
    var = (1.0 * 1e-4 + 5.0 * 4 + 25 * 1e-4 * 4 / count) / count
    assert norm.var == pytest.approx(var)
    # so the first step is scaled by about 1/sqrt(5), not clipped at 10 as a per-step update would
    # (after one return of 2 against a prior of count 1e-4, the variance is about 5e-4)
    assert np.allclose(out, rewards / np.sqrt(var + 1e-8)) and out[0, 0] == pytest.approx(0.894, abs=1e-3)


def test_the_plan_line_gives_every_derived_count(script, tmp_path, monkeypatch, capsys):
    """Defaults aside, every count printed: phases, rollouts, env steps (rounded up to whole rollouts), minibatch
    sizes, aux phases, B's size; --micro-batch-size None resolves to 256 states on a CPU."""

    class Planned(Exception):
        pass

    env_class = "ProcgenVecEnv" if script.SCRIPT == "ppg_procgen.py" else "AtariVecEnv"
    monkeypatch.setattr(script, env_class, lambda *a, **k: (_ for _ in ()).throw(Planned()))
    from conftest import main_in_process

    flags = ["--num-envs", "4", "--num-steps", "8", "--n-pi", "3", "--total-timesteps", "300", "--precision", "tf32"]
    with pytest.raises(Planned):
        main_in_process(script, [*flags, "--num-minibatches", "2", "--aux-mb-trajectories", "2"], tmp_path, monkeypatch)
    out = capsys.readouterr().out
    assert "phases: 4 of N_pi=3 rollouts; rollouts: 10 of 4 envs x 8 steps = 320 env steps; aux phases: 3\n" in out
    assert "PPO minibatch 16 states, aux minibatch 16; chunks of 256 states" in out
    assert "precision tf32\n" in out
    fields = script.buffer_fields(script.NUM_ACTIONS).values()  # B: N_pi x num_envs trajectories of 8 steps
    buffer_bytes = 3 * 4 * 8 * sum(math.prod(shape) * dtype.itemsize for shape, dtype in fields)
    assert f"B {buffer_bytes / 2**30:.2f} GiB (uint8 frames)" in out


@pytest.mark.parametrize("arch", ["dual", "shared"])
def test_bf16_gradients_point_the_same_way(script, arch):
    """One minibatch's policy-phase and aux losses: bf16 autocast of the trunks changes the gradient
    by rounding only. Weights and gradients stay fp32."""
    grads = {}
    for bf16 in (False, True):
        agent = make_agent(script, arch)
        agent.bf16 = bf16
        batch = random_batch(script, 64, A)
        out = agent(batch["obs"])
        assert out.logits.dtype == out.value.dtype == out.aux_value.dtype == torch.float32
        policy_loss, _ = script.policy_phase_loss(out, batch, script.Args())
        old = dict(batch, pi_old_logits=out.logits.detach() + 0.3 * torch.randn_like(out.logits))
        aux_loss, _ = script.aux_phase_loss(out, old, script.Args())
        (policy_loss + aux_loss).backward()
        assert all(p.grad.dtype == torch.float32 for p in agent.parameters() if p.grad is not None)
        grads[bf16] = torch.cat([p.grad.flatten() for p in agent.parameters() if p.grad is not None])
    cosine = torch.nn.functional.cosine_similarity(grads[False], grads[True], dim=0)
    assert cosine >= 0.99, float(cosine)
    assert not torch.equal(grads[False], grads[True])  # bf16 did run: its rounding changed the gradient


@pytest.mark.parametrize("arch", ["dual", "detach", "shared"])
def test_chunked_gradients_equal_whole_minibatch(script, arch):
    """--micro-batch-size changes peak memory, not the update: both phases move every parameter
    by the same amount with chunks of 3 states as with whole minibatches."""
    results = []
    for micro in (0, 3):
        agent = make_agent(script, arch)
        start = [p.detach().clone() for p in agent.parameters()]
        args = small_args(script, micro_batch_size=micro)
        pol_opt = torch.optim.SGD(agent.parameters(), lr=1e-3)
        aux_opt = torch.optim.SGD(agent.parameters(), lr=1e-3)
        torch.manual_seed(123)
        stats = script.policy_phase_update(agent, pol_opt, random_batch(script, 16, A), args, chunk_size=micro)
        obs_buf = random_obs(script, 4 * 8).view(4, 8, *script.OBS_SHAPE)
        buffers = aux_buffers(script, obs_buf, torch.randn(4, 8))
        aux = script.auxiliary_phase(agent, aux_opt, buffers, args, chunk_size=micro)
        results.append(([p.detach() - s for p, s in zip(agent.parameters(), start)], stats, aux))
    (d0, s0, e0), (d1, s1, e1) = results
    assert all(bool(torch.count_nonzero(d)) for d in d0)  # every parameter was trained
    for a, b in zip(d0, d1):
        assert torch.allclose(a, b, rtol=1e-3, atol=5e-8)  # float32 rounding of p + lr*g, not of g
    assert s0 == pytest.approx(s1, rel=1e-4, abs=1e-7)
    for a, b in zip(e0, e1):
        assert a == pytest.approx(b, rel=1e-4, abs=1e-7)


@pytest.mark.parametrize("arch", ["dual", "detach", "shared"])
def test_policy_phase_aux_head_gets_no_gradient(script, arch):
    agent = make_agent(script, arch)
    args = small_args(script)
    opt = torch.optim.Adam(agent.parameters(), lr=1e-3)
    before = [p.clone() for p in [*agent.aux_value_head.parameters(), *agent.pi_head.parameters()]]
    reached = []  # a hook on each head parameter records every gradient that reaches it
    for p in [*agent.aux_value_head.parameters(), *agent.pi_head.parameters()]:
        p.register_hook(lambda g, p=p: reached.append(p))
    script.policy_phase_update(agent, opt, random_batch(script, 16, A), args)
    assert not any(p is q for p in reached for q in agent.aux_value_head.parameters())
    assert all(torch.equal(b, p) for b, p in zip(before[:2], agent.aux_value_head.parameters()))
    assert all(any(p is q for q in reached) for p in agent.pi_head.parameters())  # while the policy did train
    assert not any(torch.equal(b, p) for b, p in zip(before[2:], agent.pi_head.parameters()))
    assert all(p.grad is None for p in agent.parameters())  # no gradient is left over for the next step or phase


@pytest.mark.parametrize("arch", ["dual", "detach", "shared"])
@pytest.mark.parametrize("e_pi, e_v", [(1, 2), (2, 1)])
def test_policy_phase_runs_value_epochs_first_when_e_pi_differs_from_e_v(script, arch, e_pi, e_v):
    """The released code's order (ppo.learn, opt_keys): with E_pi != E_V, E_V epochs of the value loss alone, stepped
    by an Adam of their own, then E_pi epochs of the PPO loss alone, stepped by the policy phase's Adam. Each step's
    gradient: the value loss never reaches theta_pi's trunk unless it is shared; the PPO loss never reaches theta_V."""
    agent = make_agent(script, arch)
    args = small_args(script, e_pi=e_pi, e_v=e_v)  # 2 minibatches an epoch
    policy_opt, value_opt = (torch.optim.Adam(agent.parameters(), lr=1e-3) for _ in range(2))
    steps, current = [], set()
    for p in agent.parameters():
        p.register_hook(lambda g, p=p: current.add(id(p)) if torch.count_nonzero(g) else None)
    for name, opt in (("policy", policy_opt), ("value", value_opt)):
        opt.step = lambda *a, name=name, step=opt.step: (steps.append((name, set(current))), current.clear(), step())
    batch = random_batch(script, 16, A)
    script.policy_phase_update(agent, policy_opt, batch, args, value_opt)
    assert [name for name, _ in steps] == ["value"] * 2 * e_v + ["policy"] * 2 * e_pi
    value, trunk = {id(p) for p in agent.value_parameters()}, {id(p) for p in agent.pi_trunk.parameters()}
    for name, reached in steps:
        if name == "value":
            assert value <= reached and (reached & trunk if arch == "shared" else not reached - value)
        else:
            assert not reached & value and {id(p) for p in agent.pi_head.parameters()} <= reached


@pytest.mark.parametrize("arch", ["dual", "detach"])
def test_aux_phase_each_loss_touches_only_its_network(script, arch):
    agent = make_agent(script, arch)
    obs = random_obs(script, 6)
    targets = torch.randn(6)
    old = torch.randn(6, A)
    _, stats = script.aux_phase_loss(agent(obs), dict(returns=targets, pi_old_logits=old), script.Args())
    joint, l_value = stats["joint_loss"], stats["value_loss"]
    pi_params, v_params = agent.policy_parameters(), agent.value_parameters()
    g_joint = torch.autograd.grad(joint, pi_params + v_params, retain_graph=True, allow_unused=True)
    g_value = torch.autograd.grad(l_value, pi_params + v_params, allow_unused=True)
    n_pi = len(pi_params)
    assert all(g is not None for g in g_joint[:n_pi]) and all(g is None for g in g_joint[n_pi:])
    assert all(g is None for g in g_value[:n_pi]) and all(g is not None for g in g_value[n_pi:])


@pytest.mark.parametrize("arch", ["dual", "detach"])
@pytest.mark.parametrize("frozen", ["value", "policy"])
def test_aux_phase_real_update_touches_each_network_only_through_its_loss(script, arch, frozen):
    """auxiliary_phase itself, one SGD step (one epoch of one minibatch): with targets equal to the
    value network's predictions, L_value is 0 and the value network must not move while the policy
    network trains; with targets equal to the aux head's predictions and beta_clone 0, L_joint is 0
    and the policy network must not move while the value network trains."""
    agent = make_agent(script, arch)
    obs_buf = random_obs(script, 4 * 8).view(4, 8, *script.OBS_SHAPE)
    with torch.no_grad():
        out = agent(obs_buf.flatten(0, 1))
    targets = (out.value if frozen == "value" else out.aux_value).view(4, 8).clone()
    args = small_args(script, e_aux=1, aux_mb_trajectories=4, beta_clone=0.0 if frozen == "policy" else 1.0)
    still = agent.value_parameters() if frozen == "value" else agent.policy_parameters()
    moving = agent.policy_parameters() if frozen == "value" else agent.value_parameters()
    before_still = [p.detach().clone() for p in still]
    before_moving = [p.detach().clone() for p in moving]
    script.auxiliary_phase(
        agent, torch.optim.SGD(agent.parameters(), lr=1.0), aux_buffers(script, obs_buf, targets), args
    )
    assert all(torch.allclose(b, p, atol=1e-6) for b, p in zip(before_still, still))
    trained = [not torch.allclose(b, p, atol=1e-6) for b, p in zip(before_moving, moving)]
    assert sum(trained) >= len(moving) // 2  # (the policy head only moves once the KL is non-zero)


@pytest.mark.parametrize("arch", ["dual", "detach", "shared"])
@pytest.mark.parametrize("bf16", [False, True])
def test_snapshot_is_taken_once_at_the_start_of_the_aux_phase(script, arch, bf16):
    """pi_old is the policy as it stands when the aux phase starts, so the first minibatch's clone KL
    is zero (exactly, in bf16: the snapshot and the update share the same computation); it is not
    retaken afterwards, so once the policy has moved the KL is positive."""
    agent = make_agent(script, arch)
    agent.bf16 = bf16
    obs_buf = random_obs(script, 4 * 8).view(4, 8, *script.OBS_SHAPE)
    targets = torch.randn(4, 8) * 5
    # one minibatch per epoch: epoch 1's mean KL is the first minibatch's; epoch 2 follows one update
    args = small_args(script, e_aux=2, aux_mb_trajectories=4, aux_kl_stop=0.0)
    buffers = aux_buffers(script, obs_buf, targets)
    aux = script.auxiliary_phase(agent, torch.optim.Adam(agent.parameters(), lr=1e-2), buffers, args)
    assert aux[0]["clone_kl"] == pytest.approx(0.0, abs=0.0 if bf16 else 1e-6)
    assert aux[1]["clone_kl"] > 1e-5
    # a snapshot alone (E_aux 0), taken now in chunks of 5 states: the policy as it is after the updates
    script.auxiliary_phase(agent, None, buffers, dataclasses.replace(args, e_aux=0), chunk_size=5)
    old = buffers["pi_old_logits"]
    assert old.shape == (4, 8, A)
    with torch.no_grad():
        # the policy's logits as it is now (not log-probabilities), up to fp32 kernels' batch-size effects
        assert torch.allclose(old, agent(obs_buf.flatten(0, 1), value=False).logits.view(4, 8, A), atol=1e-6)


def test_kl_guard_stops_aux_phase(script, capsys):
    agent = make_agent(script, "dual")
    obs_buf = random_obs(script, 4 * 8).view(4, 8, *script.OBS_SHAPE)
    targets = torch.randn(4, 8) * 5
    guarded = script.auxiliary_phase(
        agent,
        torch.optim.Adam(agent.parameters(), lr=1e-2),
        aux_buffers(script, obs_buf, targets),
        small_args(script, e_aux=3, aux_kl_stop=1e-9),
    )
    assert len(guarded) == 1 and guarded[0]["clone_kl"] > 1e-9
    out = capsys.readouterr().out
    assert "aux epoch 1/3" in out and "> --aux-kl-stop: the aux phase stops" in out and "aux epoch 2/3" not in out
    agent = make_agent(script, "dual")
    unguarded = script.auxiliary_phase(
        agent,
        torch.optim.Adam(agent.parameters(), lr=1e-2),
        aux_buffers(script, obs_buf, targets),
        small_args(script, e_aux=3, aux_kl_stop=0.0),
    )
    assert len(unguarded) == 3
    # crossing the threshold in the last epoch skips nothing, so it is not reported as a stop
    agent = make_agent(script, "dual")
    last = script.auxiliary_phase(
        agent,
        torch.optim.Adam(agent.parameters(), lr=1e-2),
        aux_buffers(script, obs_buf, targets),
        small_args(script, e_aux=1, aux_kl_stop=1e-9),
    )
    assert len(last) == 1 and "KL guard" not in capsys.readouterr().out


def test_plan_counts_and_rounding(script):
    args = small_args(script, num_envs=4, num_steps=8, n_pi=3, total_timesteps=300)  # 32-step rollouts
    plan = script.make_plan(args)
    assert plan["num_iterations"] == 10 and plan["num_phases"] == 4  # rounded up, never down: 3 + 3 + 3 + 1
    assert plan["aux_phases"] == 3  # none after the 10th (last) rollout
    assert plan["trajectories"] == 3 * 4  # B holds N_pi rollouts of whole trajectories
    no_aux = script.make_plan(small_args(script, e_aux=0))
    assert no_aux["aux_phases"] == 0 and no_aux["trajectories"] == 2  # B is one rollout's buffer
    # a resumed run (make_plan's start step and phase): its phases are counted on from its checkpoint
    resumed = script.make_plan(args, start_step=7 * 32, start_phase=3)  # 7 rollouts done in 3 phases, 3 left
    assert resumed["num_phases"] == 4 and resumed["aux_phases"] == 0 and resumed["trajectories"] == 4


@pytest.mark.parametrize("e_pi, e_v", [(1, 1), (1, 2)])
def test_policy_minibatches_skip_what_their_losses_do_not_read(script, e_pi, e_v):
    """Wasted work the policy phase avoids: its minibatches never gather pi_old (the aux phase's alone: a pi_old of
    the wrong length fails the indexing if gathered), and with `dual` and E_pi != E_V each single-loss epoch runs
    only its own network (the value epochs skip the policy trunk, the policy epochs the value trunk)."""
    agent = make_agent(script, "dual")
    args = small_args(script, e_pi=e_pi, e_v=e_v)  # 2 minibatches an epoch
    passes = {"pi": 0, "v": 0}
    agent.pi_trunk.register_forward_hook(lambda *a: passes.__setitem__("pi", passes["pi"] + 1))
    agent.v_trunk.register_forward_hook(lambda *a: passes.__setitem__("v", passes["v"] + 1))
    batch = dict(random_batch(script, 16, A), pi_old_logits=torch.zeros(1, A))  # 1 row, not 16: never indexed
    opts = [torch.optim.Adam(agent.parameters(), lr=1e-3) for _ in range(2)]
    script.policy_phase_update(agent, opts[0], batch, args, opts[1])
    if e_pi == e_v:  # one backward carries both losses: each minibatch runs both networks
        assert passes == {"pi": 2 * e_pi, "v": 2 * e_pi}
    else:
        assert passes == {"pi": 2 * e_pi, "v": 2 * e_v}
