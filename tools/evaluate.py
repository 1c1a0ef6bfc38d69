"""Evaluate a saved policy: mean raw return +- standard error over whole episodes, written to a JSON file.

    python tools/evaluate.py runs/{run_name}/checkpoint.pt --episodes 100 [--capture-video] [--seed 0] [--cpu]

Takes a checkpoint (or an older version's --save-model file) of ppg_procgen.py, ppg_atari.py or a copy of either under
another name, and rebuilds that script's network and envs from the run's saved flags (a flag added since the file was
written takes its default, and one line says so; a flag retired since, at the value it is fixed at, is dropped). A copy
is looked for in the folder its run was started from (the one holding runs/<run_name>/), then here, then in the
repository root; --script PATH names it where it is elsewhere.
Actions are sampled from the policy, as in training (not its most likely action). Each of
min(episodes, 64) envs plays a fixed share of the episodes, its first ones: taking whichever
episodes end first would favour short ones. Returns are raw game scores; on Atari, whole games.
Procgen: the run's training levels, then the full level distribution (unseen levels); a run on all
levels (--num-levels 0) has one set; returns are also given as Procgen-normalised scores (tools/scores.py).
Env seeds differ from training's: the run's --seed + 2^30 + --seed here, wrapped below 2^31 as the scripts wrap seeds,
which a run's phase k (trained on its --seed + 100,003 k) would reach only after about 10,000 phases. Writes the
returns beside the file, named by what they depend on, so that no evaluation replaces another:
<stem>.eval-step<N>-<episodes>ep-seed<seed>.json (a checkpoint; a --save-model file has no step), and the videos to
<stem>.videos-<the same>/. The same file, step and settings again are refused: remove that file first.
"""

import argparse
import dataclasses
import json
import math
import os
import pathlib
import sys

import numpy as np
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from checkpoints import SCRIPTS, base_script, drop_retired, find_script, load_script  # noqa: E402
from helptext import DefaultsHelpFormatter  # noqa: E402
from scores import normalised_score  # noqa: E402


def read_file(path: str) -> dict:
    """The checkpoint or model file, or exit with one line saying why it cannot be read."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        sys.exit(f"error: {path}: no such file")
    except Exception as e:  # truncated, or not a torch file at all
        sys.exit(f"error: {path}: not a readable checkpoint, perhaps truncated ({type(e).__name__})")
    script = state.get("script") if isinstance(state, dict) else None
    if script is None or base_script(state) is None:
        sys.exit(f"error: {path}: written by {script or 'something else'}, not by {' or '.join(SCRIPTS)} or a copy")
    missing = {"run_name", "args", "agent"} - state.keys()
    if missing:
        sys.exit(f"error: {path}: not a whole checkpoint of {script}, it lacks {', '.join(sorted(missing))}")
    return state


def run_args(module, state: dict, path: str):
    """The run's flags as this version of the script has them: a flag added since takes its default (said in one
    line); a flag this version lacks stops with one line."""
    fields = [f.name for f in dataclasses.fields(module.Args)]
    state["args"].pop("save_model", None)  # a flag of older versions: checkpoint.pt holds the weights
    if other := drop_retired(module, state["args"]):
        sys.exit(f"error: {path}: written with {other[0]}, a flag {module.SCRIPT} has fixed at another value")
    if unknown := sorted(set(state["args"]) - set(fields)):
        sys.exit(f"error: {path}: written by a version of {module.SCRIPT} with flags this one lacks: {unknown}")
    for name in (name for name in fields if name not in state["args"]):
        print(f"{path}: written before --{name.replace('_', '-')}: its default taken")
    return module.Args(**{k: v for k, v in state["args"].items()})


def write_video(path: str, frames: list) -> None:
    """An mp4 of uint8 frames, RGB (Procgen) or grayscale (Atari), through imageio-ffmpeg (gym3 installs it)."""
    import imageio_ffmpeg

    os.makedirs(os.path.dirname(path), exist_ok=True)
    gray = frames[0].ndim == 2
    writer = imageio_ffmpeg.write_frames(
        path, frames[0].shape[1::-1], fps=15, pix_fmt_in="gray" if gray else "rgb24", macro_block_size=4 if gray else 16
    )
    writer.send(None)  # start the ffmpeg process
    for frame in frames:
        writer.send(np.ascontiguousarray(frame))
    writer.close()


@torch.no_grad()
def play(agent, envs, episodes: int, device, video_dir=None) -> list:
    """Raw returns of env i's first quota[i] episodes, with quotas summing to `episodes`; with
    video_dir, an mp4 of each of env 0's counted episodes (Atari: the newest frame of each stack)."""
    quota = [episodes // envs.num_envs + (i < episodes % envs.num_envs) for i in range(envs.num_envs)]
    returns, obs = [[] for _ in quota], envs.reset()
    frames = []
    while any(len(r) < q for r, q in zip(returns, quota)):
        if video_dir:
            frames.append(obs[0] if obs.shape[-1] == 3 else obs[0, :, :, -1])
        logits = agent(torch.from_numpy(obs).to(device), value=False).logits  # the policy network alone
        obs, _, _, finished = envs.step(
            torch.distributions.Categorical(logits=logits, validate_args=False).sample().cpu().numpy()
        )
        for i, ep_return, _ in finished:
            if len(returns[i]) < quota[i]:
                returns[i].append(ep_return)
                if i == 0 and video_dir:  # the frame returned with the episode's end already starts the next one
                    write_video(os.path.join(video_dir, f"episode-{len(returns[0]) - 1}.mp4"), frames)
            if i == 0:
                frames = []
    envs.env.close()
    return [r for env_returns in returns for r in env_returns]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter)
    parser.add_argument("checkpoint", help="runs/{run_name}/checkpoint.pt (or its folder) or an old --save-model file")
    parser.add_argument("--episodes", type=int, default=100, help="episodes (Atari: whole games) per evaluation set")
    parser.add_argument("--seed", type=int, default=0, help="offset of the env seeds, and seed of the action sampling")
    parser.add_argument("--capture-video", action="store_true", help="save videos of env 0 beside the report")
    parser.add_argument("--cpu", action="store_true", help="stay on the CPU even if a GPU is visible")
    parser.add_argument("--script", metavar="PATH", help="the file of the script (a copy) that wrote the checkpoint")
    opts = parser.parse_args()
    if opts.episodes < 1:
        parser.error("--episodes must be at least 1")
    if not 0 <= opts.seed < 2**31:
        parser.error("--seed must lie in [0, 2^31) (the envs take 31-bit seeds)")

    path = os.path.join(opts.checkpoint, "checkpoint.pt") if os.path.isdir(opts.checkpoint) else opts.checkpoint
    state = read_file(path)
    # the report's name: what its returns depend on (a checkpoint is rewritten each phase: its step tells them apart)
    folder, stem = os.path.split(os.path.splitext(path)[0])
    settings = f"{opts.episodes}ep-seed{opts.seed}"
    if "global_step" in state:
        settings = f"step{state['global_step']}-{settings}"
    out = os.path.join(folder, f"{stem}.eval-{settings}.json")
    videos = os.path.join(folder, f"{stem}.videos-{settings}")
    if os.path.exists(out):
        sys.exit(f"error: {out} exists: evaluated before at this --episodes and --seed (remove it to evaluate again)")
    script = find_script(state["script"], path, opts.script)
    if script is None:
        where = f"at {opts.script}" if opts.script else "beside its run, here or in the repository root"
        sys.exit(f"error: {path}: written by {state['script']}, not found {where}: give its file with --script PATH")
    module = load_script(script)
    args = run_args(module, state, path)
    # The device and TF32 setting as the script chooses them (TF32 only with --precision tf32)
    device = torch.device("cuda" if not opts.cpu and torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = args.precision == "tf32"
    num_actions = state["agent"]["pi_head.weight"].shape[0]  # the game's own action set, as trained
    agent = module.PPGAgent(args, module.OBS_SHAPE, num_actions)
    agent.load_state_dict(state["agent"])
    agent.to(device).eval()
    torch.manual_seed(opts.seed)

    n = min(opts.episodes, 64)
    seed = (args.seed + 2**30 + opts.seed) % (2**31 - n)  # wrapped below 2^31 - n, as the scripts wrap seeds
    procgen = base_script(state) == "ppg_procgen.py"  # a copy's envs are its original's
    env_class = module.ProcgenVecEnv if procgen else module.AtariVecEnv
    sets = {"games": ("whole games", {})}  # name: (description, the env class's level arguments)
    if procgen and args.num_levels == 0:
        sets = {"all_levels": ("training distribution = all levels", dict(num_levels=0, start_level=0))}
    elif procgen:
        sets = {
            "training_levels": (
                f"training levels {args.start_level}..{args.start_level + args.num_levels - 1}",
                dict(num_levels=args.num_levels, start_level=args.start_level),
            ),
            "unseen_levels": ("full distribution (unseen levels)", dict(num_levels=0, start_level=0)),
        }

    print(
        f"{module.SCRIPT} {args.env_id}, run {state['run_name']}"
        + (f", step {state['global_step']:,}" if "global_step" in state else "")
        + f", on {device}"
    )
    report = dict(
        script=module.SCRIPT,
        base_script=base_script(state),
        env_id=args.env_id,
        checkpoint=path,
        run_name=state["run_name"],
        global_step=state.get("global_step"),
        episodes=opts.episodes,
        seed=opts.seed,
        sets={},
    )
    for name, (description, levels) in sets.items():
        video = os.path.join(videos, name) if opts.capture_video else None
        returns = play(agent, env_class(args, n, seed=seed, **levels), opts.episodes, device, video)
        mean = float(np.mean(returns))
        stderr = float(np.std(returns, ddof=1) / math.sqrt(len(returns))) if len(returns) > 1 else None
        result = dict(description=description, n=len(returns), mean=mean, stderr=stderr)
        line = f"{description}: mean return {mean:.2f} +- {'n/a' if stderr is None else f'{stderr:.2f}'} (stderr)"
        if procgen:
            scores = [normalised_score(args.env_id, args.distribution_mode, r) for r in returns]
            result["normalised_mean"] = float(np.mean(scores))
            line += f", normalised {result['normalised_mean']:.3f}"
        print(f"{line} over {len(returns)} episodes", flush=True)
        report["sets"][name] = dict(result, returns=returns)

    text = json.dumps(report, indent=1)  # made whole first: a Ctrl-C here cannot leave half a report behind
    with open(out, "x") as f:  # "x": never over an earlier report, even one written since the check above
        f.write(text)
    print(f"written to {out}" + (f"; videos in {videos}" if opts.capture_video else ""))


if __name__ == "__main__":
    main()
