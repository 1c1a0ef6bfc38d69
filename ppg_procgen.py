"""Phasic Policy Gradient (Cobbe et al. 2020, arXiv 2009.04416) on Procgen (IMPALA CNN), one file read top to bottom.
Flags: `Args`, `make_plan`; networks: `PPGAgent` (`AgentOutput`, `extra_heads`); losses: `policy_phase_loss` and
`aux_phase_loss`; B's per-step arrays: `buffer_fields`; targets: `compute_targets`; Algorithm 1: `main()`."""

import dataclasses
import importlib.util
import math
import os
import random
import resource
import signal
import sys
import time
from collections import defaultdict, deque
from typing import Annotated, Dict, List, Literal, NamedTuple, Optional, Tuple

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import tyro
from torch.utils.tensorboard import SummaryWriter

PROCGEN_GAMES = "bigfish bossfight caveflyer chaser climber coinrun dodgeball fruitbot heist jumper leaper maze miner"
PROCGEN_GAMES = tuple(f"{PROCGEN_GAMES} ninja plunder starpilot".split())  # the 16 games
OBS_SHAPE = (64, 64, 3)  # HWC uint8, as Procgen emits it
NUM_ACTIONS = 15  # every Procgen game uses the same 15-action set
ACTIVATION_BYTES = 1_525_000  # a state's in one trunk's update, fp32: 1.22 MB measured (docs/runs.md), +25%
CPU_STEPS_PER_S = 60  # a whole PPG phase at the defaults, fp32, on 2 cores of an AMD EPYC (docs/benchmarks.md)
SCRIPT = os.path.basename(__file__)


@dataclasses.dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]  # run name: {env_id}__{exp_name}__{seed}__{time}
    seed: int = 1  # seed of python, numpy, torch and the level sequence, in [0, 2^31)
    torch_deterministic: bool = True  # if toggled, `torch.backends.cudnn.deterministic=True`
    cuda: bool = True  # if toggled and a GPU is visible, train on it (the buffers live there too)
    resume: Optional[str] = None  # go on with the run in this folder (or checkpoint file)
    track: bool = False  # if toggled, mirror every TensorBoard scalar to Weights & Biases
    wandb_project_name: str = "ppg"  # the W&B project of --track
    wandb_entity: Optional[str] = None  # the W&B user or team of --track (None: yours)
    env_id: Literal[PROCGEN_GAMES] = "bigfish"  # the Procgen game
    distribution_mode: Literal["easy", "hard"] = "easy"  # `easy` (25M steps), `hard` (the PPG paper)
    num_levels: int = 0  # number of training levels; 0 trains on the full level distribution
    start_level: int = 0  # the first training level's seed
    total_timesteps: int = 25_000_000  # env steps in all (rounded up to whole rollouts)
    learning_rate: float = 5e-4  # Adam learning rate of both phases (constant, as in the paper)
    anneal_lr: bool = False  # if toggled, every Adam's rate falls linearly to 0 over the run (CleanRL)
    num_envs: int = 64  # parallel envs (256, with 16 aux minibatch trajectories: the paper's batch)
    num_steps: int = 256  # steps per env in each rollout
    gamma: float = 0.999  # discount factor of GAE and the value targets
    gae_lambda: float = 0.95  # lambda of generalised advantage estimation
    norm_reward: bool = True  # if toggled, scale rewards by the running std of their discounted return
    reward_norm_gamma: float = 0.99  # discount of that return (0.99 in the released code)
    num_minibatches: int = 8  # PPO minibatches per epoch in the policy phase
    clip_coef: float = 0.2  # PPO's clipping coefficient epsilon of L_clip (0: no clipping)
    kl_penalty: float = 0.0  # weight of L_KL's penalty 0.5 mean(log ratio^2) (the paper: --clip-coef 0 --kl-penalty 1)
    ent_coef: float = 0.01  # entropy bonus coefficient
    max_grad_norm: float = 0.0  # clip each network's gradient norm (0: none, as in the paper)
    arch: Literal["dual", "detach", "shared"] = "dual"  # dual: 2 networks; detach: V on detached trunk; shared: PPO
    n_pi: Annotated[int, tyro.conf.arg(aliases=["--n-iteration"])] = 32  # N_pi: rollouts a phase
    e_pi: Annotated[int, tyro.conf.arg(aliases=["--e-policy"])] = 1  # E_pi: policy epochs a rollout
    e_v: int = 1  # E_V: value epochs a rollout (with E_pi == E_V one step trains both losses)
    e_aux: Annotated[int, tyro.conf.arg(aliases=["--e-auxiliary"])] = 6  # E_aux: aux epochs a phase (0: none)
    beta_clone: float = 1.0  # beta_clone: weight of KL(pi_old || pi) in the aux phase's joint loss
    aux_mb_trajectories: Annotated[int, tyro.conf.arg(aliases=["--num-aux-rollouts"])] = 4  # per aux minibatch
    aux_kl_stop: float = 0.0  # KL guard: end the aux phase after an epoch whose mean KL(pi_old || pi) > this (0: off)
    micro_batch_size: Optional[int] = None  # states a forward/backward chunk (0: whole minibatches; None: 256 on CPU)
    precision: Literal["fp32", "tf32", "bf16"] = "fp32"  # `tf32`: TF32 on a GPU (a CPU: fp32); `bf16`: trunks in bf16


def make_plan(args: Args, start_step: int = 0, start_phase: int = 0) -> Dict[str, int]:
    """Refuse in one line what tyro takes but a run cannot use; derive its counts (a resume's: from its checkpoint)."""
    at_least_1, fraction = ("be at least 1", lambda v: v >= 1), ("be a finite number in [0, 1]", lambda v: 0 <= v <= 1)
    at_least_0 = ("be a finite number >= 0", lambda v: 0 <= v < math.inf)  # nan and inf fail every rule
    positive = ("be a finite number > 0", lambda v: 0 < v < math.inf)
    rules = dict(num_envs=at_least_1, num_steps=at_least_1, num_minibatches=at_least_1, n_pi=at_least_1)
    rules.update(e_pi=at_least_1, e_v=at_least_1, total_timesteps=at_least_1, aux_mb_trajectories=at_least_1)
    rules.update(e_aux=at_least_0, micro_batch_size=at_least_0, beta_clone=at_least_0, ent_coef=at_least_0)
    rules.update(aux_kl_stop=at_least_0, max_grad_norm=at_least_0, num_levels=at_least_0, start_level=at_least_0)
    rules.update(learning_rate=positive, clip_coef=at_least_0, kl_penalty=at_least_0, gamma=fraction)
    rules.update(gae_lambda=fraction, reward_norm_gamma=fraction)
    rules.update(seed=("lie in [0, 2^31) (the envs take 31-bit seeds)", lambda v: 0 <= v < 2**31))
    for name, (rule, ok) in rules.items():
        value = getattr(args, name)
        if value is not None and not ok(value):
            sys.exit(f"error: --{name.replace('_', '-')} must {rule} (got {value})")
    if args.clip_coef == 0 and args.kl_penalty == 0:
        sys.exit("error: --clip-coef 0 leaves the policy step unbounded: give --kl-penalty > 0 too (L_KL), or clip")
    batch_size = args.num_envs * args.num_steps
    if batch_size % args.num_minibatches:
        sys.exit(f"error: --num-minibatches {args.num_minibatches} does not divide a rollout's {batch_size} states")
    num_iterations = math.ceil(args.total_timesteps / batch_size)  # round UP: never train less than asked
    phases_left = math.ceil((num_iterations - start_step // batch_size) / args.n_pi)
    aux_phases = phases_left - 1 if args.e_aux > 0 and phases_left > 0 else 0  # none after the last rollout
    trajectories = args.n_pi * args.num_envs if aux_phases else args.num_envs  # the rows of the buffer B
    if aux_phases and trajectories % args.aux_mb_trajectories:
        sys.exit(f"error: --aux-mb-trajectories {args.aux_mb_trajectories} does not divide B's {trajectories} rows")
    num_phases = start_phase + phases_left
    return dict(num_iterations=num_iterations, num_phases=num_phases, aux_phases=aux_phases, trajectories=trajectories)


class ProcgenVecEnv:
    """uint8 HWC frames, raw rewards, dones, finished episodes; a done=True step's frame starts the next episode."""

    RESUME = "exact: every env, random stream and tracker restored, so the run goes on as if never stopped"

    def __init__(self, args: Args, num_envs: int, num_levels: int, start_level: int, seed: int):
        if importlib.util.find_spec("gym_notices"):  # gym 0.26 (procgen's dependency) prints a notice from this table
            __import__("gym_notices.notices").notices.notices.clear()
        from procgen import ProcgenEnv  # imported here: the flags are checked before gym loads

        levels = dict(num_levels=num_levels, start_level=start_level, distribution_mode=args.distribution_mode)
        self.env = ProcgenEnv(num_envs, args.env_id, rand_seed=seed, **levels)
        self.num_envs, self.num_actions = num_envs, self.env.action_space.n
        self.returns, self.lengths = np.zeros(num_envs, dtype=np.float64), np.zeros(num_envs, dtype=np.int64)

    def reset(self) -> np.ndarray:  # the frames to act on: a new env's first, a restored env's current (gym3's observe)
        return self.env.env.observe()[1]["rgb"]

    def state_dict(self) -> Dict:  # each env's game, level sequence and RNG (about 30 KB), and its episode so far
        return dict(games=self.env.env.get_state(), returns=self.returns.tolist(), lengths=self.lengths.tolist())

    def load_state_dict(self, state: Dict) -> None:  # Procgen restores each env exactly: the run goes on as unbroken
        self.env.env.set_state(state["games"])
        self.returns[:], self.lengths[:] = state["returns"], state["lengths"]

    def step(self, actions: np.ndarray):
        obs, rewards, dones, _ = self.env.step(actions.astype(np.int32))
        self.returns += rewards
        self.lengths += 1
        finished = [(i, float(self.returns[i]), int(self.lengths[i])) for i in np.flatnonzero(dones)]
        self.returns[dones], self.lengths[dones] = 0.0, 0
        return obs["rgb"], rewards, dones, finished


def normed_init_(layer: nn.Module, scale: float) -> nn.Module:
    """The released code's "normed" init: each output unit's weight vector rescaled to L2 norm `scale`; bias 0."""
    with torch.no_grad():
        w = layer.weight
        w.mul_(scale / w.flatten(1).norm(dim=1).view(-1, *[1] * (w.dim() - 1)))
        layer.bias.zero_()
    return layer


class ResidualBlock(nn.Module):
    def __init__(self, channels: int, scale: float):
        super().__init__()
        self.conv0 = normed_init_(nn.Conv2d(channels, channels, 3, padding=1), scale)
        self.conv1 = normed_init_(nn.Conv2d(channels, channels, 3, padding=1), scale)

    def forward(self, x):
        return x + self.conv1(F.relu(self.conv0(F.relu(x))))


class ImpalaEncoder(nn.Module):
    """uint8 HWC frames -> 256 features: 3 stacks of conv, maxpool and 2 residual blocks; flatten, relu, dense, relu."""

    def __init__(self, obs_shape: Tuple[int, ...], channels=(16, 32, 32), out_features=256):
        super().__init__()
        h, w, c = obs_shape
        # The released code's scales: each stack 1/sqrt(3), each of its 2 blocks 1/sqrt(2) of that, over 2 convs
        res_scale = math.sqrt(1 / math.sqrt(len(channels)) / math.sqrt(2))
        layers = []
        for out in channels:
            layers += [normed_init_(nn.Conv2d(c, out, 3, padding=1), 1.0), nn.MaxPool2d(3, stride=2, padding=1)]
            layers += [ResidualBlock(out, res_scale), ResidualBlock(out, res_scale)]
            c, h, w = out, (h + 1) // 2, (w + 1) // 2
        self.convs = nn.Sequential(*layers)
        self.dense = normed_init_(nn.Linear(c * h * w, out_features), 1.4)
        self.out_features = out_features

    def forward(self, obs_uint8: torch.Tensor) -> torch.Tensor:
        # The one place frames become floats; permute() keeps the NHWC memory order (channels_last: faster on a CPU)
        x = self.convs(obs_uint8.permute(0, 3, 1, 2).float().div_(255.0))
        return F.relu(self.dense(F.relu(x.flatten(1))))


class AgentOutput(NamedTuple):  # what the network returns, by name: no call site unpacks it by position
    logits: torch.Tensor  # the policy's logits, fp32
    value: torch.Tensor  # V: the true value head
    aux_value: torch.Tensor  # V_aux: the auxiliary value head, on the policy trunk
    features: torch.Tensor  # the policy trunk's features (fp32)
    heads: Dict[str, torch.Tensor] = {}  # the outputs of PPGAgent.extra_heads, by name


class PPGAgent(nn.Module):
    """Policy network: trunk, policy head, aux value head; the true value head where --arch puts it (see Args.arch)."""

    def __init__(self, args: Args, obs_shape: Tuple[int, ...], num_actions: int):
        super().__init__()
        self.arch, self.bf16 = args.arch, args.precision == "bf16"
        self.pi_trunk = ImpalaEncoder(obs_shape)
        width = self.pi_trunk.out_features
        self.pi_head = normed_init_(nn.Linear(width, num_actions), 0.1)  # every head: normed, scale 0.1 (released)
        self.aux_value_head = normed_init_(nn.Linear(width, 1), 0.1)
        self.v_trunk = ImpalaEncoder(obs_shape) if self.arch == "dual" else None
        self.value_head = normed_init_(nn.Linear(width, 1), 0.1)
        # A new head: extra_heads["x"] = a layer, under its flag (its init shifts every later draw); out.heads["x"]
        self.extra_heads = nn.ModuleDict()

    def forward(self, obs: torch.Tensor, terms=("policy", "value")) -> AgentOutput:
        """Every output; with `dual`, one term runs its network alone (pi_old, E_pi != E_V epochs), the other's None."""
        # The one place precision is chosen: with bf16 the trunks run under autocast; heads and losses stay fp32
        with torch.autocast(obs.device.type, torch.bfloat16, enabled=self.bf16):
            h = self.pi_trunk(obs).float() if "policy" in terms or self.arch != "dual" else None
            v = self.v_trunk(obs).float() if self.arch == "dual" and "value" in terms else None
        if self.arch != "dual":
            v = h.detach() if self.arch == "detach" else h
        logits = None if h is None else self.pi_head(h)
        value = None if v is None else self.value_head(v).squeeze(-1)
        aux_value = None if h is None else self.aux_value_head(h).squeeze(-1)
        heads = {name: head(h) for name, head in self.extra_heads.items()} if h is not None else {}
        return AgentOutput(logits=logits, value=value, aux_value=aux_value, features=h, heads=heads)

    def value_parameters(self) -> List[nn.Parameter]:  # theta_V: the value network (dual) or its head alone
        return [*(self.v_trunk.parameters() if self.v_trunk is not None else []), *self.value_head.parameters()]

    def policy_parameters(self) -> List[nn.Parameter]:  # theta_pi: all the rest, and any head a hack adds
        value = {id(p) for p in self.value_parameters()}
        return [p for p in self.parameters() if id(p) not in value]


def moments(x: torch.Tensor) -> Tuple[float, float, float]:
    """(count, mean, population variance) of x's elements, in float64."""
    x = x.double()
    n, total, squares = torch.stack([x.new_tensor(x.numel()), x.sum(), x.square().sum()]).tolist()
    return n, total / n, max(squares / n - (total / n) ** 2, 0.0)


class RewardNormalizer:
    """Rewards over the running std of their discounted return (no mean), clipped; a rollout at a time, as released."""

    def __init__(self, num_envs: int, gamma: float, clip: float = 10.0, epsilon: float = 1e-8):
        self.gamma, self.clip, self.epsilon = gamma, clip, epsilon
        self.ret = np.zeros(num_envs, dtype=np.float64)
        self.mean, self.var, self.count = 0.0, 1.0, 1e-4

    def __call__(self, rewards: np.ndarray, dones: np.ndarray) -> np.ndarray:
        rets = np.empty(rewards.shape, dtype=np.float64)
        for t in range(rewards.shape[1]):
            self.ret = self.ret * self.gamma + rewards[:, t]
            rets[:, t] = self.ret
            self.ret[dones[:, t]] = 0.0  # the episode ended with this reward
        n, mean, var = moments(torch.from_numpy(rets))
        delta, total = mean - self.mean, self.count + n  # the parallel (Chan et al.) merge of the rollout's moments
        self.mean += delta * n / total
        self.var = (self.var * self.count + var * n + delta**2 * self.count * n / total) / total
        self.count = total
        return np.clip(rewards / np.sqrt(self.var + self.epsilon), -self.clip, self.clip).astype(np.float32)

    def state_dict(self) -> Dict:  # `ret`: each env's discounted return so far, which the next rollout goes on with
        return dict(mean=float(self.mean), var=float(self.var), count=float(self.count), ret=self.ret.tolist())

    def load_state_dict(self, state: Dict) -> None:
        self.mean, self.var, self.count = state["mean"], state["var"], state["count"]
        self.ret = np.array(state.get("ret", self.ret), dtype=np.float64)  # a checkpoint from before `ret`: zeros


def compute_gae(rewards, values, ended, next_value, gamma: float, lam: float):
    """GAE over (num_envs, num_steps) tensors; ended[:, t]: step t ended its episode (the value after it is 0)."""
    advantages, last = torch.zeros_like(rewards), torch.zeros_like(next_value)
    for t in reversed(range(rewards.shape[1])):
        following = next_value if t == rewards.shape[1] - 1 else values[:, t + 1]
        alive = 1.0 - ended[:, t].float()
        delta = rewards[:, t] + gamma * following * alive - values[:, t]
        last = delta + gamma * lam * alive * last
        advantages[:, t] = last
    return advantages, advantages + values


def kl_divergence(p_logits, q_logits):
    """KL(p || q) of the categoricals with these logits, exact over all actions, averaged over states."""
    p_logp = F.log_softmax(p_logits, dim=-1)
    return (p_logp.exp() * (p_logp - F.log_softmax(q_logits, dim=-1))).sum(-1).mean()


def policy_phase_loss(out: AgentOutput, mb: Dict[str, torch.Tensor], args: Args, terms=("policy", "value")):
    """(L_clip or L_KL's surrogate - entropy bonus: `policy`) + 0.5 MSE of V (`value`) on a chunk: (loss, stats)."""
    loss, stats = 0.0, {}
    if "policy" in terms:
        logprobs = F.log_softmax(out.logits, dim=-1)
        logratio = logprobs.gather(-1, mb["actions"].unsqueeze(-1)).squeeze(-1) - mb["logprobs"]
        ratio, adv = logratio.exp(), mb["advantages"]
        pg_loss = -adv * ratio
        if args.clip_coef > 0:  # L_clip; with --clip-coef 0 the plain surrogate, bounded by L_KL's penalty instead
            pg_loss = torch.max(pg_loss, -adv * ratio.clamp(1 - args.clip_coef, 1 + args.clip_coef))
        pg_loss = pg_loss.mean()
        kl_penalty = args.kl_penalty * 0.5 * logratio.pow(2).mean()  # L_KL's penalty, as the released code (0: off)
        entropy = -(logprobs.exp() * logprobs).sum(-1).mean()
        loss = loss + pg_loss + kl_penalty - args.ent_coef * entropy
        stats.update(policy_loss=pg_loss, kl_penalty=kl_penalty, entropy=entropy)
        with torch.no_grad():
            stats.update(approx_kl=((ratio - 1) - logratio).mean())  # the low-variance k3 estimator
            stats.update(clipfrac=((ratio - 1).abs() > args.clip_coef).float().mean())
    if "value" in terms:
        stats["value_loss"] = 0.5 * (out.value - mb["returns"]).pow(2).mean()  # unclipped, as in the paper
        loss = loss + stats["value_loss"]
    return loss, stats


def aux_phase_loss(out: AgentOutput, mb: Dict[str, torch.Tensor], args: Args):
    """The paper's L_joint (policy network) plus L_value (value network): (loss, stats); mb is a chunk, as above."""
    l_aux = 0.5 * (out.aux_value - mb["returns"]).pow(2).mean()
    l_clone = kl_divergence(mb["pi_old_logits"], out.logits)  # KL(pi_old || pi)
    joint = l_aux + args.beta_clone * l_clone
    l_value = 0.5 * (out.value - mb["returns"]).pow(2).mean()
    return joint + l_value, dict(aux_value_loss=l_aux, clone_kl=l_clone, joint_loss=joint, value_loss=l_value)


def buffer_fields(num_actions: int) -> Dict[str, Tuple[Tuple[int, ...], torch.dtype]]:
    """Per-step arrays, name -> (a step's shape, dtype): a new target is an entry here, a line filling it, a loss."""
    return dict(
        obs=(OBS_SHAPE, torch.uint8),  # frames stay uint8 until the network
        actions=((), torch.long),
        logprobs=((), torch.float32),  # log pi(a|s) of the rollout's policy
        values=((), torch.float32),  # V(s) at rollout time
        raw_rewards=((), torch.float32),  # the env wrapper's training rewards (Atari: clipped), before the normaliser
        rewards=((), torch.float32),  # as trained on: scaled by the reward normaliser when --norm-reward
        ended=((), torch.bool),  # the step ended its episode
        advantages=((), torch.float32),  # GAE, normalised per rollout
        returns=((), torch.float32),  # V_hat = GAE advantages + V: the value and aux targets
        pi_old_logits=((num_actions,), torch.float32),  # pi_old, written at the start of each aux phase
    )


@torch.no_grad()
def collect_rollout(agent: PPGAgent, envs, next_obs: torch.Tensor, ro: Dict[str, torch.Tensor], step: int):
    """num_steps steps of every env into ro (its rows of B); returns next obs, step, V(next obs), finished episodes."""
    episodes, start, say_at = [], time.time(), time.time() + 20
    rewards, ended = np.zeros(ro["raw_rewards"].shape, np.float32), np.zeros(ro["ended"].shape, bool)  # on the host
    for t in range(ro["obs"].shape[1]):
        ro["obs"][:, t] = next_obs
        out = agent(next_obs)
        pi = torch.distributions.Categorical(logits=out.logits, validate_args=False)  # no host sync to validate
        action = pi.sample()
        ro["actions"][:, t], ro["logprobs"][:, t], ro["values"][:, t] = action, pi.log_prob(action), out.value
        obs, rewards[:, t], ended[:, t], finished = envs.step(action.cpu().numpy())  # the step's one wait
        next_obs = torch.from_numpy(obs).to(next_obs.device)
        step += envs.num_envs
        episodes += [(step, ep_return, length) for _, ep_return, length in finished]
        if time.time() > say_at:  # a long rollout (a CPU's) shows within a minute that it runs: on the host clock
            print(f"rollout: {t + 1} of {rewards.shape[1]} steps in {time.time() - start:.0f}s", flush=True)
            say_at = math.inf
    ro["raw_rewards"].copy_(torch.from_numpy(rewards))  # uploaded once a rollout
    ro["ended"].copy_(torch.from_numpy(ended))
    return next_obs, step, agent(next_obs).value, episodes


def compute_targets(ro: Dict[str, torch.Tensor], next_value, args: Args, reward_normalizer: RewardNormalizer):
    """Into a rollout's rows of B: rewards, V_hat = GAE + V and normalised advantages. Returns explained variance."""
    raw, ended, values = ro["raw_rewards"].cpu(), ro["ended"].cpu(), ro["values"].cpu()
    rewards = torch.from_numpy(reward_normalizer(raw.numpy(), ended.numpy())) if args.norm_reward else raw
    advantages, returns = compute_gae(rewards, values, ended, next_value.cpu(), args.gamma, args.gae_lambda)
    _, mean, var = moments(advantages)
    ro["rewards"].copy_(rewards)
    ro["returns"].copy_(returns)
    ro["advantages"].copy_((advantages - mean) / (math.sqrt(var) + 1e-8))
    var_y = moments(returns)[2]
    return 1 - moments(returns - values)[2] / var_y if var_y else math.nan


def gradient_step(agent: PPGAgent, optimizer, mb: Dict[str, torch.Tensor], args: Args, loss_of) -> Dict:
    """One step on mb's mean loss, backpropagated in chunks weighted by their share (the same gradient, less memory)."""
    n, stats = mb["obs"].shape[0], {}
    for start in range(0, n, args.micro_batch_size or n):
        part = slice(start, min(start + (args.micro_batch_size or n), n))
        weight = (part.stop - part.start) / n
        loss, chunk_stats = loss_of({k: v[part] for k, v in mb.items()})
        (loss * weight).backward()
        for k, v in chunk_stats.items():
            stats[k] = stats.get(k, 0.0) + weight * v.detach()
    if args.max_grad_norm > 0:  # each network's norm apart
        for network in (agent.policy_parameters(), agent.value_parameters()):
            nn.utils.clip_grad_norm_(network, args.max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return stats


def minibatch_means(logs: Dict[str, List[torch.Tensor]], where: str) -> Dict[str, float]:
    """Each statistic's mean over all its minibatches, in one host copy; a NaN or inf stops the run in one line."""
    means = dict(zip(logs, torch.stack([torch.stack(v).mean() for v in logs.values()]).tolist()))  # one host copy
    if bad := [k for k, v in means.items() if not math.isfinite(v)]:
        sys.exit(f"error: non-finite {', '.join(bad)} in the {where}; stopped, the last checkpoint unchanged")
    return means


def policy_phase_update(agent: PPGAgent, optimizer, batch: Dict[str, torch.Tensor], args: Args, value_optimizer=None):
    """E_pi epochs of PPO's loss and E_V of the value loss on a rollout's shuffled minibatches, as the released code."""
    n, logs = batch["obs"].shape[0], defaultdict(list)
    epochs = [(("policy", "value"), args.e_pi, optimizer)]
    if args.e_pi != args.e_v:
        epochs = [(("value",), args.e_v, value_optimizer), (("policy",), args.e_pi, optimizer)]
    for terms, count, opt in epochs:
        for _ in range(count):
            for idx in torch.randperm(n, device=batch["obs"].device).split(n // args.num_minibatches):
                mb = {k: v[idx] for k, v in batch.items() if k != "pi_old_logits"}  # pi_old: the aux phase's alone
                stats = gradient_step(
                    agent, opt, mb, args, lambda c: policy_phase_loss(agent(c["obs"], terms), c, args, terms)
                )
                for k, v in stats.items():
                    logs[k].append(v)
    return minibatch_means(logs, "policy phase")


def auxiliary_phase(agent: PPGAgent, optimizer, buffers: Dict[str, torch.Tensor], args: Args) -> List[Dict]:
    """pi_old into B, then E_aux epochs of aux_phase_loss on minibatches of whole trajectories (fewer: the KL guard)."""
    obs, epochs = buffers["obs"], []
    chunk = args.micro_batch_size or args.aux_mb_trajectories * args.num_steps
    # pi_old: the policy NOW (after the policy phase) on all of B; logits, so an unchanged policy has KL exactly 0
    with torch.no_grad():
        logits = [agent(part, terms=("policy",)).logits for part in obs.flatten(0, 1).split(chunk)]
        buffers["pi_old_logits"].copy_(torch.cat(logits).view(*obs.shape[:2], -1))

    def loss_of(c):  # the loss, and the guard's KL(pi_old || pi): clone_kl, unless a hack changes the clone loss
        out = agent(c["obs"])
        loss, stats = aux_phase_loss(out, c, args)
        return loss, dict(stats, guard_kl=kl_divergence(c["pi_old_logits"], out.logits.detach()))

    for epoch in range(1, args.e_aux + 1):
        logs, epoch_start = defaultdict(list), time.time()
        for traj in torch.randperm(obs.shape[0], device=obs.device).split(args.aux_mb_trajectories):
            mb = {k: v[traj].flatten(0, 1) for k, v in buffers.items()}  # whole trajectories: row blocks of B
            for k, v in gradient_step(agent, optimizer, mb, args, loss_of).items():
                logs[k].append(v)
        epochs.append(minibatch_means(logs, "auxiliary phase"))
        losses = f"aux_value_loss {epochs[-1]['aux_value_loss']:.4f} clone_kl {epochs[-1]['clone_kl']:.5f}"
        print(f"aux epoch {epoch}/{args.e_aux}: {losses} ({time.time() - epoch_start:.1f}s)", flush=True)
        if 0 < args.aux_kl_stop < epochs[-1]["guard_kl"] and epoch < args.e_aux:
            print(f"KL guard: mean KL(pi_old || pi) {epochs[-1]['guard_kl']:.4f} > --aux-kl-stop: the aux phase stops")
            break
    return epochs


def resume_args(args: Args, given: Optional[set] = None) -> Tuple[Args, Dict, str]:
    """(the run's flags, its checkpoint, its folder); a flag in `given` (None: off its default) may change a few."""
    path = os.path.join(args.resume, "checkpoint.pt") if os.path.isdir(args.resume) else args.resume
    if os.path.isdir(args.resume) and not os.path.exists(path):
        sys.exit(f"error: --resume {args.resume}: no checkpoint (it stopped before its first phase ended): start again")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)  # tensors and plain values: runs no code
        if state["script"] != SCRIPT:
            raise ValueError(f"written by {state['script']}")
    except Exception as e:  # missing, truncated, another script's, or not a torch file at all
        sys.exit(f"error: --resume {path}: not a readable checkpoint of {SCRIPT} ({type(e).__name__}: {e})"[:300])
    fields = [field.name for field in dataclasses.fields(Args)]
    state["args"].pop("save_model", None)  # a flag of older versions: checkpoint.pt holds the weights
    if unknown := sorted(set(state["args"]) - set(fields)):
        sys.exit(f"error: --resume {path}: written by a version of {SCRIPT} with flags this one lacks: {unknown}")
    saved = dict(vars(Args()), **state["args"])
    if given is None:
        given = {name for name in fields if getattr(args, name) != getattr(Args(), name)}
    allowed = ["resume", "total_timesteps", "cuda", "micro_batch_size", "track", "wandb_project_name", "wandb_entity"]
    for name in sorted(given & set(fields)):
        value = getattr(args, name)
        if name not in allowed and value != saved[name]:
            sys.exit(f"error: --{name.replace('_', '-')} {value}: a resumed run keeps its flags ({saved[name]})")
        if name == "total_timesteps" and value < saved[name]:
            sys.exit(f"error: --total-timesteps may only be raised on --resume (the run's: {saved[name]})")
        saved[name] = value
    return Args(**saved), state, os.path.dirname(os.path.abspath(path))


def memory_plan(args: Args, rows: Tuple[int, int], free: float, on_gpu: bool) -> Tuple[int, int, int]:
    """(--micro-batch-size to run with, bytes of B, of a chunk's activations), or a one-line exit if over `free`."""
    buffer_bytes = math.prod(rows) * sum(math.prod(s) * d.itemsize for s, d in buffer_fields(NUM_ACTIONS).values())
    per_state = ACTIVATION_BYTES * (2 if args.arch == "dual" else 1)  # `dual` runs both trunks in a step
    largest = max(args.num_envs * args.num_steps // args.num_minibatches, args.aux_mb_trajectories * args.num_steps)
    fits = int(max(free - buffer_bytes, 0) // per_state)  # the states whose activations fit beside B
    chunk = 256 if args.micro_batch_size is None and not on_gpu else args.micro_batch_size  # tools/benchmark.py --sweep
    if chunk is None:  # on a GPU: whole minibatches (0) if they fit beside B, else the largest power of 2 that does
        chunk = 0 if fits >= largest else 2 ** max(fits.bit_length() - 1, 0)
    states = min(chunk or largest, largest)
    if states > fits:
        gib = f"B {buffer_bytes / 2**30:.1f} GiB, chunks of {states} states {states * per_state / 2**30:.1f} GiB"
        sys.exit(f"error: {gib}: over the {free / 2**30:.1f} GiB free: lower --n-pi, --num-envs or --micro-batch-size")
    return chunk, buffer_bytes, states * per_state


def main(args: Args, given: Optional[set] = None) -> None:
    # ---- Setup: every flag checked and every count derived (and printed) before any env, buffer or log exists ----
    args, ckpt, run_dir = resume_args(args, given) if args.resume else (args, None, None)
    phase, global_step = (ckpt["phase"], ckpt["global_step"]) if ckpt else (0, 0)
    plan = make_plan(args, global_step, phase)
    num_iterations, batch_size = plan["num_iterations"], args.num_envs * args.num_steps
    iteration = global_step // batch_size
    if ckpt and iteration >= num_iterations:  # nothing to train: no plan printed, nothing written
        print(f"{run_dir} is trained to step {global_step:,}: nothing to do (a larger --total-timesteps trains on)")
        return
    device = torch.device("cuda" if args.cuda and torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = args.precision == "tf32"  # cuDNN's: on
    rows = (plan["trajectories"], args.num_steps)  # B: rows of whole trajectories, num_envs rows a rollout
    meminfo = open("/proc/meminfo").read().split() if os.path.exists("/proc/meminfo") else ["MemAvailable:", "inf"]
    free = 1024 * float(meminfo[meminfo.index("MemAvailable:") + 1])  # RAM the kernel can give without swapping
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else free
    micro_batch_flag = args.micro_batch_size  # checkpointed as given: a resume on another device chooses anew
    chunk, buffer_bytes, activation_bytes = memory_plan(args, rows, free, device.type == "cuda")
    args = dataclasses.replace(args, micro_batch_size=chunk)
    run_name = ckpt["run_name"] if ckpt else f"{args.env_id}__{args.exp_name}__{args.seed}__{int(time.time())}"
    run_dir = run_dir or f"runs/{run_name}"
    rounded = " (--total-timesteps rounded up to whole rollouts)" * (num_iterations * batch_size > args.total_timesteps)
    tf32 = " (a CPU has no TF32: plain fp32)" * (args.precision == "tf32" and device.type != "cuda")
    first = min(args.n_pi, num_iterations - iteration) * batch_size  # env steps to the first checkpoint
    hours = (num_iterations - iteration) * batch_size / CPU_STEPS_PER_S / 3600  # the rest of the run, on a CPU
    cpu = f" (on a CPU: in {first / CPU_STEPS_PER_S / 60:.0f} min; all in {hours:.0f} h{', a GPU job' * (hours > 3)})"
    print(
        f"run {run_name} on {device}: phases: {plan['num_phases']} of N_pi={args.n_pi} rollouts; rollouts: "
        f"{num_iterations} of {args.num_envs} envs x {args.num_steps} steps = {num_iterations * batch_size:,} env steps"
        f"{rounded}\narch={args.arch} E_pi={args.e_pi} E_V={args.e_v} E_aux={args.e_aux} beta_clone={args.beta_clone}; "
        f"aux phases: {plan['aux_phases']}; PPO minibatch {batch_size // args.num_minibatches} states, aux minibatch "
        f"{args.aux_mb_trajectories * args.num_steps}; B {buffer_bytes / 2**30:.2f} GiB (uint8 frames)\nprecision "
        f"{args.precision}{tf32}; chunks of {args.micro_batch_size or 'whole minibatches of'} states "
        f"({activation_bytes / 2**30:.2f} GiB of activations); a checkpoint after each phase, the first at step "
        f"{global_step + first:,}{cpu * (device.type == 'cpu')}"
    )
    seed = (args.seed + 100_003 * phase) % (2**31 - args.num_envs)  # resumes restore the streams (older ones: new)
    for seed_stream in (random.seed, np.random.seed, torch.manual_seed):
        seed_stream(seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    try:  # a new run's folder, made exclusively: a run never writes into another's (nor starts a W&B run for it)
        os.makedirs(run_dir, exist_ok=bool(ckpt))
    except FileExistsError:
        sys.exit(f"error: {run_dir} exists (a run with this --exp-name and --seed began this second): start again")
    if args.track:  # before the writer: W&B mirrors every TensorBoard scalar; a resumed run continues its W&B run
        config = dict(project=args.wandb_project_name, entity=args.wandb_entity, config=vars(args), name=run_name)
        try:
            import wandb  # only with --track

            wandb.init(**config, id=ckpt and ckpt["wandb_id"], resume="allow", sync_tensorboard=True, save_code=True)
        except Exception as e:  # not installed, not logged in, no network: the fix of each
            if not ckpt:  # the new run's folder, still empty (and runs/, if it was made for it)
                os.removedirs(run_dir)
            fix = "pip install wandb==0.31.0" if isinstance(e, ImportError) else "wandb login, or WANDB_MODE=offline"
            sys.exit(f"error: --track: {fix} ({type(e).__name__}: {e})"[:300])
    if ckpt and "events" in ckpt:  # the log cut back to the checkpoint (purge_step cannot reach aux/*'s epoch axis)
        for path in [f"{run_dir}/{name}" for name in os.listdir(run_dir) if "tfevents" in name]:
            if os.path.basename(path) in ckpt["events"]:  # its length at the checkpoint
                os.truncate(path, min(ckpt["events"][os.path.basename(path)], os.path.getsize(path)))
            else:  # begun after the checkpoint
                os.remove(path)
    writer = SummaryWriter(run_dir, purge_step=global_step + 1 if ckpt else None)  # a resume logs no step twice
    writer.add_text("hyperparameters", "|flag|value|\n|-|-|\n" + "\n".join(f"|{k}|{v}|" for k, v in vars(args).items()))
    # The env (training levels [start_level, start_level + num_levels)), the networks, the optimizers, the buffer B
    envs = ProcgenVecEnv(args, args.num_envs, args.num_levels, args.start_level, seed)
    agent = PPGAgent(args, OBS_SHAPE, envs.num_actions).to(device)
    optimizers = [torch.optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-8) for _ in range(3)]
    policy_optimizer, aux_optimizer, value_optimizer = optimizers  # kept across phases (value's: when E_pi != E_V)
    reward_normalizer = RewardNormalizer(args.num_envs, args.reward_norm_gamma)
    fields = buffer_fields(envs.num_actions).items()  # zeros: a field a hack adds reads 0 until filled
    buffers = {k: torch.zeros((*rows, *shape), dtype=dtype, device=device) for k, (shape, dtype) in fields}
    recent_returns, aux_epochs_done = deque(maxlen=100), ckpt["aux_epochs_done"] if ckpt else 0
    # All a checkpoint holds but flags and counts, in one place: each part's reader and restorer
    stateful = dict(agent=agent, policy_optimizer=policy_optimizer, aux_optimizer=aux_optimizer, envs=envs)
    stateful.update(value_optimizer=value_optimizer, reward_normalizer=reward_normalizer)
    parts = {name: (thing.state_dict, thing.load_state_dict) for name, thing in stateful.items()}
    parts.update(python_rng=(random.getstate, random.setstate), torch_rng=(torch.get_rng_state, torch.set_rng_state))
    parts.update(numpy_rng=(lambda: [(s := np.random.get_state())[0], s[1].tolist(), *s[2:]], np.random.set_state))
    parts.update(recent_returns=(lambda: list(recent_returns), recent_returns.extend))  # the console's last 100
    parts.update(dict(cuda_rng=(torch.cuda.get_rng_state, torch.cuda.set_rng_state)) if device.type == "cuda" else {})
    if ckpt:  # (a part a checkpoint from before lacks: as a new run's)
        for name in parts.keys() & ckpt.keys():
            parts[name][1](ckpt[name])
        how = envs.RESUME if "torch_rng" in ckpt else "a checkpoint from before exact resume: not the run unbroken"
        print(f"resumed from {run_dir}/checkpoint.pt after phase {phase}, step {global_step:,}; {how}")

    def stop(signum, frame):  # SIGTERM or Ctrl-C: say how to resume, exit with 128 + the signal
        saved = os.path.exists(f"{run_dir}/checkpoint.pt")
        how = f"resume with: python {SCRIPT} --resume {run_dir}" if saved else "no checkpoint had been written yet"
        os.write(sys.stdout.fileno(), f"\nstopped by {signal.Signals(signum).name}; {how}\n".encode())
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    next_obs = torch.from_numpy(envs.reset()).to(device)  # a restored env's: the frames it stopped at
    start_time, start_step = time.time(), global_step  # SPS and the ETA: this start's mean rate
    try:
        while iteration < num_iterations:
            phase, phase_start = phase + 1, time.time()
            # ============ Policy phase: N_pi iterations of a rollout, then E_pi and E_V epochs on it ============
            for i in range(min(args.n_pi, num_iterations - iteration)):
                iteration += 1
                slot = i if plan["aux_phases"] else 0  # B holds N_pi rollouts; without aux phases, one
                ro = {k: v[slot * args.num_envs : (slot + 1) * args.num_envs] for k, v in buffers.items()}  # views
                if args.anneal_lr:  # every Adam's, by the planned total (a raised one too); the aux phase keeps it
                    for group in [group for optimizer in optimizers for group in optimizer.param_groups]:
                        group["lr"] = args.learning_rate * (1 - (iteration - 1) / num_iterations)
                next_obs, global_step, next_value, episodes = collect_rollout(agent, envs, next_obs, ro, global_step)
                explained_variance = compute_targets(ro, next_value, args, reward_normalizer)  # V_hat and A
                for step, ep_return, length in episodes:
                    writer.add_scalar("charts/episodic_return", ep_return, step)
                    writer.add_scalar("charts/episodic_length", length, step)
                    recent_returns.append(ep_return)
                batch = {k: v.flatten(0, 1) for k, v in ro.items()}  # the rollout's states
                stats = policy_phase_update(agent, policy_optimizer, batch, args, value_optimizer)
                for k, v in dict(stats, explained_variance=explained_variance).items():
                    writer.add_scalar(f"losses/{k}", v, global_step)
                writer.add_scalar("charts/learning_rate", policy_optimizer.param_groups[0]["lr"], global_step)
                sps = (global_step - start_step) / (time.time() - start_time)
                writer.add_scalar("charts/SPS", int(sps), global_step)
                progress = f"phase {phase}/{plan['num_phases']} iter {iteration}/{num_iterations} step {global_step:,}"
                mean_return = f"{np.mean(recent_returns):.2f}" if recent_returns else "- (none ended yet)"  # last 100
                losses = f"policy_loss {stats['policy_loss']:.4f} value_loss {stats['value_loss']:.4f}"
                minutes = round((num_iterations - iteration) * batch_size / sps / 60)  # at this start's mean rate, so
                eta = f"{minutes // 60}h{minutes % 60:02d}m"  # short by the aux phases' share until its first has run
                print(f"{progress} SPS {sps:.0f} ETA {eta} return {mean_return} {losses}", flush=True)
            # ============ Auxiliary phase: snapshot pi_old, E_aux epochs over B (then B is refilled) ============
            aux_epochs, aux_start = [], time.time()
            if args.e_aux > 0 and iteration < num_iterations:  # none after the last rollout: nothing would use it
                aux_epochs = auxiliary_phase(agent, aux_optimizer, buffers, args)
                aux_epochs_done += len(aux_epochs)
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB to GiB
            peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else peak
            seconds = f"{time.time() - phase_start:.1f}s (aux phase {time.time() - aux_start:.1f}s)"
            print(f"phase {phase} done in {seconds}; peak {'GPU ' * (device.type == 'cuda')}memory {peak:.2f} GiB")
            # ---- The phase boundary: the checkpoint --resume continues from, written atomically ----
            for k, v in (aux_epochs[-1] if aux_epochs else {}).items():  # the aux phase's last epoch, on env steps
                writer.add_scalar(f"aux_phase/{k}", v, global_step)
            for epoch, epoch_stats in enumerate(aux_epochs):  # x-axis: aux epochs run
                for k, v in epoch_stats.items():
                    writer.add_scalar(f"aux/{k}", v, aux_epochs_done - len(aux_epochs) + 1 + epoch)
            writer.flush()  # the phase's log on disk, its length in the checkpoint: a kill after it loses none of it
            events = {n: os.path.getsize(f"{run_dir}/{n}") for n in os.listdir(run_dir) if "tfevents" in n}
            state = dict(script=SCRIPT, run_name=run_name, args=dict(vars(args), micro_batch_size=micro_batch_flag))
            state.update(phase=phase, global_step=global_step, aux_epochs_done=aux_epochs_done, events=events)
            state.update(wandb_id=wandb.run.id if args.track else ckpt and ckpt["wandb_id"])  # kept for --track
            with open(f"{run_dir}/checkpoint.pt.tmp", "wb") as f:
                torch.save(dict(state, **{name: get() for name, (get, _) in parts.items()}), f)
                os.fsync(f.fileno())  # on disk before the rename: a crash leaves the last checkpoint whole
            os.replace(f"{run_dir}/checkpoint.pt.tmp", f"{run_dir}/checkpoint.pt")
    finally:
        writer.close()
    envs.env.close()
    print(f"checkpoint: {run_dir}/checkpoint.pt; evaluate it: python tools/evaluate.py {run_dir}/checkpoint.pt")


if __name__ == "__main__":
    # The flags named on the command line (--no-cuda names cuda), by our names: --resume tells them apart
    given = {a[2:].split("=")[0].replace("-", "_").removeprefix("no_") for a in sys.argv[1:] if a.startswith("--")}
    aliases = dict(n_iteration="n_pi", e_policy="e_pi", e_auxiliary="e_aux", num_aux_rollouts="aux_mb_trajectories")
    # CleanRL's flags that have no namesake here: what to use instead
    cleanrl = dict(v_value="--e-v", n_aux_grad_accum="--micro-batch-size", clip_vloss="the value loss is unclipped")
    cleanrl.update(capture_video="tools/evaluate.py --capture-video", vf_coef="the value network's loss is unweighted")
    cleanrl.update(target_kl="--aux-kl-stop (aux phase)", adv_norm_fullbatch="advantages are normalised per rollout")
    cleanrl.update(save_model="runs/<run>/checkpoint.pt holds the weights after every phase")
    for name in sorted(given & cleanrl.keys()):
        sys.exit(f"error: --{name.replace('_', '-')} is CleanRL's flag: here {cleanrl[name]}")
    main(tyro.cli(Args), {aliases.get(name, name) for name in given})
