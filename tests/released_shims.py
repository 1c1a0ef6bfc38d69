"""What tests/test_released_code.py and tests/test_whole_run.py need to run the authors' released code
(openai/phasic-policy-gradient) in this process: where it is (tools/released.py), a single-process stand-in for
mpi4py to import it with, its model built as its train.py builds it (or around one of our trunks), the map from our
PPGAgent's parameters to its PhasicValueModel's, an optimizer that records each step's gradients, and the released
code run in float64. Nothing of the released code is copied here: it is imported from its own folder."""

import contextlib
import math
import pathlib
import sys
import types

import numpy as np
import torch
import torch.nn as nn

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Where the released code is looked for: tools/released.py (on the path by conftest.py), which tools/report.py shares
from released import BESIDE, CLONE_COMMAND, COMMIT, ENV_VAR, released_commit, released_root  # noqa: E402, F401


class SingleProcessComm:
    """MPI.COMM_WORLD of a run with one process: rank 0 of 1; every reduction is the identity."""

    rank, size = 0, 1

    def Get_rank(self):
        return 0

    def Get_size(self):
        return 1

    def Allreduce(self, src, dst, op=None):
        np.copyto(dst, src)

    def allgather(self, x):
        return [x]

    def gather(self, x, root=0):
        return [x]

    def bcast(self, x, root=0):
        return x

    def Bcast(self, buf, root=0):
        pass

    def Barrier(self):
        pass


def mpi4py_stand_in() -> types.ModuleType:
    module = types.ModuleType("mpi4py")
    module.MPI = types.SimpleNamespace(Comm=SingleProcessComm, COMM_WORLD=SingleProcessComm(), SUM="sum")
    return module


@contextlib.contextmanager
def _importable(root: pathlib.Path):
    """The released package on sys.path and the mpi4py stand-in in sys.modules, for the import alone: its modules
    keep the names they bound, and no other test sees either."""
    added = "mpi4py" not in sys.modules
    if added:
        sys.modules["mpi4py"] = mpi4py_stand_in()
    sys.path.insert(0, str(root))
    try:
        yield
    finally:
        sys.path.remove(str(root))
        if added:
            del sys.modules["mpi4py"]


_loaded = {}


def load_released(root: pathlib.Path) -> types.SimpleNamespace:
    """The released modules, imported once: ppg, ppo, torch_util (tu), reward_normalizer, train, logger, impala_cnn,
    vec_monitor2, and gym3's types."""
    if root not in _loaded:
        with _importable(root):
            import gym3.types

            from phasic_policy_gradient import impala_cnn, logger, ppg, ppo, reward_normalizer, train, vec_monitor2
            from phasic_policy_gradient import torch_util as tu
        tu.DEFAULT_DEVICE = torch.device("cpu")  # the tests' device, whatever GPU the machine has
        tu.register_distributions_for_tree_util()  # as its train.py does: aux_train slices Categorical pi_old
        _loaded[root] = types.SimpleNamespace(
            ppg=ppg,
            ppo=ppo,
            tu=tu,
            reward_normalizer=reward_normalizer,
            train=train,
            logger=logger,
            impala_cnn=impala_cnn,
            vec_monitor2=vec_monitor2,
            ImpalaEncoder=impala_cnn.ImpalaEncoder,
            gym3_types=gym3.types,
        )
    rel = _loaded[root]
    fresh_logger(rel)
    return rel


def fresh_logger(rel) -> None:
    """An empty logger (no output files) for the released code's logkv calls, whose values a test may read."""
    rel.logger.Logger.CURRENT = rel.logger.Logger(dir=None, output_formats=[], comm=None)


def released_model(rel, arch: str, obs_shape, num_actions: int, trunk=None) -> nn.Module:
    """PhasicValueModel as the released train.py builds it: IMPALA encoders (16, 32, 32) -> 256, discrete actions.
    trunk: instead of IMPALA, one of our trunk classes (Atari's Nature CNN, which the released code lacks) in the
    released Encoder interface: the released heads, arch wiring, losses and loops around our trunk."""
    types_ = rel.gym3_types
    obtype = types_.TensorType(eltype=types_.Discrete(256), shape=tuple(obs_shape))
    actype = types_.TensorType(eltype=types_.Discrete(num_actions), shape=())

    class TrunkEncoder(rel.impala_cnn.Encoder):
        def __init__(self, ob_type):
            net = trunk(ob_type.shape)
            super().__init__(ob_type, types_.TensorType(eltype=types_.Real(), shape=(net.out_features,)))
            self.trunk = net

        def forward(self, x, first, state_in):
            b, t = x.shape[:2]
            return self.trunk(x.reshape(b * t, *x.shape[2:])).view(b, t, -1), state_in

        def initial_state(self, batchsize):
            return rel.tu.zeros(batchsize, 0)

    def enc_fn(ob_type):
        if trunk is not None:
            return TrunkEncoder(ob_type)
        return rel.ImpalaEncoder(ob_type.shape, outsize=256, chans=(16, 32, 32))

    return rel.ppg.PhasicValueModel(obtype, actype, enc_fn, arch=arch)


def _trunks(arch: str):
    """(our trunk, the released encoder) pairs of an arch."""
    return [("pi_trunk", "pi_enc")] + ([("v_trunk", "vf_enc")] if arch == "dual" else [])


def _heads(arch: str) -> dict:
    vf_key = {"dual": "vf", "detach": "pi", "shared": "pi"}[arch]  # the released true value head's encoder
    return dict(pi_head="pi_head", aux_value_head="aux_vf_head", value_head=f"{vf_key}_vhead")


def layer_map(agent: nn.Module) -> dict:
    """Our Procgen PPGAgent's layers -> the released PhasicValueModel's layers of the same role."""
    layers = _heads(agent.arch)
    for ours, theirs in _trunks(agent.arch):
        stack, block = -1, 0
        for i, layer in enumerate(getattr(agent, ours).convs):
            if isinstance(layer, nn.Conv2d):  # each stack's first conv; the max-pool has no parameters
                stack, block = stack + 1, 0
                layers[f"{ours}.convs.{i}"] = f"{theirs}.cnn.stacks.{stack}.firstconv"
            elif hasattr(layer, "conv0"):  # a residual block
                for conv in ("conv0", "conv1"):
                    layers[f"{ours}.convs.{i}.{conv}"] = f"{theirs}.cnn.stacks.{stack}.blocks.{block}.{conv}"
                block += 1
        layers[f"{ours}.dense"] = f"{theirs}.cnn.dense"
    return layers


def parameter_map(agent: nn.Module, impala: bool = True) -> dict:
    """Our parameter names -> the released model's: Procgen's agent (impala), or one whose trunks sit in the
    released model as released_model(trunk=...) puts them."""
    if impala:
        return {f"{o}.{p}": f"{t}.{p}" for o, t in layer_map(agent).items() for p in ("weight", "bias")}
    names = {f"{o}.{p}": f"{t}.{p}" for o, t in _heads(agent.arch).items() for p in ("weight", "bias")}
    for ours, theirs in _trunks(agent.arch):
        names.update({f"{ours}.{n}": f"{theirs}.trunk.{n}" for n, _ in getattr(agent, ours).named_parameters()})
    return names


class Float64Names(types.ModuleType):
    """A module's view of torch or numpy in which `float32` names float64 and every other name is the module's own: put
    in place of a module's `th` or `np`, it turns the float32 that module pins into float64 and changes nothing else."""

    def __init__(self, module: types.ModuleType, float64):
        super().__init__(module.__name__)
        self._module, self.float32 = module, float64

    def __getattr__(self, name):
        return getattr(self._module, name)


def released_in_float64(patch) -> None:
    """The released code in float64, with `patch` (a pytest MonkeyPatch): every one of its modules that imports torch
    as `th` sees Float64Names(torch), where it pins float32 (the frames, GAE's masks and advantages, the reward
    normaliser's count and masks, tu.ftensor, np2th's and minibatch_optimize's casts of float64 input). The model is
    built beforehand and converted with .double() (its NormedLinear refuses float64); torch's default dtype, the
    rewards' dtype and the model's are the caller's to set."""
    float64_torch = Float64Names(torch, torch.float64)
    for name, module in list(sys.modules.items()):
        if name.startswith("phasic_policy_gradient.") and getattr(module, "th", None) is torch:
            patch.setattr(module, "th", float64_torch)


def copy_weights(agent: nn.Module, model: nn.Module, names: dict) -> None:
    """The released model takes our agent's weights, every one of its parameters exactly once (strict)."""
    ours = agent.state_dict()
    model.load_state_dict({names[k]: v.clone() for k, v in ours.items()}, strict=True)


class RecordingAdam(torch.optim.Adam):
    """Adam that keeps a copy of every parameter's gradient as each step() finds it: the gradient a loop used,
    however it clears .grad afterwards."""

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        self.grads = []

    def step(self, closure=None):
        params = [p for group in self.param_groups for p in group["params"]]
        self.grads.append({p: p.grad.detach().clone() for p in params if p.grad is not None})
        return super().step(closure)


def relative_error(ours: torch.Tensor, theirs: torch.Tensor, floor: float = 0.0) -> float:
    """max |ours - theirs| / max(max |theirs|, floor): the worst element's error on the tensor's own scale, or on
    `floor` where that is smaller (0 if both are 0)."""
    ours, theirs = ours.double(), theirs.double()
    scale = max(theirs.abs().max().item(), floor)
    diff = (ours - theirs).abs().max().item()
    return diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)
