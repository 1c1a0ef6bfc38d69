"""Phasic Policy Gradient (Cobbe, Hilton, Klimov, Schulman 2020, arXiv 2009.04416) on Procgen.

One file, read top to bottom:
  1. Args: every flag, with the paper's symbols (N_pi, E_pi, E_V, E_aux, beta_clone).
  2. Plan: checks the flags and derives every count once, before any env or buffer exists.
  3. Environment: a thin Procgen vector env that reports every finished episode's raw return.
  4. Networks: IMPALA CNN, "normed" init, and the three architectures (dual, detach, shared).
  5. Small pieces: reward normaliser, GAE, the losses, chunked gradients, the pi_old snapshot.
  6. The two phases: policy_phase_update (E_pi, E_V epochs) and auxiliary_phase (E_aux epochs).
  7. Data parallel: under torchrun, K workers average their gradients (the released code's MPI setup).
  8. Checkpoints at every phase boundary, --resume, clean stops on SIGTERM/SIGINT.
  9. main(): Algorithm 1 of the paper, with TensorBoard logging under runs/{run_name}.
"""

import contextlib
import dataclasses
import datetime
import math
import os
import random
import resource
import signal
import sys
import time
from collections import defaultdict, deque
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import tyro


# ==== 1. Arguments ========================================================================================
@dataclasses.dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]  # the name of this experiment (the first part of the run name)
    seed: int = 1  # seed of python, numpy and torch, and of the environment's level sequence
    torch_deterministic: bool = True  # if toggled, `torch.backends.cudnn.deterministic=True`
    cuda: bool = True  # if toggled and a GPU is visible, train on it (the buffers then live in GPU memory)
    save_model: bool = False  # if toggled, save the weights and flags to `runs/{run_name}/{exp_name}.pt` at the end
    resume: Optional[str] = None  # continue the run of this `runs/{run_name}` folder from its last phase boundary

    # Environment
    env_id: str = "bigfish"  # the Procgen game (one of the 16 in PROCGEN_GAMES)
    distribution_mode: str = "easy"  # Procgen difficulty: `easy` (Procgen paper, 25M steps) or `hard` (PPG paper, 100M steps)
    num_levels: int = 0  # number of training levels; 0 trains on the full level distribution
    start_level: int = 0  # the first training level's seed

    # Policy phase (PPO)
    total_timesteps: int = 25_000_000  # total env steps of all workers (rounded UP to whole rollouts; the exact count is printed)
    learning_rate: float = 5e-4  # Adam learning rate of both phases (constant, as in the paper)
    num_envs: int = 64  # number of parallel envs (of each worker, under torchrun)
    num_steps: int = 256  # steps per env in each rollout
    gamma: float = 0.999  # discount factor of GAE and the value targets
    gae_lambda: float = 0.95  # lambda of generalised advantage estimation
    norm_reward: bool = True  # if toggled, divide rewards by the running std of their discounted return, clipped to +-10
    reward_norm_gamma: float = 0.99  # discount of the return whose running std scales the rewards (0.99 in the released code)
    num_minibatches: int = 8  # PPO minibatches per epoch in the policy phase (each worker's share of a minibatch is 1/K)
    clip_coef: float = 0.2  # PPO clipping coefficient
    ent_coef: float = 0.01  # entropy bonus coefficient
    max_grad_norm: float = 0.0  # clip the gradient norm of each network to this (0 = no clipping, as in the paper)

    # Phasic Policy Gradient
    arch: str = "dual"  # `dual`: separate policy and value networks; `detach`: one trunk, value head on detached features; `shared`: value head on the trunk (with --e-aux 0 --e-pi 3 --e-v 3: the PPO baseline)
    n_pi: int = 32  # N_pi: policy-phase iterations (rollouts) per phase
    e_pi: int = 1  # E_pi: epochs of the PPO policy loss on each rollout
    e_v: int = 1  # E_V: epochs of the value loss on each rollout
    e_aux: int = 6  # E_aux: auxiliary epochs per phase (0 disables the auxiliary phase)
    beta_clone: float = 1.0  # beta_clone: weight of KL(pi_old || pi) in the auxiliary joint loss
    aux_mb_trajectories: int = 4  # whole --num-steps trajectories per auxiliary minibatch of each worker (4 x 256 = 1,024 states)
    aux_kl_stop: float = 0.02  # stop the auxiliary phase after an epoch whose mean clone KL exceeds this (0 disables)
    micro_batch_size: Optional[int] = None  # forward/backward a minibatch in chunks of this many states: the same update, with peak memory growing with the chunk (0 = the whole minibatch at once; None = the fastest measured: 256 on a CPU, whole minibatches on a GPU)
    precision: str = "auto"  # `fp32`, `bf16` (autocast of the networks' trunks; weights, optimiser and loss math stay fp32), or `auto`: bf16 where the hardware runs it natively (a GPU with bf16, a CPU with AMX or AVX512-BF16)


NORMALISATION = {  # (R_min, R_max) of the Procgen paper, to report scores normalised as the PPG paper does
    "easy": dict(coinrun=(5, 10), starpilot=(2.5, 64), caveflyer=(3.5, 12), dodgeball=(1.5, 19), fruitbot=(-1.5, 32.4),
                 chaser=(0.5, 13), miner=(1.5, 13), jumper=(3, 10), leaper=(3, 10), maze=(5, 10), bigfish=(1, 40),
                 heist=(3.5, 10), climber=(2, 12.6), plunder=(4.5, 30), ninja=(3.5, 10), bossfight=(0.5, 13)),
    "hard": dict(coinrun=(5, 10), starpilot=(1.5, 35), caveflyer=(2, 13.4), dodgeball=(1.5, 19), fruitbot=(-0.5, 27.2),
                 chaser=(0.5, 14.2), miner=(1.5, 20), jumper=(1, 10), leaper=(1.5, 10), maze=(4, 10), bigfish=(0, 40),
                 heist=(2, 10), climber=(1, 12.6), plunder=(3, 30), ninja=(2, 10), bossfight=(0.5, 13)),
}
PROCGEN_GAMES = tuple(sorted(NORMALISATION["easy"]))  # the 16 games
OBS_SHAPE = (64, 64, 3)  # HWC uint8, as Procgen emits it
NUM_ACTIONS = 15  # every Procgen game uses the same 15-action set


# ==== 2. Plan: validate the flags and derive every count once =============================================
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
    buffer_bytes: int  # bytes of the preallocated uint8 observation buffer


def make_plan(args: Args, workers: int = 1) -> Plan:
    """Check every flag and derive the run's counts for K = `workers`. Raises ArgError with a one-line message."""
    check_env_args(args)
    for name, value in dataclasses.asdict(args).items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ArgError(f"--{name.replace('_', '-')} must be a finite number (got {value})")
    if args.arch not in ("dual", "detach", "shared"):
        raise ArgError(f"--arch {args.arch!r} is unknown; use dual, detach or shared")
    for rule, ok, names in [
            ("be at least 1", lambda v: v >= 1, "num_envs num_steps num_minibatches n_pi e_pi e_v total_timesteps aux_mb_trajectories"),
            ("be >= 0", lambda v: v >= 0, "e_aux micro_batch_size beta_clone ent_coef aux_kl_stop max_grad_norm"),
            ("be > 0", lambda v: v > 0, "learning_rate clip_coef"),
            ("lie in [0, 1]", lambda v: 0 <= v <= 1, "gamma gae_lambda reward_norm_gamma")]:
        for name in names.split():
            value = getattr(args, name)
            if value is not None and not ok(value):
                raise ArgError(f"--{name.replace('_', '-')} must {rule} (got {value})")
    batch_size = args.num_envs * args.num_steps
    if batch_size % args.num_minibatches:
        raise ArgError(f"--num-minibatches {args.num_minibatches} does not divide the rollout of "
                       f"--num-envs x --num-steps = {batch_size} states; pick a divisor of {batch_size}")

    num_iterations = -(-args.total_timesteps // (batch_size * workers))  # round UP: never train less than asked
    num_aux_phases = (num_iterations - 1) // args.n_pi if args.e_aux > 0 else 0
    aux_slots = args.n_pi if num_aux_phases > 0 else 1
    trajectories = aux_slots * args.num_envs
    if num_aux_phases > 0 and trajectories % args.aux_mb_trajectories:
        raise ArgError(f"--aux-mb-trajectories {args.aux_mb_trajectories} does not divide the "
                       f"{trajectories} trajectories of an auxiliary phase (--n-pi x --num-envs)")
    return Plan(batch_size=batch_size, minibatch_size=batch_size // args.num_minibatches, num_iterations=num_iterations,
                num_aux_phases=num_aux_phases, total_env_steps=num_iterations * batch_size * workers, aux_slots=aux_slots,
                aux_minibatches=trajectories // args.aux_mb_trajectories,
                buffer_bytes=trajectories * args.num_steps * math.prod(OBS_SHAPE))


# Peak bytes of autograd activations per state and per IMPALA trunk for one forward+backward:
# peak-RSS growth over 128..512 states on the 2-core CPU machine was 1.5-1.7 MB, rounded up.
ACTIVATION_BYTES_PER_TRUNK_STATE = 1_800_000
# Resident memory of the process before any buffer: python, torch, the envs (0.4-0.5 GiB measured).
PROCESS_BYTES = 512 * 2**20
CPU_MICRO_BATCH = 256  # the chunk that ran fastest on a CPU (tools/benchmark.py; README); a GPU takes whole minibatches


def bf16_is_native(device: torch.device) -> Tuple[bool, str]:
    """Whether this device runs bf16 convolutions and matmuls in hardware, and what it is."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False), torch.cuda.get_device_name(device)
    for name, check in (("AMX", "_is_amx_tile_supported"), ("AVX512-BF16", "_is_avx512_bf16_supported")):
        if getattr(torch.cpu, check, lambda: False)():  # a private torch API, hence getattr
            return True, f"the CPU has {name}"
    return False, "the CPU has neither AMX nor AVX512-BF16"


def resolve_hardware(args: Args) -> Tuple[Args, torch.device, str]:
    """Args with `precision` and `micro_batch_size` made concrete for this device; the device; why that precision."""
    if args.precision not in ("auto", "fp32", "bf16"):
        raise ArgError(f"--precision {args.precision!r} is unknown; use auto, fp32 or bf16")
    gpus = torch.cuda.device_count() if args.cuda and torch.cuda.is_available() else 0  # worker i: GPU (i mod gpus)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % gpus) if gpus else torch.device("cpu")
    if gpus:
        torch.cuda.set_device(device)  # the current device: what bf16_is_native checks, and where nccl reduces
    native, hardware = bf16_is_native(device)
    precision = ("bf16" if native else "fp32") if args.precision == "auto" else args.precision
    chunk = (0 if device.type == "cuda" else CPU_MICRO_BATCH) if args.micro_batch_size is None else args.micro_batch_size
    why = f"auto: {hardware}" if args.precision == "auto" else f"--precision {args.precision}"
    return dataclasses.replace(args, precision=precision, micro_batch_size=chunk), device, why


def check_memory(args: Args, plan: Plan, device: torch.device) -> Tuple[int, int]:
    """Estimate the memory of this machine's workers on this device; stop with one line if it cannot fit.
    Returns (needed, free); free is -1 where it cannot be read (no /proc/meminfo), and nothing is refused."""
    chunk = min(args.micro_batch_size or math.inf, max(plan.minibatch_size, args.aux_mb_trajectories * args.num_steps))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))  # torchrun's workers on this machine share its RAM, or its GPUs
    sharing = -(-local // torch.cuda.device_count()) if device.type == "cuda" else local
    needed = sharing * (PROCESS_BYTES
                        + plan.buffer_bytes  # uint8 observations of every rollout of the phase
                        + plan.aux_slots * plan.batch_size * 4 * (1 + NUM_ACTIONS)  # return targets and the pi_old snapshot
                        + plan.batch_size * 4 * 8  # one rollout's actions, log-probs, values, rewards, ...
                        + chunk * ACTIVATION_BYTES_PER_TRUNK_STATE * (2 if args.arch == "dual" else 1))  # one chunk's activations
    where, free = ("GPU memory", torch.cuda.mem_get_info(device)[0]) if device.type == "cuda" else ("RAM", -1)
    if device.type == "cpu" and os.path.exists("/proc/meminfo"):  # Linux; elsewhere free stays -1 (unknown)
        free = next((int(line.split()[1]) * 1024 for line in open("/proc/meminfo") if line.startswith("MemAvailable")), -1)
    if needed > free >= 0:
        raise ArgError(f"this run needs about {needed / 2**30:.1f} GiB of {where} (an observation buffer of "
                       f"{plan.buffer_bytes / 2**30:.1f} GiB{f' in each of {sharing} workers' if sharing > 1 else ''}) but only "
                       f"{free / 2**30:.1f} GiB is free; shrink it with a smaller --n-pi, --num-envs, --num-steps or --micro-batch-size")
    return needed, free


# ==== 3. Environment ======================================================================================
def check_env_args(args: Args) -> None:
    if args.env_id not in PROCGEN_GAMES:
        raise ArgError(f"--env-id {args.env_id!r} is not a Procgen game; use one of: {', '.join(PROCGEN_GAMES)}")
    if args.distribution_mode not in NORMALISATION:
        raise ArgError(f"--distribution-mode {args.distribution_mode!r} is unknown; use easy or hard")
    for flag, value, least in [("--num-levels", args.num_levels, 0), ("--start-level", args.start_level, 0)]:
        if value < least:
            raise ArgError(f"{flag} must be at least {least} (got {value})")


class ProcgenVecEnv:
    """Procgen's vector env with a plain interface: uint8 HWC frames, raw rewards, done flags,
    and the (env, return, length) of every episode that finished. Procgen resets an env inside
    the step that ends its episode: the frame returned with done=True already starts the next one."""

    def __init__(self, args: Args, num_envs: int, num_levels: int, start_level: int, seed: int):
        with contextlib.suppress(ImportError):  # gym 0.26 (procgen's dependency) prints a 4-line notice from this table
            __import__("gym_notices.notices").notices.notices.clear()
        from procgen import ProcgenEnv  # imported here so the flags are checked before gym loads

        self.env = ProcgenEnv(num_envs=num_envs, env_name=args.env_id, num_levels=num_levels,
                              start_level=start_level, distribution_mode=args.distribution_mode, rand_seed=seed)
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


# ==== 4. Networks: IMPALA CNN with the released code's "normed" initialisation ============================
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
    """uint8 HWC frames -> 256 features. Three stacks (16, 32, 32 channels) of conv3x3,
    maxpool 3x3 stride 2, two residual blocks; then flatten, relu, dense 256, relu."""

    def __init__(self, obs_shape: Tuple[int, ...], channels=(16, 32, 32), out_features=256):
        super().__init__()
        h, w, c = obs_shape
        # Scales of the released code: each of the 3 stacks gets 1/sqrt(3); each of its 2 blocks
        # 1/sqrt(2) of that, split as sqrt() over the block's two convs: sqrt(1/sqrt(3)/sqrt(2)).
        res_scale = math.sqrt(1 / math.sqrt(len(channels)) / math.sqrt(2))
        layers = []
        for out in channels:
            layers += [normed_init_(nn.Conv2d(c, out, 3, padding=1), 1.0), nn.MaxPool2d(3, stride=2, padding=1),
                       ResidualBlock(out, res_scale), ResidualBlock(out, res_scale)]
            c, h, w = out, (h + 1) // 2, (w + 1) // 2
        self.convs = nn.Sequential(*layers)
        self.dense = normed_init_(nn.Linear(c * h * w, out_features), 1.4)
        self.out_features = out_features

    def forward(self, obs_uint8: torch.Tensor) -> torch.Tensor:
        # The one place frames become floats: a (B, H, W, C) uint8 batch, never a float buffer.
        # permute() keeps the NHWC memory order, so the convs run channels_last (faster on CPU).
        x = self.convs(obs_uint8.permute(0, 3, 1, 2).float().div_(255.0))
        return F.relu(self.dense(F.relu(x.flatten(1))))


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
        """The one place precision is chosen: with bf16, the trunk's convolutions and matmuls run
        under autocast; its features come back fp32, so the small heads and all loss math are fp32."""
        with torch.autocast(obs.device.type, torch.bfloat16, enabled=self.bf16):
            return trunk(obs).float()

    def forward(self, obs: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns (policy logits, true value V, auxiliary value V_aux), all fp32."""
        h = self.features(self.pi_trunk, obs)
        v = self.features(self.v_trunk, obs) if self.arch == "dual" else h.detach() if self.arch == "detach" else h
        return self.pi_head(h), self.value_head(v).squeeze(-1), self.aux_value_head(h).squeeze(-1)

    def logits(self, obs: torch.Tensor) -> torch.Tensor:
        """The policy alone (no value network pass): for the pi_old snapshot and evaluation."""
        return self.pi_head(self.features(self.pi_trunk, obs))

    def policy_parameters(self) -> List[nn.Parameter]:
        """theta_pi: the policy trunk and its two heads."""
        return [*self.pi_trunk.parameters(), *self.pi_head.parameters(), *self.aux_value_head.parameters()]

    def value_parameters(self) -> List[nn.Parameter]:
        """theta_V: the value network (dual) or the value head alone (detach, shared)."""
        return [*(self.v_trunk.parameters() if self.v_trunk is not None else []), *self.value_head.parameters()]


# ==== 5. Small pieces, each a plain function or class the tests call directly =============================
class RewardNormalizer:
    """Divide rewards by the running std of each env's discounted return (no mean subtraction), then clip: the
    released code's scheme, which keeps value targets near unit scale. As there, it takes a whole rollout: the
    statistics take every step's return of every worker's envs first (one shared scale), then it scales them."""

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
        self._update(*global_moments(torch.from_numpy(rets)))
        return np.clip(rewards / np.sqrt(self.var + self.epsilon), -self.clip, self.clip).astype(np.float32)

    def state_dict(self) -> Dict:
        return dict(mean=float(self.mean), var=float(self.var), count=float(self.count))  # not `ret`: the envs restart

    def load_state_dict(self, state: Dict) -> None:
        self.mean, self.var, self.count = state["mean"], state["var"], state["count"]

    def _update(self, n: float, mean: float, var: float) -> None:  # parallel (Chan et al.) merge of a batch's moments
        delta, total = mean - self.mean, self.count + n
        self.mean += delta * n / total
        self.var = (self.var * self.count + var * n + delta**2 * self.count * n / total) / total
        self.count = total


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


def ppo_policy_loss(logits, actions, old_logprobs, advantages, clip_coef: float):
    """PPO's clipped surrogate (to minimise). Returns (loss, entropy, approx_kl, clipfrac)."""
    logprobs = F.log_softmax(logits, dim=-1)
    new_logprob = logprobs.gather(-1, actions.unsqueeze(-1)).squeeze(-1)
    logratio = new_logprob - old_logprobs
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


def clone_kl(old_logits, new_logits):
    """Exact KL(pi_old || pi) over all actions, averaged over states."""
    old_logp = F.log_softmax(old_logits, dim=-1)
    return (old_logp.exp() * (old_logp - F.log_softmax(new_logits, dim=-1))).sum(-1).mean()


def aux_joint_loss(aux_values, returns, old_logits, new_logits, beta_clone: float):
    """L_joint = L_aux + beta_clone * L_clone. Returns (L_joint, L_aux, L_clone)."""
    l_aux = value_loss(aux_values, returns)
    l_clone = clone_kl(old_logits, new_logits)
    return l_aux + beta_clone * l_clone, l_aux, l_clone


def accumulate_gradients(n: int, chunk: int, loss_fn: Callable[[slice], Tuple[torch.Tensor, Dict[str, torch.Tensor]]]):
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
    """Adam step on the gradient averaged over the workers, after clipping the norms of theta_pi's and theta_V's
    gradients separately (if asked: one network's gradient never rescales the other's update). Then the gradients
    are dropped, so none crosses into the next step or phase (both optimizers share the parameters' .grad).
    A non-finite gradient, averaged, is seen by every worker at once: all stop, naming this worker's bad losses."""
    average_gradients(agent.parameters())
    if not torch.isfinite(sum(p.grad.norm() for p in agent.parameters() if p.grad is not None)):
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
    return torch.cat([agent.logits(part) for part in obs_buffer.flatten(0, 1).split(chunk)]).view(*obs_buffer.shape[:2], -1)


# ==== 6. The two phases ===================================================================================
def policy_phase_update(agent: PPGAgent, optimizer: torch.optim.Optimizer, batch: Dict[str, torch.Tensor],
                        args: Args, plan: Plan) -> Dict[str, float]:
    """E_pi epochs of the PPO loss (+ entropy bonus) and E_V epochs of the value loss on one rollout. Both losses of
    an epoch share each minibatch's backward pass, as in the released code; for dual and detach they touch disjoint
    parameters, so this equals two separate loops. The auxiliary value head gets no gradient here. Returns means
    over all minibatches (and workers)."""
    n, logs = batch["obs"].shape[0], defaultdict(list)
    for epoch in range(max(args.e_pi, args.e_v)):
        train_pi, train_v = epoch < args.e_pi, epoch < args.e_v
        for idx in torch.randperm(n, device=batch["obs"].device).split(plan.minibatch_size):
            mb = {k: v[idx] for k, v in batch.items()}

            def loss_fn(part: slice):
                logits, values, _ = agent(mb["obs"][part])
                loss, stats = 0.0, {}
                if train_pi:
                    pg_loss, entropy, approx_kl, clipfrac = ppo_policy_loss(
                        logits, mb["actions"][part], mb["logprobs"][part], mb["advantages"][part], args.clip_coef)
                    loss = loss + pg_loss - args.ent_coef * entropy
                    stats.update(policy_loss=pg_loss, entropy=entropy, approx_kl=approx_kl, clipfrac=clipfrac)
                if train_v:
                    v_loss = value_loss(values, mb["returns"][part])
                    loss = loss + v_loss
                    stats.update(value_loss=v_loss)
                return loss, stats

            stats = accumulate_gradients(mb["obs"].shape[0], args.micro_batch_size, loss_fn)
            optimizer_step(optimizer, agent, args.max_grad_norm, stats)
            for k, v in stats.items():
                logs[k].append(v)
    return mean_over_workers(logs)


def auxiliary_phase(agent: PPGAgent, optimizer: torch.optim.Optimizer, obs_buffer: torch.Tensor,
                    returns_buffer: torch.Tensor, args: Args) -> Dict:
    """Snapshot pi_old, then E_aux epochs over minibatches of whole trajectories of
    L_joint = 0.5 (V_aux - V_hat)^2 + beta_clone KL(pi_old || pi)  on the policy network, and
    L_value = 0.5 (V - V_hat)^2  on the value network. V_hat (returns_buffer) stays fixed.
    Stops after an epoch whose mean KL exceeds --aux-kl-stop (the seed's KL guard)."""
    chunk = args.micro_batch_size or args.aux_mb_trajectories * args.num_steps
    t0 = time.perf_counter()
    old_logits = snapshot_policy(agent, obs_buffer, chunk)
    snapshot_s, epochs, stopped_early = time.perf_counter() - t0, [], False
    for epoch in range(args.e_aux):
        logs = defaultdict(list)
        for traj in torch.randperm(obs_buffer.shape[0], device=obs_buffer.device).split(args.aux_mb_trajectories):
            # Whole trajectories: each one is a contiguous row block of the buffer.
            obs, targets, old = obs_buffer[traj].flatten(0, 1), returns_buffer[traj].flatten(), old_logits[traj].flatten(0, 1)

            def loss_fn(part: slice):
                logits, values, aux_values = agent(obs[part])
                joint, l_aux, l_clone = aux_joint_loss(aux_values, targets[part], old[part], logits, args.beta_clone)
                l_value = value_loss(values, targets[part])
                return joint + l_value, dict(aux_value_loss=l_aux, clone_kl=l_clone, joint_loss=joint, value_loss=l_value)

            stats = accumulate_gradients(obs.shape[0], chunk, loss_fn)
            optimizer_step(optimizer, agent, args.max_grad_norm, stats)
            for k, v in stats.items():
                logs[k].append(v)
        epochs.append(mean_over_workers(logs))  # every worker sees the same means: the KL guard stops them all at once
        if args.aux_kl_stop > 0 and epochs[-1]["clone_kl"] > args.aux_kl_stop and epoch < args.e_aux - 1:
            stopped_early = True  # only when an epoch is actually skipped
            break
    return dict(epochs=epochs, stopped_early=stopped_early, snapshot_s=snapshot_s,
                aux_s=time.perf_counter() - t0 - snapshot_s)


# ==== 7. Data parallel: torchrun's workers, as the released code's MPI ranks ==============================
# Each worker steps its own envs into its own buffers; the update sees them all: gradients averaged before every optimizer
# step, advantages and reward scale from moments over all workers, statistics (so the KL guard) averaged. Without torchrun
# each function here is the identity.
GRAD_ALLREDUCE_S = [0.0]  # seconds spent averaging gradients (waits for the slowest worker included)


def all_reduce(x: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """x summed, averaged (`mean`) or maximised (`max`) over the workers, as a new tensor on x's device."""
    if not dist.is_initialized():
        return x
    y = x.to("cuda" if dist.get_backend() == "nccl" else "cpu", copy=True)  # nccl reduces on GPUs, gloo on CPUs
    dist.all_reduce(y, dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return (y / dist.get_world_size() if op == "mean" else y).to(x.device)


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
        t0, grads = time.perf_counter(), [p.grad for p in parameters if p.grad is not None]  # the same on all workers
        flat = all_reduce(torch.cat([g.flatten() for g in grads]), "mean")
        for g, mean in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(mean.view_as(g))
        if flat.is_cuda:
            torch.cuda.synchronize()  # time the all-reduce itself, not its launch
        GRAD_ALLREDUCE_S[0] += time.perf_counter() - t0


def gather(items: list) -> list:
    """Every worker's list, concatenated in rank order (this worker's list without torchrun)."""
    parts = [items]
    if dist.is_initialized():
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, items)
    return [item for part in parts for item in part]


def start_workers(device: torch.device, agent: nn.Module) -> None:
    """Join torchrun's process group (nccl where each worker has a GPU of its own; gloo on CPUs and shared GPUs),
    then copy rank 0's parameters to every worker. A collective kept waiting 30 minutes fails the run."""
    nccl = device.type == "cuda" and int(os.environ["LOCAL_WORLD_SIZE"]) <= torch.cuda.device_count()
    dist.init_process_group("nccl" if nccl else "gloo", timeout=datetime.timedelta(minutes=30))
    for tensor in agent.state_dict().values():  # broadcast as a sum: rank 0's values plus zeros, exactly rank 0's
        tensor.copy_(all_reduce(tensor if dist.get_rank() == 0 else torch.zeros_like(tensor)))


# ==== 8. Runs that survive: atomic checkpoints at phase boundaries, --resume, stop signals ================
CHECKPOINT_FORMAT = 1
SCRIPT = os.path.basename(__file__)
# The flags --resume takes from the command line; the others come from the checkpoint.
RESUMABLE = ("resume", "total_timesteps", "cuda", "save_model", "micro_batch_size")


def model_file(args: Args, run_name: str, agent: nn.Module) -> Dict:
    """What --save-model writes, and every checkpoint holds: enough to rebuild and run the policy."""
    return dict(format=CHECKPOINT_FORMAT, script=SCRIPT, run_name=run_name, args=dataclasses.asdict(args), agent=agent.state_dict())


def save_checkpoint(path: str, state: Dict) -> float:
    """Write atomically (a temporary file, fsynced, renamed over the old one): a crash mid-write leaves the previous
    checkpoint intact. Returns the seconds it took."""
    t0 = time.time()
    with open(path + ".tmp", "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)
    return time.time() - t0


def load_checkpoint(path: str, flag: str = "--resume") -> Dict:
    """A checkpoint (or --save-model file) of this script, or ArgError with one line saying why not.
    weights_only: the file holds tensors and plain Python values only, and loading runs no code."""
    path = os.path.join(path, "checkpoint.pt") if os.path.isdir(path) else path
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ArgError(f"{flag} {path}: no such file") from None
    except Exception as e:  # truncated, or not a torch file at all
        raise ArgError(f"{flag} {path}: not a readable checkpoint, perhaps truncated ({type(e).__name__})") from None
    script = state.get("script") if isinstance(state, dict) else None
    if script != SCRIPT:
        raise ArgError(f"{flag} {path}: written by {script or 'something else'}, not by {SCRIPT}")
    if state.get("format") != CHECKPOINT_FORMAT or not {"run_name", "args", "agent"} <= state.keys():
        raise ArgError(f"{flag} {path}: checkpoint format {state.get('format')}; this script reads format {CHECKPOINT_FORMAT}")
    if differ := sorted(set(state["args"]) ^ {field.name for field in dataclasses.fields(Args)}):  # another version's flags
        raise ArgError(f"{flag} {path}: written by a version of {SCRIPT} with other flags ({', '.join(differ)}); use that version")
    return state


def resume_args(args: Args, given: Optional[set] = None) -> Tuple[Args, Dict]:
    """The checkpointed run's flags, with those of RESUMABLE that this command line gives; a training flag given with
    another value is refused. `given`: the flags named on the command line (None: those off their defaults)."""
    state, defaults = load_checkpoint(args.resume), Args()
    saved = state["args"]
    given = {n for n, v in dataclasses.asdict(args).items() if v != getattr(defaults, n)} if given is None else given
    for name in sorted(given - set(RESUMABLE)):
        if getattr(args, name) != saved[name]:
            raise ArgError(f"--{name.replace('_', '-')} {getattr(args, name)} conflicts with the checkpoint's {saved[name]}: "
                           f"a resumed run keeps its training flags; leave it out")
    keep = {name: getattr(args, name) for name in given & set(RESUMABLE)}
    if keep.get("total_timesteps", saved["total_timesteps"]) < saved["total_timesteps"]:
        raise ArgError(f"--total-timesteps may only be raised on --resume (the checkpoint's is {saved['total_timesteps']:,})")
    return dataclasses.replace(Args(**saved), **keep), state


class StopSignal:
    """SIGTERM and SIGINT ask the run to stop at the next rollout boundary; the last phase-boundary
    checkpoint stays, so at most one phase is lost. A second signal stops it at once."""

    def __init__(self):
        self.signum = 0
        signal.signal(signal.SIGTERM, self), signal.signal(signal.SIGINT, self)

    def __call__(self, signum, frame) -> None:
        if self.signum:
            sys.exit(128 + signum)
        self.signum = signum
        os.write(sys.stdout.fileno(), f"\n{signal.Signals(signum).name}: stopping at the next rollout boundary (again: stop now)\n".encode())


# ==== 9. Evaluation on unseen levels, and main(): the paper's Algorithm 1 =================================
def normalised_score(args: Args, episode_return: float) -> float:
    r_min, r_max = NORMALISATION[args.distribution_mode][args.env_id]
    return (episode_return - r_min) / (r_max - r_min)


@torch.no_grad()
def evaluate(agent: PPGAgent, args: Args, device: torch.device) -> List[float]:
    """One episode in each of --num-envs envs on unseen levels (the full distribution; the same ones every time)."""
    envs, returns = ProcgenVecEnv(args, args.num_envs, num_levels=0, start_level=0, seed=args.seed + 1_000_003), {}
    obs = envs.reset()
    while len(returns) < envs.num_envs:
        actions = torch.distributions.Categorical(logits=agent.logits(torch.from_numpy(obs).to(device))).sample()
        obs, _, _, finished = envs.step(actions.cpu().numpy())
        returns.update({i: ep_return for i, ep_return, _ in finished if i not in returns})  # each env's first episode
    envs.close()
    return list(returns.values())


def eta_seconds(args: Args, plan: Plan, iterations_done: int, aux_phases_left: int, spent: Dict[str, float]) -> float:
    """Time left at the measured costs. Until an aux phase has run, it costs the policy update's time per rollout and
    epoch (the same forward+backward) x its rollouts x E_aux + 1/3 epochs (the snapshot: a forward pass, a third)."""
    per_aux = ((spent["snapshot"] + spent["aux_epochs"]) / spent["aux_phases"] if spent["aux_phases"] else
               spent["policy_update"] / (iterations_done * max(args.e_pi, args.e_v)) * plan.aux_slots * (args.e_aux + 1 / 3))
    per_iteration = (spent["rollout"] + spent["policy_update"]) / iterations_done
    return (plan.num_iterations - iterations_done) * per_iteration + aux_phases_left * per_aux


def main(args: Args, given: Optional[set] = None) -> List[Dict[str, float]]:
    """Train; returns each phase's speed figures (tools/benchmark.py reads them). `given`: see resume_args.
    Under torchrun every worker runs this (torchrun sets RANK and WORLD_SIZE); rank 0 alone prints and writes."""
    rank, workers = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    launch = "python" if workers == 1 else f"torchrun --standalone --nproc-per-node {workers}" if os.environ.get(
        "LOCAL_WORLD_SIZE") == str(workers) else "torchrun (as launched)"
    try:
        args, ckpt = resume_args(args, given) if args.resume else (args, None)
        if ckpt and ckpt.get("workers", 1) != workers:  # else the global batch would change
            raise ArgError(f"--resume: the run had {ckpt.get('workers', 1)} workers and resumes with as many, not {workers}")
        args, device, precision_why = resolve_hardware(args)
        plan = make_plan(args, workers)
        mem_needed, mem_free = check_memory(args, plan, device)
    except ArgError as e:
        sys.exit(f"error: {e}" if int(os.environ.get("LOCAL_RANK", 0)) == 0 else 2)  # one line a machine (its file, its memory)
    if rank:
        sys.stdout = open(os.devnull, "w")  # rank 0 alone prints

    run_name = ckpt["run_name"] if ckpt else f"{args.env_id}__{args.exp_name}__{args.seed}__{int(time.time())}"
    # Phases and rollouts done: none, or the checkpoint's; the remaining rollouts run N_pi to a phase.
    phase, iteration = (ckpt["phase"], ckpt["global_step"] // (plan.batch_size * workers)) if ckpt else (0, 0)
    num_phases = phase + -(-(plan.num_iterations - iteration) // args.n_pi)
    k_x = f"{workers} workers x " if workers > 1 else ""
    print(f"run {run_name} on {device}: {num_phases} phases x N_pi={args.n_pi} iterations = {plan.num_iterations} rollouts "
          f"of {k_x}{args.num_envs} envs x {args.num_steps} steps = {plan.total_env_steps:,} env steps" +
          (f" (--total-timesteps {args.total_timesteps:,} rounded up to whole rollouts)" if plan.total_env_steps != args.total_timesteps else ""))
    aux_plan = (f"{max(num_phases - phase - 1, 0) if args.e_aux else 0} auxiliary phases of {plan.aux_minibatches} minibatches "
                f"x {k_x}{args.aux_mb_trajectories * args.num_steps} states" if plan.num_aux_phases else "no auxiliary phase")
    print(f"arch={args.arch} E_pi={args.e_pi} E_V={args.e_v} E_aux={args.e_aux} beta_clone={args.beta_clone}; {aux_plan}; PPO "
          f"minibatch {k_x}{plan.minibatch_size} states; observation buffer {k_x}{plan.buffer_bytes / 2**30:.2f} GiB uint8; "
          f"estimated need {mem_needed / 2**30:.2f} GiB" + (f" of {mem_free / 2**30:.1f} GiB free" if mem_free >= 0 else ""))
    print(f"precision {args.precision} ({precision_why}); forward/backward in chunks of {args.micro_batch_size or 'whole minibatches of'} states")

    from torch.utils.tensorboard import SummaryWriter

    # On --resume, purge_step hides what the stopped run logged after its checkpoint: no step twice.
    writer = SummaryWriter(f"runs/{run_name}", purge_step=ckpt["global_step"] + 1 if ckpt else None) if rank == 0 else None
    if writer:  # rank 0 alone writes files
        writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + "\n".join(f"|{k}|{v}|" for k, v in vars(args).items()))
    log = writer.add_scalar if writer else lambda tag, value, step: None

    # One random stream per start and worker: --seed, shifted by the phases done (so a resumed run is reproducible
    # too) and by the rank (so no two workers play the same levels or sample the same actions).
    seed = args.seed + 100_003 * phase + rank * args.num_envs
    random.seed(seed), np.random.seed(seed), torch.manual_seed(seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic

    # ---- Environment: training levels [start_level, start_level + num_levels), level sequence seeded by `seed` ----
    envs = ProcgenVecEnv(args, args.num_envs, args.num_levels, args.start_level, seed)
    reward_normalizer = RewardNormalizer(args.num_envs, args.reward_norm_gamma)

    # ---- Networks and the two optimizers (each persists across phases) ----
    agent = PPGAgent(args.arch, OBS_SHAPE, envs.num_actions, bf16=args.precision == "bf16").to(device)
    policy_optimizer = torch.optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-8)
    aux_optimizer = torch.optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-8)

    # ---- Buffers. Slot i of the auxiliary buffer IS the rollout buffer of iteration i of a phase: rollouts are written
    # straight into it as uint8, so it costs no copy. Rows are whole trajectories (num_envs rows per rollout). ----
    obs_buffer = torch.empty((plan.aux_slots * args.num_envs, args.num_steps, *OBS_SHAPE), dtype=torch.uint8, device=device)
    returns_buffer = torch.zeros((plan.aux_slots * args.num_envs, args.num_steps), device=device)
    shape = (args.num_envs, args.num_steps)
    actions, ended = torch.zeros(shape, dtype=torch.long, device=device), torch.zeros(shape, dtype=torch.bool, device=device)
    logprobs, values, rewards = (torch.zeros(shape, device=device) for _ in range(3))

    global_step, aux_epochs_done, start_time, phase_reports, recent_returns = 0, 0, time.time(), [], deque(maxlen=100)
    spent = dict(rollout=0.0, policy_update=0.0, snapshot=0.0, aux_epochs=0.0, aux_phases=0)  # seconds so far
    # Everything a checkpoint holds with a state_dict: saved at each phase boundary, restored on --resume.
    stateful = dict(agent=agent, policy_optimizer=policy_optimizer, aux_optimizer=aux_optimizer, reward_normalizer=reward_normalizer)
    if ckpt:  # --resume: everything the checkpoint holds
        for name, thing in stateful.items():
            thing.load_state_dict(ckpt[name])
        global_step, aux_epochs_done, spent = ckpt["global_step"], ckpt["aux_epochs_done"], ckpt["spent"]
        recent_returns.extend(ckpt["recent_returns"])
        print(f"resumed from runs/{run_name}/checkpoint.pt after phase {phase}, step {global_step:,}")
    if workers > 1:
        start_workers(device, agent)  # torchrun's process group; every worker takes rank 0's parameters
    stop, start_step, checkpointed, signum = StopSignal(), global_step, (phase, global_step) if ckpt else None, 0

    def guarded(where: str, update: Callable, *update_args):  # a non-finite gradient stops the run with one line
        try:
            return update(*update_args)
        except NonFiniteError as e:
            if writer:
                writer.close()
            sys.exit(f"error: phase {phase}, iteration {iteration}: {e} in the {where}; stopped before the optimizer "
                     f"step, and the last checkpoint is unchanged")

    next_obs = torch.from_numpy(envs.reset()).to(device)
    while iteration < plan.num_iterations and not (signum := int(all_reduce(torch.tensor(stop.signum), "max"))):
        phase, phase_start, spent_before, allreduce_before = phase + 1, time.time(), dict(spent), GRAD_ALLREDUCE_S[0]
        phase_iterations = min(args.n_pi, plan.num_iterations - iteration)
        # ============ Policy phase: N_pi iterations of rollout + PPO ============
        for it in range(phase_iterations):
            iteration += 1
            rows = slice((it % plan.aux_slots) * args.num_envs, (it % plan.aux_slots + 1) * args.num_envs)
            rollout_obs = obs_buffer[rows]

            # -- Collect a rollout with the current policy (no autograd) --
            t0, episodes = time.time(), []
            with torch.no_grad():
                for step in range(args.num_steps):
                    rollout_obs[:, step] = next_obs
                    logits, value, _ = agent(next_obs)
                    pi = torch.distributions.Categorical(logits=logits)
                    action = pi.sample()
                    actions[:, step], logprobs[:, step], values[:, step] = action, pi.log_prob(action), value
                    obs_np, reward_np, done_np, finished = envs.step(action.cpu().numpy())
                    rewards[:, step] = torch.from_numpy(reward_np).to(device)
                    ended[:, step] = torch.from_numpy(done_np).to(device)
                    next_obs = torch.from_numpy(obs_np).to(device)
                    global_step += args.num_envs * workers  # the workers step in lockstep
                    episodes += [(global_step, ep_return, ep_length) for _, ep_return, ep_length in finished]
                if args.norm_reward:  # once per rollout: update the return statistics, then scale
                    rewards.copy_(torch.from_numpy(reward_normalizer(rewards.cpu().numpy(), ended.cpu().numpy())))
                # -- GAE with the value network's predictions; V_hat = V + A --
                advantages, returns = compute_gae(rewards, values, ended, agent(next_obs)[1], args.gamma, args.gae_lambda)
            for step, ep_return, ep_length in gather(episodes):  # every finished episode of every worker, raw game reward
                log("charts/episodic_return", ep_return, step)
                log("charts/episodic_length", ep_length, step)
                log("charts/normalized_return", normalised_score(args, ep_return), step)
                recent_returns.append(ep_return)
            spent["rollout"] += time.time() - t0

            # -- E_pi epochs of PPO on the policy, E_V epochs of value loss (advantages normalised once, over all workers) --
            t0, (_, adv_mean, adv_var) = time.time(), global_moments(advantages)
            batch = dict(obs=rollout_obs.flatten(0, 1), actions=actions.flatten(), logprobs=logprobs.flatten(),
                         advantages=((advantages - adv_mean) / (math.sqrt(adv_var) + 1e-8)).flatten(), returns=returns.flatten())
            stats = guarded("policy update", policy_phase_update, agent, policy_optimizer, batch, args, plan)
            spent["policy_update"] += time.time() - t0
            returns_buffer[rows] = returns  # V_hat for the auxiliary phase (the observations are already in place)

            var_y = global_moments(returns)[2]
            explained_var = float("nan") if var_y == 0 else 1 - global_moments(returns - values)[2] / var_y
            for k, v in stats.items():
                log(f"losses/{k}", v, global_step)
            log("losses/explained_variance", explained_var, global_step)
            sps = int((global_step - start_step) / (time.time() - start_time))
            log("charts/SPS", sps, global_step)
            eta = eta_seconds(args, plan, iteration, num_phases - phase if args.e_aux else 0, spent)
            print(f"phase {phase}/{num_phases} iter {iteration}/{plan.num_iterations} step {global_step:,}/{plan.total_env_steps:,} "
                  f"SPS {sps} ETA {f'{eta / 3600:.1f}h' if eta >= 3600 else f'{eta / 60:.0f}min'} return(last {len(recent_returns)}) "
                  f"{np.mean(recent_returns) if recent_returns else float('nan'):.2f} policy_loss {stats['policy_loss']:.4f} "
                  f"value_loss {stats['value_loss']:.4f}", flush=True)
            signum = int(all_reduce(torch.tensor(stop.signum), "max"))  # all workers stop at the same rollout boundary
            if signum:
                break
        if signum:
            break  # before the aux phase: the run resumes from the last phase boundary

        # ============ Auxiliary phase: snapshot pi_old, E_aux epochs, then the buffer is reused ============
        aux = None
        if args.e_aux > 0 and iteration < plan.num_iterations:  # none after the last rollout: nothing uses it
            aux = guarded("auxiliary phase", auxiliary_phase, agent, aux_optimizer, obs_buffer, returns_buffer, args)
            aux_epochs_done += len(aux["epochs"])
            log("charts/aux_epochs", len(aux["epochs"]), global_step)
            if aux["stopped_early"]:
                print(f"phase {phase}: auxiliary phase stopped after epoch {len(aux['epochs'])}/{args.e_aux}: mean clone "
                      f"KL {aux['epochs'][-1]['clone_kl']:.4f} > --aux-kl-stop {args.aux_kl_stop}", flush=True)
            spent.update(snapshot=spent["snapshot"] + aux["snapshot_s"], aux_epochs=spent["aux_epochs"] + aux["aux_s"],
                         aux_phases=spent["aux_phases"] + 1)

        phase_s = time.time() - phase_start
        if args.num_levels > 0 and rank == 0:  # generalisation: the policy on unseen levels, once per phase (all are alike)
            eval_returns = evaluate(agent, args, device)
            log("eval/episodic_return", np.mean(eval_returns), global_step)
            log("eval/normalized_return", np.mean([normalised_score(args, r) for r in eval_returns]), global_step)
            print(f"phase {phase}: unseen-level return {np.mean(eval_returns):.2f} over {len(eval_returns)} episodes", flush=True)

        # ---- Per-phase report: where the time went (the gradient all-reduce is inside the update and aux epochs), a
        # worker's forward+backward states/s, peak memory; a check that all workers hold the same parameters; then
        # the checkpoint, where --resume continues ----
        timings = {k: spent[k] - spent_before[k] for k in ("rollout", "policy_update", "snapshot", "aux_epochs")}
        timings["grad_allreduce"] = GRAD_ALLREDUCE_S[0] - allreduce_before  # 0 without torchrun
        for k, v in timings.items():
            log(f"timing/{k}_s", v, global_step)
        steps = phase_iterations * plan.batch_size  # of one worker
        report = dict(whole_phase_sps=steps * workers / phase_s,
                      policy_phase_sps=steps * workers / (timings["rollout"] + timings["policy_update"]),
                      update_states_per_s=steps * max(args.e_pi, args.e_v) / timings["policy_update"],
                      aux_states_per_s=len(aux["epochs"]) * obs_buffer.shape[:2].numel() / aux["aux_s"] if aux else 0.0)
        phase_reports.append(dict(report, grad_allreduce_s=timings["grad_allreduce"]))
        peak = (torch.cuda.max_memory_allocated(device) if device.type == "cuda"
                else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # Linux reports KiB
        log("charts/peak_memory_GiB", peak / 2**30, global_step)
        if len(set(gather([float(sum(p.detach().double().sum() for p in agent.parameters()))]))) > 1:
            sys.exit(f"error: phase {phase}: the workers' parameters differ; a bug in {SCRIPT}, please report it")
        checkpoint_s = save_checkpoint(f"runs/{run_name}/checkpoint.pt", dict(
            model_file(args, run_name, agent), **{name: thing.state_dict() for name, thing in stateful.items()}, workers=workers,
            global_step=global_step, phase=phase, aux_epochs_done=aux_epochs_done, recent_returns=list(recent_returns),
            spent=spent)) if rank == 0 else 0.0
        checkpointed = (phase, global_step)
        # aux/ tags (x-axis: aux epochs run) only now: purge_step covers env steps, not epochs
        for epoch, epoch_stats in enumerate(aux["epochs"] if aux else []):
            for k, v in epoch_stats.items():
                log(f"aux/{k}", v, aux_epochs_done - len(aux["epochs"]) + 1 + epoch)
        print(f"phase {phase} done in {phase_s:.1f}s: " + ", ".join(f"{k} {v:.1f}s" for k, v in timings.items()) +
              f"; SPS whole-phase {report['whole_phase_sps']:.0f}, policy-phase {report['policy_phase_sps']:.0f}; forward+backward "
              f"states/s a worker: update {report['update_states_per_s']:.0f}" + (f", aux epochs {report['aux_states_per_s']:.0f}; " if aux else "; ") +
              f"peak {'GPU memory' if device.type == 'cuda' else 'RSS'} {peak / 2**30:.2f} GiB (observation buffer "
              f"{plan.buffer_bytes / 2**30:.2f} GiB); checkpoint {checkpoint_s:.1f}s", flush=True)

    envs.close()
    if writer:
        writer.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    if signum and iteration < plan.num_iterations:
        print(f"stopped by {signal.Signals(signum).name} at step {global_step:,}; " + (
            f"the checkpoint after phase {checkpointed[0]} (step {checkpointed[1]:,}) stays; resume with: {launch} {SCRIPT} "
            f"--resume runs/{run_name}" if checkpointed else "no checkpoint had been written yet"))
        sys.exit(128 + signum)
    if args.save_model and rank == 0:
        torch.save(model_file(args, run_name, agent), f"runs/{run_name}/{args.exp_name}.pt")
        print(f"model saved to runs/{run_name}/{args.exp_name}.pt")
    return phase_reports


if __name__ == "__main__":  # given: the flags named on the command line (--no-cuda names cuda), for --resume
    with open(os.devnull, "w") as quiet, contextlib.redirect_stderr(quiet if int(os.environ.get("LOCAL_RANK", 0)) else sys.stderr):
        cli_args = tyro.cli(Args)  # under torchrun, a machine's first worker alone reports flags tyro rejects
    main(cli_args, {a[2:].split("=")[0].replace("-", "_").removeprefix("no_") for a in sys.argv[1:] if a[:2] == "--"})
