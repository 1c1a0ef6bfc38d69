"""How fast a script's networks run, and how close its training loop comes to that speed.

    python tools/benchmark.py ppg_procgen.py                        # the script's defaults (fp32, chunk 256 on a CPU)
    python tools/benchmark.py ppg_procgen.py --precision bf16
    python tools/benchmark.py ppg_atari.py --sweep --no-train       # the chunk-size table of docs/benchmarks.md
    python tools/benchmark.py ppg_procgen.py --file OTHER/ppg_procgen.py --no-raw   # another copy, timed alike

1. raw: forward, and forward+backward (loss = sum of the outputs), of the script's own PPGAgent on random uint8
   states, fed in chunks exactly as training feeds them;
2. train: the script's own main() on a scaled config (the default minibatch shapes with a short phase, see SCALED),
   in this process, timed from outside: the script's collect_rollout, compute_targets, policy_phase_update and
   auxiliary_phase are wrapped to record when they run (on a GPU, after a synchronize), and nothing in the script
   changes. From the first phase (N_pi rollouts and an aux phase): the forward+backward states/s that the policy
   update and the aux epochs achieved over the raw speed of the same chunks (goal >= 0.9), and the whole phase's
   env steps/s. The same wrapping times any copy of the scripts that has those four functions (--file), so two
   commits are compared by one harness.
--sweep first prints raw forward+backward states/s for fp32 and bf16 over several chunk sizes.
"""

import argparse
import importlib.util
import os
import pathlib
import sys
import tempfile
import time
from collections import defaultdict

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))  # the tools' own modules
from helptext import DefaultsHelpFormatter  # noqa: E402

# Per-state cost does not depend on N_pi or the rollout length (every state gets the same passes), so these keep the
# default minibatch shapes and shrink the phase: one phase with an aux phase, then one rollout (the last rollout never
# has an aux phase).
SCALED = {
    "ppg_procgen.py": "--env-id bigfish --num-envs 64 --num-steps 32 --n-pi 2 --num-minibatches 1 "
    "--aux-mb-trajectories 32 --total-timesteps 6144",
    "ppg_atari.py": "--env-id BreakoutNoFrameskip-v4 --n-pi 4 --total-timesteps 5120",
}
TIMED = ("collect_rollout", "compute_targets", "policy_phase_update", "auxiliary_phase")


def load(path: pathlib.Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # tyro reads the help comments through inspect
    spec.loader.exec_module(module)
    return module


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def raw_speed(module, agent, device, chunk: int, states: int = 2048) -> dict:
    """States/s of forward alone and of forward+backward over `states` random states, each timed after an untimed
    pass over the same states (the first pass pays for allocation and kernel setup)."""
    obs = torch.randint(0, 256, (states, *module.OBS_SHAPE), dtype=torch.uint8, device=device)
    chunk = chunk or states
    result = {}
    for name, grad in (("forward", False), ("forward+backward", True)):
        for _ in range(2):  # the second pass is the timed one
            synchronize(device)
            t0 = time.perf_counter()
            for start in range(0, states, chunk):
                with torch.set_grad_enabled(grad):
                    out = agent(obs[start : start + chunk])
                if grad:
                    (out.logits.sum() + out.value.sum() + out.aux_value.sum()).backward()
            synchronize(device)
        result[name] = states / (time.perf_counter() - t0)
    agent.zero_grad(set_to_none=True)
    return result


def timed_first_phase(module, args, device) -> dict:
    """Seconds by part of the first phase of main(args): each TIMED function's calls, and the whole phase (from the
    first rollout's start to the end of the aux phase)."""
    spent, marks, originals = defaultdict(float), [], {name: getattr(module, name) for name in TIMED}
    for name, real in originals.items():

        def timed(*a, real=real, name=name, **k):
            synchronize(device)
            t0 = time.perf_counter()
            result = real(*a, **k)
            synchronize(device)
            if not spent["aux_phases"]:  # the first phase only
                spent[name] += time.perf_counter() - t0
                marks.append((t0, time.perf_counter()))
                spent["aux_phases"] += name == "auxiliary_phase"
                spent["aux_epochs_run"] += len(result) if name == "auxiliary_phase" else 0
            return result

        setattr(module, name, timed)
    try:
        module.main(args, set())
    finally:
        for name, real in originals.items():
            setattr(module, name, real)
    spent["phase"] = marks[-1][1] - marks[0][0]
    return spent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter)
    parser.add_argument("script", choices=sorted(SCALED))
    parser.add_argument("--file", type=pathlib.Path, help="time this copy of the script instead (another commit's)")
    parser.add_argument("--precision", default="fp32", choices=("fp32", "tf32", "bf16"), help="as the script's flag")
    parser.add_argument("--micro-batch-size", type=int, default=None, help="chunk size (default: the script's)")
    parser.add_argument("--arch", default="dual", help="as the script's flag")
    parser.add_argument("--cpu", action="store_true", help="stay on the CPU even if a GPU is visible")
    parser.add_argument("--sweep", action="store_true", help="first, raw speed over precisions and chunk sizes")
    parser.add_argument("--no-raw", action="store_true", help="skip the raw speed at the training chunks")
    parser.add_argument("--raw-states", type=int, default=2048, help="states a raw-speed pass at the training chunks")
    parser.add_argument("--no-train", action="store_true", help="skip the scaled training run")
    parser.add_argument(
        "--set", action="append", default=[], metavar="FLAG=VALUE", help="change a flag of the scaled run: n-pi=2"
    )
    opts = parser.parse_args()
    module = load(opts.file or ROOT / opts.script)
    device = torch.device("cuda" if not opts.cpu and torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"{opts.file or opts.script} arch={opts.arch} on {name} ({torch.backends.cpu.get_cpu_capability()})")

    def agent_for(precision: str):
        torch.manual_seed(0)
        # the TF32 setting the script makes for this precision (TF32 only with tf32)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = precision == "tf32"
        args = module.Args(arch=opts.arch, precision=precision)
        return module.PPGAgent(args, module.OBS_SHAPE, module.NUM_ACTIONS).to(device)

    if opts.sweep:
        print("raw forward+backward states/s (chunk 0 = 2,048 states at once)")
        for precision in ("fp32", "tf32", "bf16") if device.type == "cuda" else ("fp32", "bf16"):
            speeds = [
                f"{c}: {raw_speed(module, agent_for(precision), device, c)['forward+backward']:.0f}"
                for c in (128, 256, 512, 1024, 0)
            ]
            print(f"  {precision}  " + "   ".join(speeds), flush=True)

    scaled = SCALED[opts.script].split()
    for flag, value in (("--" + item.split("=")[0], item.split("=", 1)[1]) for item in opts.set):
        scaled += [flag, value] if flag not in scaled else []
        scaled[scaled.index(flag) + 1] = value
    train_argv = scaled + ["--arch", opts.arch, "--precision", opts.precision] + (["--no-cuda"] if opts.cpu else [])
    train_argv += ["--micro-batch-size", str(opts.micro_batch_size)] if opts.micro_batch_size is not None else []
    import tyro

    args = tyro.cli(module.Args, args=train_argv)
    chunk = args.micro_batch_size if args.micro_batch_size is not None else (0 if device.type == "cuda" else 256)
    batch, aux_states = args.num_envs * args.num_steps, args.aux_mb_trajectories * args.num_steps
    minibatch = batch // args.num_minibatches
    chunks = dict(policy=min(chunk or minibatch, minibatch), aux=min(chunk or aux_states, aux_states))
    raw = {}
    for size in [] if opts.no_raw else sorted(set(chunks.values())):
        raw[size] = raw_speed(module, agent_for(opts.precision), device, size, max(opts.raw_states, size))
        print(
            f"precision {opts.precision}, chunk {size}: raw forward {raw[size]['forward']:.0f} states/s, "
            f"forward+backward {raw[size]['forward+backward']:.0f} states/s",
            flush=True,
        )
    if opts.no_train:
        return

    print("scaled training run: " + " ".join(train_argv), flush=True)
    os.chdir(tempfile.mkdtemp(prefix="ppg-benchmark-"))  # its runs/ folder goes there
    phase = timed_first_phase(module, args, device)
    steps = args.n_pi * batch
    passes = args.e_pi if args.e_pi == args.e_v else args.e_pi + args.e_v
    update = steps * passes / phase["policy_phase_update"]
    aux = phase["aux_epochs_run"] * args.n_pi * batch / phase["auxiliary_phase"]  # the snapshot's forward included
    rollout = phase["collect_rollout"] + phase["compute_targets"]
    print(
        f"first phase {phase['phase']:.2f} s: rollouts {rollout:.2f} s, policy updates "
        f"{phase['policy_phase_update']:.2f} s, aux phase {phase['auxiliary_phase']:.2f} s"
    )
    print(f"forward+backward states/s: policy update {update:.0f}, aux epochs {aux:.0f}")
    if raw:
        print(
            "efficiency (achieved / raw forward+backward at the same chunk): policy update "
            f"{update / raw[chunks['policy']]['forward+backward']:.2f}, "
            f"aux epochs {aux / raw[chunks['aux']]['forward+backward']:.2f}"
        )
    print(
        f"whole-phase env steps/s {steps / phase['phase']:.1f} (policy phase alone {steps / (rollout + phase['policy_phase_update']):.1f})"
    )


if __name__ == "__main__":
    main()
