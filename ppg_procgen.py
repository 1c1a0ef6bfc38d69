"""Phasic Policy Gradient (Cobbe, Hilton, Klimov, Schulman 2020, arXiv 2009.04416) on Procgen.

One file, read top to bottom:
  1. Args: every flag, with the paper's symbols (N_pi, E_pi, E_V, E_aux, beta_clone).
  2. Plan: checks the flags and derives every count once, before any env or buffer exists.
  3. Environment: a thin Procgen vector env that reports every finished episode's raw return.
  4. Networks: IMPALA CNN, "normed" init, and the three architectures (dual, detach, shared).
  5. Small pieces: reward normaliser, GAE, the losses, chunked gradients, the pi_old snapshot.
  6. The two phases: the rollout, policy_phase_update (E_pi, E_V epochs), auxiliary_phase (E_aux epochs).
  7. Data parallel: under torchrun, K workers average their gradients (the released code's MPI setup).
  8. Runs that survive and report: checkpoints, --resume, stop signals, logs.
  9. main(): Algorithm 1 of the paper.
"""

import contextlib
import dataclasses
import datetime
import importlib.util
import io
import math
import os
import random
import resource
import signal
import socket
import sys
import time
from collections import defaultdict, deque
from typing import Callable, Dict, List, Literal, NamedTuple, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import tyro

# Procgen paper's (R_min, R_max) of each game in easy and hard mode, to normalise scores as the PPG paper does
SCORE_RANGES = """
    game      easy_min easy_max hard_min hard_max
    bigfish          1       40        0       40
    bossfight      0.5       13      0.5       13
    caveflyer      3.5       12        2     13.4
    chaser         0.5       13      0.5     14.2
    climber          2     12.6        1     12.6
    coinrun          5       10        5       10
    dodgeball      1.5       19      1.5       19
    fruitbot      -1.5     32.4     -0.5     27.2
    heist          3.5       10        2       10
    jumper           3       10        1       10
    leaper           3       10      1.5       10
    maze             5       10        4       10
    miner          1.5       13      1.5       20
    ninja          3.5       10        2       10
    plunder        4.5       30        3       30
    starpilot      2.5       64      1.5       35
"""
_ROWS = [row.split() for row in SCORE_RANGES.strip().splitlines()[1:]]
NORMALISATION = {mode: {r[0]: (float(r[i]), float(r[i + 1])) for r in _ROWS} for mode, i in (("easy", 1), ("hard", 3))}
PROCGEN_GAMES = tuple(NORMALISATION["easy"])  # the 16 games
OBS_SHAPE = (64, 64, 3)  # HWC uint8, as Procgen emits it
NUM_ACTIONS = 15  # every Procgen game uses the same 15-action set


# ==== 1. Arguments ====================================================================================================
@dataclasses.dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]  # the first part of the run name
    # seed of python, numpy and torch, and of the environment's level sequence, in [0, 2^31); the seeds derived from it (per phase, worker and evaluation) wrap around below 2^31 - num_envs
    seed: int = 1
    torch_deterministic: bool = True  # if toggled, `torch.backends.cudnn.deterministic=True`
    cuda: bool = True  # if toggled and a GPU is visible, train on it (the buffers then live in GPU memory)
    save_model: bool = False  # if toggled, save the weights and flags to `{run folder}/{exp_name}.pt` at the end
    resume: Optional[str] = None  # continue the run in this folder (or checkpoint file) from its last phase boundary
    # if toggled, log the run to Weights & Biases too (every TensorBoard scalar, by sync_tensorboard)
    track: bool = False
    wandb_project_name: str = "ppg"  # the W&B project of --track
    wandb_entity: Optional[str] = None  # the W&B entity (user or team) of --track; None: the logged-in user's default

    # Environment
    env_id: Literal[PROCGEN_GAMES] = "bigfish"  # the Procgen game
    distribution_mode: Literal["easy", "hard"] = "easy"  # `easy` (Procgen paper, 25M steps) or `hard` (PPG paper, 100M)
    num_levels: int = 0  # number of training levels; 0 trains on the full level distribution
    start_level: int = 0  # the first training level's seed

    # Policy phase (PPO)
    total_timesteps: int = 25_000_000  # env steps of all workers (rounded UP to whole rollouts; the count is printed)
    learning_rate: float = 5e-4  # Adam learning rate of both phases (constant, as in the paper)
    # if toggled, every optimizer's rate falls linearly to 0 over the run's rollouts (CleanRL's flag; off in the paper); each aux phase takes its phase's last rate
    anneal_lr: bool = False
    num_envs: int = 64  # number of parallel envs (of each worker, under torchrun)
    num_steps: int = 256  # steps per env in each rollout
    gamma: float = 0.999  # discount factor of GAE and the value targets
    gae_lambda: float = 0.95  # lambda of generalised advantage estimation
    norm_reward: bool = True  # if toggled, divide rewards by the running std of their discounted return, clip to +-10
    reward_norm_gamma: float = 0.99  # discount of the return whose running std scales rewards (0.99 in released code)
    num_minibatches: int = 8  # PPO minibatches per epoch in the policy phase (each worker's share is 1/K)
    clip_coef: float = 0.2  # PPO clipping coefficient
    ent_coef: float = 0.01  # entropy bonus coefficient
    max_grad_norm: float = 0.0  # clip the gradient norm of each network to this (0 = no clipping, as in the paper)

    # Phasic Policy Gradient

    # `dual`: separate policy and value networks; `detach`: one trunk, value head on detached features; `shared`: value head on the trunk (with --e-aux 0 --e-pi 3 --e-v 3: the paper's PPO baseline)
    arch: Literal["dual", "detach", "shared"] = "dual"
    n_pi: int = 32  # N_pi: policy-phase iterations (rollouts) per phase
    e_pi: int = 1  # E_pi: epochs of the PPO policy loss on each rollout
    e_v: int = 1  # E_V: epochs of the value loss on each rollout
    e_aux: int = 6  # E_aux: auxiliary epochs per phase (0 disables the auxiliary phase)
    beta_clone: float = 1.0  # beta_clone: weight of KL(pi_old || pi) in the auxiliary joint loss
    aux_mb_trajectories: int = 4  # whole --num-steps trajectories per aux minibatch of each worker (4 x 256 states)
    # stop the auxiliary phase after an epoch whose mean KL(pi_old || pi) exceeds this (0 disables); the guard measures it apart from the clone loss
    aux_kl_stop: float = 0.02
    # forward/backward a minibatch in chunks of this many states: the same update, with peak memory growing with the chunk (0 = whole minibatches; None = the fastest measured where the run starts: 256 on a CPU, whole minibatches on a GPU)
    micro_batch_size: Optional[int] = None
    # `fp32`: fp32 everywhere (TF32 off on GPUs). `tf32`: fp32 weights and optimiser, TF32 matmuls and convolutions on GPUs (a CPU has no TF32: plain fp32, with a printed note). `bf16`: autocast of the trunks, 1.6-2.3x faster on CPUs with AVX512-BF16; weights, optimiser and loss math stay fp32 (docs/benchmarks.md says what is known of how it learns)
    precision: Literal["fp32", "tf32", "bf16"] = "fp32"


# ==== 2. Plan: validate the flags and derive every count once =========================================================
class ArgError(Exception):
    """A bad flag or combination of flags; main() prints it as one line and exits."""


class NonFiniteError(Exception):
    """A loss or gradient became NaN or infinite: the run stops with one line, before the optimizer step."""


@dataclasses.dataclass(frozen=True)
class Plan:
    batch_size: int  # env steps per rollout of one worker = num_envs * num_steps (K times that in all)
    minibatch_size: int  # states per PPO minibatch of one worker
    num_iterations: int  # rollouts in the whole run (each worker does them all)
    num_aux_phases: int  # auxiliary phases that actually run (none after the last rollout)
    total_env_steps: int  # num_iterations * batch_size * workers: what the run really does
    aux_slots: int  # rollouts the buffer holds: N_pi if an auxiliary phase ever runs, else 1
    aux_minibatches: int  # auxiliary minibatches per epoch
    update_epochs: int  # passes over a rollout in its update: E_pi (== E_V, one backward for both) or E_pi + E_V
    buffer_bytes: int  # bytes of every per-step array of buffer_fields (frames uint8), as allocate_buffers makes them


def make_plan(args: Args, workers: int = 1) -> Plan:
    """Check every flag and derive the run's counts for K = `workers`. Raises ArgError with a one-line message."""
    floats = " ".join(name for name, value in vars(args).items() if isinstance(value, float))
    rules = [
        ("be a finite number", math.isfinite, floats),
        ("be at least 1", lambda v: v >= 1, "num_envs num_steps num_minibatches n_pi e_pi e_v total_timesteps"),
        ("be at least 1", lambda v: v >= 1, "aux_mb_trajectories"),
        ("be >= 0", lambda v: v >= 0, "e_aux micro_batch_size beta_clone ent_coef aux_kl_stop max_grad_norm"),
        ("be > 0", lambda v: v > 0, "learning_rate clip_coef"),
        ("lie in [0, 1]", lambda v: 0 <= v <= 1, "gamma gae_lambda reward_norm_gamma"),
        ("lie in [0, 2^31) (the envs take 31-bit seeds)", lambda v: 0 <= v < 2**31, "seed"),
    ]
    for rule, ok, names in rules + ENV_RULES:
        for name in names.split():
            if getattr(args, name) is not None and not ok(getattr(args, name)):
                raise ArgError(f"--{name.replace('_', '-')} must {rule} (got {getattr(args, name)})")
    batch_size = args.num_envs * args.num_steps
    if batch_size % args.num_minibatches:
        raise ArgError(
            f"--num-minibatches {args.num_minibatches} does not divide the {batch_size} states of a rollout "
            f"(--num-envs x --num-steps); pick a divisor of {batch_size}"
        )
    num_iterations = -(-args.total_timesteps // (batch_size * workers))  # round UP: never train less than asked
    num_aux_phases = (num_iterations - 1) // args.n_pi if args.e_aux > 0 else 0
    aux_slots = args.n_pi if num_aux_phases > 0 else 1
    trajectories = aux_slots * args.num_envs
    if num_aux_phases > 0 and trajectories % args.aux_mb_trajectories:
        raise ArgError(
            f"--aux-mb-trajectories {args.aux_mb_trajectories} does not divide the {trajectories} "
            f"trajectories of an auxiliary phase (--n-pi x --num-envs)"
        )
    return Plan(
        batch_size=batch_size,
        minibatch_size=batch_size // args.num_minibatches,
        num_iterations=num_iterations,
        num_aux_phases=num_aux_phases,
        total_env_steps=num_iterations * batch_size * workers,
        aux_slots=aux_slots,
        aux_minibatches=trajectories // args.aux_mb_trajectories,
        update_epochs=args.e_pi if args.e_pi == args.e_v else args.e_pi + args.e_v,
        buffer_bytes=trajectories * args.num_steps * step_bytes(NUM_ACTIONS),
    )


def derived_seed(seed: int, shift: int, num_envs: int) -> int:
    """seed + shift, wrapped into [0, 2^31 - num_envs): the one place seeds are derived (per phase, worker and
    evaluation), so that any phase or worker count gives seeds numpy, torch, Procgen (31-bit) and ALE (env i:
    seed + i, int32) all take. The identity wherever seed + shift is already that small."""
    return (seed + shift) % (2**31 - num_envs)


CPU_MICRO_BATCH = 256  # the chunk that ran fastest on a CPU (tools/benchmark.py --sweep); a GPU takes whole minibatches
# Peak autograd activations per state and per IMPALA trunk for one forward+backward: peak-RSS growth over 128..512
# states on the 2-core CPU machine was 1.5-1.7 MB, rounded up. The process itself (python, torch, envs): 0.4-0.5 GiB.
ACTIVATION_BYTES_PER_TRUNK_STATE, PROCESS_BYTES = 1_800_000, 512 * 2**20


def pick_device(args: Args) -> torch.device:
    """This worker's device (worker i takes GPU i mod GPUs), with TF32 on or off as --precision says."""
    gpus = torch.cuda.device_count() if args.cuda and torch.cuda.is_available() else 0
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % gpus) if gpus else torch.device("cpu")
    if gpus:
        torch.cuda.set_device(device)  # where nccl reduces
        # TF32 only when asked: PyTorch runs cuDNN convolutions in TF32 by default on Ampere and later GPUs, and
        # bf16 autocasts the trunks alone (the heads and losses stay fp32)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = args.precision == "tf32"
    return device


def micro_batch(args: Args, device: torch.device) -> int:
    """The chunk size on this device. A checkpoint keeps --micro-batch-size as given, so a run moved between a CPU
    and a GPU takes, at each start, the chunk that is fastest where it runs."""
    if args.micro_batch_size is not None:
        return args.micro_batch_size
    return 0 if device.type == "cuda" else CPU_MICRO_BATCH


def check_memory(args: Args, plan: Plan, device: torch.device, sharing: int = 1) -> Tuple[int, int]:
    """(bytes the `sharing` workers on this device need: buffers, a chunk's activations, the process; bytes free on
    it or -1), or ArgError. The device: this worker's GPU, or this machine's RAM."""
    minibatch = max(plan.minibatch_size, args.aux_mb_trajectories * args.num_steps)  # states gathered at once
    chunk = min(micro_batch(args, device) or math.inf, minibatch)
    buffers = plan.buffer_bytes + minibatch * step_bytes(NUM_ACTIONS)  # the buffers, and one minibatch's copy
    allowance = PROCESS_BYTES + chunk * ACTIVATION_BYTES_PER_TRUNK_STATE * (2 if args.arch == "dual" else 1)
    cuda, needed = device.type == "cuda", sharing * (buffers + allowance)
    meminfo = open("/proc/meminfo").readlines() if os.path.exists("/proc/meminfo") and not cuda else []
    free = next((int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable")), -1)
    free = torch.cuda.mem_get_info(device)[0] if cuda else free
    if needed > free >= 0:
        raise ArgError(
            f"this run needs about {needed / 2**30:.1f} GiB of {'GPU memory' if cuda else 'RAM'} but "
            f"{free / 2**30:.1f} GiB is free; use a smaller --n-pi, --num-envs, --num-steps or --micro-batch-size"
        )
    return needed, free


# ==== 3. Environment ==================================================================================================
ENV_RULES = [("be >= 0", lambda v: v >= 0, "num_levels start_level")]  # make_plan checks these flags too


class ProcgenVecEnv:
    """uint8 HWC frames, raw rewards, done flags, and each finished episode's (env, return, length). Procgen resets an
    env inside the step that ends its episode: the frame returned with done=True already starts the next one."""

    def __init__(self, args: Args, num_envs: int, num_levels: int, start_level: int, seed: int):
        with contextlib.suppress(ImportError):  # gym 0.26 (procgen's dependency) prints a notice from this table
            __import__("gym_notices.notices").notices.notices.clear()
        from procgen import ProcgenEnv  # imported here so the flags are checked before gym loads

        levels = dict(num_levels=num_levels, start_level=start_level, distribution_mode=args.distribution_mode)
        self.env = ProcgenEnv(num_envs, args.env_id, rand_seed=seed, **levels)
        self.num_envs, self.num_actions = num_envs, self.env.action_space.n
        self.returns, self.lengths = np.zeros(num_envs, dtype=np.float64), np.zeros(num_envs, dtype=np.int64)

    def reset(self) -> np.ndarray:
        return self.env.reset()["rgb"]

    def step(self, actions: np.ndarray):
        obs_dict, rewards, dones, _ = self.env.step(actions.astype(np.int32))
        self.returns += rewards
        self.lengths += 1
        finished = [(i, float(self.returns[i]), int(self.lengths[i])) for i in np.flatnonzero(dones)]
        self.returns[dones] = 0.0
        self.lengths[dones] = 0
        return obs_dict["rgb"], rewards, dones, finished

    def close(self) -> None:
        self.env.close()


def normalised_score(args: Args, episode_return: float) -> float:
    r_min, r_max = NORMALISATION[args.distribution_mode][args.env_id]
    return (episode_return - r_min) / (r_max - r_min)


@torch.no_grad()
def evaluate(agent: "PPGAgent", args: Args, device: torch.device) -> Dict[str, float]:
    """Mean return and normalised score of one episode in each of --num-envs envs on unseen levels (the same ones)."""
    seed = derived_seed(args.seed, 1_000_003, args.num_envs)  # another level sequence than training's
    envs, returns = ProcgenVecEnv(args, args.num_envs, num_levels=0, start_level=0, seed=seed), {}
    obs = envs.reset()
    while len(returns) < envs.num_envs:
        logits = agent.logits(to_device(obs, device))
        actions = torch.distributions.Categorical(logits=logits, validate_args=False).sample()
        obs, _, _, finished = envs.step(actions.cpu().numpy())
        returns.update({i: ep_return for i, ep_return, _ in finished if i not in returns})  # each env's first episode
    envs.close()
    print(f"unseen-level return {np.mean(list(returns.values())):.2f} over {len(returns)} episodes")
    scores = [normalised_score(args, r) for r in returns.values()]
    return dict(episodic_return=np.mean(list(returns.values())), normalized_return=np.mean(scores))


# ==== 4. Networks: IMPALA CNN with the released code's "normed" initialisation ========================================
def normed_init_(layer: nn.Module, scale: float) -> nn.Module:
    """Rescale each output unit's weight vector to L2 norm `scale`; zero the bias."""
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
        # The released code's scales: each of the 3 stacks gets 1/sqrt(3); each of its 2 blocks 1/sqrt(2) of that,
        # split as sqrt() over the block's two convs: sqrt(1/sqrt(3)/sqrt(2)).
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
        # The one place frames become floats: a (B, H, W, C) uint8 batch, never a float buffer.
        # permute() keeps the NHWC memory order, so the convs run channels_last (faster on CPU).
        x = self.convs(obs_uint8.permute(0, 3, 1, 2).float().div_(255.0))
        return F.relu(self.dense(F.relu(x.flatten(1))))


class AgentOutput(NamedTuple):
    """What the network returns, by name (no call site unpacks it by position): a new head is a new field."""

    logits: torch.Tensor  # the policy's logits, fp32
    value: torch.Tensor  # V: the true value head
    aux_value: torch.Tensor  # V_aux: the auxiliary value head, on the policy trunk
    features: torch.Tensor  # the policy trunk's features (fp32), for a new head


class PPGAgent(nn.Module):
    """Policy network: trunk + policy head + auxiliary value head. True value head:
    dual   - on its own trunk (the value network), so no value gradient reaches the policy trunk;
    detach - on the policy trunk's detached features (the trunk learns value only in the aux phase);
    shared - on the policy trunk (value gradients reach it every step: PPO's usual network)."""

    def __init__(self, arch: str, obs_shape: Tuple[int, ...], num_actions: int, bf16: bool = False):
        super().__init__()
        self.arch, self.bf16 = arch, bf16
        self.pi_trunk = ImpalaEncoder(obs_shape)
        width = self.pi_trunk.out_features
        # Policy and value heads alike: normed, scale 0.1 (the released code)
        self.pi_head = normed_init_(nn.Linear(width, num_actions), 0.1)
        self.aux_value_head = normed_init_(nn.Linear(width, 1), 0.1)
        self.v_trunk = ImpalaEncoder(obs_shape) if arch == "dual" else None
        self.value_head = normed_init_(nn.Linear(width, 1), 0.1)

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

    def policy_parameters(self) -> List[nn.Parameter]:
        """theta_pi: every parameter but theta_V (the policy trunk, its two heads, and any head a hack adds)."""
        value = {id(p) for p in self.value_parameters()}
        return [p for p in self.parameters() if id(p) not in value]

    def value_parameters(self) -> List[nn.Parameter]:
        """theta_V: the value network (dual) or the value head alone (detach, shared)."""
        return [*(self.v_trunk.parameters() if self.v_trunk is not None else []), *self.value_head.parameters()]


# ==== 5. Small pieces, each a plain function or class the tests call directly =========================================
class RewardNormalizer:
    """Divide rewards by the running std of each env's discounted return (no mean subtraction), then clip: the
    released code's scheme, which keeps value targets near unit scale. As there, it takes a whole rollout: every
    step's return of every worker's envs updates the statistics first (one shared scale), then it scales them."""

    def __init__(self, num_envs: int, gamma: float, clip: float = 10.0, epsilon: float = 1e-8):
        self.gamma, self.clip, self.epsilon = gamma, clip, epsilon
        self.ret = np.zeros(num_envs, dtype=np.float64)
        self.mean, self.var, self.count = 0.0, 1.0, 1e-4

    def __call__(self, rewards: np.ndarray, dones: np.ndarray) -> np.ndarray:
        """rewards, dones: (num_envs, num_steps) of one rollout; returns the scaled rewards."""
        rets = np.empty(rewards.shape, dtype=np.float64)
        for t in range(rewards.shape[1]):
            self.ret = self.ret * self.gamma + rewards[:, t]
            rets[:, t] = self.ret
            self.ret[dones[:, t]] = 0.0  # the episode ended with this reward
        n, mean, var = global_moments(torch.from_numpy(rets))
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


def normalise_advantages(advantages: torch.Tensor) -> torch.Tensor:
    """Once per rollout, by the mean and (population) std over all workers' states, as the released code does."""
    _, mean, var = global_moments(advantages)
    return (advantages - mean) / (math.sqrt(var) + 1e-8)


def ppo_policy_loss(logits, actions, old_logprobs, advantages, clip_coef: float):
    """PPO's clipped surrogate (to minimise). Returns (loss, entropy, approx_kl, clipfrac)."""
    logprobs = F.log_softmax(logits, dim=-1)
    logratio = logprobs.gather(-1, actions.unsqueeze(-1)).squeeze(-1) - old_logprobs
    ratio = logratio.exp()
    loss = torch.max(-advantages * ratio, -advantages * ratio.clamp(1 - clip_coef, 1 + clip_coef)).mean()
    entropy = -(logprobs.exp() * logprobs).sum(-1).mean()
    with torch.no_grad():
        approx_kl = ((ratio - 1) - logratio).mean()  # the low-variance k3 estimator
        clipfrac = ((ratio - 1).abs() > clip_coef).float().mean()
    return loss, entropy, approx_kl, clipfrac


def value_loss(values, returns):
    """0.5 * MSE, unclipped (the paper clips neither values nor gradients)."""
    return 0.5 * (values - returns).pow(2).mean()


def policy_kl(old_logits, new_logits):
    """Exact KL(pi_old || pi) over all actions, averaged over states."""
    old_logp = F.log_softmax(old_logits, dim=-1)
    return (old_logp.exp() * (old_logp - F.log_softmax(new_logits, dim=-1))).sum(-1).mean()


clone_kl = policy_kl  # L_clone, the paper's KL(pi_old || pi); the KL guard reads policy_kl, whatever L_clone becomes


def aux_joint_loss(aux_values, returns, old_logits, new_logits, beta_clone: float):
    """L_joint = L_aux + beta_clone * L_clone. Returns (L_joint, L_aux, L_clone)."""
    l_aux = value_loss(aux_values, returns)
    l_clone = clone_kl(old_logits, new_logits)
    return l_aux + beta_clone * l_clone, l_aux, l_clone


def policy_phase_loss(out: AgentOutput, mb: Dict[str, torch.Tensor], args: Args, terms=("policy", "value")):
    """The policy phase's loss on a minibatch: PPO's clipped surrogate and entropy bonus (`policy`) and the value loss
    (`value`), as policy_phase_update's epoch asks. Returns (loss, statistics to log)."""
    loss, stats = 0.0, {}
    if "policy" in terms:
        pg_loss, entropy, approx_kl, clipfrac = ppo_policy_loss(
            out.logits, mb["actions"], mb["logprobs"], mb["advantages"], args.clip_coef
        )
        loss = loss + pg_loss - args.ent_coef * entropy
        stats.update(policy_loss=pg_loss, entropy=entropy, approx_kl=approx_kl, clipfrac=clipfrac)
    if "value" in terms:
        stats["value_loss"] = value_loss(out.value, mb["returns"])
        loss = loss + stats["value_loss"]
    return loss, stats


def aux_phase_loss(out: AgentOutput, mb: Dict[str, torch.Tensor], args: Args):
    """The auxiliary phase's loss on a minibatch: L_joint = 0.5 (V_aux - V_hat)^2 + beta_clone L_clone on the policy
    network and L_value = 0.5 (V - V_hat)^2 on the value network. Returns (loss, statistics to log)."""
    old, new = mb["pi_old_logits"], out.logits
    joint, l_aux, l_clone = aux_joint_loss(out.aux_value, mb["returns"], old, new, args.beta_clone)
    l_value = value_loss(out.value, mb["returns"])
    return joint + l_value, dict(aux_value_loss=l_aux, clone_kl=l_clone, joint_loss=joint, value_loss=l_value)


def annealed_rate(line: Dict[str, float], iteration: int) -> float:
    """--anneal-lr: the rate of rollout `iteration` (from 1) on a line that starts at `rate` after rollout `start`
    and falls linearly to 0 after rollout `end` (CleanRL's schedule for a fresh run: start 0, end = all rollouts)."""
    return line["rate"] * (line["end"] - iteration + 1) / (line["end"] - line["start"])


def rate_line(args: Args, plan: Plan, iteration: int, saved: Optional[Dict[str, float]]) -> Dict[str, float]:
    """--anneal-lr's line: a fresh run's, or the checkpoint's (so a resumed run takes exactly the rates of one that
    never stopped). A --total-timesteps raised on --resume (after `iteration` rollouts) starts a new line at the rate
    of the last rollout done, falling to 0 after the new end: no jump, and printed."""
    line = saved or dict(start=0, rate=args.learning_rate, end=plan.num_iterations)
    if line["end"] != plan.num_iterations:
        line = dict(start=iteration - 1, rate=annealed_rate(line, iteration), end=plan.num_iterations)
        if args.anneal_lr:
            print(f"--anneal-lr: rate {line['rate']:.3g} at rollout {iteration}, falling to 0 after {line['end']}")
    return line


def accumulate_gradients(n: int, chunk: int, loss_fn: Callable[[slice], Tuple[torch.Tensor, Dict]]) -> Dict:
    """Backpropagate the mean loss over n states in chunks of `chunk` (0 = all at once). Each chunk's mean loss is
    weighted by its share of n, so the summed gradient equals that of one pass over all n, while only one chunk's
    activations are alive at a time. Returns the (detached) statistics of loss_fn, averaged the same way."""
    chunk, stats = chunk or n, {}
    for start in range(0, n, chunk):
        part = slice(start, min(start + chunk, n))
        weight = (part.stop - part.start) / n
        loss, chunk_stats = loss_fn(part)
        (loss * weight).backward()
        for k, v in chunk_stats.items():
            stats[k] = stats.get(k, 0.0) + weight * v.detach()
    return stats


def optimizer_step(optimizer: torch.optim.Optimizer, agent: "PPGAgent", max_grad_norm: float, stats: Dict) -> None:
    """Adam step on the workers' mean gradient, theta_pi's and theta_V's norms clipped separately (one network's gradient
    never rescales the other's update); then the gradients are dropped, as the optimizers share the parameters' .grad.
    A non-finite gradient, averaged, is seen by every worker at once: all stop, naming this worker's bad losses."""
    average_gradients(agent.parameters())
    # Any NaN or inf makes the L1 norm non-finite; one foreach pass (not a kernel a tensor) and one wait a step
    if not torch.isfinite(nn.utils.get_total_norm([p.grad for p in agent.parameters() if p.grad is not None], 1.0)):
        bad = ", ".join(k for k, v in stats.items() if not torch.isfinite(v)) or "losses finite on this worker"
        raise NonFiniteError(f"non-finite gradient ({bad})")
    if max_grad_norm > 0:
        nn.utils.clip_grad_norm_(agent.policy_parameters(), max_grad_norm)
        nn.utils.clip_grad_norm_(agent.value_parameters(), max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@torch.no_grad()
def snapshot_policy(agent: PPGAgent, obs_buffer: torch.Tensor, chunk: int) -> torch.Tensor:
    """pi_old for the auxiliary phase: the logits of the policy as it stands NOW (after the policy phase) on every
    state of the buffer, not the rollout-time ones. Logits, not log-probabilities: clone_kl normalises both sides
    alike, so an unchanged policy gives a KL of exactly 0. Shape (trajectories, steps, actions), float32."""
    logits = [agent.logits(part) for part in obs_buffer.flatten(0, 1).split(chunk)]
    return torch.cat(logits).view(*obs_buffer.shape[:2], -1)


# ==== 6. The two phases ===============================================================================================
SPENT: Dict[str, float] = defaultdict(float)  # seconds spent by part of the run, and aux phases run (checkpointed)
PENDING: List[Tuple[str, torch.cuda.Event, torch.cuda.Event]] = []  # GPU-timed parts not yet added to SPENT


@contextlib.contextmanager
def timed(part: str, wait: bool = True):
    """Adds the seconds spent in `part` to SPENT. On a GPU, the time between two CUDA events: the work, not its
    launch. A part that waits (once per rollout or phase) adds every part timed since; grad_allreduce, timed at each
    optimizer step, does not wait."""
    if not torch.cuda.is_initialized():
        t0 = time.perf_counter()
        yield
        SPENT[part] += time.perf_counter() - t0
        return
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    yield
    end.record()
    PENDING.append((part, start, end))
    if wait:
        end.synchronize()
        for name, a, b in PENDING:
            SPENT[name] += a.elapsed_time(b) / 1000
        PENDING.clear()


def buffer_fields(num_actions: int) -> Dict[str, Tuple[Tuple[int, ...], torch.dtype]]:
    """Every per-step array the run stores: name -> (shape of one step's entry, dtype). Allocation, both phases'
    minibatches and the memory estimate read this table alone: a new per-step target is one entry here, the line
    that fills it, and the loss that reads it."""
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


def step_bytes(num_actions: int) -> int:
    return sum(math.prod(shape) * dtype.itemsize for shape, dtype in buffer_fields(num_actions).values())


def allocate_buffers(args: Args, plan: Plan, num_actions: int, device: torch.device) -> Dict[str, torch.Tensor]:
    """buffer_fields' arrays as rows of whole trajectories, num_envs rows per rollout: slot i of the aux buffer B IS
    the rollout buffer of iteration i of a phase (written straight into it, at no copy). Zeros: a field a hack
    adds and has not filled yet (pi_old_logits before the first aux phase) reads as 0, never as stale memory."""
    rows = (plan.aux_slots * args.num_envs, args.num_steps)
    fields = buffer_fields(num_actions).items()
    return {name: torch.zeros((*rows, *shape), dtype=dtype, device=device) for name, (shape, dtype) in fields}


@torch.no_grad()
def collect_rollout(agent: PPGAgent, envs, next_obs: torch.Tensor, ro: Dict[str, torch.Tensor], step: int):
    """num_steps steps of every env into ro, this rollout's rows of the buffers (frames as uint8). Returns the next
    obs, global step and value (GAE's bootstrap), and the finished episodes' (step, return, length)."""
    episodes, workers = [], dist.get_world_size() if dist.is_initialized() else 1
    rewards, ended = np.zeros(ro["raw_rewards"].shape, np.float32), np.zeros(ro["ended"].shape, bool)  # on the host
    for t in range(ro["obs"].shape[1]):
        ro["obs"][:, t] = next_obs
        out = agent(next_obs)
        pi = torch.distributions.Categorical(logits=out.logits, validate_args=False)  # no host sync to validate
        action = pi.sample()
        ro["actions"][:, t], ro["logprobs"][:, t], ro["values"][:, t] = action, pi.log_prob(action), out.value
        obs, rewards[:, t], ended[:, t], finished = envs.step(action.cpu().numpy())  # the step's one wait
        next_obs = to_device(obs, next_obs.device)
        step += envs.num_envs * workers  # the workers step in lockstep
        episodes += [(step, ep_return, length) for _, ep_return, length in finished]
    ro["raw_rewards"].copy_(torch.from_numpy(rewards)), ro["ended"].copy_(torch.from_numpy(ended))  # moved once
    return next_obs, step, agent(next_obs).value, episodes


def to_device(frames: np.ndarray, device: torch.device) -> torch.Tensor:
    """uint8 frames onto the device; on a GPU through pinned memory, without a wait (the copy is queued before the
    kernels that read it, and PyTorch keeps the pinned block until it is done)."""
    frames = torch.from_numpy(frames)
    return frames.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else frames


def compute_targets(ro: Dict[str, torch.Tensor], next_value, args: Args, reward_normalizer: RewardNormalizer):
    """After a rollout, in its rows of B: the rewards trained on (raw_rewards keeps the env's), V_hat = GAE advantages
    + V (the value and aux targets) and the advantages normalised over the rollout. Returns V's explained variance.
    On the host: GAE is num_steps tiny steps (on a GPU, thousands of kernel launches); one copy each way."""
    raw, ended, values = ro["raw_rewards"].cpu(), ro["ended"].cpu(), ro["values"].cpu()
    rewards = raw
    if args.norm_reward:  # once per rollout: update the return statistics, then scale
        rewards = torch.from_numpy(reward_normalizer(raw.numpy(), ended.numpy()))
    # GAE with the value network's predictions
    advantages, returns = compute_gae(rewards, values, ended, next_value.cpu(), args.gamma, args.gae_lambda)
    for k, v in dict(rewards=rewards, returns=returns, advantages=normalise_advantages(advantages)).items():
        ro[k].copy_(v)
    var_y = global_moments(returns)[2]
    return 1 - global_moments(returns - values)[2] / var_y if var_y else math.nan


def policy_phase_update(agent: PPGAgent, optimizer, batch, args: Args, plan: Plan, value_optimizer=None) -> Dict:
    """E_pi epochs of PPO's loss and E_V of the value loss over shuffled minibatches of one rollout's states (batch:
    each buffer's rows of the rollout, flattened); the aux value head gets no gradient. As in the released code: with
    E_pi == E_V one backward a minibatch carries both losses; otherwise the E_V value epochs run first, with an Adam
    of their own (value_optimizer), then the E_pi policy epochs. Returns each statistic's mean over its minibatches."""
    n, logs = batch["obs"].shape[0], defaultdict(list)
    epochs = [(("policy", "value"), args.e_pi, optimizer)]
    if args.e_pi != args.e_v:
        if value_optimizer is None:
            raise ValueError("policy_phase_update: E_pi != E_V needs the value epochs' own optimizer")
        epochs = [(("value",), args.e_v, value_optimizer), (("policy",), args.e_pi, optimizer)]
    for terms, count, opt in epochs:
        for _ in range(count):
            for idx in torch.randperm(n, device=batch["obs"].device).split(plan.minibatch_size):
                mb = {k: v[idx] for k, v in batch.items()}

                def loss_fn(part: slice):
                    chunk = {k: v[part] for k, v in mb.items()}
                    return policy_phase_loss(agent(chunk["obs"]), chunk, args, terms)

                stats = accumulate_gradients(idx.shape[0], micro_batch(args, idx.device), loss_fn)
                optimizer_step(opt, agent, args.max_grad_norm, stats)
                for k, v in stats.items():
                    logs[k].append(v)
    return mean_over_workers(logs)


def auxiliary_phase(agent: PPGAgent, optimizer, buffers: Dict[str, torch.Tensor], args: Args):
    """Snapshot pi_old into the buffers, then E_aux epochs of aux_phase_loss over minibatches of whole trajectories
    (V_hat, the returns, stays fixed). Stops after an epoch whose mean KL(pi_old || pi), measured apart from the
    loss as guard_kl, exceeds --aux-kl-stop (the seed's KL guard). Returns each epoch's means."""
    epochs, obs = [], buffers["obs"]
    chunk = micro_batch(args, obs.device) or args.aux_mb_trajectories * args.num_steps
    with timed("snapshot"):
        buffers["pi_old_logits"].copy_(snapshot_policy(agent, obs, chunk))
    with timed("aux_epochs"):
        for _ in range(args.e_aux):
            logs = defaultdict(list)
            for traj in torch.randperm(obs.shape[0], device=obs.device).split(args.aux_mb_trajectories):
                mb = {k: v[traj].flatten(0, 1) for k, v in buffers.items()}  # whole trajectories: row blocks of B

                def loss_fn(part: slice):
                    chunk_mb = {k: v[part] for k, v in mb.items()}
                    out = agent(chunk_mb["obs"])
                    loss, stats = aux_phase_loss(out, chunk_mb, args)
                    return loss, dict(stats, guard_kl=policy_kl(chunk_mb["pi_old_logits"], out.logits.detach()))

                stats = accumulate_gradients(mb["obs"].shape[0], chunk, loss_fn)
                optimizer_step(optimizer, agent, args.max_grad_norm, stats)
                for k, v in stats.items():
                    logs[k].append(v)
            epochs.append(mean_over_workers(logs))  # the same means on every worker: the KL guard stops all at once
            if 0 < args.aux_kl_stop < epochs[-1]["guard_kl"] and len(epochs) < args.e_aux:
                kl = f"mean KL(pi_old || pi) {epochs[-1]['guard_kl']:.4f} > --aux-kl-stop {args.aux_kl_stop}"
                print(f"auxiliary phase stopped after epoch {len(epochs)}/{args.e_aux}: {kl}", flush=True)
                break
    SPENT["aux_phases"] += 1
    return epochs


# ==== 7. Data parallel: torchrun's workers, as the released code's MPI ranks ==========================================
# Each worker steps its own envs into its own buffers; the update sees them all: gradients averaged before every
# optimizer step, advantages and reward scale from moments over all workers, statistics (so the KL guard) averaged.
# Without torchrun each function here is the identity.
NCCL: List = []  # under torchrun: the nccl process group, where every worker has a GPU of its own


def all_reduce(x: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """x summed, averaged (`mean`) or maximised (`max`) over the workers, on x's device (x may be reduced in place)."""
    if not dist.is_initialized():
        return x
    y = x.to("cuda" if NCCL else "cpu")  # nccl reduces on GPUs, gloo on CPUs; no copy where x already is
    dist.all_reduce(y, dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=NCCL[0] if NCCL else None)
    return (y.div_(dist.get_world_size()) if op == "mean" else y).to(x.device)


def global_moments(x: torch.Tensor) -> Tuple[float, float, float]:
    """(count, mean, variance) of the elements of x on all workers together, in float64."""
    x = x.double()
    n, total, squares = all_reduce(torch.stack([x.new_tensor(x.numel()), x.sum(), x.square().sum()])).tolist()
    return n, total / n, max(squares / n - (total / n) ** 2, 0.0)


def mean_over_workers(logs: Dict[str, List[torch.Tensor]]) -> Dict[str, float]:
    """Each statistic's mean over all minibatches and all workers (one all-reduce for all of them)."""
    return dict(zip(logs, all_reduce(torch.stack([torch.stack(v).mean() for v in logs.values()]), "mean").tolist()))


def average_gradients(parameters) -> None:
    """Each .grad becomes its mean over the workers: the gradient of the whole global minibatch."""
    if dist.is_initialized():
        with timed("grad_allreduce", wait=False):  # the wait for the slowest worker included
            grads = [p.grad for p in parameters if p.grad is not None]  # the same parameters on every worker
            flat = all_reduce(torch.cat([g.flatten() for g in grads]), "mean")
            for g, mean in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(mean.view_as(g))


def gather(items: list) -> list:
    """Every worker's list, concatenated in rank order (this worker's list without torchrun)."""
    parts = [items]
    if dist.is_initialized():
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, items)
    return [item for part in parts for item in part]


def join_workers(device: torch.device) -> int:
    """Join torchrun's process group (gloo); reduce through nccl if every worker has a GPU of its own (GPUs told
    apart by UUID, so a launcher that shows each worker only its own GPU gets nccl too; CPUs and shared GPUs: gloo).
    A collective kept waiting 30 minutes fails the run. Returns how many workers share this one's device (its GPU,
    or this machine's RAM), for the memory check."""
    timeout, NCCL[:] = datetime.timedelta(minutes=30), []
    dist.init_process_group("gloo", timeout=timeout)
    place = (
        socket.gethostname(),
        str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else None,
    )
    places = gather([place])
    if own_gpus([gpu for _, gpu in places]):
        NCCL.append(dist.new_group(backend="nccl", timeout=timeout))
    return places.count(place)


def broadcast_parameters(agent: nn.Module) -> None:
    """Every worker takes rank 0's parameters."""
    for tensor in agent.state_dict().values():  # broadcast as a sum: rank 0's values plus zeros, exactly rank 0's
        tensor.copy_(all_reduce(tensor if dist.get_rank() == 0 else torch.zeros_like(tensor)))


def own_gpus(gpus: List[Optional[str]]) -> bool:
    """Whether every worker has a GPU (its UUID; None: none) that no other worker uses."""
    return None not in gpus and len(set(gpus)) == len(gpus)


# ==== 8. Runs that survive and report: checkpoints, --resume, stop signals, logs ======================================
CHECKPOINT_FORMAT, SCRIPT = 1, os.path.basename(__file__)
RESUMABLE = ("resume", "total_timesteps", "cuda", "save_model", "micro_batch_size", "track", "wandb_project_name")
RESUMABLE += ("wandb_entity",)  # these a --resume may give; the rest come from the checkpoint


def model_file(args: Args, run_name: str, agent: nn.Module) -> Dict:
    """What --save-model writes, and every checkpoint holds: enough to rebuild and run the policy."""
    return dict(format=CHECKPOINT_FORMAT, script=SCRIPT, run_name=run_name, args=vars(args), agent=agent.state_dict())


def save_checkpoint(path: str, state: Dict) -> None:
    """Atomically: a temporary file, fsynced, renamed over the old one; a crash mid-write leaves the old one whole."""
    with open(path + ".tmp", "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def load_checkpoint(path: str, flag: str = "--resume") -> Dict:
    """A checkpoint (or --save-model file) of this script, or ArgError with one line saying why not. One written
    before a flag existed takes that flag's default, said in one line; a flag this version lacks is refused.
    weights_only: the file holds tensors and plain Python values only, and loading runs no code."""
    path = os.path.join(path, "checkpoint.pt") if os.path.isdir(path) else path
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ArgError(f"{flag} {path}: no such file") from None
    except Exception as e:  # truncated, or not a torch file at all
        raise ArgError(f"{flag} {path}: not a readable checkpoint, perhaps truncated ({type(e).__name__})") from None
    if (script := state.get("script") if isinstance(state, dict) else None) != SCRIPT:
        raise ArgError(f"{flag} {path}: written by {script or 'something else'}, not by {SCRIPT}")
    if state.get("format") != CHECKPOINT_FORMAT or not {"run_name", "args", "agent"} <= state.keys():
        raise ArgError(f"{flag} {path}: checkpoint format {state.get('format')}; {SCRIPT} reads {CHECKPOINT_FORMAT}")
    flags, defaults = {f.name for f in dataclasses.fields(Args)}, Args()
    if unknown := sorted(set(state["args"]) - flags):  # a later (or another) version's flags
        raise ArgError(
            f"{flag} {path}: written by a version of {SCRIPT} with flags this one lacks ({', '.join(unknown)})"
        )
    if missing := sorted(flags - set(state["args"])):
        state["args"] = dict(state["args"], **{name: getattr(defaults, name) for name in missing})
        names = ", ".join("--" + name.replace("_", "-") for name in missing)
        if int(os.environ.get("RANK", 0)) == 0:  # once, not by every torchrun worker
            print(f"{path}: written before {names}: default values taken")
    return state


def resume_args(args: Args, given: Optional[set] = None) -> Tuple[Args, Dict, str]:
    """The checkpointed run's flags, with those of RESUMABLE that this command line gives; a training flag given
    with another value is refused. `given`: the flags named on the command line (None: those off their defaults).
    Returns (args, checkpoint, the folder the checkpoint lives in: the resumed run writes there)."""
    state, defaults = load_checkpoint(args.resume), Args()
    saved = state["args"]
    given = {n for n, v in vars(args).items() if v != getattr(defaults, n)} if given is None else given
    for name in sorted(given - set(RESUMABLE)):
        if getattr(args, name) != saved[name]:
            raise ArgError(
                f"--{name.replace('_', '-')} {getattr(args, name)} conflicts with the checkpoint's "
                f"{saved[name]}: a resumed run keeps its training flags; leave it out"
            )
    keep = {name: getattr(args, name) for name in given & set(RESUMABLE)}
    if keep.get("total_timesteps", saved["total_timesteps"]) < saved["total_timesteps"]:
        raise ArgError(
            f"--total-timesteps may only be raised on --resume (the checkpoint's: {saved['total_timesteps']})"
        )
    run_dir = os.path.normpath(args.resume if os.path.isdir(args.resume) else os.path.dirname(args.resume) or ".")
    run_dir = os.path.abspath(run_dir) if os.path.basename(run_dir) in (".", "..") else run_dir  # a name to run under
    if os.path.basename(run_dir) != state["run_name"]:  # a folder copied or renamed under another name is a run
        state["wandb_id"] = None  # of its own: with --track, a W&B run under its name, not the original's
    return dataclasses.replace(Args(**saved), **keep), state, run_dir


class StopSignal:
    """SIGTERM and SIGINT ask the run to stop at the next rollout boundary; the last phase-boundary checkpoint
    stays, so at most one phase is lost. A second signal stops it at once."""

    def __init__(self):
        self.signum = 0
        signal.signal(signal.SIGTERM, self), signal.signal(signal.SIGINT, self)

    def __call__(self, signum, frame) -> None:
        if self.signum:
            sys.exit(128 + signum)
        self.signum = signum
        message = f"\n{signal.Signals(signum).name}: stopping at the next rollout boundary (again: stop now)\n"
        os.write(sys.stdout.fileno(), message.encode())

    def agreed(self) -> int:
        """The signal any worker got (0: none). Every worker asks at the same points, so all stop together."""
        return int(all_reduce(torch.tensor(self.signum), "max"))


class Logger:
    """TensorBoard scalars in the run's folder (rank 0 alone writes them) and the console lines."""

    def __init__(self, run_dir: str, args: Args, rank: int, resumed_step: Optional[int], wandb_id: Optional[str]):
        from torch.utils.tensorboard import SummaryWriter

        self.wandb = None
        if args.track and rank == 0:  # before the SummaryWriter: sync_tensorboard patches it
            import wandb  # only with --track

            name = os.path.basename(run_dir)  # a resumed run continues its W&B run (the id its checkpoint keeps)
            self.wandb = wandb.init(
                project=args.wandb_project_name,
                entity=args.wandb_entity,
                config=vars(args),
                name=name,
                id=wandb_id,
                resume="allow" if wandb_id else None,
                sync_tensorboard=True,
                save_code=True,
            )

        # On --resume, purge_step hides what the stopped run logged after its checkpoint: no step twice.
        self.writer = SummaryWriter(run_dir, purge_step=resumed_step and resumed_step + 1) if rank == 0 else None
        if self.writer and resumed_step is None:  # the flags, once
            table = "\n".join(f"|{k}|{v}|" for k, v in vars(args).items())
            self.writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + table)
        self.args, self.recent_returns, self.start = args, deque(maxlen=100), (time.time(), resumed_step or 0)

    def scalars(self, prefix: str, values: Dict[str, float], step: int) -> None:
        for k, v in values.items() if self.writer else ():
            self.writer.add_scalar(prefix + k, v, step)

    def episodes(self, episodes: List[Tuple[int, float, int]]) -> None:
        """Every finished episode of every worker (raw game score), in step order."""
        for step, ep_return, length in sorted(gather(episodes)):
            scores = dict(episodic_return=ep_return, episodic_length=length)
            self.scalars("charts/", dict(scores, normalized_return=normalised_score(self.args, ep_return)), step)
            self.recent_returns.append(ep_return)

    def rollout(self, progress: str, step: int, stats: Dict[str, float], eta: float) -> None:
        sps = int((step - self.start[1]) / (time.time() - self.start[0]))
        self.scalars("losses/", stats, step)
        self.scalars("charts/", dict(SPS=sps), step)
        mean = np.mean(self.recent_returns) if self.recent_returns else float("nan")
        eta_text = f"{eta / 3600:.1f}h" if eta >= 3600 else f"{eta / 60:.0f}min"
        returns = f"return(last {len(self.recent_returns)}) {mean:.2f}"
        losses = f"policy_loss {stats['policy_loss']:.4f} value_loss {stats['value_loss']:.4f}"
        print(f"{progress} step {step:,} SPS {sps} ETA {eta_text} {returns} {losses}", flush=True)

    def phase(self, phase: int, step: int, since: Dict[str, float], phase_s: float, device: torch.device) -> Dict:
        """The phase's seconds by part (timing/*) and peak memory, in TensorBoard and one line. Returns the seconds."""
        seconds = {k: SPENT[k] - since.get(k, 0.0) for k in TIMED}
        cuda, peak = device.type == "cuda", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        peak = torch.cuda.max_memory_allocated(device) if cuda else peak
        self.scalars("timing/", {f"{k}_s": v for k, v in seconds.items()}, step)
        self.scalars("charts/", dict(peak_memory_GiB=peak / 2**30), step)
        parts = ", ".join(f"{k} {v:.1f}s" for k, v in seconds.items())
        memory = f"peak {'GPU memory' if cuda else 'RSS'} {peak / 2**30:.2f} GiB"
        print(f"phase {phase} done in {phase_s:.1f}s: {parts}; {memory}", flush=True)
        return dict(seconds, phase_s=phase_s)

    def close(self, exit_code: int = 0) -> None:
        if self.writer:
            self.writer.close()
        if self.wandb:
            self.wandb.finish(exit_code=exit_code)


TIMED = ("rollout", "policy_update", "snapshot", "aux_epochs", "grad_allreduce")  # all-reduce: inside the updates


def eta_seconds(args: Args, plan: Plan, iterations_done: int, aux_phases_left: int, spent: Dict[str, float]) -> float:
    """Time left at the measured costs. Until an aux phase has run, it costs the policy update's time per rollout and
    epoch (the same forward+backward) x its rollouts x E_aux + 1/3 epochs (the snapshot: a forward pass, a third)."""
    per_update = spent["policy_update"] / (iterations_done * plan.update_epochs)
    per_aux = (spent["snapshot"] + spent["aux_epochs"]) / spent["aux_phases"] if spent["aux_phases"] else None
    per_iteration = (spent["rollout"] + spent["policy_update"]) / iterations_done
    per_aux = per_update * plan.aux_slots * (args.e_aux + 1 / 3) if per_aux is None else per_aux
    return (plan.num_iterations - iterations_done) * per_iteration + aux_phases_left * per_aux


def print_plan(args: Args, plan: Plan, run_name: str, device, workers: int, phases: int, phases_left: int, memory):
    k_x = f"{workers} workers x " if workers > 1 else ""
    rounded = f" (--total-timesteps {args.total_timesteps:,} rounded up to whole rollouts)"
    print(
        f"run {run_name} on {device}: {phases} phases x N_pi={args.n_pi} iterations = {plan.num_iterations} rollouts "
        f"of {k_x}{args.num_envs} envs x {args.num_steps} steps = {plan.total_env_steps:,} env steps"
        + (rounded if plan.total_env_steps != args.total_timesteps else "")
    )
    aux = f"{phases_left - 1 if plan.num_aux_phases else 0} auxiliary phases of {plan.aux_minibatches} minibatches x {k_x}"
    free = f" of {memory[1] / 2**30:.1f} GiB free" if memory[1] >= 0 else ""
    print(
        f"arch={args.arch} E_pi={args.e_pi} E_V={args.e_v} E_aux={args.e_aux} beta_clone={args.beta_clone}; "
        f"{aux}{args.aux_mb_trajectories * args.num_steps} states; PPO minibatch {k_x}{plan.minibatch_size} states; "
        f"buffers {k_x}{plan.buffer_bytes / 2**30:.2f} GiB (frames uint8); need about {memory[0] / 2**30:.2f} GiB{free}"
    )
    chunk = micro_batch(args, device) or "whole minibatches of"
    no_tf32 = " (a CPU has no TF32: plain fp32, the arithmetic of --precision fp32)" * (device.type != "cuda")
    precision = f"{args.precision}{no_tf32 if args.precision == 'tf32' else ''}"
    print(f"precision {precision}; forward/backward in chunks of {chunk} states", flush=True)


def stop_message(signum: int, step: int, saved: Optional[Tuple[int, int]], run_dir: str, workers: int) -> str:
    """Where a stopped run can resume from (saved: the phase and step of its last checkpoint, if any), and how."""
    launch = "python" if workers == 1 else f"torchrun --standalone --nproc-per-node {workers}"
    launch = launch if os.environ.get("LOCAL_WORLD_SIZE", "1") == str(workers) else "torchrun (as launched)"
    stopped = f"stopped by {signal.Signals(signum).name} at step {step:,}; "
    if not saved:
        return stopped + "no checkpoint had been written yet"
    return (
        stopped
        + f"the checkpoint after phase {saved[0]} (step {saved[1]:,}) stays; resume with: {launch} {SCRIPT} --resume {run_dir}"
    )


def parse_args() -> Tuple[Args, set]:
    """The flags, and the names of those given on the command line (--no-cuda names cuda), for --resume. tyro's
    boxed message about a bad flag becomes one line; under torchrun a machine's first worker alone prints it."""
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            args = tyro.cli(Args)
    except SystemExit as e:
        if not e.code or int(os.environ.get("LOCAL_RANK", 0)):  # --help (it goes to stdout), or not the first worker
            raise
        title, *lines = [line.strip("│╭╮╰╯─ ") for line in captured.getvalue().strip().splitlines()] or [""]
        sys.exit(f"error: {title}: {' '.join(lines[: lines.index('') if '' in lines else None])}")
    return args, {a[2:].split("=")[0].replace("-", "_").removeprefix("no_") for a in sys.argv[1:] if a[:2] == "--"}


def prepare(args: Args, given: Optional[set], workers: int):
    """Every flag checked and the memory estimated before any env, buffer or log exists: (args, the checkpoint of
    --resume and its folder, device, plan, (bytes needed, bytes free)); or exit with one line a machine."""
    try:
        args, ckpt, run_dir = resume_args(args, given) if args.resume else (args, None, None)
        if ckpt and ckpt.get("workers", 1) != workers:  # else the global batch would change
            raise ArgError(f"--resume: the run had {ckpt.get('workers', 1)} workers; resume it with as many")
        if args.track and importlib.util.find_spec("wandb") is None:  # (wandb is imported only with --track)
            raise ArgError("--track needs wandb: pip install wandb==0.31.0 (or leave --track out)")
        device = pick_device(args)
        plan = make_plan(args, workers)
        sharing = join_workers(device) if workers > 1 else 1  # torchrun: the process group; who shares this device
        return args, ckpt, run_dir, device, plan, check_memory(args, plan, device, sharing)
    except ArgError as e:
        if int(os.environ.get("LOCAL_RANK", 0)):  # the first worker prints: torchrun must not stop it before it has
            time.sleep(3)
        sys.exit(f"error: {e}" if int(os.environ.get("LOCAL_RANK", 0)) == 0 else 2)


# ==== 9. main(): the paper's Algorithm 1 ==============================================================================
def main(args: Args, given: Optional[set] = None) -> List[Dict[str, float]]:
    """Train; returns each phase's seconds by part (for tools/benchmark.py). Under torchrun, every worker runs it."""
    rank, workers = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    args, ckpt, run_dir, device, plan, memory = prepare(args, given, workers)
    if rank:
        sys.stdout = open(os.devnull, "w")  # rank 0 alone prints
    run_name = os.path.basename(run_dir) if ckpt else f"{args.env_id}__{args.exp_name}__{args.seed}__{int(time.time())}"
    run_dir = run_dir or f"runs/{run_name}"
    # Phases and rollouts done: none, or the checkpoint's. Each phase has N_pi rollouts (the last may have fewer).
    phase, iteration = (ckpt["phase"], ckpt["global_step"] // (plan.batch_size * workers)) if ckpt else (0, 0)
    num_phases = phase + -(-(plan.num_iterations - iteration) // args.n_pi)
    print_plan(args, plan, run_name, device, workers, num_phases, num_phases - phase, memory)
    log = Logger(run_dir, args, rank, ckpt["global_step"] if ckpt else None, ckpt.get("wandb_id") if ckpt else None)

    # One random stream per start and worker: --seed, shifted by the phases done (so a resumed run is reproducible
    # too) and by the rank (so no two workers play the same levels or sample the same actions).
    shift = 100_003 * phase + rank * args.num_envs
    seed = derived_seed(args.seed, shift, args.num_envs)
    if seed != args.seed + shift:
        print(f"seed: --seed {args.seed:,} + {shift:,} (phases done, worker) wraps around to {seed:,}")
    random.seed(seed), np.random.seed(seed), torch.manual_seed(seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic

    # Environment (training levels [start_level, start_level + num_levels)), networks, the optimizers
    envs = ProcgenVecEnv(args, args.num_envs, args.num_levels, args.start_level, seed)
    agent = PPGAgent(args.arch, OBS_SHAPE, envs.num_actions, bf16=args.precision == "bf16").to(device)
    # Adam instances persisting across phases: the policy phase's, the aux phase's, and (as in the released code,
    # only when E_pi != E_V) one for the value-only epochs
    optimizers = [torch.optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-8) for _ in range(3)]
    policy_optimizer, aux_optimizer, value_optimizer = optimizers
    stateful = dict(agent=agent, policy_optimizer=policy_optimizer, aux_optimizer=aux_optimizer)
    stateful["value_optimizer"] = value_optimizer
    stateful["reward_normalizer"] = reward_normalizer = RewardNormalizer(args.num_envs, args.reward_norm_gamma)

    # The buffers of buffer_fields: rows of whole trajectories; slot i of the aux buffer B is rollout i of a phase
    buffers = allocate_buffers(args, plan, envs.num_actions, device)

    global_step, aux_epochs_done, phases, saved = 0, 0, [], None  # saved: (phase, step) of the last checkpoint
    SPENT.clear(), PENDING.clear()
    if ckpt:  # --resume: everything the checkpoint holds
        for name in [name for name in stateful if name in ckpt or name != "value_optimizer"]:  # older files lack it
            stateful[name].load_state_dict(ckpt[name])
        global_step, aux_epochs_done, saved = ckpt["global_step"], ckpt["aux_epochs_done"], (phase, ckpt["global_step"])
        SPENT.update(ckpt["spent"])
        log.recent_returns.extend(ckpt["recent_returns"])
        print(f"resumed from {run_dir}/checkpoint.pt after phase {phase}, step {global_step:,}")
    line = rate_line(args, plan, iteration, ckpt.get("rate_line") if ckpt else None)  # --anneal-lr's schedule
    if workers > 1:
        broadcast_parameters(agent)  # every worker starts from rank 0's parameters
    stop, next_obs = StopSignal(), to_device(envs.reset(), device)
    try:
        while iteration < plan.num_iterations and not stop.agreed():
            phase, phase_start, since, signum = phase + 1, time.time(), dict(SPENT), 0
            # ============ Policy phase: N_pi iterations of a rollout, then E_pi and E_V epochs on it ============
            for i in range(min(args.n_pi, plan.num_iterations - iteration)):
                iteration, first_row = iteration + 1, i % plan.aux_slots * args.num_envs
                ro = {k: v[first_row : first_row + args.num_envs] for k, v in buffers.items()}  # its rows of B
                if args.anneal_lr:  # every optimizer: the aux phase after the phase's last rollout keeps its rate
                    for group in (group for optimizer in optimizers for group in optimizer.param_groups):
                        group["lr"] = annealed_rate(line, iteration)
                with timed("rollout"):
                    next_obs, global_step, next_value, episodes = collect_rollout(
                        agent, envs, next_obs, ro, global_step
                    )
                    explained_variance = compute_targets(ro, next_value, args, reward_normalizer)  # V_hat, A
                log.episodes(episodes)
                with timed("policy_update"):
                    batch = {k: v.flatten(0, 1) for k, v in ro.items()}  # the rollout's states
                    stats = policy_phase_update(agent, policy_optimizer, batch, args, plan, value_optimizer)
                stats["explained_variance"] = explained_variance
                log.scalars("charts/", dict(learning_rate=policy_optimizer.param_groups[0]["lr"]), global_step)
                eta = eta_seconds(args, plan, iteration, num_phases - phase if args.e_aux else 0, SPENT)
                progress = f"phase {phase}/{num_phases} iter {iteration}/{plan.num_iterations}"
                log.rollout(progress, global_step, stats, eta)
                if iteration < plan.num_iterations and (signum := stop.agreed()):  # (the last rollout ends the run)
                    break
            if signum:
                break  # before the aux phase: the run resumes from the last phase boundary

            # ============ Auxiliary phase: snapshot pi_old, E_aux epochs over B, then B is reused ============
            aux_epochs = []
            if args.e_aux > 0 and iteration < plan.num_iterations:  # none after the last rollout: nothing would use it
                aux_epochs = auxiliary_phase(agent, aux_optimizer, buffers, args)
                aux_epochs_done += len(aux_epochs)
                log.scalars("charts/", dict(aux_epochs=len(aux_epochs)), global_step)
            phase_s = time.time() - phase_start
            if args.num_levels > 0 and rank == 0:  # generalisation: the policy on unseen levels, once per phase
                log.scalars("eval/", evaluate(agent, args, device), global_step)

            # ---- The phase boundary: its report, then the checkpoint that --resume continues from ----
            phases.append(dict(log.phase(phase, global_step, since, phase_s, device), aux_epochs_run=len(aux_epochs)))
            counters = dict(workers=workers, global_step=global_step, phase=phase, aux_epochs_done=aux_epochs_done)
            if rank == 0:
                state = {name: thing.state_dict() for name, thing in stateful.items()}
                state.update(counters, recent_returns=list(log.recent_returns), spent=dict(SPENT), rate_line=line)
                state["wandb_id"] = log.wandb.id if log.wandb else ckpt and ckpt.get("wandb_id")  # kept for --track
                save_checkpoint(f"{run_dir}/checkpoint.pt", dict(model_file(args, run_name, agent), **state))
            saved = (phase, global_step)
            for epoch, epoch_stats in enumerate(aux_epochs):  # x-axis: aux epochs run; logged after the checkpoint,
                log.scalars("aux/", epoch_stats, aux_epochs_done - len(aux_epochs) + 1 + epoch)  # as purge_step can't
    except NonFiniteError as e:
        log.close(exit_code=1)
        if dist.is_initialized():
            dist.destroy_process_group()
        sys.exit(f"error: phase {phase}, iteration {iteration}: {e}; stopped before that step; checkpoint unchanged")

    envs.close()
    log.close()
    signum = stop.agreed()
    if dist.is_initialized():
        dist.destroy_process_group()
    if signum and iteration < plan.num_iterations:
        print(stop_message(signum, global_step, saved, run_dir, workers))
        sys.exit(128 + signum)
    if signum:
        print(f"{signal.Signals(signum).name} came during the last rollout: the run finished and wrote its checkpoint")
    if args.save_model and rank == 0:
        torch.save(model_file(args, run_name, agent), f"{run_dir}/{args.exp_name}.pt")
        print(f"model saved to {run_dir}/{args.exp_name}.pt")
    return phases


if __name__ == "__main__":
    main(*parse_args())
