"""Differential tests against the authors' released code (github.com/openai/phasic-policy-gradient, MIT), imported
from its own folder: $PPG_RELEASED_CODE, else ../shared/reference/phasic-policy-gradient; without either, every test
here skips. Same weights, same batches, same hyperparameters on both sides; each comparison states its tolerance.

  - Procgen's network against the released PhasicValueModel (weights copied through a parameter map, loaded
    strictly): forward outputs and the "normed" initialisation, for each arch.
  - The losses on the same network outputs (leaf tensors): released ppo.compute_losses and ppg.aux_train against our
    policy_phase_loss and aux_phase_loss, values and gradients, for both scripts.
  - One step of each phase through the network: our policy_phase_update and auxiliary_phase against the released
    loop body and aux_train, gradients and parameters after the step, for each arch of both scripts. Atari's Nature
    CNN is not in the released code: there the released PhasicValueModel (heads, arch wiring) is built around our
    trunk class and takes our weights (released_shims.released_model(trunk=...)).
  - GAE, value targets, advantage normalisation and the reward normaliser over three
    consecutive rollouts, for both scripts.

Declared deviations, not compared (each named where it applies):
  - approx_kl: we log the k3 estimator mean((r - 1) - log r); the released code logs 0.5 * mean(log(r)^2);
  - PPO minibatches: ours are shuffled states, the released code's whole trajectories; with one minibatch (as here)
    both are the whole rollout;
  - E_pi != E_V is not compared here: both codes then run the E_V value epochs first with an Adam of their own, then
    the E_pi policy epochs (tests/test_pieces.py checks that order); with E_pi = E_V (the paper's 1 and 1, and here)
    both take one backward of the summed losses and one Adam.

Run with -rP to see each comparison's worst measured difference next to its tolerance."""

import inspect
import math
import types

import pytest
import torch
import torch.nn.functional as F

import released_shims as rs
from conftest import aux_buffers, load_script  # and its `script` fixture: each training script

RELEASED_ROOT, WHY_NOT = rs.released_root()
pytestmark = pytest.mark.skipif(RELEASED_ROOT is None, reason=WHY_NOT or "no released code")

ARCHS = ["dual", "detach", "shared"]
N_TRAJ, N_STEPS = 2, 4  # a network-level rollout: 8 states, 2 trajectories of 4 steps

# Tolerances: float32 rounding, as a fraction of the tensor's own largest element (released_shims.relative_error).
# The two sides compute the same float32 values by different operations or orders (log_softmax against
# Categorical's logits - logsumexp, means over (B, T) against B, gamma * lambda * mask grouped differently, ...).
TOL_FORWARD = 1e-6  # log pi, V, V_aux; pi_old
TOL_LOSS = 1e-6  # every loss and logged statistic (see worst_loss), the losses' gradients with respect to the outputs
# Parameter gradients: the outputs' ~1e-7 rounding differences, summed over states and conv positions with
# cancellation, measure up to ~6e-6 of a tensor's largest element in the first layers of the policy trunk, 15 convs
# from the loss (a real difference is of the order of the gradient itself)
TOL_GRAD = 1e-5
TOL_INIT = 1e-6  # per-unit weight norms of the normed initialisation
TOL_TARGETS = 1e-6  # GAE's recursion; our float64 normaliser and moments against the released float32 ones

# The policy-phase losses: L_clip (the default), the paper's L_KL (no clipping: the plain surrogate plus
# kl_penalty * 0.5 mean(log ratio^2), as the released compute_losses), and both at once
POLICY_LOSSES = {
    "clip": dict(clip_coef=0.2, kl_penalty=0.0),
    "kl": dict(clip_coef=0.0, kl_penalty=1.0),
    "clip_kl": dict(clip_coef=0.2, kl_penalty=1.0),
}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread for this module: its batches are a few states, and on a busy 2-core machine a second
    thread mostly waits for the other core (10x slower measured). The suite's setting is put back afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def rel():
    return rs.load_released(RELEASED_ROOT)


@pytest.fixture(autouse=True)
def released_logger(rel):
    rs.fresh_logger(rel)  # each test reads the values the released code logs in it alone


def is_procgen(script) -> bool:
    return script.__name__ == "ppg_procgen"


def check(label: str, measured: float, tolerance: float) -> None:
    print(f"{label}: worst {measured:.3g} (tolerance {tolerance:g})")
    assert measured <= tolerance, f"{label}: {measured:.3g} > {tolerance:g}"


def released_defaults(rel) -> dict:
    """The released hyperparameters: its train_fn's defaults over its ppo.learn's (train_fn passes its own)."""
    learn = {k: p.default for k, p in inspect.signature(rel.ppo.learn).parameters.items()}
    train = {k: p.default for k, p in inspect.signature(rel.train.train_fn).parameters.items()}
    rnorm = {k: p.default for k, p in inspect.signature(rel.reward_normalizer.RewardNormalizer).parameters.items()}
    return dict(learn, **train, reward_norm_gamma=rnorm["gamma"], reward_clip=rnorm["cliprew"])


def make_args(script, n: int = N_TRAJ, t: int = N_STEPS, **overrides):
    """One rollout of n x t states in one PPO minibatch and one aux minibatch, E_pi = E_V = 1, one aux epoch."""
    base = dict(
        num_envs=n,
        num_steps=t,
        num_minibatches=1,
        micro_batch_size=0,
        e_pi=1,
        e_v=1,
        n_pi=1,
        e_aux=1,
        aux_mb_trajectories=n,
        total_timesteps=n * t,
        precision="fp32",
        max_grad_norm=0.0,
    )
    return script.Args(**dict(base, **overrides))


def make_data(script, n: int = N_TRAJ, t: int = N_STEPS, seed: int = 1) -> types.SimpleNamespace:
    """(n, t) arrays of a rollout: frames, actions, rollout log-probabilities near a uniform policy's (the agents
    start near uniform) by noise, so ratios spread around 1 and some are clipped; advantages; returns; pi_old."""
    g = torch.Generator().manual_seed(seed)
    a, noise = script.NUM_ACTIONS, 0.3 * torch.randn(n, t, generator=g)
    return types.SimpleNamespace(
        obs=torch.randint(0, 256, (n, t, *script.OBS_SHAPE), dtype=torch.uint8, generator=g),
        first=torch.zeros(n, t, dtype=torch.bool),  # unused by the released stateless encoders
        actions=torch.randint(0, a, (n, t), generator=g),
        logprobs=-math.log(a) + noise,
        noise=noise,
        advantages=torch.randn(n, t, generator=g),
        returns=2 * torch.randn(n, t, generator=g) + 0.5,
        pi_old=torch.randn(n, t, a, generator=g),
    )


def flat_batch(d) -> dict:
    """The batch as policy_phase_update takes it: the rollout's states flattened."""
    return {k: getattr(d, k).flatten(0, 1) for k in ("obs", "actions", "logprobs", "advantages", "returns")}


def released_policy_losses(rel, model, d, args):
    return rel.ppo.compute_losses(
        model,
        ob=d.obs,
        ac=d.actions,
        first=d.first,
        logp=d.logprobs,
        vtarg=d.returns,
        adv=d.advantages,
        state_in=model.initial_state(d.actions.shape[0]),
        clip_param=args.clip_coef,
        vfcoef=released_defaults(rel)["vfcoef"],  # 0.5 * MSE: ours has it built in
        entcoef=args.ent_coef,
        kl_penalty=args.kl_penalty,
    )


def released_aux_segs(model, d, oldpd=None) -> list:
    seg = dict(ob=d.obs, first=d.first, state_in=model.initial_state(d.actions.shape[0]), vtarg=d.returns)
    return [seg if oldpd is None else dict(seg, oldpd=oldpd)]


def released_name2coef(rel, args) -> dict:
    return {"pol_distance": args.beta_clone, "vf_true": released_defaults(rel)["vf_true_weight"]}


def released_aux_losses(rel) -> dict:
    logged = rel.logger.Logger.CURRENT.name2val
    return {k: logged[f"unscaled/{k}"] for k in ("pol_distance", "vf_aux", "vf_true")}


def worst_of(pairs: dict, floor: float = 0.0) -> float:
    """The worst relative_error of (ours, theirs) pairs."""
    pairs = [(torch.as_tensor(a).detach(), torch.as_tensor(b).detach()) for a, b in pairs.values()]
    return max(rs.relative_error(a, b, floor) for a, b in pairs)


def worst_loss(pairs: dict) -> float:
    """Losses and statistics are means of unit-scale terms (advantage x ratio, log-probabilities, squared errors of
    unit-scale targets): their rounding is that of the terms, so a mean that cancels to near 0 (the surrogate of
    mixed-sign advantages: -0.07 from terms of about 1, measured 8e-7 off on its own scale) is compared on a scale
    of at least 1."""
    return worst_of(pairs, floor=1.0)


# ==== The network (Procgen's IMPALA CNN against the released model) ==================================================
def fast_orthogonal_(tensor, gain=1.0):
    """A stand-in for Atari's orthogonal init while the tests build its networks (the QR of its 512 x 3136 dense
    layer takes seconds here): rows of about the same norm. A comparison of the same weights on both sides needs no
    particular weights; the normed init, which the released code has, is compared in test_normed_init."""
    return torch.nn.init.normal_(tensor, std=gain / math.sqrt(tensor[0].numel()))


def make_pair(script, rel, arch: str):
    """(our agent, the released PhasicValueModel with the same weights, our parameter name -> the released
    model's). Procgen: the released model as its train.py builds it. Atari: the released model around our Nature
    CNN trunks (the released code has none): its heads, arch wiring, losses and loops."""
    procgen = is_procgen(script)
    with pytest.MonkeyPatch.context() as patch:
        if not procgen:
            patch.setattr(torch.nn.init, "orthogonal_", fast_orthogonal_)
        torch.manual_seed(0)
        agent = script.PPGAgent(script.Args(arch=arch), script.OBS_SHAPE, script.NUM_ACTIONS)
        trunk = None if procgen else type(agent.pi_trunk)
        model = rs.released_model(rel, arch, script.OBS_SHAPE, script.NUM_ACTIONS, trunk)
    names = rs.parameter_map(agent, impala=procgen)
    rs.copy_weights(agent, model, names)  # strict: every released parameter gets one of ours
    return agent, model, names


@pytest.mark.parametrize("arch", ARCHS)
def test_forward(rel, arch):
    """logits, V and V_aux of the released PhasicValueModel and ours on the same uint8 frames and weights."""
    script = load_script("ppg_procgen.py")
    agent, model, _ = make_pair(script, rel, arch)
    d = make_data(script)
    with torch.no_grad():
        out = agent(d.obs.flatten(0, 1))
        pd, vpred, aux, _ = model(d.obs, d.first, model.initial_state(N_TRAJ))
    # The released Categorical keeps normalised logits: log-probabilities (a shift of all logits is the same policy)
    log_pi = F.log_softmax(out.logits, -1)
    check(f"{arch} forward log pi", rs.relative_error(log_pi, pd.logits.flatten(0, 1)), TOL_FORWARD)
    check(f"{arch} forward V", rs.relative_error(out.value, vpred.flatten()), TOL_FORWARD)
    check(f"{arch} forward V_aux", rs.relative_error(out.aux_value, aux["vpredaux"].flatten()), TOL_FORWARD)


@pytest.mark.parametrize("arch", ARCHS)
def test_normed_init(rel, arch):
    """Freshly built models (other seeds): every layer's per-output-unit weight norms, as the released code sets
    them, equal ours for the layer of the same role; every bias is zero on both sides."""
    script = load_script("ppg_procgen.py")
    torch.manual_seed(0)
    agent = script.PPGAgent(script.Args(arch=arch), script.OBS_SHAPE, script.NUM_ACTIONS)
    torch.manual_seed(1)
    model = rs.released_model(rel, arch, script.OBS_SHAPE, script.NUM_ACTIONS)
    layers = rs.layer_map(agent)
    assert len(layers) * 2 == len(dict(model.named_parameters())), "a released layer has no counterpart"
    worst = 0.0
    for ours, theirs in layers.items():
        a, b = agent.get_submodule(ours), model.get_submodule(theirs)
        assert a.weight.shape == b.weight.shape, ours
        norms_a, norms_b = a.weight.detach().flatten(1).norm(dim=1), b.weight.detach().flatten(1).norm(dim=1)
        worst = max(worst, rs.relative_error(norms_a, norms_b))
        assert not a.bias.any() and not b.bias.any(), ours
        assert not torch.equal(a.weight, b.weight), ours  # two draws: the norms are the init's, not a copy's
    check(f"{arch} per-unit weight norms", worst, TOL_INIT)


def test_defaults(rel):
    """Procgen's defaults are the released train.py's (the paper's settings). The comparisons pass our values to the
    released functions, so a default changed on our side alone shows here."""
    args, theirs = load_script("ppg_procgen.py").Args(), released_defaults(rel)
    pairs = dict(
        learning_rate=theirs["lr"],
        gamma=theirs["gamma"],
        gae_lambda=theirs["λ"],
        num_envs=theirs["num_envs"],
        num_steps=theirs["nstep"],
        num_minibatches=theirs["nminibatch"],
        clip_coef=theirs["clip_param"],
        ent_coef=theirs["entcoef"],
        e_pi=theirs["n_epoch_pi"],
        e_v=theirs["n_epoch_vf"],
        e_aux=theirs["n_aux_epochs"],
        n_pi=theirs["n_pi"],
        beta_clone=theirs["beta_clone"],
        aux_mb_trajectories=theirs["aux_mbsize"],
        reward_norm_gamma=theirs["reward_norm_gamma"],
        norm_reward=theirs["rnorm"],
        arch=theirs["arch"],
    )
    assert {k: getattr(args, k) for k in pairs} == pairs
    assert theirs["aux_lr"] == theirs["lr"] and theirs["vf_true_weight"] == 1.0 and theirs["kl_penalty"] == 0.0
    assert theirs["vfcoef"] == 0.5 and theirs["reward_clip"] == 10.0  # ours: 0.5 * MSE and clip 10, built in


# ==== The losses, on the same network outputs ========================================================================
class ReleasedHeads:
    """The released model interface with outputs that are leaf tensors (n, t, ...): the released losses' gradients
    with respect to the outputs themselves. Each frame is its trajectory's index, so a minibatch of trajectories
    gets its own rows."""

    def __init__(self, rel, logits, value, aux_value):
        self.rel = rel
        self.leaves = [x.detach().clone().requires_grad_() for x in (logits, value, aux_value)]

    def __call__(self, ob, first, state_in):
        logits, value, aux_value = (x[ob[:, 0]] for x in self.leaves)
        aux = dict(vpredaux=aux_value, vpredtrue=value)
        return torch.distributions.Categorical(logits=logits), value, aux, state_in

    def compute_aux_loss(self, aux, seg):
        return self.rel.ppg.PhasicValueModel.compute_aux_loss(self, aux, seg)

    def aux_keys(self):
        return ["vtarg"]

    def initial_state(self, batchsize):
        return torch.zeros(batchsize, 0)

    def parameters(self):
        return self.leaves


def head_outputs(script, n: int, t: int, seed: int):
    """Network outputs for a head-level comparison: logits, V, V_aux (n, t, ...), and our leaves of them."""
    g = torch.Generator().manual_seed(seed)
    outputs = [torch.randn(n, t, script.NUM_ACTIONS, generator=g), torch.randn(n, t, generator=g) * 2]
    outputs.append(torch.randn(n, t, generator=g) * 2)
    leaves = [x.clone().requires_grad_() for x in outputs]
    out = script.AgentOutput(leaves[0].flatten(0, 1), leaves[1].flatten(), leaves[2].flatten(), None)
    return outputs, leaves, out


def check_penalty_and_clipping(args, diags) -> None:
    """The batch exercises what the loss has, as the released compute_losses measures it (diags): a KL penalty of
    size, and (clipping on) some ratios clipped and some not; without clipping every ratio counts as clipped (the
    released clipfrac: |ratio - 1| > 0). Our values are compared with these afterwards."""
    if args.kl_penalty > 0:
        assert diags["pi_kl"] > 1e-3, "the log ratios should be far enough from 0 to be penalised"
    else:
        assert diags["pi_kl"] == 0
    if args.clip_coef > 0:
        assert 0 < diags["clipfrac"] < 1, "the batch should clip some ratios and not others"
    else:
        assert diags["clipfrac"] == 1


@pytest.mark.parametrize("objective", POLICY_LOSSES)
def test_policy_loss(rel, script, objective):
    """Released ppo.compute_losses (the surrogate, clipped or not, its KL penalty, entropy bonus, value loss) against
    our policy_phase_loss (epoch 0, E_pi = E_V = 1) on the same outputs, for L_clip, L_KL and both: every loss and
    statistic and the gradients with respect to logits and V. Declared deviation: approx_kl (k3 against
    0.5 * mean(log(r)^2)), each checked against its own formula."""
    n, t = 4, 8
    args, d = make_args(script, n, t, **POLICY_LOSSES[objective]), make_data(script, n, t)
    outputs, leaves, out = head_outputs(script, n, t, seed=5)
    # rollout log-probabilities near these outputs' (by make_data's noise), so some ratios are clipped and some not
    d.logprobs = F.log_softmax(outputs[0], -1).gather(-1, d.actions[..., None]).squeeze(-1) + d.noise
    d.obs = torch.arange(n)[:, None].expand(n, t)  # ReleasedHeads: each trajectory's index
    loss, stats = script.policy_phase_loss(out, flat_batch(d), args)
    loss.backward()
    heads = ReleasedHeads(rel, *outputs)
    losses, diags = released_policy_losses(rel, heads, d, args)
    (losses["pi"] + losses["vf"]).backward()
    check_penalty_and_clipping(args, diags)
    pairs = dict(
        loss=(loss, losses["pi"] + losses["vf"]),
        policy_loss=(stats["policy_loss"], diags["pg"]),
        kl_penalty=(stats["kl_penalty"], diags["pi_kl"]),
        entropy=(stats["entropy"], diags["entropy"]),
        value_loss=(stats["value_loss"], losses["vf"]),
        clipfrac=(stats["clipfrac"], diags["clipfrac"]),
    )
    check(f"{script.__name__} {objective} policy-phase losses", worst_loss(pairs), TOL_LOSS)
    # approx_kl, the declared deviation: each side's estimator of the same log-ratios
    logratio = F.log_softmax(outputs[0], -1).gather(-1, d.actions[..., None]).squeeze(-1) - d.logprobs
    assert rs.relative_error(stats["approx_kl"], (logratio.exp() - 1 - logratio).mean()) <= TOL_LOSS
    assert rs.relative_error(diags["approxkl"], 0.5 * logratio.square().mean()) <= TOL_LOSS
    assert leaves[2].grad is None and heads.leaves[2].grad is None  # V_aux: no policy-phase gradient
    pairs = dict(logits=(leaves[0].grad, heads.leaves[0].grad), value=(leaves[1].grad, heads.leaves[1].grad))
    check(f"{script.__name__} {objective} policy-phase loss gradients (logits, V)", worst_of(pairs), TOL_LOSS)


def test_aux_loss(rel, script):
    """The released aux_train's loss (beta_clone * KL(pi_old || pi) + its V_aux and V losses) against our
    aux_phase_loss on the same outputs, with pi_old away from pi (at pi = pi_old, as on the first minibatch of a
    phase, the clone term has no gradient): each loss and the gradients with respect to logits, V and V_aux."""
    n, t = 4, 8
    args, d = make_args(script, n, t), make_data(script, n, t)
    outputs, leaves, out = head_outputs(script, n, t, seed=6)
    mb = dict(returns=d.returns.flatten(), pi_old_logits=d.pi_old.flatten(0, 1))
    loss, stats = script.aux_phase_loss(out, mb, args)
    loss.backward()
    heads = ReleasedHeads(rel, *outputs)
    d.obs = torch.arange(n)[:, None].expand(n, t)
    segs = released_aux_segs(heads, d, torch.distributions.Categorical(logits=d.pi_old))
    theirs = rs.RecordingAdam(heads.parameters(), lr=args.learning_rate)
    rel.ppg.aux_train(model=heads, segs=segs, opt=theirs, mbsize=n, name2coef=released_name2coef(rel, args))
    logged = released_aux_losses(rel)
    assert stats["clone_kl"] > 0.1, "pi_old should be away from pi"
    pairs = dict(
        clone_kl=(stats["clone_kl"], logged["pol_distance"]),
        aux_value_loss=(stats["aux_value_loss"], logged["vf_aux"]),
        value_loss=(stats["value_loss"], logged["vf_true"]),
        loss=(loss, args.beta_clone * logged["pol_distance"] + logged["vf_aux"] + logged["vf_true"]),
    )
    check(f"{script.__name__} aux losses", worst_loss(pairs), TOL_LOSS)
    grads = theirs.grads[0]
    pairs = {k: (leaves[i].grad, grads[heads.leaves[i]]) for i, k in enumerate(("logits", "value", "aux_value"))}
    check(f"{script.__name__} aux loss gradients (logits, V, V_aux)", worst_of(pairs), TOL_LOSS)


# ==== One step of each phase, through the network ====================================================================
def compare_gradients(label, agent, model, names, ours: dict, theirs: dict, vanishing=()) -> None:
    """ours / theirs: {parameter: gradient}. The same parameters have a gradient (by the map), equal to TOL_GRAD of
    the tensor's largest element. `vanishing`: parameters whose exact gradient is 0 (the clone term's at pi = pi_old):
    both sides' float noise there must stay below 1e-6 of the largest gradient element of the whole model."""
    worst, scale = 0.0, max(g.abs().max().item() for g in theirs.values())
    for n, p in agent.named_parameters():
        q = model.get_parameter(names[n])
        assert (p in ours) == (q in theirs), f"{label}: {n} has a gradient on one side only"
        if n in vanishing:
            noise = max(ours[p].abs().max().item(), theirs[q].abs().max().item()) / scale
            check(f"{label} {n} (exact gradient 0) noise", noise, 1e-6)
        elif p in ours:
            worst = max(worst, rs.relative_error(ours[p], theirs[q]))
    check(f"{label} gradients", worst, TOL_GRAD)


def compare_adam_step(label, agent, model, names, before: dict, ours: dict, theirs: dict, lr: float, vanishing=()):
    """Parameters after one Adam step on each side's own gradient. Adam's first step is -lr * g / (|g| + eps) per
    element (about lr * sign(g)): it does not shrink a gradient's float noise, so an element whose two gradients
    differ by d may step differently by up to lr * d / (min |g| + eps) (2 lr at most, opposite signs). Allowed: that,
    from the gradients each side measured, plus 4 ulp of the parameter and 1e-6 of a step for rounding."""
    worst, noisy, eps = {True: 0.0, False: 0.0}, 0, 1e-8  # eps: both sides' Adam's
    for n, p in agent.named_parameters():
        q, p0 = model.get_parameter(names[n]), before[n].double()
        step_ours, step_theirs = p.detach().double() - p0, q.detach().double() - p0
        if p not in ours:  # no gradient on either side (compare_gradients): neither moves
            assert not step_ours.any() and not step_theirs.any(), f"{label}: {n} moved without a gradient"
            continue
        g, h = ours[p].double(), theirs[q].double()
        rounding = 2.0**-21 * (p0.abs() + lr) + 1e-6 * lr
        from_gradients = lr * ((g - h).abs() / (torch.minimum(g.abs(), h.abs()) + eps)).clamp(max=2.0)
        diff = (step_ours - step_theirs).abs()
        assert (diff <= rounding + from_gradients).all(), f"{label}: {n} steps apart by {diff.max().item():.3g}"
        if n not in vanishing:  # Adam steps a gradient of 0 + noise by a noise-driven fraction of lr, on both sides
            assert step_ours.abs().max() > 0.5 * lr, f"{label}: {n} did not take an Adam step"
        worst[n in vanishing] = max(worst[n in vanishing], diff.max().item())
        noisy += int((diff > rounding).sum())
    print(f"{label}: parameters after the step apart by at most {worst[False]:.3g} (lr {lr:g}), those with an exact")
    print(f"  gradient of 0 by {worst[True]:.3g}; {noisy} elements by more than rounding, each within its allowance")


# Every arch with L_clip; L_KL and L_clip with the penalty on the dual arch (the loss is the same for every arch)
@pytest.mark.parametrize("arch, objective", [(a, "clip") for a in ARCHS] + [("dual", "kl"), ("dual", "clip_kl")])
def test_policy_phase_update(rel, script, arch, objective):
    """One Adam step of our policy_phase_update (one minibatch: num_minibatches 1, micro_batch_size 0) against the
    released loop body on the same minibatch: zero_grad, backward of the summed pi and vf losses, step (with
    E_pi = E_V the released code's one optimizer), for L_clip, L_KL and both. The gradients as each step found them,
    the parameters after it, and the logged means. Declared deviations: PPO minibatches of shuffled states (here both
    the whole rollout); approx_kl (test_policy_loss)."""
    agent, model, names = make_pair(script, rel, arch)
    d, args = make_data(script), make_args(script, **POLICY_LOSSES[objective])
    before = {n: p.detach().clone() for n, p in agent.named_parameters()}
    ours = rs.RecordingAdam(agent.parameters(), lr=args.learning_rate, eps=1e-8)  # as main() builds it
    stats = script.policy_phase_update(agent, ours, flat_batch(d), args)
    theirs = rs.RecordingAdam(model.parameters(), lr=args.learning_rate)  # as the released ppo.learn builds it
    losses, diags = released_policy_losses(rel, model, d, args)
    theirs.zero_grad()
    (losses["pi"] + losses["vf"]).backward()
    theirs.step()
    assert len(ours.grads) == len(theirs.grads) == 1
    label = f"{script.__name__} {arch} {objective} policy-phase step"
    check_penalty_and_clipping(args, diags)
    pairs = dict(
        policy_loss=(stats["policy_loss"], diags["pg"]),
        kl_penalty=(stats["kl_penalty"], diags["pi_kl"]),
        entropy=(stats["entropy"], diags["entropy"]),
        value_loss=(stats["value_loss"], losses["vf"]),
        clipfrac=(stats["clipfrac"], diags["clipfrac"]),
    )
    check(f"{label} logged losses", worst_loss(pairs), TOL_LOSS)
    compare_gradients(label, agent, model, names, ours.grads[0], theirs.grads[0])
    compare_adam_step(label, agent, model, names, before, ours.grads[0], theirs.grads[0], args.learning_rate)


@pytest.mark.parametrize("arch", ARCHS)
def test_auxiliary_phase(rel, script, arch):
    """Our auxiliary_phase (snapshot pi_old, one epoch of one minibatch of all trajectories) against the released
    compute_presleep_outputs and one aux_train epoch (one minibatch) from the same weights: pi_old, the logged
    losses, the gradients as each step found them and the parameters after it. On this first minibatch pi = pi_old,
    so the clone term's gradient is exactly 0 (test_aux_loss compares it away from pi_old): the policy head gets
    float noise alone, on both sides."""
    agent, model, names = make_pair(script, rel, arch)
    d, args = make_data(script), make_args(script)
    before = {n: p.detach().clone() for n, p in agent.named_parameters()}
    buffers = aux_buffers(script, d.obs, d.returns, script.NUM_ACTIONS)
    ours = rs.RecordingAdam(agent.parameters(), lr=args.learning_rate, eps=1e-8)  # as main() builds it
    (epoch,) = script.auxiliary_phase(agent, ours, buffers, args)
    segs = released_aux_segs(model, d)
    rel.ppg.compute_presleep_outputs(model=model, segs=segs, mbsize=N_TRAJ)
    theirs = rs.RecordingAdam(model.parameters(), lr=args.learning_rate)  # as the released ppg.learn builds it
    rel.ppg.aux_train(model=model, segs=segs, opt=theirs, mbsize=N_TRAJ, name2coef=released_name2coef(rel, args))
    label = f"{script.__name__} {arch} aux-phase step"
    pi_old = F.log_softmax(buffers["pi_old_logits"], -1)
    check(f"{label} pi_old", rs.relative_error(pi_old, segs[0]["oldpd"].logits), TOL_FORWARD)
    logged = released_aux_losses(rel)
    pairs = dict(
        aux_value_loss=(epoch["aux_value_loss"], logged["vf_aux"]), value=(epoch["value_loss"], logged["vf_true"])
    )
    check(f"{label} logged losses", worst_loss(pairs), TOL_LOSS)
    # pi = pi_old: both KLs are 0 but for rounding (absolute: a KL of 0 has no scale of its own)
    check(f"{label} clone KL at pi = pi_old", abs(epoch["clone_kl"]) + abs(float(logged["pol_distance"])), 1e-6)
    assert len(ours.grads) == len(theirs.grads) == 1
    vanishing = ("pi_head.weight", "pi_head.bias")
    compare_gradients(label, agent, model, names, ours.grads[0], theirs.grads[0], vanishing)
    compare_adam_step(label, agent, model, names, before, ours.grads[0], theirs.grads[0], args.learning_rate, vanishing)


# ==== Targets: GAE, V_hat, advantage normalisation, the reward normaliser ============================================
def rollout_arrays(g, n: int, t: int) -> dict:
    """Sparse rewards (Procgen-like) with a few small penalties, episode ends inside the rollout, values and the
    bootstrap value."""
    rewards = torch.where(torch.rand(n, t, generator=g) < 0.3, torch.randint(1, 11, (n, t), generator=g), 0).float()
    return dict(
        rewards=rewards - 0.5 * (torch.rand(n, t, generator=g) < 0.1).float(),
        ended=torch.rand(n, t, generator=g) < 0.2,
        values=2 * torch.randn(n, t, generator=g),
        next_value=2 * torch.randn(n, generator=g),
    )


def released_first(ended: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """The released `first` (n, T + 1) of a rollout: first[:, t + 1] (step t + 1 starts an episode) is our
    ended[:, t] (step t ended one); `starts`: first[:, 0], the previous rollout's last `ended`."""
    return torch.cat([starts[:, None], ended], dim=1)


def test_gae(rel, script):
    """compute_gae against the released ppo.compute_gae, with episode ends inside the rollout and at its last step
    (where the bootstrap value must be masked), and an env with none (bootstrapped from next_value)."""
    args, g = script.Args(), torch.Generator().manual_seed(3)
    r = rollout_arrays(g, 4, 16)
    r["ended"][0, 5] = r["ended"][1, -1] = True
    r["ended"][2] = False
    adv, ret = script.compute_gae(r["rewards"], r["values"], r["ended"], r["next_value"], args.gamma, args.gae_lambda)
    their_adv, their_ret = rel.ppo.compute_gae(
        vpred=torch.cat([r["values"], r["next_value"][:, None]], dim=1),
        reward=r["rewards"],
        first=released_first(r["ended"], torch.ones(4, dtype=torch.bool)),
        γ=args.gamma,
        λ=args.gae_lambda,
    )
    check(f"{script.__name__} GAE advantages", rs.relative_error(adv, their_adv), TOL_TARGETS)
    check(f"{script.__name__} value targets", rs.relative_error(ret, their_ret), TOL_TARGETS)


def test_targets_over_rollouts(rel, script):
    """Three consecutive rollouts through our RewardNormalizer and compute_targets against the released
    RewardNormalizer and ppo.compute_advantage (GAE, V_hat, advantages normalised by torch_util.mpi_moments): episode
    ends inside the rollouts and across a boundary, and one reward that is clipped."""
    args = script.Args(norm_reward=True)
    n, t, g = 4, 16, torch.Generator().manual_seed(4)
    ours_norm = script.RewardNormalizer(n, args.reward_norm_gamma)
    theirs_norm = rel.reward_normalizer.RewardNormalizer(n, gamma=args.reward_norm_gamma)
    starts, worst, clipped = torch.ones(n, dtype=torch.bool), {}, 0  # every env starts an episode at step 0
    for k in range(3):
        r = rollout_arrays(g, n, t)
        if k == 0:  # the next rollout starts a new episode in env 0 and continues env 1's (both with a return)
            r["ended"][0, -2:] = torch.tensor([False, True])
            r["rewards"][0, -1] = r["rewards"][1, -1] = 5.0
            r["ended"][1, -1] = False
        if k == 2:
            r["rewards"][1, -1] = 1e4  # large enough to be clipped at 10 after scaling
        ro = dict(raw_rewards=r["rewards"], ended=r["ended"], values=r["values"])
        ro.update({key: torch.zeros(n, t) for key in ("rewards", "returns", "advantages")})
        script.compute_targets(ro, r["next_value"], args, ours_norm)

        first = released_first(r["ended"], starts)
        seg = dict(reward=r["rewards"].clone(), first=first[:, :-1], vpred=r["values"], finalfirst=first[:, -1])
        seg.update(finalob=None, finalstate=None)
        seg["reward"] = theirs_norm(seg["reward"], seg["first"])  # as the released ppo.learn does, then:
        value_model = types.SimpleNamespace(v=lambda ob, first, state: r["next_value"])  # V of the final frame
        rel.ppo.compute_advantage(value_model, seg, args.gamma, args.gae_lambda, comm=rs.SingleProcessComm())
        starts = r["ended"][:, -1]

        clipped += int((ro["rewards"].abs() == 10).sum())
        assert torch.equal(ro["rewards"].abs() == 10, seg["reward"].abs() == 10)
        rms = theirs_norm.ret_rms
        for key, ours, theirs in [
            ("scaled rewards", ro["rewards"], seg["reward"]),
            ("value targets", ro["returns"], seg["vtarg"]),
            ("normalised advantages", ro["advantages"], seg["adv"]),
            ("normaliser variance", ours_norm.var, rms.var),
            ("normaliser mean", ours_norm.mean, rms.mean),
            ("normaliser count", ours_norm.count, rms.count),
        ]:
            measured = rs.relative_error(torch.as_tensor(ours), torch.as_tensor(theirs))
            worst[key] = max(worst.get(key, 0.0), measured)
    assert clipped == 1
    for key, value in worst.items():
        check(f"{script.__name__} {key} (3 rollouts)", value, TOL_TARGETS)
