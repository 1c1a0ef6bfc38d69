"""A whole training run of ppg_procgen.py against the authors' released code (github.com/openai/phasic-policy-gradient,
MIT), imported from its own folder: $PPG_RELEASED_CODE, else ../shared/reference/phasic-policy-gradient; without either,
every test here skips. Our main(), unmodified, and the released ppg.learn train on starpilot for 3 phases of N_pi = 2
rollouts of 3 envs x 32 steps (E_aux 2), and must be the same run:

  - the same starting weights: the released PhasicValueModel's own (normed) initialisation, given to the agent main()
    builds through released_shims.parameter_map (strict both ways);
  - the same levels: the released envs.py's ProcgenGym3Env + ExtractDictObWrapper and our ProcgenEnv with the same
    game, rand_seed, num_levels, start_level and distribution mode;
  - the same random draws: the released run goes first and records them. Each torch.distributions.Categorical.sample
    (both codes' one action draw) takes uniforms from one stream and inverts the policy's CDF; our run takes the
    released run's uniforms in the same order. Each torch.randperm (every minibatch order of both codes) comes from one
    stream; our run gets the released permutation mapped onto its own rows (Coupler.our_randperm says how);
  - the released hyperparameters set to ours explicitly (its nstep defaults to 256, its gamma to 0.99, and its
    nminibatch is silently cut to the env count), the script's own KL guard default (off: the released code has none) and
    --micro-batch-size 0; the released logger writes nothing (RCALL_LOGDIR is an empty temporary folder, no save_mode).

What "the same run" means in float32. The two codes' forward passes agree to float32 rounding
(tests/test_released_code.py), but their updates sum in different orders, and Adam turns rounding noise into whole
steps where a gradient is near 0: the first aux minibatch of a phase has pi = pi_old exactly, so its clone gradient is
pure noise, which Adam scales to steps of about lr. The policies drift apart by rounding, and a uniform that falls
between the two codes' CDFs draws different actions. The rounding itself differs between processes here: the same
dual run in two processes met 2 and 4 near ties. The checks:

  - every draw: where our action differs from the released one, the uniform must lie within DELTA of our interval of
    the released action (a near tie: our run then takes the released action and goes on); anything else fails at
    once, naming the env step;
  - every minibatch order: ours shuffles what the released code shuffles at that point (a rollout, or B), and our run
    makes exactly as many draws and minibatch orders as the released run;
  - every finished episode's return and length, in order; at least 3 episodes end and at least 5 rewards are nonzero,
    so that the reward normaliser, episode ends and GAE's masks are exercised;
  - the final parameters of each network: the largest difference within TOL_MAX and the root mean square within
    TOL_RMS.

Measured once, on the 2-core AMD EPYC (AVX-512, torch 2.13 CPU, loaded by a training run), for every configuration at
seeds 1, 2 and 3 with 1 thread (dual and PPO at seeds 4, 5 and 6 too), and for dual and PPO at seed 1 with 2 threads:
every run passed. Dual: at most 4 near ties a run, the farthest 2.0e-3 from our interval; the two CDFs at most 4.3e-3
apart at a draw; final parameters at most 3.3e-3 apart, root mean square at most 1.4e-4. The slow configurations with
aux phases: at most 24 near ties, the farthest 1.0e-2; CDFs 1.6e-2 apart; parameters 6.4e-3 apart, root mean square
3.3e-4 (all minibatches2, in one of its four runs: its 2 Adam steps a rollout give the aux phases' noise more to work
on; with E_aux 0 it stays within 1.2e-5 of the released CDFs). PPO: no near tie, the CDFs at most 4.8e-5 apart,
parameters at most 1.5e-3 apart, root mean square at most 9.2e-6. DELTA and the tolerances leave a margin of about 3
over the worst of these, and 3 to 10 over PPO's.
L_KL (`ppgkl`, the aux bounds; 3 minibatches a rollout), measured once at seed 1 with 1 thread on the same loaded
machine: 1 near tie, 1.7e-3 from our interval; the CDFs at most 2.8e-3 apart; parameters at most 5.8e-3 apart, root
mean square at most 2.6e-4.

Each of these mistakes, put in a scratch copy of the script, fails the CI cases (the first draw past DELTA lies just
past it: the two runs drift apart step by step; with DELTA lifted, the draws go on to 0.05 apart):
  - a fresh policy-phase Adam every phase: both cases, at a draw (dual at env step 543, 0.030 from our interval; PPO
    at env step 384, 4.5e-3);
  - pi_old taken at the start of the policy phase instead of the aux phase: dual, at a draw (env step 422, 0.031);
    PPO has no aux phase;
  - the reward normaliser's statistics reset every phase: PPO, at a draw (env step 546, 5.2e-4; with DELTA lifted, a
    later one lies 2.3e-3 away, and the final parameters' root mean square, 1.0e-4, is over its tolerance too); dual
    passes: the aux phases' noise hides it.
Run with -rP to see each run's near ties, its closest agreeing draw to a boundary, the largest difference of the two
CDFs and the final parameter differences.

The CI cases dual and PPO cost about 25 s of CPU time at 1 thread (dual 20 s, PPO 5 s), measured on the loaded
machine: an estimate of their wall time on an idle one. The others are marked slow (python -m pytest -q tests -m slow);
they run 4 envs, for more episodes and rewards, and (minibatches2) two whole envs a released minibatch."""

import contextlib
import io

import numpy as np
import pytest
import torch
import tyro
from torch.utils.tensorboard import SummaryWriter

import released_shims as rs
from conftest import load_script, main_in_process

RELEASED_ROOT, WHY_NOT = rs.released_root()
pytestmark = pytest.mark.skipif(RELEASED_ROOT is None, reason=WHY_NOT or "no released code")

SEED = 1  # of the levels (rand_seed), the released initialisation and both random streams
THREADS = 1
PHASES = 3
# starpilot: rewards in most rollouts and random-policy episodes of 40-150 steps; levels 7..26 of the easy mode
BASE = dict(
    env_id="starpilot",
    distribution_mode="easy",
    num_levels=20,
    start_level=7,
    num_envs=3,
    num_steps=32,
    n_pi=2,
    e_aux=2,
    aux_mb_trajectories=3,
    num_minibatches=1,
    micro_batch_size=0,
)
ROOMY = dict(num_envs=4, aux_mb_trajectories=4)  # the slow configurations': more episodes and rewards, no time limit
CONFIGS = {
    "dual": {},
    "ppo": dict(arch="shared", e_aux=0),
    "detach": dict(arch="detach", **ROOMY),
    "shared": dict(arch="shared", **ROOMY),
    "e_pi1_e_v2": dict(e_pi=1, e_v=2, **ROOMY),  # both codes: E_V value epochs first, with an Adam of their own
    "minibatches2": dict(num_minibatches=2, **ROOMY),  # the released code: 2 whole envs a minibatch
    # L_KL (the released clip_param 0, kl_penalty 1); 3 minibatches, so that all but the first of a rollout have
    # ratios away from 1, where the penalty and the unclipped surrogate differ from L_clip
    "ppgkl": dict(clip_coef=0.0, kl_penalty=1.0, num_minibatches=3),
}
CI = ("dual", "ppo", "ppgkl")
# Tolerances, measured on correct code (see the docstring), by whether the run has aux phases ("aux") or not ("ppo")
DELTA = dict(aux=3e-2, ppo=5e-4)  # the farthest a near tie's uniform may lie from our interval of the released action
TOL_MAX = dict(aux=2e-2, ppo=5e-3)  # the largest |ours - released| of any final parameter
TOL_RMS = dict(aux=1e-3, ppo=5e-5)  # the root mean square of |ours - released| over each network's final parameters

_randperm = torch.randperm  # the originals: the patched ones draw from them


@pytest.fixture(scope="module", autouse=True)
def threads():
    """THREADS intra-op threads for this module; the suite's setting is put back afterwards. One: on a busy 2-core
    machine a second thread mostly waits (the dual case took 138 s of CPU time at 2 threads, 20 s at 1)."""
    before = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def rel():
    return rs.load_released(RELEASED_ROOT)


def kind(config: str) -> str:
    """The tolerances' key of a configuration: "aux" for a run with aux phases, "ppo" for one without (E_aux 0)."""
    if dict(BASE, **CONFIGS[config])["e_aux"] == 0:
        return "ppo"
    return "aux"


def flags(config: str, seed: int = SEED) -> list:
    """Our command line for a configuration: BASE with its changes, PHASES phases of N_pi rollouts."""
    values = dict(BASE, **CONFIGS[config], seed=seed)
    values["total_timesteps"] = PHASES * values["n_pi"] * values["num_envs"] * values["num_steps"]
    return [item for k, v in values.items() for item in (f"--{k.replace('_', '-')}", str(v))]


def cdf(dist) -> torch.Tensor:
    """(draws, actions) cumulative probabilities of a Categorical, in float64: action a is drawn for a uniform u when
    cdf[a - 1] < u <= cdf[a]."""
    probs = dist.probs.detach()
    return probs.reshape(-1, probs.shape[-1]).double().cumsum(-1)


def inverse_cdf(cumulative: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The action of each uniform: how many of the boundaries between actions lie below it (the last cumulative
    probability is 1 but for rounding, so it is no boundary)."""
    return (cumulative[:, :-1] < u[:, None]).sum(-1)


class Coupler:
    """The two runs' random draws, coupled: the released run's are drawn and recorded, ours replays them."""

    def __init__(self, args, seed: int, delta: float):
        self.args, self.delta = args, delta
        self.uniforms = np.random.default_rng(seed)
        self.orders = torch.Generator().manual_seed(seed)
        self.draws, self.perms = [], []  # the released run's: (uniforms, CDF, actions) and permutations, in order
        self.next_draw = self.next_perm = 0  # how many of them our run has taken
        self.near_ties, self.margin, self.divergence = [], 1.0, 0.0

    def released_sample(self, dist, sample_shape=torch.Size()):
        assert not sample_shape, "the released code draws one action a state"
        cumulative = cdf(dist)
        u = torch.from_numpy(self.uniforms.random(cumulative.shape[0]))
        actions = inverse_cdf(cumulative, u)
        self.draws.append((u, cumulative, actions))
        return actions.view(dist.batch_shape)

    def released_randperm(self, n, *args, **kwargs):
        perm = _randperm(n, generator=self.orders)
        self.perms.append(perm)
        return perm

    def where(self, k: int, env: int) -> str:
        """Draw k (one a step of all envs) as the env step of the run it is."""
        rollout, t = divmod(k, self.args.num_steps)
        phase = rollout // self.args.n_pi + 1
        return f"env step {k * self.args.num_envs + env} (phase {phase}, rollout {rollout + 1}, step {t}, env {env})"

    def our_sample(self, dist, sample_shape=torch.Size()):
        k = self.next_draw
        assert k < len(self.draws), f"our run draws actions more often than the released run ({len(self.draws)})"
        u, theirs, actions = self.draws[k]
        ours = cdf(dist)
        assert ours.shape == theirs.shape, f"{self.where(k, 0)}: ours draws {ours.shape[0]} actions, released {len(u)}"
        self.divergence = max(self.divergence, (ours - theirs).abs().max().item())
        boundaries = torch.cat([ours.new_zeros(len(u), 1), ours[:, :-1], ours.new_ones(len(u), 1)], dim=1)
        for env, (ours_action, action) in enumerate(zip(inverse_cdf(ours, u).tolist(), actions.tolist())):
            if ours_action == action:
                self.margin = min(self.margin, (ours[env, :-1] - u[env]).abs().min().item())
                continue
            low, high = boundaries[env, action].item(), boundaries[env, action + 1].item()
            distance = max(low - u[env].item(), u[env].item() - high)  # how far u is from our interval of `action`
            assert distance <= self.delta, (
                f"{self.where(k, env)}: ours draws action {ours_action}, the released code {action}: the uniform "
                f"{u[env].item():.6f} lies {distance:.3g} from our interval of action {action} (a near tie: "
                f"<= {self.delta:g})"
            )
            self.near_ties.append((self.where(k, env), distance))
        self.next_draw += 1
        return actions.view(dist.batch_shape)  # near ties included: our run goes on as the released one did

    def our_randperm(self, n, *args, **kwargs):
        """The released permutation at this point, mapped onto our rows. The released code shuffles a rollout's envs
        (ppo.py's minibatch_optimize: whole trajectories) or B's (env, rollout) pairs, env by env (ppg.py's
        make_minibatches); we shuffle a rollout's states (rows env by env, step by step) or B's rows (rollout by
        rollout, env by env). Ours draws minibatches of shuffled states (a deviation the README declares); any
        permutation is one our randperm may draw, and the one given here lists the states of the released
        minibatches' envs, env by env, so that our split cuts exactly the released minibatches, in the same order,
        rows in the same order: the rest of the phase is compared on the same data."""
        p, a = self.next_perm, self.args
        assert p < len(self.perms), (
            f"our run draws minibatch orders more often than the released run ({len(self.perms)})"
        )
        theirs = self.perms[p]
        self.next_perm += 1
        what = {a.num_envs * a.num_steps: "a rollout's states", a.n_pi * a.num_envs: "the aux buffer B"}
        released = {a.num_envs: "a rollout's states", a.n_pi * a.num_envs: "the aux buffer B"}
        assert what.get(n) == released.get(len(theirs)), (
            f"minibatch order {p + 1}: ours shuffles {what.get(n, n)}, the released code {released.get(len(theirs))}"
        )
        if what[n] == "a rollout's states":
            return (theirs[:, None] * a.num_steps + torch.arange(a.num_steps)).flatten()
        env, rollout = theirs // a.n_pi, theirs % a.n_pi
        return rollout * a.num_envs + env


def run_released(rel, args, model, logdir) -> list:
    """The released ppg.learn as its train.py calls it, with our hyperparameters; returns the finished episodes'
    (return, length), in the order they ended."""
    venv = rel.train.get_venv(
        num_envs=args.num_envs,
        env_name=args.env_id,
        distribution_mode=args.distribution_mode,
        num_levels=args.num_levels,
        start_level=args.start_level,
        rand_seed=args.seed,
    )
    # The Roller's own episode monitor (it wraps a venv only when it is not one), here with a list that keeps them all
    venv = rel.vec_monitor2.VecMonitor2(venv, keep_buf=100, keep_non_rolling=True)
    ppo_hps = dict(
        nstep=args.num_steps,
        lr=args.learning_rate,
        γ=args.gamma,
        λ=args.gae_lambda,
        nminibatch=args.num_minibatches,
        n_epoch_pi=args.e_pi,
        n_epoch_vf=args.e_v,
        clip_param=args.clip_coef,
        entcoef=args.ent_coef,
        vfcoef=0.5,  # our value loss is 0.5 MSE
        kl_penalty=args.kl_penalty,
        rnorm=args.norm_reward,
        log_save_opts={},  # save_mode "none": no model file
    )
    assert args.reward_norm_gamma == 0.99 and args.beta_clone == 1.0, (
        "the released RewardNormalizer's gamma; train.py's"
    )
    rel.ppg.learn(
        model=model,
        venv=venv,
        ppo_hps=ppo_hps,
        aux_lr=args.learning_rate,
        aux_mbsize=args.aux_mb_trajectories,
        n_aux_epochs=args.e_aux,
        n_pi=args.n_pi,
        interacts_total=args.total_timesteps,
        name2coef={"pol_distance": args.beta_clone, "vf_true": 1.0},
        comm=rs.SingleProcessComm(),
    )
    assert not any(logdir.iterdir()), "the released logger wrote files"
    return [(float(ep.ret), int(ep.len)) for ep in venv.non_rolling_buf]


def whole_runs(rel, config: str, seed: int, tmp_path, monkeypatch) -> dict:
    """The released run, then ours, coupled; asserts every draw (Coupler) and returns what else is compared."""
    script = load_script("ppg_procgen.py")
    argv = flags(config, seed)
    args = tyro.cli(script.Args, args=argv)
    coupler = Coupler(args, seed, DELTA[kind(config)])
    torch.manual_seed(seed)
    model = rs.released_model(rel, args.arch, script.OBS_SHAPE, script.NUM_ACTIONS)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    logdir, nonzero = tmp_path / "released", []
    logdir.mkdir()
    rs.fresh_logger(rel)
    normalize = rel.reward_normalizer.RewardNormalizer.__call__

    def counting(normalizer, reward, first):  # each rollout's raw rewards, as the released ppo.learn scales them
        nonzero.append(int((reward != 0).sum()))
        return normalize(normalizer, reward, first)

    printed = io.StringIO()  # both runs' progress lines: -rP shows the comparison's summary alone
    with monkeypatch.context() as patch, contextlib.redirect_stdout(printed):
        patch.setenv("RCALL_LOGDIR", str(logdir))  # the released LogSaveHelper prints it every rollout
        patch.setattr(
            torch.distributions.Categorical, "sample", lambda d, s=torch.Size(): coupler.released_sample(d, s)
        )
        patch.setattr(torch, "randperm", coupler.released_randperm)
        patch.setattr(rel.reward_normalizer.RewardNormalizer, "__call__", counting)
        released_episodes = run_released(rel, args, model, logdir)

    agents, logged = [], {"charts/episodic_return": [], "charts/episodic_length": []}

    class StartingFromReleased(script.PPGAgent):
        """The agent main() builds, whatever its arguments, with the released model's starting weights."""

        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.load_state_dict({ours: start[theirs] for ours, theirs in rs.parameter_map(self).items()}, strict=True)
            agents.append(self)

    add_scalar = SummaryWriter.add_scalar

    def recording(writer, tag, value, *a, **kw):  # main()'s log of every finished episode
        if tag in logged:
            logged[tag].append(value)
        return add_scalar(writer, tag, value, *a, **kw)

    (tmp_path / "ours").mkdir()
    with monkeypatch.context() as patch, contextlib.redirect_stdout(printed):
        patch.setattr(script, "PPGAgent", StartingFromReleased)
        patch.setattr(torch.distributions.Categorical, "sample", lambda d, s=torch.Size(): coupler.our_sample(d, s))
        patch.setattr(torch, "randperm", coupler.our_randperm)
        patch.setattr(SummaryWriter, "add_scalar", recording)
        main_in_process(script, argv, tmp_path / "ours", patch)
    assert coupler.next_draw == len(coupler.draws), f"our run drew {coupler.next_draw} times, the released run more"
    assert coupler.next_perm == len(coupler.perms), f"our run drew {coupler.next_perm} orders, the released run more"
    (agent,) = agents
    return dict(
        coupler=coupler,
        released_episodes=released_episodes,
        ours_episodes=[
            (float(r), int(n)) for r, n in zip(logged["charts/episodic_return"], logged["charts/episodic_length"])
        ],
        nonzero=sum(nonzero),
        networks=parameter_differences(agent, model),
    )


def parameter_differences(agent, model) -> dict:
    """{network: (largest |ours - released| of its parameters, that parameter's name, root mean square difference)}
    of the policy network (trunk, policy and aux value heads) and the value network (dual: its trunk; else its head)"""
    found = {}
    for ours, theirs in rs.parameter_map(agent).items():
        p = agent.get_parameter(ours)
        diff = (p - model.get_parameter(theirs)).detach().double().abs()
        network = "value" if ours.startswith(("v_trunk.", "value_head.")) else "policy"
        worst, where, squares, count = found.get(network, (0.0, "", 0.0, 0))
        if diff.max().item() >= worst:
            worst, where = diff.max().item(), ours
        found[network] = (worst, where, squares + diff.square().sum().item(), count + diff.numel())
    return {k: (worst, where, (squares / count) ** 0.5) for k, (worst, where, squares, count) in found.items()}


@pytest.mark.parametrize("config", [c if c in CI else pytest.param(c, marks=pytest.mark.slow) for c in CONFIGS])
def test_whole_run(rel, config, tmp_path, monkeypatch):
    """Our main() against the released ppg.learn, draw for draw (see the module's docstring)."""
    r, envs = whole_runs(rel, config, SEED, tmp_path, monkeypatch), dict(BASE, **CONFIGS[config])["num_envs"]
    c, episodes, tol_max, tol_rms = r["coupler"], r["ours_episodes"], TOL_MAX[kind(config)], TOL_RMS[kind(config)]
    draws = f"{len(c.draws) * envs} action draws ({len(c.draws)} steps of {envs} envs)"
    print(f"{config}, seed {SEED}, {torch.get_num_threads()} thread(s): {draws}, {len(c.perms)} minibatch orders")
    ties = f"{len(c.near_ties)} near ties (DELTA {c.delta:g})"
    print(f"  {len(episodes)} episodes ended, {r['nonzero']} nonzero rewards; {ties}")
    for where, distance in c.near_ties:
        print(f"    at {where}: the uniform {distance:.3g} from our interval of the released action")
    print(f"  the closest agreeing draw to one of our boundaries: {c.margin:.3g} away")
    print(f"  the largest difference of the two runs' CDFs at a draw: {c.divergence:.3g}")
    for network, (worst, where, rms) in r["networks"].items():
        print(f"  {network} network's final parameters: apart by {worst:.3g} at most ({where}; tolerance {tol_max:g}),")
        print(f"    root mean square {rms:.3g} (tolerance {tol_rms:g})")
    assert episodes == r["released_episodes"], f"episodes (return, length): ours {episodes}, {r['released_episodes']}"
    assert len(episodes) >= 3 and r["nonzero"] >= 5, "too few episodes or nonzero rewards to exercise the run"
    for network, (worst, where, rms) in r["networks"].items():
        assert worst <= tol_max, f"{network} network: final parameters apart by {worst:.3g} ({where}) > {tol_max:g}"
        assert rms <= tol_rms, (
            f"{network} network: final parameters' root mean square difference {rms:.3g} > {tol_rms:g}"
        )
