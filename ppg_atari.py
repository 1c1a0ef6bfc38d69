"""Phasic Policy Gradient (Cobbe et al. 2020, arXiv 2009.04416) on Atari: flags, env, networks, losses, the
buffer B (`buffer_fields`), the phases, the run around them (`setup`), and Algorithm 1 (`main`)."""

import dataclasses
import fcntl
import math
import os
import random
import shutil
import signal
import sys
import time
from collections import defaultdict, deque
from typing import Dict, Literal, NamedTuple, Optional

import ale_py
import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import tyro
from torch.utils.tensorboard import SummaryWriter

OBS_SHAPE = (84, 84, 4)  # HWC uint8: 84x84 gray, the last 4 frames as channels
NUM_ACTIONS = 18  # the full action set, for the memory check
# A state's activations in a network's update, fp32: 0.29 MB (docs/runs.md) + 25%
ACTIVATION_BYTES = 360_000
SCRIPT = os.path.basename(__file__)
BASE_SCRIPT = "ppg_atari.py"  # the script this file is, or was copied from
RETIRED_FLAGS = {"torch_deterministic": True}  # flags of older versions, fixed at the one value they took


@dataclasses.dataclass
class Args:
    exp_name: str = SCRIPT[:-3]  # names runs/{env_id}__{exp_name}__{seed}__{time}
    seed: int = 1  # seeds python, numpy, torch and the envs (env i: seed + i); in [0, 2^31)
    cuda: bool = True  # if toggled, train on a GPU where one is visible
    resume: Optional[str] = None  # go on with the run in this folder (or checkpoint)
    track: bool = False  # if toggled, mirror the log to W&B
    wandb_project_name: str = "ppg"  # the W&B project of --track
    wandb_entity: Optional[str] = None  # the W&B user or team
    env_id: str = "BreakoutNoFrameskip-v4"  # or ALE/Breakout-v5 (sticky actions)
    repeat_action_probability: Optional[float] = None  # sticky actions (None: v4 0, v5 0.25)
    episodic_life: bool = True  # if toggled, a lost life ends a training episode
    clip_rewards: bool = True  # if toggled, train on sign(reward)
    max_episode_frames: int = 108_000  # a game's most frames (30 minutes)
    total_timesteps: int = 10_000_000  # env steps (rounded up to whole rollouts)
    learning_rate: float = 2.5e-4  # Adam's rate in both phases (constant)
    anneal_lr: bool = False  # if toggled, anneal the learning rate linearly to 0 over the run (PPO's Atari recipe)
    num_envs: int = 8  # parallel envs
    num_steps: int = 128  # steps of each env in a rollout
    gamma: float = 0.99  # discount of GAE and the value targets
    gae_lambda: float = 0.95  # lambda of GAE
    norm_reward: bool = False  # if toggled, divide rewards by their return's std
    reward_norm_gamma: float = 0.99  # the discount of that return (as released)
    num_minibatches: int = 4  # PPO minibatches an epoch
    clip_coef: float = 0.1  # epsilon of PPO's L_clip (0: no clipping)
    kl_penalty: float = 0.0  # L_KL's weight (L_KL: --clip-coef 0 --kl-penalty 1)
    ent_coef: float = 0.01  # entropy bonus coefficient
    max_grad_norm: float = 0.0  # clip each network's gradient norm (0: off)
    # dual: 2 networks; detach: V on the policy trunk's detached features; shared: PPO
    arch: Literal["dual", "detach", "shared"] = "dual"
    n_pi: int = 32  # N_pi: rollouts a phase
    e_pi: int = 1  # E_pi: policy epochs
    e_v: int = 1  # E_V: value epochs a rollout
    e_aux: int = 6  # E_aux (0: no aux)
    beta_clone: float = 1.0  # beta_clone: weight of KL(pi_old || pi) in the aux loss
    aux_mb_trajectories: int = 4  # trajectories (rows of B) in an aux minibatch
    aux_kl_stop: float = 0.0  # stop the aux phase once an epoch's KL(pi_old || pi) > this
    micro_batch_size: Optional[int] = None  # states a backward chunk (0: all; None: auto)
    precision: Literal["fp32", "tf32", "bf16"] = "fp32"  # tf32: a GPU's; bf16: the trunks'


def ale_protocol(env_id: str):
    """(v5 id, sticky actions, most no-op starts, FIRE on reset): DQN's for v4 ids, Machado's for v5."""
    if env_id.endswith("NoFrameskip-v4"):
        return f"ALE/{env_id[: -len('NoFrameskip-v4')]}-v5", 0.0, 30, True
    return env_id, 0.25, 0, False


def make_plan(args: Args, start_step: int = 0, start_phase: int = 0):
    positive = ["num_envs", "num_steps", "num_minibatches", "n_pi", "e_pi", "e_v"]
    positive += ["total_timesteps", "aux_mb_trajectories", "learning_rate", "max_episode_frames"]
    for name, value in vars(args).items():
        if type(value) not in (int, float):
            continue
        rule, ok = ">= 0", 0 <= value < math.inf  # nan fails
        if name in positive:
            rule, ok = "> 0", 0 < value < math.inf
        if name in ["gamma", "gae_lambda", "reward_norm_gamma"]:
            rule, ok = "in [0, 1]", 0 <= value <= 1
        if name == "repeat_action_probability":
            rule, ok = "in [0, 1)", 0 <= value < 1
        if name == "seed":
            rule, ok = "in [0, 2^31)", 0 <= value < 2**31
        if not ok:
            sys.exit(f"error: --{name.replace('_', '-')} must be a finite number {rule} (got {value})")
    gym.register_envs(ale_py)
    ale_id = ale_protocol(args.env_id)[0]
    if ale_id not in gym.registry or not ale_id.endswith("-v5"):  # only v5 ids have ale-py's vector env
        sys.exit(f"error: --env-id {args.env_id}: not an ale-py game id, as BreakoutNoFrameskip-v4 or ALE/Breakout-v5")
    if args.clip_coef == 0 and args.kl_penalty == 0:
        sys.exit("error: --clip-coef 0 leaves the policy step unbounded: add --kl-penalty 1")
    batch_size = args.num_envs * args.num_steps
    if batch_size % args.num_minibatches:
        sys.exit(f"error: --num-minibatches must divide a rollout's {batch_size} states")
    num_iterations = math.ceil(args.total_timesteps / batch_size)
    phases_left = math.ceil((num_iterations - start_step // batch_size) / args.n_pi)
    aux_phases = 0  # none after the last rollout
    if args.e_aux > 0 and phases_left > 0:
        aux_phases = phases_left - 1
    trajectories = args.num_envs
    if aux_phases:
        trajectories = args.n_pi * args.num_envs
    if aux_phases and trajectories % args.aux_mb_trajectories:
        sys.exit(f"error: --aux-mb-trajectories must divide B's {trajectories} trajectories")
    plan = dict(num_iterations=num_iterations, num_phases=start_phase + phases_left)
    return dict(plan, aux_phases=aux_phases, trajectories=trajectories)


class AtariVecEnv:
    """ale-py's frames (skip 4, max-pool, 84x84 gray, 4 stacked) as uint8 HWC."""

    RESUME = "not exact: each env starts a new game"
    NEW_GAMES = True  # on resume

    def __init__(self, args: Args, num_envs: int, seed: int):
        ale_id, sticky, noop_max, fire_reset = ale_protocol(args.env_id)
        if args.repeat_action_probability is not None:
            sticky = args.repeat_action_probability
        frames = dict(frameskip=4, maxpool=True, img_height=84, img_width=84, grayscale=True, stack_num=4)
        # Its life loss and clipping off (its episodic_life resets the game): step() does them
        protocol = dict(repeat_action_probability=sticky, noop_max=noop_max, use_fire_reset=fire_reset)
        protocol.update(max_num_frames_per_episode=args.max_episode_frames, episodic_life=False, reward_clipping=False)
        self.env = gym.make_vec(ale_id, num_envs, "vector_entry_point", autoreset_mode="SameStep", **frames, **protocol)
        self.args, self.seed, self.num_envs = args, seed, num_envs
        self.num_actions = self.env.single_action_space.n
        self.returns = np.zeros(num_envs, dtype=np.float64)
        self.lengths = np.zeros(num_envs, dtype=np.int64)

    def reset(self):
        obs, info = self.env.reset(seed=self.seed)  # env i gets seed + i
        self.lives = info["lives"].copy()
        return np.ascontiguousarray(obs.transpose(0, 2, 3, 1))  # (N, stack, H, W) -> NHWC

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass

    def step(self, actions):
        obs, rewards, terminated, truncated, info = self.env.step(actions.astype(np.int64))
        game_over = terminated | truncated
        life_lost = (info["lives"] < self.lives) & ~game_over  # at game over, lives are the new game's
        self.lives = info["lives"].copy()
        self.returns += rewards
        self.lengths += 1
        finished = [(i, float(self.returns[i]), int(self.lengths[i])) for i in np.flatnonzero(game_over)]
        self.returns[game_over] = 0.0
        self.lengths[game_over] = 0
        train_rewards = np.sign(rewards) if self.args.clip_rewards else rewards
        train_dones = game_over | life_lost if self.args.episodic_life else game_over
        return np.ascontiguousarray(obs.transpose(0, 2, 3, 1)), train_rewards.astype(np.float32), train_dones, finished


def orthogonal_init_(layer, gain: float):
    """The PPO Atari recipe's init."""
    nn.init.orthogonal_(layer.weight, gain)
    nn.init.zeros_(layer.bias)
    return layer


class NatureEncoder(nn.Module):
    """The Nature DQN CNN: uint8 frame stacks -> 512 features."""

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
        # The one place frames become floats; permute keeps NHWC memory order (faster on a CPU)
        x = self.convs(obs_uint8.permute(0, 3, 1, 2).float().div_(255.0))
        return F.relu(self.dense(x.flatten(1)))


class AgentOutput(NamedTuple):  # read by name, never by position
    logits: torch.Tensor
    value: torch.Tensor
    aux_value: torch.Tensor
    heads: Dict[str, torch.Tensor] = {}  # extra_heads' outputs


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
        # A new head: extra_heads["x"] = a layer (under its flag: its init shifts later draws)
        self.extra_heads = nn.ModuleDict()

    def forward(self, obs, terms=("policy", "value")) -> AgentOutput:
        """With dual, a term alone runs its network alone (the other's outputs: None)."""
        h, v = None, None
        # bf16: the trunks under autocast; heads and losses in fp32
        with torch.autocast(obs.device.type, torch.bfloat16, enabled=self.bf16):
            if "policy" in terms or self.arch != "dual":
                h = self.pi_trunk(obs).float()
            if "value" in terms and self.arch == "dual":
                v = self.v_trunk(obs).float()
        if self.arch == "detach":
            v = h.detach()
        if self.arch == "shared":
            v = h
        logits, value, aux_value, heads = None, None, None, {}
        if h is not None:
            logits = self.pi_head(h)
            aux_value = self.aux_value_head(h).squeeze(-1)
            heads = {name: head(h) for name, head in self.extra_heads.items()}
        if v is not None:
            value = self.value_head(v).squeeze(-1)
        return AgentOutput(logits, value, aux_value, heads)

    def value_parameters(self):  # theta_V
        trunk = list(self.v_trunk.parameters()) if self.v_trunk else []
        return trunk + list(self.value_head.parameters())

    def policy_parameters(self):  # theta_pi
        value = {id(p) for p in self.value_parameters()}
        return [p for p in self.parameters() if id(p) not in value]


def moments(x: torch.Tensor):
    x = x.double()
    n, total, squares = torch.stack([x.new_tensor(x.numel()), x.sum(), x.square().sum()]).tolist()
    return n, total / n, max(squares / n - (total / n) ** 2, 0.0)


class RewardNormalizer:
    """Rewards over the running std of their discounted return, clipped, as released."""

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
        # Chan et al.'s merge of the rollout's moments into the running ones
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


def kl_divergence(p_logits, q_logits):
    p_logp = F.log_softmax(p_logits, dim=-1)
    return (p_logp.exp() * (p_logp - F.log_softmax(q_logits, dim=-1))).sum(-1).mean()


# A loss sees a chunk of a minibatch (gradient_step): a statistic over it (a std, say) is the chunk's
def policy_phase_loss(out: AgentOutput, mb: Dict, args: Args, terms=("policy", "value")):
    loss, stats = 0.0, {}
    if "policy" in terms:
        logprobs = F.log_softmax(out.logits, dim=-1)
        logratio = logprobs.gather(-1, mb["actions"].unsqueeze(-1)).squeeze(-1) - mb["logprobs"]
        ratio, adv = logratio.exp(), mb["advantages"]
        pg_loss = -adv * ratio
        if args.clip_coef > 0:  # L_clip
            clipped = ratio.clamp(1 - args.clip_coef, 1 + args.clip_coef)
            pg_loss = torch.max(pg_loss, -adv * clipped)
        pg_loss = pg_loss.mean()
        kl_penalty = args.kl_penalty * 0.5 * logratio.pow(2).mean()  # L_KL's, as released
        entropy = -(logprobs.exp() * logprobs).sum(-1).mean()
        loss = loss + pg_loss + kl_penalty - args.ent_coef * entropy
        stats.update(policy_loss=pg_loss, kl_penalty=kl_penalty, entropy=entropy)
        with torch.no_grad():
            stats["approx_kl"] = ((ratio - 1) - logratio).mean()
            stats["clipfrac"] = ((ratio - 1).abs() > args.clip_coef).float().mean()
    if "value" in terms:  # unclipped, as in the paper
        stats["value_loss"] = 0.5 * (out.value - mb["returns"]).pow(2).mean()
        loss = loss + stats["value_loss"]
    return loss, stats


def aux_phase_loss(out: AgentOutput, mb: Dict, args: Args):
    """L_joint (the policy network's) + L_value (the value network's)."""
    l_aux = 0.5 * (out.aux_value - mb["returns"]).pow(2).mean()
    l_clone = kl_divergence(mb["pi_old_logits"], out.logits)  # KL(pi_old || pi)
    joint = l_aux + args.beta_clone * l_clone
    l_value = 0.5 * (out.value - mb["returns"]).pow(2).mean()
    stats = dict(aux_value_loss=l_aux, clone_kl=l_clone, joint_loss=joint, value_loss=l_value)
    return joint + l_value, stats


def buffer_fields(num_actions: int):
    """B's per-step arrays: name -> (shape, dtype). A new target: an entry, a line filling it, a loss."""
    return dict(
        obs=(OBS_SHAPE, torch.uint8),  # uint8 until the network
        actions=((), torch.long),
        logprobs=((), torch.float32),
        values=((), torch.float32),
        raw_rewards=((), torch.float32),
        rewards=((), torch.float32),  # as trained on
        ended=((), torch.bool),
        advantages=((), torch.float32),
        returns=((), torch.float32),  # V_hat
        pi_old_logits=((num_actions,), torch.float32),
    )


@torch.no_grad()
def collect_rollout(agent: PPGAgent, envs, next_obs, ro: Dict, step: int):
    episodes = []
    rewards = np.zeros(ro["raw_rewards"].shape, np.float32)
    ended = np.zeros(ro["ended"].shape, bool)
    for t in range(ro["obs"].shape[1]):
        ro["obs"][:, t] = next_obs
        out = agent(next_obs)
        pi = torch.distributions.Categorical(logits=out.logits, validate_args=False)  # no host sync
        action = pi.sample()
        ro["actions"][:, t] = action
        ro["logprobs"][:, t] = pi.log_prob(action)
        ro["values"][:, t] = out.value
        obs, rewards[:, t], ended[:, t], finished = envs.step(action.cpu().numpy())  # the step's one wait
        next_obs = torch.from_numpy(obs).to(next_obs.device)
        step += envs.num_envs
        for _, ep_return, length in finished:
            episodes.append((step, ep_return, length))
    ro["raw_rewards"].copy_(torch.from_numpy(rewards))
    ro["ended"].copy_(torch.from_numpy(ended))
    return next_obs, step, agent(next_obs).value, episodes


def compute_targets(ro: Dict, next_value, args: Args, reward_normalizer: RewardNormalizer):
    """Rewards, V_hat and advantages (normalised over the rollout)."""
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


def gradient_step(agent: PPGAgent, optimizer, mb: Dict, args: Args, loss_of):
    """One step on mb's mean loss, backpropagated in weighted chunks: less memory, same gradient."""
    n, stats = mb["obs"].shape[0], {}
    size = args.micro_batch_size or n
    for start in range(0, n, size):
        part = slice(start, min(start + size, n))
        weight = (part.stop - part.start) / n
        loss, chunk_stats = loss_of({k: v[part] for k, v in mb.items()})
        (loss * weight).backward()
        for k, v in chunk_stats.items():
            stats[k] = stats.get(k, 0.0) + weight * v.detach()
    if args.max_grad_norm > 0:  # each network's norm apart
        for network in (agent.policy_parameters(), agent.value_parameters()):
            nn.utils.clip_grad_norm_(network, args.max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)  # None: Adam skips what a loss did not reach
    return stats


def minibatch_means(logs: Dict, where: str):  # NaN or inf stops the run
    means = dict(zip(logs, torch.stack([torch.stack(v).mean() for v in logs.values()]).tolist()))
    bad = [k for k, v in means.items() if not math.isfinite(v)]
    if bad:
        sys.exit(f"error: non-finite {', '.join(bad)} in the {where}; the last checkpoint kept")
    return means


def policy_phase_update(agent: PPGAgent, optimizer, batch: Dict, args: Args, value_optimizer=None):
    """E_pi policy and E_V value epochs on a rollout, as released: with E_pi == E_V a step trains
    both losses; else the value epochs come first."""
    schedule = [(("policy", "value"), args.e_pi, optimizer)]
    if args.e_pi != args.e_v:
        schedule = [(("value",), args.e_v, value_optimizer), (("policy",), args.e_pi, optimizer)]
    n, logs = batch["obs"].shape[0], defaultdict(list)
    for terms, epochs, opt in schedule:

        def loss_of(chunk):
            return policy_phase_loss(agent(chunk["obs"], terms), chunk, args, terms)

        for _ in range(epochs):
            for idx in torch.randperm(n, device=batch["obs"].device).split(n // args.num_minibatches):
                mb = {k: v[idx] for k, v in batch.items() if k != "pi_old_logits"}
                for k, v in gradient_step(agent, opt, mb, args, loss_of).items():
                    logs[k].append(v)
    return minibatch_means(logs, "policy phase")


def auxiliary_phase(agent: PPGAgent, optimizer, buffers: Dict, args: Args):
    """pi_old into B, then E_aux epochs on minibatches of whole trajectories (fewer: the KL guard)."""
    obs, epochs = buffers["obs"], []
    chunk = args.micro_batch_size or args.aux_mb_trajectories * args.num_steps
    # pi_old: the policy after the policy phase, as logits (an unchanged policy: KL exactly 0)
    with torch.no_grad():
        logits = [agent(part, ("policy",)).logits for part in obs.flatten(0, 1).split(chunk)]
        buffers["pi_old_logits"].copy_(torch.cat(logits).view(*obs.shape[:2], -1))

    def loss_of(chunk):
        return aux_phase_loss(agent(chunk["obs"]), chunk, args)

    for epoch in range(1, args.e_aux + 1):
        logs, epoch_start = defaultdict(list), time.time()
        for rows in torch.randperm(obs.shape[0], device=obs.device).split(args.aux_mb_trajectories):
            mb = {k: v[rows].flatten(0, 1) for k, v in buffers.items()}
            for k, v in gradient_step(agent, optimizer, mb, args, loss_of).items():
                logs[k].append(v)
        means = minibatch_means(logs, "auxiliary phase")
        epochs.append(means)
        losses = f"aux_value_loss {means['aux_value_loss']:.4f} clone_kl {means['clone_kl']:.5f}"
        print(f"aux epoch {epoch}/{args.e_aux}: {losses} ({time.time() - epoch_start:.1f}s)", flush=True)
        if 0 < args.aux_kl_stop < means["clone_kl"] and epoch < args.e_aux:
            print(f"KL guard: mean KL(pi_old || pi) {means['clone_kl']:.4f} > --aux-kl-stop: the aux phase stops")
            break
    return epochs


def named_flags(argv):  # --no-cuda names cuda
    return {word[2:].split("=")[0].replace("-", "_").removeprefix("no_") for word in argv if word[:2] == "--"}


def resume_args(args: Args, given: set):
    """The run's flags: those in `given` keep their values, but may_change."""
    path = args.resume
    if os.path.isdir(path):
        path = os.path.join(path, "checkpoint.pt")
        if not os.path.exists(path):
            sys.exit(f"error: --resume {args.resume}: no checkpoint (stopped before its first phase ended)")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
        if state["script"] != SCRIPT:
            raise ValueError(f"written by {state['script']}")
    except Exception as e:
        sys.exit(f"error: --resume {path}: not a readable checkpoint of {SCRIPT} ({type(e).__name__}: {e})"[:300])
    for name, value in RETIRED_FLAGS.items():  # an older version's flag, at the value it is fixed at: dropped
        old = state["args"].pop(name, value)
        if old != value:
            flag = f"--{name.replace('_', '-')} {old}"
            sys.exit(f"error: --resume {path}: written with {flag}, a retired flag this version fixes at {value}")
    state.setdefault("same", {})  # written before the conditions were recorded: none to compare
    unknown = sorted(state["args"].keys() - vars(Args()).keys())
    if unknown:
        sys.exit(f"error: --resume {path}: written with flags this version lacks: {unknown}")
    saved = dict(vars(Args()), **state["args"])
    may_change = "resume total_timesteps cuda micro_batch_size track wandb_project_name wandb_entity".split()
    for name in sorted(given & saved.keys()):
        value, flag = getattr(args, name), "--" + name.replace("_", "-")
        if name not in may_change and value != saved[name]:
            sys.exit(f"error: {flag} {value}: a resumed run keeps its flags ({saved[name]})")
        if name == "total_timesteps" and value < saved[name]:
            sys.exit(f"error: {flag} may only be raised on --resume (the run's: {saved[name]})")
        saved[name] = value
    return Args(**saved), state, os.path.dirname(os.path.abspath(path))


def memory_plan(args: Args, rows, free: float, on_gpu: bool):
    step_bytes = sum(math.prod(shape) * dtype.itemsize for shape, dtype in buffer_fields(NUM_ACTIONS).values())
    buffer_bytes = math.prod(rows) * step_bytes
    per_state = ACTIVATION_BYTES * (2 if args.arch == "dual" else 1)
    ppo_minibatch = args.num_envs * args.num_steps // args.num_minibatches
    largest = max(ppo_minibatch, args.aux_mb_trajectories * args.num_steps)
    fits = int(max(free - buffer_bytes, 0) // per_state)
    chunk = args.micro_batch_size
    if chunk is None and not on_gpu:
        chunk = 256  # the fastest on a CPU (tools/benchmark.py)
    if chunk is None:  # a GPU's: whole minibatches if they fit, else the most that do
        chunk = 0 if fits >= largest else 2 ** max(fits.bit_length() - 1, 0)
    states = min(chunk or largest, largest)
    if states > fits:
        need = f"B {buffer_bytes / 2**30:.1f} GiB, chunks of {states} states {states * per_state / 2**30:.1f} GiB"
        sys.exit(f"error: {need}: over {free / 2**30:.1f} GiB free: lower --n-pi, --num-envs or --micro-batch-size")
    return chunk, buffer_bytes, states * per_state


def free_memory(device):
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    meminfo = open("/proc/meminfo").read().split()
    return 1024 * float(meminfo[meminfo.index("MemAvailable:") + 1])


def open_run_folder(args: Args, ckpt: Optional[Dict], run_dir: str, run_name: str):
    os.makedirs(run_dir, exist_ok=True)
    # One process a run: a lock the kernel drops as the process ends (kill -9 too)
    lock = os.open(os.path.join(run_dir, "lock"), os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        sys.exit(f"error: {run_dir} is being trained by process {os.pread(lock, 12, 0).decode().strip()}")
    os.pwrite(lock, f"{os.getpid():<12}".encode(), 0)
    wandb_id = ckpt["wandb_id"] if ckpt else None
    if args.track:
        try:
            import wandb  # only with --track

            config = dict(config=vars(args), name=run_name, id=wandb_id, resume="allow", sync_tensorboard=True)
            wandb_id = wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, **config).id
            # The code that ran, kept with the run (a hacked copy too): a copy, not a link to a file that may change
            wandb.save(shutil.copy(__file__, wandb.run.dir), base_path=wandb.run.dir, policy="now")
        except Exception as e:  # not installed, no login, no network
            if not ckpt:
                shutil.rmtree(run_dir)  # its lock alone
            sys.exit(f"error: --track: {repr(e)[:200]} (pip install wandb; wandb login)")
    return wandb_id


def setup(args: Args, given: set):
    """All before the envs; None if a resumed run has no steps left."""
    ckpt, run_dir = None, None
    if args.resume:
        args, ckpt, run_dir = resume_args(args, given)
    start_step = ckpt["global_step"] if ckpt else 0
    plan = make_plan(args, start_step, ckpt["phase"] if ckpt else 0)
    if plan["num_iterations"] * args.num_envs * args.num_steps <= start_step:
        print(f"{run_dir} is trained to step {start_step:,}: nothing to do")
        return None
    device = torch.device("cuda" if args.cuda and torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = args.precision == "tf32"
    torch.backends.cudnn.allow_tf32 = args.precision == "tf32"
    rows = (plan["trajectories"], args.num_steps)
    chunk, *memory = memory_plan(args, rows, free_memory(device), device.type == "cuda")
    flags = dict(vars(args))  # as given: a resume chooses anew
    args = dataclasses.replace(args, micro_batch_size=chunk)
    # What a bit-identical resume needs kept
    same = dict(threads=torch.get_num_threads(), torch=str(torch.__version__), micro_batch_size=chunk)
    same["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    run_name = ckpt["run_name"] if ckpt else f"{args.env_id}__{args.exp_name}__{args.seed}__{int(time.time())}"
    run_dir = run_dir or f"runs/{run_name}"
    wandb_id = open_run_folder(args, ckpt, run_dir, run_name)
    header = dict(script=SCRIPT, base_script=BASE_SCRIPT, run_name=run_name, args=flags, wandb_id=wandb_id, same=same)
    print(f"run {run_name} on {device}, precision {args.precision}")
    batch_size, iterations = args.num_envs * args.num_steps, plan["num_iterations"]
    print(
        f"phases: {plan['num_phases']} of N_pi={args.n_pi} rollouts; rollouts: {iterations} of {args.num_envs} envs"
        f" x {args.num_steps} steps = {iterations * batch_size:,} env steps; aux phases: {plan['aux_phases']}"
    )
    mb, aux_mb = batch_size // args.num_minibatches, args.aux_mb_trajectories * args.num_steps
    print(f"PPO minibatch {mb} states, aux minibatch {aux_mb}; chunks of {args.micro_batch_size or 'all'} states")
    print(f"B {memory[0] / 2**30:.2f} GiB (uint8 frames), a chunk's activations {memory[1] / 2**30:.2f} GiB")
    changed = [f"{k} {v} -> {same[k]}" for k, v in (ckpt or header)["same"].items() if v != same[k]]
    if changed:
        print(f"not bit for bit the run unbroken: {', '.join(changed)}")
    # purge_step: a resume hides all the stopped run logged after its checkpoint
    writer = SummaryWriter(run_dir, purge_step=start_step + 1 if ckpt else None)
    return args, ckpt, plan, device, run_dir, writer, header


def save_checkpoint(run_dir: str, state: Dict, stateful: Dict, recent_returns):
    for name, thing in stateful.items():
        state[name] = thing.state_dict()
    state["python_rng"] = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state["numpy_rng"] = [kind, keys.tolist(), pos, has_gauss, cached]  # weights_only reads no arrays
    state["torch_rng"] = torch.get_rng_state()
    if torch.cuda.is_initialized():
        state["cuda_rng"] = torch.cuda.get_rng_state()
    state["recent_returns"] = list(recent_returns)
    path = os.path.join(run_dir, "checkpoint.pt")
    with open(path + ".tmp", "wb") as f:
        torch.save(state, f)
        os.fsync(f.fileno())  # on disk before the rename
    os.replace(path + ".tmp", path)


def restore(ckpt: Dict, stateful: Dict, recent_returns):
    for name, thing in stateful.items():
        thing.load_state_dict(ckpt[name])
    random.setstate(ckpt["python_rng"])
    np.random.set_state(ckpt["numpy_rng"])
    torch.set_rng_state(ckpt["torch_rng"])
    if "cuda_rng" in ckpt and torch.cuda.is_available():
        torch.cuda.set_rng_state(ckpt["cuda_rng"])
    recent_returns.extend(ckpt["recent_returns"])
    if stateful["envs"].NEW_GAMES:  # each env's discounted return starts again with its game
        stateful["reward_normalizer"].ret[:] = 0.0


def stop_on_signals(run_dir: str):

    def stop(signum, frame):
        how = f"resume with: python {SCRIPT} --resume {os.path.abspath(run_dir)}"
        if not os.path.exists(os.path.join(run_dir, "checkpoint.pt")):
            how = "no checkpoint had been written yet"
        os.write(sys.stdout.fileno(), f"\nstopped by {signal.Signals(signum).name}; {how}\n".encode())
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)


def main(args: Args, given: set):
    run = setup(args, given)
    if run is None:
        return
    args, ckpt, plan, device, run_dir, writer, header = run
    phase = ckpt["phase"] if ckpt else 0
    global_step = ckpt["global_step"] if ckpt else 0
    num_iterations, batch_size = plan["num_iterations"], args.num_envs * args.num_steps
    iteration = global_step // batch_size
    # A resume restores the streams; its new envs take a seed 100_003 a phase on
    seed = (args.seed + 100_003 * phase) % (2**31 - args.num_envs)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.backends.cudnn.deterministic = True
    envs = AtariVecEnv(args, args.num_envs, seed)
    agent = PPGAgent(args, OBS_SHAPE, envs.num_actions).to(device)  # theta_pi, theta_V
    # An Adam a phase, as released (and E_V's when E_pi != E_V), each over all parameters: a step moves
    # those its loss reaches
    optimizers = [torch.optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-8) for _ in range(3)]
    policy_optimizer, aux_optimizer, value_optimizer = optimizers
    reward_normalizer = RewardNormalizer(args.num_envs, args.reward_norm_gamma)
    buffers = {}  # B
    for k, (shape, dtype) in buffer_fields(envs.num_actions).items():
        buffers[k] = torch.zeros(plan["trajectories"], args.num_steps, *shape, dtype=dtype, device=device)
    recent_returns = deque(maxlen=100)
    stateful = dict(agent=agent, policy_optimizer=policy_optimizer, aux_optimizer=aux_optimizer)
    stateful.update(value_optimizer=value_optimizer, reward_normalizer=reward_normalizer, envs=envs)
    if ckpt:
        restore(ckpt, stateful, recent_returns)
        print(f"resumed from {run_dir}/checkpoint.pt after phase {phase}, step {global_step:,}; {envs.RESUME}")
    stop_on_signals(run_dir)
    next_obs = torch.from_numpy(envs.reset()).to(device)
    start_time, start_step = time.time(), global_step
    try:
        while iteration < num_iterations:
            phase, phase_start = phase + 1, time.time()
            # Policy phase: N_pi rollouts, each with E_pi and E_V epochs
            for i in range(min(args.n_pi, num_iterations - iteration)):
                iteration += 1
                slot = i if plan["aux_phases"] else 0  # rollout i's rows of B (views)
                ro = {k: v[slot * args.num_envs : (slot + 1) * args.num_envs] for k, v in buffers.items()}
                next_obs, global_step, next_value, episodes = collect_rollout(agent, envs, next_obs, ro, global_step)
                compute_targets(ro, next_value, args, reward_normalizer)
                for step, ep_return, length in episodes:
                    writer.add_scalar("charts/episodic_return", ep_return, step)
                    writer.add_scalar("charts/episodic_length", length, step)
                    recent_returns.append(ep_return)
                batch = {k: v.flatten(0, 1) for k, v in ro.items()}
                stats = policy_phase_update(agent, policy_optimizer, batch, args, value_optimizer)
                for name, value in stats.items():
                    writer.add_scalar("losses/" + name, value, global_step)
                sps = (global_step - start_step) / (time.time() - start_time)
                writer.add_scalar("charts/SPS", int(sps), global_step)
                seconds = round((num_iterations - iteration) * batch_size / sps)  # at this start's mean rate
                eta = f"{seconds // 3600}h{seconds // 60 % 60:02d}m" if seconds >= 60 else f"{seconds}s"
                mean_return = f"{np.mean(recent_returns):.2f}" if recent_returns else "- (none ended yet)"
                where = f"phase {phase}/{plan['num_phases']} iter {iteration}/{num_iterations} step {global_step:,}"
                print(f"{where} SPS {sps:.0f} ETA {eta} return {mean_return}", flush=True)
            # Auxiliary phase: pi_old, then E_aux epochs over B
            aux_epochs, aux_start = [], time.time()
            if args.e_aux > 0 and iteration < num_iterations:  # none after the last rollout
                aux_epochs = auxiliary_phase(agent, aux_optimizer, buffers, args)
            for name, value in (aux_epochs[-1] if aux_epochs else {}).items():  # the last epoch's
                writer.add_scalar("aux_phase/" + name, value, global_step)
            print(f"phase {phase} done in {time.time() - phase_start:.1f}s (aux {time.time() - aux_start:.1f}s)")
            # The phase's end: the checkpoint a resume goes on from
            writer.flush()  # first: a kill after this loses none of the phase's log
            save_checkpoint(run_dir, dict(header, phase=phase, global_step=global_step), stateful, recent_returns)
    finally:
        writer.close()
    envs.env.close()
    path = os.path.join(run_dir, "checkpoint.pt")
    print(f"checkpoint: {path}; evaluate it: python tools/evaluate.py {path}")


if __name__ == "__main__":
    main(tyro.cli(Args), named_flags(sys.argv[1:]))
