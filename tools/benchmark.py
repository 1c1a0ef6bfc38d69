"""How fast a script's networks run, and how close its training loop comes to that speed.

    python tools/benchmark.py ppg_procgen.py                        # the script's defaults (fp32, chunk 256 on a CPU)
    python tools/benchmark.py ppg_procgen.py --precision bf16
    python tools/benchmark.py ppg_atari.py --sweep --no-train       # the chunk-size table of docs/benchmarks.md

1. raw: forward, and forward+backward (loss = sum of the outputs), of the script's own PPGAgent on
   random uint8 states, fed in chunks exactly as training feeds them;
2. train: the script's own main() on a scaled config (the default minibatch shapes with a short
   phase, see SCALED); from the seconds main() returns for its first phase, the loop's efficiency:
   the forward+backward states/s that the policy update and the aux epochs achieved, divided by the
   raw speed of the same chunks (goal >= 0.9), and the whole-phase env steps/s.
--sweep first prints raw forward+backward states/s for fp32 and bf16 over several chunk sizes.

Under `torchrun --standalone --nproc-per-node K tools/benchmark.py ...` the scaled run is data parallel:
K workers with the same per-worker shapes (so K times the env steps), and rank 0 prints, adding the
seconds the phase spent averaging gradients. One thread a worker is torchrun's default; compare with
`OMP_NUM_THREADS=1 python tools/benchmark.py ...` for one worker.
"""

import argparse
import importlib.util
import os
import pathlib
import sys
import tempfile
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Per-state cost does not depend on N_pi or the rollout length (every state gets the same passes),
# so these keep the default minibatch shapes and shrink the phase: one phase with an aux phase, then
# one rollout (the last rollout never has an aux phase).
SCALED = {
    "ppg_procgen.py": [
        "--env-id",
        "bigfish",
        "--num-envs",
        "64",
        "--num-steps",
        "32",
        "--n-pi",
        "2",
        "--num-minibatches",
        "1",
        "--aux-mb-trajectories",
        "32",
        "--total-timesteps",
        "6144",
    ],
    "ppg_atari.py": ["--env-id", "BreakoutNoFrameskip-v4", "--n-pi", "4", "--total-timesteps", "5120"],
}


def load(script: str):
    spec = importlib.util.spec_from_file_location(pathlib.Path(script).stem, ROOT / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def raw_speed(module, agent, device, chunk: int, states: int = 2048) -> dict:
    """States/s of forward alone and of forward+backward over `states` random states, each timed
    after an untimed pass over the same states (the first pass pays for allocation and kernel setup)."""
    obs = torch.randint(0, 256, (states, *module.OBS_SHAPE), dtype=torch.uint8, device=device)
    chunk = chunk or states
    result = {}
    for name, grad in (("forward", False), ("forward+backward", True)):
        for _ in range(2):  # the second pass is the timed one
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for start in range(0, states, chunk):
                with torch.set_grad_enabled(grad):
                    out = agent(obs[start : start + chunk])
                if grad:
                    (out.logits.sum() + out.value.sum() + out.aux_value.sum()).backward()
            if device.type == "cuda":
                torch.cuda.synchronize()
        result[name] = states / (time.perf_counter() - t0)
    agent.zero_grad(set_to_none=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("script", choices=sorted(SCALED))
    parser.add_argument("--precision", default="fp32", choices=("fp32", "tf32", "bf16"), help="as the script's flag")
    parser.add_argument("--micro-batch-size", type=int, default=None, help="chunk size (default: the script's)")
    parser.add_argument("--arch", default="dual")
    parser.add_argument("--cpu", action="store_true", help="stay on the CPU even if a GPU is visible")
    parser.add_argument("--sweep", action="store_true", help="first, raw speed over precisions and chunk sizes")
    parser.add_argument("--no-train", action="store_true", help="skip the scaled training run")
    parser.add_argument(
        "--set", action="append", default=[], metavar="FLAG=VALUE", help="change a flag of the scaled run: n-pi=2"
    )
    opts = parser.parse_args()
    workers = int(os.environ.get("WORLD_SIZE", 1))
    if int(os.environ.get("RANK", 0)):
        sys.stdout = open(os.devnull, "w")  # under torchrun, rank 0 alone prints
    module = load(opts.script)

    def agent_for(args):
        torch.manual_seed(0)
        return module.PPGAgent(args.arch, module.OBS_SHAPE, module.NUM_ACTIONS, bf16=args.precision == "bf16").to(
            device
        )

    flags = dict(arch=opts.arch, precision=opts.precision, micro_batch_size=opts.micro_batch_size, cuda=not opts.cpu)
    args = module.Args(**flags)
    device = module.pick_device(args)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"{opts.script} arch={args.arch} on {name}")
    if opts.sweep:
        print("raw forward+backward states/s (chunk 0 = 2,048 states at once)")
        for precision in ("fp32", "tf32", "bf16") if device.type == "cuda" else ("fp32", "bf16"):
            speeds = []
            for chunk in (128, 256, 512, 1024, 0):
                sweep_args = module.Args(**dict(flags, precision=precision))
                module.pick_device(sweep_args)  # this precision's TF32 setting
                speeds.append(
                    f"{chunk}: {raw_speed(module, agent_for(sweep_args), device, chunk)['forward+backward']:.0f}"
                )
            print(f"  {precision}  " + "   ".join(speeds), flush=True)
        module.pick_device(args)  # back to the measured precision's TF32 setting (the sweep ends on bf16's)

    scaled = list(SCALED[opts.script])  # --total-timesteps counts every worker's steps: K times as many
    for flag, value in (("--" + item.split("=")[0], item.split("=", 1)[1]) for item in opts.set):
        scaled += [flag, value] if flag not in scaled else []
        scaled[scaled.index(flag) + 1] = value
    scaled[scaled.index("--total-timesteps") + 1] = str(int(scaled[scaled.index("--total-timesteps") + 1]) * workers)
    train_argv = scaled + ["--arch", args.arch, "--precision", args.precision] + (["--no-cuda"] if opts.cpu else [])
    train_argv += ["--micro-batch-size", str(args.micro_batch_size)] if args.micro_batch_size is not None else []
    import tyro

    train_args = tyro.cli(module.Args, args=train_argv)
    plan, chunk = module.make_plan(train_args, workers), module.micro_batch(train_args, device)
    # Raw speed at the chunks training runs: the PPO minibatch's and the aux minibatch's (whole minibatches differ)
    aux_states = train_args.aux_mb_trajectories * train_args.num_steps
    chunks = dict(
        policy=min(chunk or plan.minibatch_size, plan.minibatch_size), aux=min(chunk or aux_states, aux_states)
    )
    raw = {size: raw_speed(module, agent_for(args), device, size) for size in sorted(set(chunks.values()))}
    for size, speed in raw.items():
        print(
            f"precision {args.precision}, chunk {size}: raw forward {speed['forward']:.0f} states/s, "
            f"forward+backward {speed['forward+backward']:.0f} states/s",
            flush=True,
        )
    if opts.no_train:
        return

    print("scaled training run: " + " ".join(train_argv), flush=True)
    os.chdir(tempfile.mkdtemp(prefix="ppg-benchmark-"))  # its runs/ folder goes there
    sys.argv = [opts.script, *train_argv]
    args = train_args
    phase = module.main(args)[0]  # the phase that has an aux phase: seconds by part
    steps = args.n_pi * args.num_envs * args.num_steps  # of one worker
    update = steps * plan.update_epochs / phase["policy_update"]
    aux = phase["aux_epochs_run"] * plan.aux_slots * plan.batch_size / phase["aux_epochs"]
    print(f"forward+backward states/s of one worker: policy update {update:.0f}, aux epochs {aux:.0f}")
    print(
        "efficiency (achieved / raw forward+backward at the same chunk): policy update "
        f"{update / raw[chunks['policy']]['forward+backward']:.2f}, aux epochs {aux / raw[chunks['aux']]['forward+backward']:.2f}"
    )
    policy_phase = steps * workers / (phase["rollout"] + phase["policy_update"])
    print(
        f"whole-phase env steps/s {steps * workers / phase['phase_s']:.1f} (policy phase alone {policy_phase:.1f})"
        + (
            f", {workers} workers; gradient all-reduce {phase['grad_allreduce']:.1f}s of the phase"
            if workers > 1
            else ""
        )
    )


if __name__ == "__main__":
    main()
