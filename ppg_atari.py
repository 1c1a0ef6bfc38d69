"""Phasic Policy Gradient (Cobbe et al. 2020, arXiv 2009.04416) on Atari, one file read top to bottom: flags, vector env
(ale-py), networks (Nature CNN), the PPG pieces, the rollout and the two phases, and main(): the paper's Algorithm 1."""

import dataclasses
import difflib
import math
import os
import random
import re
import resource
import signal
import sys
import time
from collections import defaultdict, deque
from typing import Dict, List, Literal, NamedTuple, Optional, Tuple

import ale_py
import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import tyro
from torch.utils.tensorboard import SummaryWriter

OBS_SHAPE = (84, 84, 4)  # HWC uint8: 84x84 grayscale, the 4 most recent frames as channels
NUM_ACTIONS = 18  # the most any game has (the full action set), for the memory check
SCRIPT = os.path.basename(__file__)


# ==== Arguments =======================================================================================================
@dataclasses.dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]  # the first part of the run name
    seed: int = 1  # seed of python, numpy, torch and the envs (env i gets seed + i), in [0, 2^31)
    torch_deterministic: bool = True  # if toggled, `torch.backends.cudnn.deterministic=True`
    cuda: bool = True  # if toggled and a GPU is visible, train on it (the buffers then live in GPU memory)
    save_model: bool = False  # if toggled, save the weights and flags to `runs/{run_name}/{exp_name}.pt` at the end
    resume: Optional[str] = None  # continue the run in this folder (or checkpoint file) from its last phase boundary
    track: bool = False  # if toggled, log the run to Weights & Biases too (every TensorBoard scalar)
    wandb_project_name: str = "ppg"  # the W&B project of --track
    wandb_entity: Optional[str] = None  # the W&B entity (user or team) of --track; None: the logged-in user's

    # Environment
    env_id: str = "BreakoutNoFrameskip-v4"  # the game, `BreakoutNoFrameskip-v4` style or `ALE/Breakout-v5` style
    repeat_action_probability: Optional[float] = None  # sticky actions (None: 0 for *NoFrameskip-v4, 0.25 for v5)
    episodic_life: bool = True  # if toggled, a lost life ends the episode for training (logged returns: whole games)
    clip_rewards: bool = True  # if toggled, train on sign(reward) (logged returns: raw game scores)
    max_episode_frames: int = 108_000  # a game is cut after this many emulator frames (30 minutes of play)

    # Policy phase (PPO)
    total_timesteps: int = 10_000_000  # env steps in all (rounded UP to whole rollouts; the count is printed)
    learning_rate: float = 2.5e-4  # Adam learning rate of both phases (constant, as in the paper)
    anneal_lr: bool = False  # if toggled, every optimizer's rate falls linearly to 0 over the run's rollouts (CleanRL)
    num_envs: int = 8  # parallel envs
    num_steps: int = 128  # steps per env in each rollout
    gamma: float = 0.99  # discount factor of GAE and the value targets
    gae_lambda: float = 0.95  # lambda of generalised advantage estimation
    norm_reward: bool = False  # if toggled, divide rewards by the running std of their discounted return, clip to +-10
    reward_norm_gamma: float = 0.99  # discount of the return whose running std scales rewards (0.99 in released code)
    num_minibatches: int = 4  # PPO minibatches per epoch in the policy phase
    clip_coef: float = 0.1  # PPO clipping coefficient
    ent_coef: float = 0.01  # entropy bonus coefficient
    max_grad_norm: float = 0.0  # clip each network's gradient norm to this (0 = no clipping, as in the paper)

    # Phasic Policy Gradient
    # `dual`: policy and value networks apart; `detach`: value head on detached features; `shared`: PPO's network
    arch: Literal["dual", "detach", "shared"] = "dual"
    n_pi: int = 32  # N_pi: policy-phase iterations (rollouts) per phase
    e_pi: int = 1  # E_pi: epochs of the PPO policy loss on each rollout
    e_v: int = 1  # E_V: epochs of the value loss on each rollout
    e_aux: int = 6  # E_aux: auxiliary epochs per phase (0 disables the auxiliary phase: with arch shared, PPO)
    beta_clone: float = 1.0  # beta_clone: weight of KL(pi_old || pi) in the auxiliary joint loss
    aux_mb_trajectories: int = 4  # whole --num-steps trajectories per aux minibatch (4 x 128 states)
    aux_kl_stop: float = 0.02  # stop the aux phase after an epoch whose mean KL(pi_old || pi) exceeds this (0: never)
    # states per forward/backward chunk: the same update in less memory (0: whole minibatches; None: 256 on a CPU)
    micro_batch_size: Optional[int] = None
    # `fp32`; `tf32`: TF32 matmuls and convolutions on a GPU (plain fp32 on a CPU); `bf16`: autocast of the trunks
    precision: Literal["fp32", "tf32", "bf16"] = "fp32"


def ale_protocol(env_id: str) -> Tuple[str, float, int, bool]:
    """(ALE/*-v5 id, sticky-action probability, most no-op starts, FIRE on reset): each id style keeps its protocol.
    *NoFrameskip-v4: DQN's (no sticky actions, up to 30 no-ops, FIRE); ALE/*-v5: Machado et al. 2018 (sticky 0.25)."""
    if env_id.endswith("NoFrameskip-v4"):
        return f"ALE/{env_id[: -len('NoFrameskip-v4')]}-v5", 0.0, 30, True
    return env_id, 0.25, 0, False


def make_plan(args: Args) -> Dict[str, int]:
    """Refuse in one line the values tyro accepts but the run cannot use; derive the run's counts once."""
    rules = [
        ("be a finite number", math.isfinite, " ".join(k for k, v in vars(args).items() if isinstance(v, float))),
        ("be at least 1", lambda v: v >= 1, "num_envs num_steps num_minibatches n_pi e_pi e_v total_timesteps"),
        ("be at least 1", lambda v: v >= 1, "aux_mb_trajectories max_episode_frames"),
        ("be >= 0", lambda v: v >= 0, "e_aux micro_batch_size beta_clone ent_coef aux_kl_stop max_grad_norm"),
        ("lie in [0, 1)", lambda v: 0 <= v < 1, "repeat_action_probability"),
        ("be > 0", lambda v: v > 0, "learning_rate clip_coef"),
        ("lie in [0, 1]", lambda v: 0 <= v <= 1, "gamma gae_lambda reward_norm_gamma"),
        ("lie in [0, 2^31) (the envs take 31-bit seeds)", lambda v: 0 <= v < 2**31, "seed"),
    ]
    for rule, ok, names in rules:
        for name in names.split():
            if getattr(args, name) is not None and not ok(getattr(args, name)):
                sys.exit(f"error: --{name.replace('_', '-')} must {rule} (got {getattr(args, name)})")
    gym.register_envs(ale_py)  # only ALE/*-v5 ids have ale-py's vector env
    if (ale_id := ale_protocol(args.env_id)[0]) not in gym.registry or not ale_id.endswith("-v5"):
        games = [k[4:-3] for k in gym.registry if k.startswith("ALE/") and k.endswith("-v5")]
        close = difflib.get_close_matches(re.sub(r"^ALE/|(NoFrameskip|Deterministic)?-v\d+$", "", args.env_id), games)
        hint = " or ".join(f"{g}NoFrameskip-v4" for g in close) or "BreakoutNoFrameskip-v4 or ALE/Breakout-v5"
        sys.exit(f"error: --env-id {args.env_id} is not a game of ale-py's vector env; did you mean {hint}?")
    batch_size = args.num_envs * args.num_steps
    if batch_size % args.num_minibatches:
        sys.exit(f"error: --num-minibatches {args.num_minibatches} does not divide a rollout's {batch_size} states")
    num_iterations = -(-args.total_timesteps // batch_size)  # round UP: never train less than asked
    aux_phases = (num_iterations - 1) // args.n_pi if args.e_aux > 0 else 0  # none after the last rollout
    trajectories = args.n_pi * args.num_envs if aux_phases else args.num_envs  # the rows of the buffer B
    if aux_phases and trajectories % args.aux_mb_trajectories:
        sys.exit(f"error: --aux-mb-trajectories {args.aux_mb_trajectories} does not divide B's {trajectories} rows")
    phases = -(-num_iterations // args.n_pi)
    return dict(num_iterations=num_iterations, num_phases=phases, aux_phases=aux_phases, trajectories=trajectories)


# ==== Environment =====================================================================================================
class AtariVecEnv:
    """ale-py's vector env (frame-skip 4, max-pooled, 84x84 gray, 4 stacked): uint8 HWC frames, the TRAINING reward and
    done (clipped; a lost life counts), and each finished GAME's (env, raw score, length): the number papers report."""

    def __init__(self, args: Args, num_envs: int, seed: int):
        ale_id, sticky, noop_max, fire_reset = ale_protocol(args.env_id)
        sticky = sticky if args.repeat_action_probability is None else args.repeat_action_probability
        frames = dict(frameskip=4, maxpool=True, img_height=84, img_width=84, grayscale=True, stack_num=4)
        # Its own life-loss and clipping stay off (its episodic_life resets the game): done in step(), for training
        protocol = dict(repeat_action_probability=sticky, noop_max=noop_max, use_fire_reset=fire_reset)
        protocol.update(max_num_frames_per_episode=args.max_episode_frames, episodic_life=False, reward_clipping=False)
        self.env = gym.make_vec(ale_id, num_envs, "vector_entry_point", autoreset_mode="SameStep", **frames, **protocol)
        self.args, self.seed, self.num_envs = args, seed, num_envs
        self.num_actions, self.lives = self.env.single_action_space.n, np.zeros(num_envs, dtype=np.int64)
        self.returns, self.lengths = np.zeros(num_envs, dtype=np.float64), np.zeros(num_envs, dtype=np.int64)

    def reset(self) -> np.ndarray:
        obs, info = self.env.reset(seed=self.seed)  # env i gets seed + i
        self.lives = info["lives"].copy()
        return np.ascontiguousarray(obs.transpose(0, 2, 3, 1))  # (N, stack, H, W) -> (N, H, W, stack)

    def step(self, actions: np.ndarray):
        obs, rewards, terminated, truncated, info = self.env.step(actions.astype(np.int64))
        game_over = terminated | truncated
        life_lost = (info["lives"] < self.lives) & ~game_over  # at game over, lives are the new game's
        self.lives = info["lives"].copy()
        self.returns += rewards
        self.lengths += 1
        finished = [(i, float(self.returns[i]), int(self.lengths[i])) for i in np.flatnonzero(game_over)]
        self.returns[game_over], self.lengths[game_over] = 0.0, 0
        train_rewards = np.sign(rewards) if self.args.clip_rewards else rewards
        train_dones = game_over | life_lost if self.args.episodic_life else game_over
        return np.ascontiguousarray(obs.transpose(0, 2, 3, 1)), train_rewards.astype(np.float32), train_dones, finished

    def close(self) -> None:
        self.env.close()


# ==== Networks: Nature CNN with orthogonal initialisation =============================================================
def orthogonal_init_(layer: nn.Module, gain: float) -> nn.Module:
    """Orthogonal weights with this gain, bias 0: the init of the standard PPO Atari recipe."""
    nn.init.orthogonal_(layer.weight, gain)
    nn.init.zeros_(layer.bias)
    return layer


class NatureEncoder(nn.Module):
    """uint8 HWC frame stacks -> 512 features: the Nature DQN CNN (conv 32x8x8/4, 64x4x4/2, 64x3x3/1, dense 512)."""

    def __init__(self, obs_shape: Tuple[int, ...], out_features=512):
        super().__init__()
        h, w, c = obs_shape
        gain = math.sqrt(2)
        self.convs = nn.Sequential(
            orthogonal_init_(nn.Conv2d(c, 32, 8, stride=4), gain),
            nn.ReLU(),
            orthogonal_init_(nn.Conv2d(32, 64, 4, stride=2), gain),
            nn.ReLU(),
            orthogonal_init_(nn.Conv2d(64, 64, 3, stride=1), gain),
            nn.ReLU(),
        )
        with torch.no_grad():
            flat = self.convs(torch.zeros(1, c, h, w)).numel()
        self.dense = orthogonal_init_(nn.Linear(flat, out_features), gain)
        self.out_features = out_features

    def forward(self, obs_uint8: torch.Tensor) -> torch.Tensor:
        # The one place frames become floats; permute() keeps the NHWC memory order (channels_last: faster on a CPU)
        x = obs_uint8.permute(0, 3, 1, 2).float().div_(255.0)
        return F.relu(self.dense(self.convs(x).flatten(1)))


class AgentOutput(NamedTuple):
    """What the network returns, by name (no call site unpacks it by position): a new head is a new field."""

    logits: torch.Tensor  # the policy's logits, fp32
    value: torch.Tensor  # V: the true value head
    aux_value: torch.Tensor  # V_aux: the auxiliary value head, on the policy trunk
    features: torch.Tensor  # the policy trunk's features (fp32), for a new head


class PPGAgent(nn.Module):
    """Policy network: trunk + policy head + auxiliary value head. The true value head sits
    dual   - on its own trunk (the value network): no value gradient reaches the policy trunk;
    detach - on the policy trunk's detached features: the trunk learns value only in the aux phase;
    shared - on the policy trunk: value gradients reach it every step (PPO's usual network)."""

    def __init__(self, arch: str, obs_shape: Tuple[int, ...], num_actions: int, bf16: bool = False):
        super().__init__()
        self.arch, self.bf16 = arch, bf16
        self.pi_trunk = NatureEncoder(obs_shape)
        width = self.pi_trunk.out_features
        self.pi_head = orthogonal_init_(nn.Linear(width, num_actions), 0.01)  # a near-uniform first policy
        self.aux_value_head = orthogonal_init_(nn.Linear(width, 1), 1.0)
        self.v_trunk = NatureEncoder(obs_shape) if arch == "dual" else None
        self.value_head = orthogonal_init_(nn.Linear(width, 1), 1.0)

    def features(self, trunk: nn.Module, obs: torch.Tensor) -> torch.Tensor:
        """The one place precision is chosen: with bf16 the trunk runs under autocast; heads and losses stay fp32."""
        with torch.autocast(obs.device.type, torch.bfloat16, enabled=self.bf16):
            return trunk(obs).float()

    def forward(self, obs: torch.Tensor) -> AgentOutput:
        h = self.features(self.pi_trunk, obs)
        v = self.features(self.v_trunk, obs) if self.arch == "dual" else h.detach() if self.arch == "detach" else h
        return AgentOutput(
            logits=self.pi_head(h),
            value=self.value_head(v).squeeze(-1),
            aux_value=self.aux_value_head(h).squeeze(-1),
            features=h,
        )

    def logits(self, obs: torch.Tensor) -> torch.Tensor:
        """The policy alone (no value network pass): for the pi_old snapshot and evaluation."""
        return self.pi_head(self.features(self.pi_trunk, obs))

    def value_parameters(self) -> List[nn.Parameter]:  # theta_V: the value network (dual) or its head alone
        return [*(self.v_trunk.parameters() if self.v_trunk is not None else []), *self.value_head.parameters()]

    def policy_parameters(self) -> List[nn.Parameter]:  # theta_pi: all the rest, and any head a hack adds
        value = {id(p) for p in self.value_parameters()}
        return [p for p in self.parameters() if id(p) not in value]


# ==== The PPG pieces: plain functions that main() and the tests call alike ============================================
def moments(x: torch.Tensor) -> Tuple[float, float, float]:
    """(count, mean, population variance) of x's elements, in float64."""
    x = x.double()
    n, total, squares = torch.stack([x.new_tensor(x.numel()), x.sum(), x.square().sum()]).tolist()
    return n, total / n, max(squares / n - (total / n) ** 2, 0.0)


class RewardNormalizer:
    """Rewards divided by the running std of the discounted return (no mean subtraction), then clipped, as the released
    code: a (num_envs, num_steps) rollout's returns update the statistics, then its rewards are scaled by them."""

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

    def state_dict(self) -> Dict:
        return dict(mean=float(self.mean), var=float(self.var), count=float(self.count))  # not `ret`: envs restart

    def load_state_dict(self, state: Dict) -> None:
        self.mean, self.var, self.count = state["mean"], state["var"], state["count"]


def compute_gae(rewards, values, ended, next_value, gamma: float, lam: float):
    """Generalised advantage estimation over (num_envs, num_steps) tensors; ended[:, t] is True when step t's
    transition ended its episode (the value after it is 0). Returns (advantages, returns = advantages + values)."""
    advantages, last = torch.zeros_like(rewards), torch.zeros_like(next_value)
    for t in reversed(range(rewards.shape[1])):
        following = next_value if t == rewards.shape[1] - 1 else values[:, t + 1]
        alive = 1.0 - ended[:, t].float()
        delta = rewards[:, t] + gamma * following * alive - values[:, t]
        last = delta + gamma * lam * alive * last
        advantages[:, t] = last
    return advantages, advantages + values


def policy_kl(old_logits, new_logits):
    """Exact KL(pi_old || pi) over all actions, averaged over states."""
    old_logp = F.log_softmax(old_logits, dim=-1)
    return (old_logp.exp() * (old_logp - F.log_softmax(new_logits, dim=-1))).sum(-1).mean()


def policy_phase_loss(out: AgentOutput, mb: Dict[str, torch.Tensor], args: Args, terms=("policy", "value")):
    """PPO's clipped surrogate minus the entropy bonus (`policy`) plus 0.5 MSE of V (`value`): (loss, stats). mb is a
    --micro-batch-size chunk: a statistic over a whole minibatch belongs in policy_phase_update, where it is drawn."""
    loss, stats = 0.0, {}
    if "policy" in terms:
        logprobs = F.log_softmax(out.logits, dim=-1)
        logratio = logprobs.gather(-1, mb["actions"].unsqueeze(-1)).squeeze(-1) - mb["logprobs"]
        ratio, adv = logratio.exp(), mb["advantages"]
        pg_loss = torch.max(-adv * ratio, -adv * ratio.clamp(1 - args.clip_coef, 1 + args.clip_coef)).mean()
        entropy = -(logprobs.exp() * logprobs).sum(-1).mean()
        loss = loss + pg_loss - args.ent_coef * entropy
        stats.update(policy_loss=pg_loss, entropy=entropy)
        with torch.no_grad():
            stats.update(approx_kl=((ratio - 1) - logratio).mean())  # the low-variance k3 estimator
            stats.update(clipfrac=((ratio - 1).abs() > args.clip_coef).float().mean())
    if "value" in terms:
        stats["value_loss"] = 0.5 * (out.value - mb["returns"]).pow(2).mean()  # unclipped, as in the paper
        loss = loss + stats["value_loss"]
    return loss, stats


def aux_phase_loss(out: AgentOutput, mb: Dict[str, torch.Tensor], args: Args):
    """L_joint = 0.5 (V_aux - V_hat)^2 + beta_clone KL(pi_old || pi) on the policy network, plus the value network's
    L_value = 0.5 (V - V_hat)^2: (loss, stats). mb is a chunk, as in policy_phase_loss."""
    l_aux = 0.5 * (out.aux_value - mb["returns"]).pow(2).mean()
    l_clone = policy_kl(mb["pi_old_logits"], out.logits)
    joint = l_aux + args.beta_clone * l_clone
    l_value = 0.5 * (out.value - mb["returns"]).pow(2).mean()
    return joint + l_value, dict(aux_value_loss=l_aux, clone_kl=l_clone, joint_loss=joint, value_loss=l_value)


@torch.no_grad()
def snapshot_policy(agent: PPGAgent, obs_buffer: torch.Tensor, chunk: int) -> torch.Tensor:
    """pi_old: the logits of the policy as it is NOW (after the policy phase) on every state of B, not the rollout's.
    Logits: policy_kl normalises both sides alike, so an unchanged policy has a KL of exactly 0."""
    logits = [agent.logits(part) for part in obs_buffer.flatten(0, 1).split(chunk)]
    return torch.cat(logits).view(*obs_buffer.shape[:2], -1)


# ==== The rollout and the two phases ==================================================================================
def buffer_fields(num_actions: int) -> Dict[str, Tuple[Tuple[int, ...], torch.dtype]]:
    """Every per-step array: name -> (shape of one step's entry, dtype). Allocation, both phases' minibatches and the
    memory check read this alone: a new per-step target is an entry here, the line that fills it, its loss."""
    return dict(
        obs=(OBS_SHAPE, torch.uint8),  # frames stay uint8 until the network
        actions=((), torch.long),
        logprobs=((), torch.float32),  # log pi(a|s) of the rollout's policy
        values=((), torch.float32),  # V(s) at rollout time
        raw_rewards=((), torch.float32),  # the env's rewards
        rewards=((), torch.float32),  # as trained on: scaled by the reward normaliser when --norm-reward
        ended=((), torch.bool),  # the step ended its episode
        advantages=((), torch.float32),  # GAE, normalised per rollout
        returns=((), torch.float32),  # V_hat = GAE advantages + V: the value and aux targets
        pi_old_logits=((num_actions,), torch.float32),  # pi_old, written at the start of each aux phase
    )


@torch.no_grad()
def collect_rollout(agent: PPGAgent, envs, next_obs: torch.Tensor, ro: Dict[str, torch.Tensor], step: int):
    """num_steps steps of every env into ro, this rollout's rows of B. Returns the next obs, the step count, V of the
    next obs (GAE's bootstrap) and the finished episodes' (step, return, length)."""
    episodes = []
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
    ro["raw_rewards"].copy_(torch.from_numpy(rewards))  # uploaded once a rollout
    ro["ended"].copy_(torch.from_numpy(ended))
    return next_obs, step, agent(next_obs).value, episodes


def compute_targets(ro: Dict[str, torch.Tensor], next_value, args: Args, reward_normalizer: RewardNormalizer):
    """Into a rollout's rows of B: the rewards trained on, V_hat = GAE advantages + V, and the advantages normalised
    over the rollout. Returns V's explained variance. On the host: GAE is num_steps tiny steps."""
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
    """One step on mb's mean loss, backpropagated in --micro-batch-size chunks weighted by their share: a whole pass's
    gradient, one chunk's activations alive at a time. Each network's norm is clipped apart. Returns the stats."""
    n, stats = mb["obs"].shape[0], {}
    for start in range(0, n, args.micro_batch_size or n):
        part = slice(start, min(start + (args.micro_batch_size or n), n))
        weight = (part.stop - part.start) / n
        loss, chunk_stats = loss_of({k: v[part] for k, v in mb.items()})
        (loss * weight).backward()
        for k, v in chunk_stats.items():
            stats[k] = stats.get(k, 0.0) + weight * v.detach()
    if args.max_grad_norm > 0:
        nn.utils.clip_grad_norm_(agent.policy_parameters(), args.max_grad_norm)
        nn.utils.clip_grad_norm_(agent.value_parameters(), args.max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return stats


def minibatch_means(logs: Dict[str, List[torch.Tensor]], where: str) -> Dict[str, float]:
    """Each statistic's mean over all its minibatches, in one host copy; a NaN or inf stops the run in one line."""
    means = dict(zip(logs, torch.stack([torch.stack(v).mean() for v in logs.values()]).tolist()))
    if bad := [k for k, v in means.items() if not math.isfinite(v)]:
        sys.exit(f"error: non-finite {', '.join(bad)} in the {where}; stopped, the last checkpoint unchanged")
    return means


def policy_phase_update(agent: PPGAgent, optimizer, batch: Dict[str, torch.Tensor], args: Args, value_optimizer=None):
    """E_pi epochs of PPO's loss and E_V of the value loss on a rollout's states, in shuffled minibatches. As in the
    released code: with E_pi == E_V one backward carries both losses; otherwise the E_V value epochs run first, with
    their own Adam (value_optimizer), then the E_pi policy epochs. Returns each statistic's mean."""
    n, logs = batch["obs"].shape[0], defaultdict(list)
    epochs = [(("policy", "value"), args.e_pi, optimizer)]
    if args.e_pi != args.e_v:
        epochs = [(("value",), args.e_v, value_optimizer), (("policy",), args.e_pi, optimizer)]
    for terms, count, opt in epochs:
        for _ in range(count):
            for idx in torch.randperm(n, device=batch["obs"].device).split(n // args.num_minibatches):
                mb = {k: v[idx] for k, v in batch.items()}  # the whole minibatch: its own statistics go here
                stats = gradient_step(
                    agent, opt, mb, args, lambda c: policy_phase_loss(agent(c["obs"]), c, args, terms)
                )
                for k, v in stats.items():
                    logs[k].append(v)
    return minibatch_means(logs, "policy phase")


def auxiliary_phase(agent: PPGAgent, optimizer, buffers: Dict[str, torch.Tensor], args: Args) -> List[Dict]:
    """pi_old snapshot into B, then E_aux epochs of aux_phase_loss over minibatches of whole trajectories. The KL
    guard stops after an epoch whose mean KL(pi_old || pi), measured apart from the loss, exceeds --aux-kl-stop."""
    obs, epochs = buffers["obs"], []
    chunk = args.micro_batch_size or args.aux_mb_trajectories * args.num_steps
    buffers["pi_old_logits"].copy_(snapshot_policy(agent, obs, chunk))

    def loss_of(c):  # the loss, and the KL guard's own measurement
        out = agent(c["obs"])
        loss, stats = aux_phase_loss(out, c, args)
        return loss, dict(stats, guard_kl=policy_kl(c["pi_old_logits"], out.logits.detach()))

    for _ in range(args.e_aux):
        logs = defaultdict(list)
        for traj in torch.randperm(obs.shape[0], device=obs.device).split(args.aux_mb_trajectories):
            mb = {k: v[traj].flatten(0, 1) for k, v in buffers.items()}  # whole trajectories: row blocks of B
            for k, v in gradient_step(agent, optimizer, mb, args, loss_of).items():
                logs[k].append(v)
        epochs.append(minibatch_means(logs, "auxiliary phase"))
        if 0 < args.aux_kl_stop < epochs[-1]["guard_kl"] and len(epochs) < args.e_aux:
            kl = f"mean KL(pi_old || pi) {epochs[-1]['guard_kl']:.4f} > --aux-kl-stop {args.aux_kl_stop}"
            print(f"auxiliary phase stopped after epoch {len(epochs)}/{args.e_aux}: {kl}")
            break
    return epochs


def resume_args(args: Args, given: Optional[set] = None) -> Tuple[Args, Dict, str]:
    """The checkpoint of --resume and its flags (a flag added since takes its default), with those of `resumable` that
    the command line gives (`given`; None: those off their defaults). Returns (args, checkpoint, the run's folder)."""
    resumable = "resume total_timesteps cuda save_model micro_batch_size track wandb_project_name wandb_entity".split()
    path = os.path.join(args.resume, "checkpoint.pt") if os.path.isdir(args.resume) else args.resume
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)  # tensors and plain values: runs no code
        if state["script"] != SCRIPT:
            raise ValueError(f"written by {state['script']}")
    except Exception as e:  # missing, truncated, another script's, or not a torch file at all
        sys.exit(f"error: --resume {path}: not a readable checkpoint of {SCRIPT} ({type(e).__name__}: {e})"[:300])
    fields, defaults = [f.name for f in dataclasses.fields(Args)], Args()
    if unknown := sorted(set(state["args"]) - set(fields)):
        sys.exit(f"error: --resume {path}: written by a version of {SCRIPT} with flags this one lacks: {unknown}")
    if missing := [name for name in fields if name not in state["args"]]:
        print(f"{path}: written before --{', --'.join(missing).replace('_', '-')}: their defaults taken")
    saved = {name: state["args"].get(name, getattr(defaults, name)) for name in fields}
    given = {k for k, v in vars(args).items() if v != getattr(defaults, k)} if given is None else given & set(fields)
    for name in [name for name in sorted(given - set(resumable)) if getattr(args, name) != saved[name]]:
        sys.exit(
            f"error: --{name.replace('_', '-')} {getattr(args, name)}: a resumed run keeps its flags ({saved[name]})"
        )
    if "total_timesteps" in given and args.total_timesteps < saved["total_timesteps"]:
        sys.exit(f"error: --total-timesteps may only be raised on --resume (the run's: {saved['total_timesteps']})")
    keep = {name: getattr(args, name) for name in given & set(resumable)}
    return dataclasses.replace(Args(**saved), **keep), state, os.path.dirname(os.path.abspath(path))


# ==== main(): the paper's Algorithm 1 =================================================================================
def main(args: Args, given: Optional[set] = None) -> None:
    # ---- Setup: every flag checked and every count derived (and printed) before any env, buffer or log exists ----
    args, ckpt, run_dir = resume_args(args, given) if args.resume else (args, None, None)
    plan = make_plan(args)
    num_iterations, batch_size = plan["num_iterations"], args.num_envs * args.num_steps
    device = torch.device("cuda" if args.cuda and torch.cuda.is_available() else "cpu")
    # TF32 only when asked: PyTorch runs cuDNN convolutions in TF32 by default on recent GPUs
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = args.precision == "tf32"
    if args.micro_batch_size is None:  # the fastest measured where the run starts (tools/benchmark.py --sweep)
        args = dataclasses.replace(args, micro_batch_size=0 if device.type == "cuda" else 256)
    rows = (plan["trajectories"], args.num_steps)  # B: rows of whole trajectories, num_envs rows a rollout
    fields = buffer_fields(NUM_ACTIONS).values()  # the most actions a game has
    needed = math.prod(rows) * sum(math.prod(shape) * dtype.itemsize for shape, dtype in fields)
    meminfo = open("/proc/meminfo").read().split() if os.path.exists("/proc/meminfo") else ["MemAvailable:", "inf"]
    free = 1024 * float(meminfo[meminfo.index("MemAvailable:") + 1])  # RAM the kernel can give without swapping
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else free
    if needed > free:
        sys.exit(f"error: B needs {needed / 2**30:.1f} GiB, {free / 2**30:.1f} GiB is free: lower --n-pi or --num-envs")
    run_name = ckpt["run_name"] if ckpt else f"{args.env_id}__{args.exp_name}__{args.seed}__{int(time.time())}"
    run_dir = run_dir or f"runs/{run_name}"
    phase, global_step = (ckpt["phase"], ckpt["global_step"]) if ckpt else (0, 0)
    iteration = global_step // batch_size
    rounded = " (--total-timesteps rounded up to whole rollouts)" * (num_iterations * batch_size > args.total_timesteps)
    tf32 = " (a CPU has no TF32: plain fp32)" * (args.precision == "tf32" and device.type != "cuda")
    print(
        f"run {run_name} on {device}: {plan['num_phases']} phases, N_pi={args.n_pi}: {num_iterations} rollouts of "
        f"{args.num_envs} envs x {args.num_steps} steps = {num_iterations * batch_size:,} env steps{rounded}\n"
        f"arch={args.arch} E_pi={args.e_pi} E_V={args.e_v} E_aux={args.e_aux} beta_clone={args.beta_clone}; "
        f"{plan['aux_phases']} auxiliary phases; PPO minibatch {batch_size // args.num_minibatches} states, aux "
        f"minibatch {args.aux_mb_trajectories * args.num_steps}; buffers {needed / 2**30:.2f} GiB (uint8 frames)"
        f"\nprecision {args.precision}{tf32}; chunks of {args.micro_batch_size or 'whole minibatches of'} states"
    )

    # A resumed run draws from another random stream: the seed shifted by the phases done (wrapped to 31 bits)
    seed = (args.seed + 100_003 * phase) % (2**31 - args.num_envs)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    if args.track:  # before the writer: W&B mirrors every TensorBoard scalar; a resumed run continues its W&B run
        config = dict(project=args.wandb_project_name, entity=args.wandb_entity, config=vars(args), name=run_name)
        try:
            import wandb  # only with --track

            wandb.init(**config, id=ckpt and ckpt["wandb_id"], resume="allow", sync_tensorboard=True, save_code=True)
        except Exception as e:  # not installed (pip install wandb==0.31.0), not logged in (wandb login), ...
            sys.exit(f"error: --track: {type(e).__name__}: {e} (pip install wandb==0.31.0; wandb login)"[:300])
    # On --resume, purge_step hides what the stopped run logged after its checkpoint: no step is logged twice
    writer = SummaryWriter(run_dir, purge_step=global_step + 1 if ckpt else None)
    table = "\n".join(f"|{k}|{v}|" for k, v in vars(args).items())  # each start's flags, at the step it starts from
    writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + table, global_step)

    # The envs, the networks, the optimizers, the buffer B
    envs = AtariVecEnv(args, args.num_envs, seed)
    agent = PPGAgent(args.arch, OBS_SHAPE, envs.num_actions, bf16=args.precision == "bf16").to(device)
    # Adams that persist across phases: the policy phase's, the aux phase's, the value epochs' (when E_pi != E_V)
    optimizers = [torch.optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-8) for _ in range(3)]
    policy_optimizer, aux_optimizer, value_optimizer = optimizers
    reward_normalizer = RewardNormalizer(args.num_envs, args.reward_norm_gamma)
    stateful = dict(agent=agent, policy_optimizer=policy_optimizer, aux_optimizer=aux_optimizer)
    stateful.update(value_optimizer=value_optimizer, reward_normalizer=reward_normalizer)
    # Zeros: a field a hack adds reads 0 until it is filled, never stale memory
    fields = buffer_fields(envs.num_actions).items()
    buffers = {k: torch.zeros((*rows, *shape), dtype=dtype, device=device) for k, (shape, dtype) in fields}
    recent_returns, aux_epochs_done = deque(maxlen=100), 0
    if ckpt:
        for name, thing in stateful.items():
            thing.load_state_dict(ckpt[name])
        recent_returns.extend(ckpt["recent_returns"])
        aux_epochs_done = ckpt["aux_epochs_done"]
        print(f"resumed from {run_dir}/checkpoint.pt after phase {phase}, step {global_step:,}")

    def stop(signum, frame):  # SIGTERM or Ctrl-C: say how to resume, exit with 128 + the signal
        saved = os.path.exists(f"{run_dir}/checkpoint.pt")
        how = f"resume with: python {SCRIPT} --resume {run_dir}" if saved else "no checkpoint had been written yet"
        os.write(sys.stdout.fileno(), f"\nstopped by {signal.Signals(signum).name}; {how}\n".encode())
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    next_obs = torch.from_numpy(envs.reset()).to(device)
    start_time, start_step, start_phase = time.time(), global_step, phase  # this start's: SPS and ETA
    try:
        while iteration < num_iterations:
            phase, phase_start = phase + 1, time.time()
            # ============ Policy phase: N_pi iterations of a rollout, then E_pi and E_V epochs on it ============
            for i in range(min(args.n_pi, num_iterations - iteration)):
                iteration += 1
                first = i * args.num_envs % plan["trajectories"]  # slot i of B IS this rollout's buffer
                ro = {k: v[first : first + args.num_envs] for k, v in buffers.items()}
                if args.anneal_lr:  # every optimizer (the aux phase keeps its phase's last rate), by the planned total:
                    for group in (group for optimizer in optimizers for group in optimizer.param_groups):
                        group["lr"] = args.learning_rate * (1 - (iteration - 1) / num_iterations)  # a raised one too
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
                # ETA at this start's SPS, which holds the aux phases once one has run (until then, it says so)
                eta = (num_iterations * batch_size - global_step) / sps / 3600
                eta_aux = " + aux phases, untimed yet" * (phase == start_phase + 1 <= plan["aux_phases"])
                mean_return = np.mean(recent_returns) if recent_returns else math.nan  # of the last 100 episodes
                progress = f"phase {phase}/{plan['num_phases']} iter {iteration}/{num_iterations} step {global_step:,}"
                losses = f"policy_loss {stats['policy_loss']:.4f} value_loss {stats['value_loss']:.4f}"
                print(f"{progress} SPS {sps:.0f} ETA {eta:.1f}h{eta_aux} return {mean_return:.2f} {losses}", flush=True)

            # ============ Auxiliary phase: snapshot pi_old, E_aux epochs over B (then B is refilled) ============
            aux_epochs, t0 = [], time.time()
            if args.e_aux > 0 and iteration < num_iterations:  # none after the last rollout: nothing would use it
                aux_epochs = auxiliary_phase(agent, aux_optimizer, buffers, args)
                aux_epochs_done += len(aux_epochs)
                writer.add_scalar("charts/aux_epochs", len(aux_epochs), global_step)
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB to GiB
            peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else peak
            seconds = f"{time.time() - phase_start:.1f}s (aux phase {time.time() - t0:.1f}s)"
            print(f"phase {phase} done in {seconds}; peak {'GPU ' * (device.type == 'cuda')}memory {peak:.2f} GiB")

            # ---- The phase boundary: the checkpoint --resume continues from, written atomically ----
            writer.flush()  # what was logged up to it is on disk: a kill after it loses nothing of it
            state = {name: thing.state_dict() for name, thing in stateful.items()}
            state.update(script=SCRIPT, run_name=run_name, args=vars(args), phase=phase, global_step=global_step)
            state.update(aux_epochs_done=aux_epochs_done, recent_returns=list(recent_returns))
            state.update(wandb_id=wandb.run.id if args.track else ckpt and ckpt["wandb_id"])  # kept for --track
            with open(f"{run_dir}/checkpoint.pt.tmp", "wb") as f:
                torch.save(state, f)
                os.fsync(f.fileno())  # on disk before the rename: a crash leaves the last checkpoint whole
            os.replace(f"{run_dir}/checkpoint.pt.tmp", f"{run_dir}/checkpoint.pt")
            for epoch, epoch_stats in enumerate(aux_epochs):  # x-axis: aux epochs; logged after the checkpoint,
                for k, v in epoch_stats.items():  # as purge_step cannot hide another axis's values
                    writer.add_scalar(f"aux/{k}", v, aux_epochs_done - len(aux_epochs) + 1 + epoch)
    finally:
        writer.close()
    envs.close()
    if args.save_model:
        model = dict(script=SCRIPT, run_name=run_name, args=vars(args), agent=agent.state_dict())
        torch.save(model, f"{run_dir}/{args.exp_name}.pt")
        print(f"model saved to {run_dir}/{args.exp_name}.pt")


if __name__ == "__main__":
    # The flags named on the command line (--no-cuda names cuda): --resume tells them from the checkpoint's
    given = {a[2:].split("=")[0].replace("-", "_").removeprefix("no_") for a in sys.argv[1:] if a.startswith("--")}
    main(tyro.cli(Args), given)
