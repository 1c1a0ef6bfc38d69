"""Phasic Policy Gradient (Cobbe, Hilton, Klimov and Schulman 2020, arXiv 2009.04416) on Atari, in one file.

Read it from the top: the flags, the envs, the two networks, the losses, the buffer B, the rollout, the targets, the
two phases, and main(), which follows the paper's Algorithm 1. Below the banner that comes after main() is the run's
plumbing (seeds, flag checks, resume, the run's folder and its lock, W&B, memory planning, checkpoints, signals,
progress lines); a change to the algorithm seldom needs to touch it.
"""

import dataclasses
import fcntl
import glob
import math
import os
import random
import shlex
import shutil
import signal
import sys
import time
from collections import defaultdict, deque
from typing import Dict, List, Literal, NamedTuple, Optional

import ale_py
import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import tyro
from torch.utils.tensorboard import SummaryWriter

OBS_SHAPE = (84, 84, 4)  # height, width, channels: 84x84 gray frames, the last 4 stacked as channels
NUM_ACTIONS = 18  # the full Atari action set, for the memory check
# The activations of one state in one network's update at fp32: 0.29 MB (measured: docs/runs.md), plus 25%
ACTIVATION_BYTES = 360_000
SCRIPT = os.path.basename(__file__)


# Flags -------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Args:
    exp_name: str = SCRIPT[:-3]  # the experiment's name; a run's folder is runs/{env_id}__{exp_name}__{seed}__{time}
    seed: int = 1  # seeds python, numpy, torch and the envs (env i takes seed + i); in [0, 2^31)
    cuda: bool = True  # if toggled, train on a GPU when one is visible
    resume: Optional[str] = None  # continue the run saved in this folder (or in this checkpoint file)
    track: bool = False  # if toggled, mirror the TensorBoard log to Weights & Biases
    wandb_project_name: str = "ppg"  # the W&B project that --track logs to
    wandb_entity: Optional[str] = None  # the W&B user or team that --track logs to
    env_id: str = "BreakoutNoFrameskip-v4"  # the game: a v4 id (no sticky actions) or a v5 id as ALE/Breakout-v5
    repeat_action_probability: Optional[float] = None  # sticky actions (unset: 0 for v4 ids, 0.25 for v5 ids)
    episodic_life: bool = True  # if toggled, a lost life ends a training episode
    clip_rewards: bool = True  # if toggled, train on the sign of each reward
    max_episode_frames: int = 108_000  # the most frames of a game (30 minutes)
    total_timesteps: int = 10_000_000  # env steps to train for (rounded up to whole rollouts)
    learning_rate: float = 2.5e-4  # Adam's learning rate in both phases (constant unless annealed)
    anneal_lr: bool = False  # if toggled, anneal the learning rate linearly to 0 over the run (PPO's Atari recipe)
    num_envs: int = 8  # parallel envs
    num_steps: int = 128  # steps of each env per rollout
    gamma: float = 0.99  # the discount of GAE and of the value targets
    gae_lambda: float = 0.95  # the lambda of GAE
    norm_reward: bool = False  # if toggled, divide the rewards by the running std of their discounted return
    reward_norm_gamma: float = 0.99  # the discount of that return (as in the released code)
    num_minibatches: int = 4  # PPO minibatches per epoch
    clip_coef: float = 0.1  # the epsilon of PPO's clipped objective L_clip (0: no clipping)
    kl_penalty: float = 0.0  # the weight of the KL penalty (the paper's L_KL objective: --clip-coef 0 --kl-penalty 1)
    ent_coef: float = 0.01  # the weight of the entropy bonus
    max_grad_norm: float = 0.0  # clip the gradient norm of each network apart to this (0: no clipping)
    # dual: a policy network and a value network; detach: one network, whose value head reads detached features;
    # shared: one network trained by the sum of the losses (PPO)
    arch: Literal["dual", "detach", "shared"] = "dual"
    n_pi: int = 32  # N_pi: rollouts per policy phase
    e_pi: int = 1  # E_pi: policy epochs per rollout
    e_v: int = 1  # E_V: value epochs per rollout
    e_aux: int = 6  # E_aux: epochs per auxiliary phase (0: no auxiliary phase)
    beta_clone: float = 1.0  # beta_clone: the weight of KL(pi_old || pi) in the auxiliary loss
    aux_mb_trajectories: int = 4  # trajectories (rows of B) per auxiliary minibatch
    # end an auxiliary phase early once an epoch's mean KL(pi_old || pi) exceeds this (0: never)
    aux_kl_stop: float = 0.0
    # states per backward pass (0: whole minibatches; unset: 256 on a CPU, on a GPU whole minibatches where they fit)
    micro_batch_size: Optional[int] = None
    # fp32; tf32: TensorFloat-32 matrix products (GPUs only); bf16: the trunks in bfloat16, the heads and losses in fp32
    precision: Literal["fp32", "tf32", "bf16"] = "fp32"


# Envs --------------------------------------------------------------------------------------------
class AleProtocol(NamedTuple):
    ale_id: str  # the v5 id, whose vector env ale-py has
    sticky: float  # the probability of repeating the last action
    noop_max: int  # the largest number of no-op actions that begin each game
    fire_reset: bool  # whether each game waits for the FIRE action to start


def ale_protocol(env_id: str) -> AleProtocol:
    """DQN's protocol for v4 ids, Machado et al.'s for v5 ids."""
    if env_id.endswith("NoFrameskip-v4"):
        return AleProtocol(f"ALE/{env_id[: -len('NoFrameskip-v4')]}-v5", 0.0, 30, True)
    return AleProtocol(env_id, 0.25, 0, False)


class AtariVecEnv:
    """ale-py's frames (4 frames skipped per step, max-pooled, 84x84 gray, 4 stacked) as uint8, channels last."""

    def __init__(self, args: Args, num_envs: int, seed: int):
        game = ale_protocol(args.env_id)
        sticky = game.sticky
        if args.repeat_action_probability is not None:
            sticky = args.repeat_action_probability
        frames = dict(frameskip=4, maxpool=True, img_height=84, img_width=84, grayscale=True, stack_num=4)
        # ale-py's own life loss and reward clipping are off (its life loss resets the game): step() does both
        protocol = dict(repeat_action_probability=sticky, noop_max=game.noop_max, use_fire_reset=game.fire_reset)
        protocol.update(max_num_frames_per_episode=args.max_episode_frames, episodic_life=False, reward_clipping=False)
        self.env = gym.make_vec(
            game.ale_id, num_envs, "vector_entry_point", autoreset_mode="SameStep", **frames, **protocol
        )
        self.args, self.seed, self.num_envs = args, seed, num_envs
        self.num_actions = self.env.single_action_space.n
        self.returns = np.zeros(num_envs, dtype=np.float64)
        self.lengths = np.zeros(num_envs, dtype=np.int64)
        # The envs whose game started afresh when the run was resumed: all of them, as ale-py cannot save a game
        self.new_games = np.ones(num_envs, dtype=bool)

    def reset(self):
        obs, info = self.env.reset(seed=self.seed)  # env i takes seed + i
        self.lives = info["lives"].copy()
        return np.ascontiguousarray(obs.transpose(0, 2, 3, 1))  # (envs, stack, H, W) -> (envs, H, W, stack)

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass  # nothing to restore: every env starts a new game

    def step(self, actions):
        obs, rewards, terminated, truncated, info = self.env.step(actions.astype(np.int64))
        game_over = terminated | truncated
        life_lost = (info["lives"] < self.lives) & ~game_over  # at a game's end, lives are the new game's
        self.lives = info["lives"].copy()
        self.returns += rewards
        self.lengths += 1
        finished = [(i, float(self.returns[i]), int(self.lengths[i])) for i in np.flatnonzero(game_over)]
        self.returns[game_over] = 0.0
        self.lengths[game_over] = 0
        train_rewards = np.sign(rewards) if self.args.clip_rewards else rewards
        train_dones = game_over | life_lost if self.args.episodic_life else game_over
        return np.ascontiguousarray(obs.transpose(0, 2, 3, 1)), train_rewards.astype(np.float32), train_dones, finished


# Networks ----------------------------------------------------------------------------------------
def orthogonal_init_(layer, gain: float):
    """The initialisation of the PPO Atari recipe: orthogonal weights of this gain, and a zero bias."""
    nn.init.orthogonal_(layer.weight, gain)
    nn.init.zeros_(layer.bias)
    return layer


class NatureEncoder(nn.Module):
    """The Nature DQN network: uint8 frame stacks in, 512 features out."""

    def __init__(self, obs_shape, out_features=512):
        super().__init__()
        h, w, c = obs_shape
        layers = []
        for i, o, k, stride in [(c, 32, 8, 4), (32, 64, 4, 2), (64, 64, 3, 1)]:
            layers.append(orthogonal_init_(nn.Conv2d(i, o, k, stride=stride), math.sqrt(2)))
            layers.append(nn.ReLU())
        self.convs = nn.Sequential(*layers)
        flat = self.convs(torch.zeros(1, c, h, w)).numel()
        self.dense = orthogonal_init_(nn.Linear(flat, out_features), math.sqrt(2))
        self.out_features = out_features

    def forward(self, obs_uint8):
        # The one place where frames become floats. The permute keeps the memory in NHWC order, faster on a CPU.
        x = self.convs(obs_uint8.permute(0, 3, 1, 2).float().div_(255.0))
        return F.relu(self.dense(x.flatten(1)))


class AgentOutput(NamedTuple):  # read its fields by name, never by position
    logits: torch.Tensor  # the policy's logits (policy network)
    value: torch.Tensor  # V, the value head (value network)
    aux_value: torch.Tensor  # the auxiliary value head (policy network)
    heads: Dict[str, torch.Tensor] = {}  # the outputs of extra_heads, by name


class PPGAgent(nn.Module):
    def __init__(self, args: Args, obs_shape, num_actions: int):
        super().__init__()
        self.arch, self.bf16 = args.arch, args.precision == "bf16"
        self.pi_trunk = NatureEncoder(obs_shape)
        width = self.pi_trunk.out_features
        self.pi_head = orthogonal_init_(nn.Linear(width, num_actions), 0.01)
        self.aux_value_head = orthogonal_init_(nn.Linear(width, 1), 1.0)
        self.v_trunk = NatureEncoder(obs_shape) if self.arch == "dual" else None
        self.value_head = orthogonal_init_(nn.Linear(width, 1), 1.0)
        # A new head on the policy trunk goes in extra_heads (docs/hacking.md). Build it only when its flag is on:
        # building a layer draws its initial weights from torch's random stream, which changes every later draw.
        self.extra_heads = nn.ModuleDict()

    def forward(self, obs, policy: bool = True, value: bool = True) -> AgentOutput:
        """Runs the policy network if `policy` and the value network if `value`; the outputs of a network that did
        not run are None. With --arch dual the two are apart; otherwise V reads the policy trunk's features."""
        h, v = None, None
        # With bf16, the trunks run under autocast, and the heads and losses stay in fp32
        with torch.autocast(obs.device.type, torch.bfloat16, enabled=self.bf16):
            if policy or self.arch != "dual":
                h = self.pi_trunk(obs).float()
            if value and self.arch == "dual":
                v = self.v_trunk(obs).float()
        if self.arch == "detach":
            v = h.detach()
        if self.arch == "shared":
            v = h
        logits, value_out, aux_value, heads = None, None, None, {}
        if h is not None:
            logits = self.pi_head(h)
            aux_value = self.aux_value_head(h).squeeze(-1)
            heads = {name: head(h) for name, head in self.extra_heads.items()}
        if v is not None:
            value_out = self.value_head(v).squeeze(-1)
        return AgentOutput(logits, value_out, aux_value, heads)

    def value_parameters(self):  # theta_V
        trunk = list(self.v_trunk.parameters()) if self.v_trunk else []
        return trunk + list(self.value_head.parameters())

    def policy_parameters(self):  # theta_pi: every parameter outside the value network
        value = {id(p) for p in self.value_parameters()}
        return [p for p in self.parameters() if id(p) not in value]


# Losses ------------------------------------------------------------------------------------------
# gradient_step hands a loss one chunk of a minibatch at a time (--micro-batch-size), so a statistic taken inside a
# loss (a std, say) is the chunk's, not the minibatch's: docs/hacking.md says where to compute one instead.
def kl_divergence(p_logits, q_logits):
    p_logp = F.log_softmax(p_logits, dim=-1)
    return (p_logp.exp() * (p_logp - F.log_softmax(q_logits, dim=-1))).sum(-1).mean()


def policy_phase_loss(out: AgentOutput, mb: Dict, args: Args, policy: bool = True, value: bool = True):
    """L_clip (or L_KL) with the entropy bonus if `policy`, plus L_value if `value`."""
    loss, stats = 0.0, {}
    if policy:
        logprobs = F.log_softmax(out.logits, dim=-1)
        logratio = logprobs.gather(-1, mb["actions"].unsqueeze(-1)).squeeze(-1) - mb["logprobs"]
        ratio, adv = logratio.exp(), mb["advantages"]
        pg_loss = -adv * ratio
        if args.clip_coef > 0:  # L_clip
            clipped = ratio.clamp(1 - args.clip_coef, 1 + args.clip_coef)
            pg_loss = torch.max(pg_loss, -adv * clipped)
        pg_loss = pg_loss.mean()
        # The penalty of the L_KL objective, written as the released code writes it: half the squared log-ratio
        kl_penalty = args.kl_penalty * 0.5 * logratio.pow(2).mean()
        entropy = -(logprobs.exp() * logprobs).sum(-1).mean()
        loss = loss + pg_loss + kl_penalty - args.ent_coef * entropy
        stats.update(policy_loss=pg_loss, kl_penalty=kl_penalty, entropy=entropy)
        with torch.no_grad():
            stats["approx_kl"] = ((ratio - 1) - logratio).mean()
            stats["clipfrac"] = ((ratio - 1).abs() > args.clip_coef).float().mean()
    if value:  # unclipped, as in the paper
        stats["value_loss"] = 0.5 * (out.value - mb["returns"]).pow(2).mean()
        loss = loss + stats["value_loss"]
    return loss, stats


def aux_phase_loss(out: AgentOutput, mb: Dict, args: Args, policy: bool = True, value: bool = True):
    """L_joint (trains the policy network) if `policy`, plus L_value (trains the value network) if `value`."""
    loss, stats = 0.0, {}
    if policy:
        l_aux = 0.5 * (out.aux_value - mb["returns"]).pow(2).mean()
        l_clone = kl_divergence(mb["pi_old_logits"], out.logits)  # KL(pi_old || pi)
        joint = l_aux + args.beta_clone * l_clone
        loss = loss + joint
        stats.update(aux_value_loss=l_aux, clone_kl=l_clone, joint_loss=joint)
    if value:
        stats["value_loss"] = 0.5 * (out.value - mb["returns"]).pow(2).mean()
        loss = loss + stats["value_loss"]
    return loss, stats


# B, the buffer of the last N_pi rollouts ---------------------------------------------------------
def buffer_fields(num_actions: int):
    """The arrays B holds per step: name -> (shape, dtype). A new target takes an entry here, a line that fills it
    (in collect_rollout or compute_targets) and a loss that reads it."""
    return dict(
        obs=(OBS_SHAPE, torch.uint8),  # frames stay uint8 until the network
        actions=((), torch.long),
        logprobs=((), torch.float32),
        values=((), torch.float32),
        raw_rewards=((), torch.float32),
        rewards=((), torch.float32),  # the rewards trained on (normalised with --norm-reward)
        ended=((), torch.bool),
        advantages=((), torch.float32),
        returns=((), torch.float32),  # V_hat, the value targets
        pi_old_logits=((num_actions,), torch.float32),
    )


# The rollout -------------------------------------------------------------------------------------
@torch.no_grad()
def collect_rollout(agent: PPGAgent, envs, next_obs, ro: Dict, step: int, progress=None):
    """Plays num_steps steps of every env into the rollout's rows `ro` of B. Returns the next observations, their V
    (to bootstrap the targets) and the finished episodes as (env step, return, length)."""
    episodes = []
    rewards = np.zeros(ro["raw_rewards"].shape, np.float32)
    ended = np.zeros(ro["ended"].shape, bool)
    for t in range(ro["obs"].shape[1]):
        ro["obs"][:, t] = next_obs
        out = agent(next_obs)
        # validate_args=False: checking the logits would make the host wait for the device
        pi = torch.distributions.Categorical(logits=out.logits, validate_args=False)
        action = pi.sample()
        ro["actions"][:, t] = action
        ro["logprobs"][:, t] = pi.log_prob(action)
        ro["values"][:, t] = out.value
        # The actions' copy to the host is the one wait for the device per step: the envs need the actions
        obs, rewards[:, t], ended[:, t], finished = envs.step(action.cpu().numpy())
        next_obs = torch.from_numpy(obs).to(next_obs.device)
        step += envs.num_envs
        for _, ep_return, length in finished:
            episodes.append((step, ep_return, length))
        if progress is not None:
            progress.tick("rollout", (t + 1) * envs.num_envs, ro["obs"].shape[:2].numel(), "env steps")
    ro["raw_rewards"].copy_(torch.from_numpy(rewards))
    ro["ended"].copy_(torch.from_numpy(ended))
    return next_obs, agent(next_obs).value, episodes


# The targets -------------------------------------------------------------------------------------
def moments(x: torch.Tensor):
    """Count, mean and variance of x, in float64, with one wait for the device."""
    x = x.double()
    n, total, squares = torch.stack([x.new_tensor(x.numel()), x.sum(), x.square().sum()]).tolist()
    return n, total / n, max(squares / n - (total / n) ** 2, 0.0)


class RewardNormalizer:
    """As released: divides rewards by the running std of their discounted return, and clips them to [-10, 10]."""

    def __init__(self, num_envs: int, gamma: float):
        self.gamma = gamma
        self.ret = np.zeros(num_envs, dtype=np.float64)
        self.mean, self.var, self.count = 0.0, 1.0, 1e-4

    def __call__(self, rewards: np.ndarray, dones: np.ndarray):
        rets = np.empty(rewards.shape, dtype=np.float64)
        for t in range(rewards.shape[1]):
            self.ret = self.ret * self.gamma + rewards[:, t]
            rets[:, t] = self.ret
            self.ret[dones[:, t]] = 0.0  # the episode ended with this reward
        # Merge the rollout's moments into the running ones (Chan et al.'s parallel algorithm)
        n, mean, var = moments(torch.from_numpy(rets))
        delta, total = mean - self.mean, self.count + n
        self.mean += delta * n / total
        m2 = self.var * self.count + var * n + delta**2 * self.count * n / total
        self.var, self.count = m2 / total, total
        return np.clip(rewards / np.sqrt(self.var + 1e-8), -10, 10).astype(np.float32)

    def state_dict(self):
        return dict(mean=self.mean, var=self.var, count=self.count, ret=self.ret.tolist())

    def load_state_dict(self, state):
        self.mean, self.var, self.count = state["mean"], state["var"], state["count"]
        self.ret = np.array(state["ret"], dtype=np.float64)


def compute_gae(rewards, values, ended, next_value, gamma: float, lam: float):
    advantages = torch.zeros_like(rewards)
    last = torch.zeros_like(next_value)
    for t in reversed(range(rewards.shape[1])):
        following = next_value if t == rewards.shape[1] - 1 else values[:, t + 1]
        alive = 1.0 - ended[:, t].float()
        delta = rewards[:, t] + gamma * following * alive - values[:, t]
        last = delta + gamma * lam * alive * last
        advantages[:, t] = last
    return advantages, advantages + values


def compute_targets(ro: Dict, next_value, args: Args, reward_normalizer: RewardNormalizer):
    """Writes the rollout's rewards, value targets V_hat and advantages (normalised over the rollout) into B.
    Returns the explained variance of V_hat by the values V, 1 - Var(V_hat - V) / Var(V_hat) (nan if Var(V_hat) is 0)."""
    raw, ended, values = ro["raw_rewards"].cpu(), ro["ended"].cpu(), ro["values"].cpu()
    rewards = raw
    if args.norm_reward:
        rewards = torch.from_numpy(reward_normalizer(raw.numpy(), ended.numpy()))
    gae = compute_gae(rewards, values, ended, next_value.cpu(), args.gamma, args.gae_lambda)
    advantages, returns = gae
    _, mean, var = moments(advantages)
    ro["rewards"].copy_(rewards)
    ro["returns"].copy_(returns)
    ro["advantages"].copy_((advantages - mean) / (math.sqrt(var) + 1e-8))
    var_returns = moments(returns)[2]
    return 1 - moments(returns - values)[2] / var_returns if var_returns > 0 else math.nan


# The two phases ----------------------------------------------------------------------------------
def gradient_step(agent: PPGAgent, optimizer, mb: Dict, args: Args, chunk_size: int, loss_fn, policy, value):
    """One optimizer step on the mean of loss_fn over the minibatch mb, taken in chunks of chunk_size states (0: whole),
    each weighted by its share of mb: less memory, the same gradient. `policy` and `value` say which networks run."""
    n, stats = mb["obs"].shape[0], {}
    size = chunk_size or n
    for start in range(0, n, size):
        part = slice(start, min(start + size, n))
        weight = (part.stop - part.start) / n
        chunk = {k: v[part] for k, v in mb.items()}
        out = agent(chunk["obs"], policy=policy, value=value)
        loss, chunk_stats = loss_fn(out, chunk, args, policy=policy, value=value)
        (loss * weight).backward()
        for k, v in chunk_stats.items():
            stats[k] = stats.get(k, 0.0) + weight * v.detach()
    if args.max_grad_norm > 0:  # the norm of each network apart
        for network in (agent.policy_parameters(), agent.value_parameters()):
            nn.utils.clip_grad_norm_(network, args.max_grad_norm)
    optimizer.step()
    # Every optimizer holds every parameter. Setting the gradients to None (not 0) makes Adam skip the parameters
    # that the next loss does not reach, so a step moves only the network it trains.
    optimizer.zero_grad(set_to_none=True)
    return stats


def ppo_epochs(agent: PPGAgent, optimizer, batch: Dict, args: Args, epochs, logs, chunk_size, progress, policy, value):
    """`epochs` passes over the rollout in num_minibatches random minibatches, training as `policy` and `value` say."""
    n = batch["obs"].shape[0]
    for epoch in range(epochs):
        for i, idx in enumerate(torch.randperm(n, device=batch["obs"].device).split(n // args.num_minibatches)):
            mb = {k: v[idx] for k, v in batch.items() if k != "pi_old_logits"}
            stats = gradient_step(agent, optimizer, mb, args, chunk_size, policy_phase_loss, policy, value)
            for k, v in stats.items():
                logs[k].append(v)
            if progress is not None:
                progress.tick("update", epoch * args.num_minibatches + i + 1, epochs * args.num_minibatches, "steps")


def policy_phase_update(agent, optimizer, batch: Dict, args: Args, value_optimizer=None, chunk_size=0, progress=None):
    """The E_pi policy epochs and E_V value epochs on one rollout, as in the released code."""
    logs = defaultdict(list)
    if args.e_pi == args.e_v:  # each step trains both networks, on the sum of their losses
        ppo_epochs(agent, optimizer, batch, args, args.e_pi, logs, chunk_size, progress, policy=True, value=True)
    else:  # the value network's epochs first, with an Adam of their own, then the policy network's
        ppo_epochs(agent, value_optimizer, batch, args, args.e_v, logs, chunk_size, progress, policy=False, value=True)
        ppo_epochs(agent, optimizer, batch, args, args.e_pi, logs, chunk_size, progress, policy=True, value=False)
    return minibatch_means(logs, "policy phase")


def auxiliary_phase(agent: PPGAgent, optimizer, buffers: Dict, args: Args, chunk_size: int = 0, progress=None):
    """Stores pi_old in B, then trains both networks for E_aux epochs on minibatches of whole trajectories. With
    --aux-kl-stop, the phase ends after an epoch whose mean KL(pi_old || pi) exceeds it. Returns each epoch's means."""
    obs, epochs = buffers["obs"], []
    # pi_old is the policy as the policy phase left it, kept as logits
    states = chunk_size or args.aux_mb_trajectories * args.num_steps
    with torch.no_grad():
        logits = [agent(part, value=False).logits for part in obs.flatten(0, 1).split(states)]
        buffers["pi_old_logits"].copy_(torch.cat(logits).view(*obs.shape[:2], -1))
    for epoch in range(1, args.e_aux + 1):
        logs, epoch_start = defaultdict(list), time.time()
        minibatches = torch.randperm(obs.shape[0], device=obs.device).split(args.aux_mb_trajectories)
        for i, rows in enumerate(minibatches):
            mb = {k: v[rows].flatten(0, 1) for k, v in buffers.items()}
            stats = gradient_step(agent, optimizer, mb, args, chunk_size, aux_phase_loss, policy=True, value=True)
            for k, v in stats.items():
                logs[k].append(v)
            if progress is not None:
                progress.tick(f"aux epoch {epoch}", i + 1, len(minibatches), "minibatches")
        means = minibatch_means(logs, "auxiliary phase")
        epochs.append(means)
        losses = f"aux_value_loss {means['aux_value_loss']:.4f} clone_kl {means['clone_kl']:.5f}"
        print(f"aux epoch {epoch}/{args.e_aux}: {losses} ({time.time() - epoch_start:.1f}s)", flush=True)
        if 0 < args.aux_kl_stop < means["clone_kl"] and epoch < args.e_aux:
            print(f"KL guard: mean KL(pi_old || pi) {means['clone_kl']:.4f} > --aux-kl-stop: the aux phase stops")
            break
    return epochs


# Algorithm 1 -------------------------------------------------------------------------------------
def main(args: Args, given: set):
    run = setup(args, given)  # the flags checked, the run's folder, lock and log opened: below the banner
    if run is None:
        return
    stop_on_signals(run)  # from here on, SIGTERM and Ctrl-C stop the run with a line that says how to resume it
    args, plan, device, chunk_size = run.args, run.plan, run.device, run.chunk_size
    phase = run.ckpt["phase"] if run.ckpt else 0
    global_step = run.ckpt["global_step"] if run.ckpt else 0
    batch_size = args.num_envs * args.num_steps
    iteration, start_step = global_step // batch_size, global_step
    try:  # from here on, a fresh run stopped before its first rollout ended leaves no folder
        seed = seed_everything(args, phase)
        envs = AtariVecEnv(args, args.num_envs, seed)
        agent = PPGAgent(args, OBS_SHAPE, envs.num_actions).to(device)  # theta_pi and theta_V
        # As released, one Adam per phase, and a third for the value epochs when E_pi != E_V; each holds every parameter
        optimizers = [torch.optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-8) for _ in range(3)]
        policy_optimizer, aux_optimizer, value_optimizer = optimizers
        reward_normalizer = RewardNormalizer(args.num_envs, args.reward_norm_gamma)
        buffers = {}  # B: for each field of buffer_fields, an array of (trajectories, steps) items
        for name, (shape, dtype) in buffer_fields(envs.num_actions).items():
            buffers[name] = torch.zeros(plan["trajectories"], args.num_steps, *shape, dtype=dtype, device=device)
        recent_returns = deque(maxlen=100)
        stateful = dict(agent=agent, policy_optimizer=policy_optimizer, aux_optimizer=aux_optimizer)
        stateful.update(value_optimizer=value_optimizer, reward_normalizer=reward_normalizer, envs=envs)
        if run.ckpt:
            restore(run, stateful, recent_returns)
        next_obs = torch.from_numpy(envs.reset()).to(device)
        progress = Progress(plan, batch_size, start_step)
        while iteration < plan["num_iterations"]:
            phase, phase_start = phase + 1, time.time()
            # The policy phase: N_pi rollouts, each followed by E_pi policy epochs and E_V value epochs
            for i in range(min(args.n_pi, plan["num_iterations"] - iteration)):
                iteration += 1
                # Rollout i fills rows i * num_envs to (i + 1) * num_envs of B (views into it); without an
                # auxiliary phase, B holds one rollout
                slot = i if plan["aux_phases"] else 0
                ro = {k: v[slot * args.num_envs : (slot + 1) * args.num_envs] for k, v in buffers.items()}
                next_obs, next_value, episodes = collect_rollout(agent, envs, next_obs, ro, global_step, progress)
                global_step += batch_size
                if args.anneal_lr:  # the rate of this rollout's update, logged at its step as the losses are
                    lr = anneal_learning_rate(optimizers, args, iteration, plan["num_iterations"])
                    run.writer.add_scalar("charts/learning_rate", lr, global_step)
                explained_variance = compute_targets(ro, next_value, args, reward_normalizer)
                for step, ep_return, length in episodes:
                    run.writer.add_scalar("charts/episodic_return", ep_return, step)
                    run.writer.add_scalar("charts/episodic_length", length, step)
                    recent_returns.append(ep_return)
                batch = {k: v.flatten(0, 1) for k, v in ro.items()}
                stats = policy_phase_update(agent, policy_optimizer, batch, args, value_optimizer, chunk_size, progress)
                for name, value in dict(stats, explained_variance=explained_variance).items():
                    run.writer.add_scalar("losses/" + name, value, global_step)
                progress.rollout_done(run.writer, phase, iteration, global_step, recent_returns)
            # The auxiliary phase: pi_old, then E_aux epochs over B (none after the last rollout)
            aux_epochs, aux_start = [], time.time()
            if args.e_aux > 0 and iteration < plan["num_iterations"]:
                aux_epochs = auxiliary_phase(agent, aux_optimizer, buffers, args, chunk_size, progress)
            log_aux_phase(run, aux_epochs, global_step)
            print(f"phase {phase} done in {time.time() - phase_start:.1f}s (aux {time.time() - aux_start:.1f}s)")
            # The end of a phase is where a resumed run goes on from. The log is flushed first, so that a kill
            # after the checkpoint loses none of the phase's log.
            run.writer.flush()
            save_checkpoint(run.dir, dict(run.header, phase=phase, global_step=global_step), stateful, recent_returns)
    finally:
        close_run(run, trained=global_step > start_step)
    envs.env.close()
    print(evaluate_hint(run))


# =====================================================================================================================
# The run's plumbing: seeds, the schedule of --anneal-lr, the NaN check, flag checks, resume, the run's folder and its
# lock, W&B, memory planning, checkpoints, signals, progress lines. Above is PPG; below is what runs it.
# =====================================================================================================================

BASE_SCRIPT = "ppg_atari.py"  # the script this file is, or was copied from (checkpoints record it: tools/ reads it)
HERE = os.path.dirname(os.path.abspath(__file__))
# Flags of older versions, fixed at the one value they always took: a checkpoint that holds one at that value resumes
RETIRED_FLAGS = {"torch_deterministic": True}
# Flags of CleanRL's ppg_procgen.py that this script names otherwise or lacks, with what to use instead
CLEANRL_FLAGS = dict(
    n_iteration="--n-pi",
    e_policy="--e-pi",
    v_value="--e-v",
    e_auxiliary="--e-aux",
    num_aux_rollouts="--aux-mb-trajectories",
    n_aux_grad_accum="--aux-mb-trajectories for larger aux minibatches (--micro-batch-size saves memory)",
    target_kl="--aux-kl-stop, which ends an auxiliary phase early (no flag ends the policy epochs early)",
    capture_video="tools/evaluate.py CHECKPOINT --capture-video",
    batch_size="--num-envs and --num-steps",
    minibatch_size="--num-minibatches",
    num_iterations="--total-timesteps",
    num_phases="--total-timesteps and --n-pi",
    aux_batch_rollouts="--n-pi",
)
# Flags of CleanRL's ppg_procgen.py for what this script always does, as the released code does
CLEANRL_AS_RELEASED = ["torch_deterministic", "adv_norm_fullbatch", "clip_vloss", "vf_coef"]


def answer_cleanrl_flags(argv):
    """Stops, in one line, on a flag of CleanRL's ppg_procgen.py that this script does not have."""
    for name in sorted(named_flags(argv) & {*CLEANRL_FLAGS, *CLEANRL_AS_RELEASED}):
        what = f"use {CLEANRL_FLAGS[name]}" if name in CLEANRL_FLAGS else "drop it: this script always does as released"
        sys.exit(f"error: --{name.replace('_', '-')} is a flag of CleanRL's ppg_procgen.py: {what}")


def seed_everything(args: Args, phase: int) -> int:
    """Seeds python, numpy and torch, and returns the seed of the envs.

    A fresh run starts at phase 0 with --seed. A resumed run restores every random stream from its checkpoint right
    after this, so there the seed reaches only the envs it creates. Procgen's envs then load their saved games, but
    Atari's start new games, which should differ from the games the run played before: so the seed moves on by
    100_003 per finished phase, a step larger than any --num-envs, so that the new games are not those of a run given
    a nearby seed either. Atari's env i takes seed + i: the modulus 2^31 - num_envs keeps every env's seed below 2^31.
    """
    seed = (args.seed + 100_003 * phase) % (2**31 - args.num_envs)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.backends.cudnn.deterministic = True
    return seed


def anneal_learning_rate(optimizers, args: Args, iteration: int, num_iterations: int):
    """--anneal-lr: the rate of every optimizer falls linearly from --learning-rate at the first rollout towards 0 at
    the last, as in PPO's Atari recipe."""
    lr = args.learning_rate * (1.0 - (iteration - 1.0) / num_iterations)
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["lr"] = lr
    return lr


def minibatch_means(logs: Dict, where: str):
    """The mean of each statistic over the minibatches, with one wait for the device. NaN or inf stops the run."""
    means = dict(zip(logs, torch.stack([torch.stack(v).mean() for v in logs.values()]).tolist()))
    bad = [k for k, v in means.items() if not math.isfinite(v)]
    if bad:
        sys.exit(f"error: non-finite {', '.join(bad)} in the {where}; the last checkpoint is kept")
    return means


def make_plan(args: Args, start_step: int = 0, start_phase: int = 0):
    """Checks the flags, and counts the run's rollouts, phases and aux phases, and the rows of B."""
    positive = ["num_envs", "num_steps", "num_minibatches", "n_pi", "e_pi", "e_v"]
    positive += ["total_timesteps", "aux_mb_trajectories", "learning_rate", "max_episode_frames"]
    for name, value in vars(args).items():
        if type(value) not in (int, float):
            continue
        rule, ok = ">= 0", 0 <= value < math.inf  # nan fails every comparison
        if name in positive:
            rule, ok = "> 0", 0 < value < math.inf
        if name in ["gamma", "gae_lambda", "reward_norm_gamma"]:
            rule, ok = "in [0, 1]", 0 <= value <= 1
        if name == "seed":
            rule, ok = "in [0, 2^31)", 0 <= value < 2**31
        if name == "repeat_action_probability":
            rule, ok = "in [0, 1)", 0 <= value < 1
        if not ok:
            sys.exit(f"error: --{name.replace('_', '-')} must be a finite number {rule} (got {value})")
    gym.register_envs(ale_py)
    ale_id = ale_protocol(args.env_id).ale_id
    if ale_id not in gym.registry or not ale_id.endswith("-v5"):  # only v5 ids have ale-py's vector env
        sys.exit(f"error: --env-id {args.env_id}: not an ale-py game id, as BreakoutNoFrameskip-v4 or ALE/Breakout-v5")
    if args.clip_coef == 0 and args.kl_penalty == 0:
        sys.exit("error: --clip-coef 0 leaves the policy step unbounded: add --kl-penalty 1")
    batch_size = args.num_envs * args.num_steps
    if batch_size % args.num_minibatches:
        sys.exit(f"error: --num-minibatches must divide the {batch_size} states of a rollout")
    num_iterations = math.ceil(args.total_timesteps / batch_size)
    phases_left = math.ceil((num_iterations - start_step // batch_size) / args.n_pi)
    aux_phases = 0  # no auxiliary phase follows the last rollout
    if args.e_aux > 0 and phases_left > 0:
        aux_phases = phases_left - 1
    trajectories = args.num_envs
    if aux_phases:
        trajectories = args.n_pi * args.num_envs
    if aux_phases and trajectories % args.aux_mb_trajectories:
        sys.exit(f"error: --aux-mb-trajectories must divide the {trajectories} trajectories of B")
    plan = dict(num_iterations=num_iterations, num_phases=start_phase + phases_left)
    return dict(plan, aux_phases=aux_phases, trajectories=trajectories)


def named_flags(argv):
    """The names of the flags on a command line, as Args names them (--no-cuda names cuda)."""
    return {word[2:].split("=")[0].replace("-", "_").removeprefix("no_") for word in argv if word[:2] == "--"}


def resume_args(args: Args, given: set):
    """The resumed run's flags, its checkpoint and its folder. The flags keep the run's values, except those in
    may_change that are given on the command line."""
    path = args.resume
    if os.path.isdir(path):
        if not os.path.exists(os.path.join(path, "checkpoint.pt")):
            runs = sorted(glob.glob(os.path.join(path, "*", "checkpoint.pt")))
            if runs:
                example = os.path.dirname(runs[-1])
                sys.exit(f"error: --resume {path}: a folder of runs, not a run: name one, as --resume {example}")
            sys.exit(f"error: --resume {path}: no checkpoint (stopped before its first phase ended)")
        path = os.path.join(path, "checkpoint.pt")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
        if state["script"] != SCRIPT:
            raise ValueError(f"written by {state['script']}")
    except Exception as e:
        sys.exit(f"error: --resume {path}: not a readable checkpoint of {SCRIPT} ({type(e).__name__}: {e})"[:300])
    flags = {k: v for k, v in state["args"].items() if k not in RETIRED_FLAGS}
    for name in sorted(state["args"].keys() & RETIRED_FLAGS.keys()):
        if state["args"][name] != RETIRED_FLAGS[name]:
            flag, fixed = f"--{name.replace('_', '-')} {state['args'][name]}", RETIRED_FLAGS[name]
            sys.exit(f"error: --resume {path}: written with {flag}, a retired flag this version fixes at {fixed}")
    if "torch_rng" not in state:  # versions before cea22d9 saved the weights, not the envs and random streams
        sys.exit(f"error: --resume {path}: holds no env or random state to go on from (tools/evaluate.py reads it)")
    unknown = sorted(flags.keys() - vars(Args()).keys())
    if unknown:
        sys.exit(f"error: --resume {path}: written with flags this version lacks: {unknown}")
    saved = dict(vars(Args()), **flags)
    may_change = "resume total_timesteps cuda micro_batch_size track wandb_project_name wandb_entity".split()
    for name in sorted(given & saved.keys()):
        value, flag = getattr(args, name), "--" + name.replace("_", "-")
        if name not in may_change and value != saved[name]:
            sys.exit(f"error: {flag} {value}: a resumed run keeps its flags ({saved[name]})")
        if name == "total_timesteps" and value < saved[name]:
            sys.exit(f"error: {flag} may only be raised on --resume (the run's: {saved[name]})")
        saved[name] = value
    return Args(**saved), state, os.path.dirname(os.path.abspath(path))


class MemoryPlan(NamedTuple):
    chunk_size: int  # states per backward pass (0: whole minibatches)
    buffer_bytes: int  # the size of B
    chunk_bytes: float  # the activations of one chunk


def memory_plan(args: Args, rows, free: float, on_gpu: bool) -> MemoryPlan:
    """Chooses the chunk size (--micro-batch-size unset: 256 on a CPU, the fastest measured there; on a GPU whole
    minibatches if they fit, else the largest power of 2 that does), and stops the run if B and the activations of
    a chunk do not fit in the free memory (inf where it cannot be read: then nothing is checked)."""
    step_bytes = sum(math.prod(shape) * dtype.itemsize for shape, dtype in buffer_fields(NUM_ACTIONS).values())
    buffer_bytes = math.prod(rows) * step_bytes
    per_state = ACTIVATION_BYTES * (2 if args.arch == "dual" else 1)
    ppo_minibatch = args.num_envs * args.num_steps // args.num_minibatches
    largest = max(ppo_minibatch, args.aux_mb_trajectories * args.num_steps)
    fits = largest
    if math.isfinite(free):
        fits = int(max(free - buffer_bytes, 0) // per_state)
    chunk = args.micro_batch_size
    if chunk is None and not on_gpu:
        chunk = 256
    if chunk is None:
        chunk = 0 if fits >= largest else 2 ** max(fits.bit_length() - 1, 0)
    states = min(chunk or largest, largest)
    if states > fits:
        need = f"B {buffer_bytes / 2**30:.1f} GiB, chunks of {states} states {states * per_state / 2**30:.1f} GiB"
        sys.exit(f"error: {need}: over {free / 2**30:.1f} GiB free: lower --n-pi, --num-envs or --micro-batch-size")
    return MemoryPlan(chunk, buffer_bytes, states * per_state)


def free_memory(device):
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            meminfo = f.read().split()
    except OSError:  # no /proc (macOS, say): the memory is not checked
        return math.inf
    return 1024 * float(meminfo[meminfo.index("MemAvailable:") + 1])


def open_run_folder(args: Args, ckpt: Optional[Dict], run_dir: str, run_name: str):
    """Creates the run's folder and locks it, and starts W&B with --track. Returns the W&B run's id and the lock's
    file descriptor (the lock lasts until it is closed, or the process ends)."""
    fresh = not os.path.exists(run_dir)
    os.makedirs(run_dir, exist_ok=True)
    # One process per run: the kernel drops this lock however the process ends (kill -9 too)
    lock = os.open(os.path.join(run_dir, "lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        sys.exit(f"error: {run_dir} is being trained by process {os.pread(lock, 12, 0).decode().strip()}")
    except OSError as e:  # a filesystem without flock: Lustre mounted without -o flock, some NFS mounts
        if fresh:
            shutil.rmtree(run_dir)
        sys.exit(f"error: cannot lock {run_dir}/lock ({e.strerror}): keep runs/ on a filesystem with flock")
    os.pwrite(lock, f"{os.getpid():<12}".encode(), 0)
    wandb_id = ckpt["wandb_id"] if ckpt else None
    if args.track:
        try:
            import wandb  # imported only with --track

            config = dict(config=vars(args), name=run_name, id=wandb_id, resume="allow", sync_tensorboard=True)
            wandb_id = wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, **config).id
            # The script that ran, hacks and all, kept with the run: a copy, not a link to a file that may change
            wandb.save(shutil.copy(__file__, wandb.run.dir), base_path=wandb.run.dir, policy="now")
        except Exception as e:  # not installed, not logged in, no network
            if not ckpt:
                shutil.rmtree(run_dir)  # it holds the lock alone
            sys.exit(f"error: --track: {repr(e)[:200]} (pip install wandb; wandb login)")
    return wandb_id, lock


@dataclasses.dataclass
class Run:
    args: Args  # the flags as the run uses them (a resumed run's own)
    ckpt: Optional[Dict]  # the checkpoint a resumed run goes on from (None: a fresh run)
    plan: Dict  # make_plan's counts
    device: torch.device
    dir: str  # the run's folder, runs/{run_name}
    writer: SummaryWriter
    header: Dict  # what every checkpoint of this process records beside the state
    chunk_size: int  # states per backward pass (memory_plan; 0: whole minibatches)
    not_exact: list  # why a resumed run is not bit for bit the run unbroken (empty: it is)
    lock: int  # the file descriptor of the run's lock


def setup(args: Args, given: set) -> Optional[Run]:
    """Everything before the envs exist. Returns None when a resumed run has no steps left."""
    ckpt, run_dir = None, None
    if args.resume:
        args, ckpt, run_dir = resume_args(args, given)
    start_step = ckpt["global_step"] if ckpt else 0
    plan = make_plan(args, start_step, ckpt["phase"] if ckpt else 0)
    batch_size, iterations = args.num_envs * args.num_steps, plan["num_iterations"]
    if iterations * batch_size <= start_step:
        print(f"{run_dir} is trained to step {start_step:,}: nothing to do (raise --total-timesteps above it to go on)")
        return None
    device = torch.device("cuda" if args.cuda and torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = args.precision == "tf32"
    torch.backends.cudnn.allow_tf32 = args.precision == "tf32"
    rows = (plan["trajectories"], args.num_steps)
    memory = memory_plan(args, rows, free_memory(device), device.type == "cuda")
    # What a bit-identical resume needs to be the same. The chunk size is recorded under its flag's name.
    same = dict(threads=torch.get_num_threads(), torch=str(torch.__version__), micro_batch_size=memory.chunk_size)
    same["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    same["cpu_kernels"] = torch.backends.cpu.get_cpu_capability()  # AVX2 and AVX512 kernels round differently
    recorded = ckpt.get("same", {}) if ckpt else {}  # older versions' checkpoints record none
    not_exact = [f"{k} {v} -> {same[k]}" for k, v in recorded.items() if v != same.get(k)]
    if ckpt and same.keys() - recorded.keys():
        not_exact.append(f"conditions not recorded: {', '.join(sorted(same.keys() - recorded.keys()))}")
    if ckpt and not ckpt.get("exact", True):
        not_exact.append("an earlier resume was not exact")
    run_name = ckpt["run_name"] if ckpt else f"{args.env_id}__{args.exp_name}__{args.seed}__{int(time.time())}"
    run_dir = run_dir or f"runs/{run_name}"
    wandb_id, lock = open_run_folder(args, ckpt, run_dir, run_name)
    # The flags are saved as given, so --micro-batch-size unset stays unset: a resume chooses its own chunk size
    header = dict(script=SCRIPT, base_script=BASE_SCRIPT, run_name=run_name, args=vars(args), wandb_id=wandb_id)
    # Older checkpoints did not count their aux phases (None: unknown)
    header.update(same=same, exact=not not_exact, aux_phases_done=ckpt.get("aux_phases_done") if ckpt else 0)
    print(f"run {run_name} on {device}, precision {args.precision}")
    aux_phases = plan["aux_phases"]
    if ckpt and header["aux_phases_done"] is not None:
        aux_phases = f"{header['aux_phases_done'] + plan['aux_phases']} ({plan['aux_phases']} still to run)"
    elif ckpt:
        aux_phases = f"{plan['aux_phases']} still to run"
    print(
        f"phases: {plan['num_phases']} of N_pi={args.n_pi} rollouts; rollouts: {iterations} of {args.num_envs} envs"
        f" x {args.num_steps} steps = {iterations * batch_size:,} env steps; aux phases: {aux_phases}"
    )
    next_checkpoint = min((start_step // batch_size + args.n_pi) * batch_size, iterations * batch_size)
    print(f"a checkpoint at the end of each phase; the next at env step {next_checkpoint:,}")
    mb, aux_mb = batch_size // args.num_minibatches, args.aux_mb_trajectories * args.num_steps
    print(f"PPO minibatch {mb} states, aux minibatch {aux_mb}; chunks of {memory.chunk_size or 'all'} states")
    print(f"B {memory.buffer_bytes / 2**30:.2f} GiB (uint8 frames); activations {memory.chunk_bytes / 2**30:.2f} GiB")
    # purge_step: a resumed run's log hides all that the stopped run logged after its checkpoint
    writer = SummaryWriter(run_dir, purge_step=start_step + 1 if ckpt else None)
    table = "\n".join(f"|{name}|{value}|" for name, value in vars(args).items())
    writer.add_text("hyperparameters", f"|param|value|\n|-|-|\n{table}", global_step=start_step)
    return Run(args, ckpt, plan, device, run_dir, writer, header, memory.chunk_size, not_exact, lock)


def save_checkpoint(run_dir: str, state: Dict, stateful: Dict, recent_returns):
    for name, thing in stateful.items():
        state[name] = thing.state_dict()
    state["python_rng"] = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    # As a list, because torch.load with weights_only=True reads no numpy arrays
    state["numpy_rng"] = [kind, keys.tolist(), pos, has_gauss, cached]
    state["torch_rng"] = torch.get_rng_state()
    if torch.cuda.is_initialized():
        state["cuda_rng"] = torch.cuda.get_rng_state()
    state["recent_returns"] = list(recent_returns)
    path = os.path.join(run_dir, "checkpoint.pt")
    with open(path + ".tmp", "wb") as f:
        torch.save(state, f)
        os.fsync(f.fileno())  # on disk before the rename, so a crash leaves the old checkpoint or the new one
    os.replace(path + ".tmp", path)


def restore(run: Run, stateful: Dict, recent_returns):
    ckpt = run.ckpt
    for name, thing in stateful.items():
        if name == "test_envs" and name not in ckpt:  # a checkpoint written before the test envs existed
            run.not_exact.append("the test envs start afresh")
            continue
        thing.load_state_dict(ckpt[name])
    random.setstate(ckpt["python_rng"])
    np.random.set_state(ckpt["numpy_rng"])
    torch.set_rng_state(ckpt["torch_rng"])
    if "cuda_rng" in ckpt and torch.cuda.is_available():
        torch.cuda.set_rng_state(ckpt["cuda_rng"])
    recent_returns.extend(ckpt["recent_returns"])
    # An env that starts a new game on resume ends its episode there, so the discounted return that the reward
    # normaliser keeps for it starts again at 0, as at any episode's end
    new_games = stateful["envs"].new_games
    stateful["reward_normalizer"].ret[new_games] = 0.0
    if new_games.any():
        run.not_exact.append("each env starts a new game")
    run.header["exact"] = not run.not_exact  # later checkpoints remember a resume that was not exact
    how = "bit for bit the run unbroken" if run.header["exact"] else f"not exact: {'; '.join(run.not_exact)}"
    print(f"resumed from {run.dir}/checkpoint.pt after phase {ckpt['phase']}, step {ckpt['global_step']:,}: {how}")


def stop_on_signals(run: Run):
    """On SIGTERM or SIGINT (Ctrl-C), stops the run with a line that says how to resume it."""

    def stop(signum, frame):
        how = "resume with: " + shlex.join(
            [sys.executable, os.path.join(HERE, SCRIPT), "--resume", os.path.abspath(run.dir)]
        )
        if not os.path.exists(os.path.join(run.dir, "checkpoint.pt")):
            how = "no checkpoint had been written yet"
        os.write(sys.stdout.fileno(), f"\nstopped by {signal.Signals(signum).name}; {how}\n".encode())
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)


def close_run(run: Run, trained: bool):
    """Closes the log and lets go of the lock. A fresh run stopped before its first rollout ended leaves no folder."""
    run.writer.close()
    os.close(run.lock)
    if run.ckpt is None and not trained:
        shutil.rmtree(run.dir, ignore_errors=True)
        print(f"{run.dir} removed: the run stopped before its first rollout ended")


def evaluate_hint(run: Run) -> str:
    """Where the checkpoint is, and the command that evaluates it, with absolute paths: it works from any folder."""
    path = os.path.abspath(os.path.join(run.dir, "checkpoint.pt"))
    command = shlex.join([sys.executable, os.path.join(HERE, "tools", "evaluate.py"), path])
    return f"checkpoint: {path}; evaluate it: {command}"


def log_aux_phase(run: Run, epochs: List[Dict], global_step: int):
    """Logs the means of aux epoch k as aux/<name> at env step global_step - E_aux + k, the last steps before the
    phase's checkpoint: a resumed run's log drops the steps after its checkpoint, so it keeps these and drops those
    of an aux phase that a stopped run left unfinished. The last epoch's means also go to aux_phase/<name>. The
    checkpoints count the aux phases run, for a resumed run's plan."""
    for epoch, means in enumerate(epochs, start=1):
        for name, value in means.items():
            run.writer.add_scalar("aux/" + name, value, global_step - run.args.e_aux + epoch)
    for name, value in (epochs[-1] if epochs else {}).items():
        run.writer.add_scalar("aux_phase/" + name, value, global_step)
    if epochs and run.header["aux_phases_done"] is not None:
        run.header["aux_phases_done"] += 1


def duration(seconds: float) -> str:
    seconds = round(seconds)
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m" if seconds >= 60 else f"{seconds}s"


class Progress:
    """Progress lines on the console: one per rollout, and within long work (a rollout, an update, an aux epoch) one
    whenever 20 seconds have passed since the last progress or rollout line (the first 10 seconds after training
    starts), so that a slow run (the defaults on a CPU) shows that it is alive. Reading the clock costs no wait for the
    device."""

    def __init__(self, plan: Dict, batch_size: int, start_step: int):
        self.plan, self.batch_size = plan, batch_size
        self.start_time, self.start_step = time.time(), start_step
        self.work, self.done, self.work_start, self.first = None, 0, 0.0, 0
        self.last_line = time.time() - 10  # so that the first line comes 10 seconds after training starts

    def tick(self, work: str, done: int, total: int, unit: str):
        now = time.time()
        if work != self.work or done < self.done:  # new work: its rate is measured from here
            self.work, self.work_start, self.first = work, now, done
        self.done = done
        if now - self.last_line < 20 or done == self.first:
            return
        left = (total - done) * (now - self.work_start) / (done - self.first)
        print(f"  {work}: {done:,} of {total:,} {unit}, about {duration(left)} left", flush=True)
        self.last_line = now

    def rollout_done(self, writer, phase: int, iteration: int, global_step: int, recent_returns, test_envs=None):
        sps = (global_step - self.start_step) / (time.time() - self.start_time)
        writer.add_scalar("charts/SPS", int(sps), global_step)
        # The time left, at this process's mean rate
        eta = duration((self.plan["num_iterations"] - iteration) * self.batch_size / sps)
        mean_return = f"{np.mean(recent_returns):.2f}" if recent_returns else "- (none ended yet)"
        if test_envs is not None:
            test_returns = test_envs.recent_returns
            mean_return += f" test return {np.mean(test_returns):.2f}" if test_returns else " test return -"
        where = f"phase {phase}/{self.plan['num_phases']} iter {iteration}/{self.plan['num_iterations']}"
        print(f"{where} step {global_step:,} SPS {sps:.0f} ETA {eta} return {mean_return}", flush=True)
        self.last_line = time.time()


if __name__ == "__main__":
    answer_cleanrl_flags(sys.argv[1:])
    main(tyro.cli(Args), named_flags(sys.argv[1:]))
