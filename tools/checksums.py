"""Checksums of the final parameters of tiny runs: the check that a refactor changed no arithmetic.

    python tools/checksums.py                 # every config, one thread each; prints `name sha256[:16]`
    python tools/checksums.py pA aC           # some of them

Run it before and after a change on the same machine: every line must be identical. Each config is a tiny run
(2 envs x 32 steps, 3 rollouts, one aux phase), run as a user runs it; the checksum is of the agent's state dict in
its checkpoint.pt (the weights after the last phase), tensors in key order. The configs cover each arch, E_V > E_pi,
gradient clipping, several minibatches, the KL guard firing, 2-trajectory aux minibatches, training levels, the reward
normaliser, bf16 (pE), and tf32 (pT: on a CPU equal to pA).
"""

import argparse
import hashlib
import os
import pathlib
import subprocess
import sys
import tempfile

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))  # the tools' own modules
from helptext import DefaultsHelpFormatter  # noqa: E402

TINY = "--num-envs 2 --num-steps 32 --n-pi 2 --total-timesteps 192 --num-minibatches 1 --aux-mb-trajectories 4"
TINY += " --e-aux 2 --micro-batch-size 8 --exp-name checksum"
PROCGEN, ATARI = "ppg_procgen.py --env-id dodgeball", "ppg_atari.py --max-episode-frames 100"
CONFIGS = {
    "pA": f"{PROCGEN} --num-levels 10",
    "pB": f"{PROCGEN} --arch detach --e-v 2 --max-grad-norm 0.5 --num-minibatches 2",
    "pC": f"{PROCGEN} --arch shared --e-aux 0 --e-pi 4 --e-v 4",
    "pD": f"{PROCGEN} --aux-kl-stop 1e-9 --aux-mb-trajectories 2 --seed 7",
    "pE": f"{PROCGEN} --precision bf16",
    "pF": f"{PROCGEN} --e-v 2 --num-minibatches 2",  # dual with E_pi != E_V: each network's epochs apart
    "pT": f"{PROCGEN} --num-levels 10 --precision tf32",  # on a CPU: pA's arithmetic (no TF32 there)
    "aA": f"{ATARI} --num-minibatches 2",
    "aB": f"{ATARI} --arch detach --norm-reward --aux-kl-stop 1e-9",
    "aC": f"{ATARI} --arch shared --e-aux 0 --e-pi 4 --e-v 4 --max-grad-norm 0.5",
    "aF": f"{ATARI} --e-pi 2",  # dual with E_pi != E_V
}


def checksum(name: str) -> str:
    words = CONFIGS[name].split()
    # The later flag wins in tyro, so a config's own values override TINY's.
    argv = [sys.executable, str(ROOT / words[0]), *TINY.split(), *words[1:]]
    with tempfile.TemporaryDirectory() as cwd:
        env = dict(os.environ, OMP_NUM_THREADS="1")
        done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True)
        if done.returncode:
            return f"failed: {done.stderr.strip().splitlines()[-1:]}"
        (checkpoint,) = pathlib.Path(cwd).glob("runs/*/checkpoint.pt")
        agent = torch.load(checkpoint, weights_only=True)["agent"]
    digest = hashlib.sha256()
    for key in sorted(agent):
        digest.update(key.encode())
        digest.update(agent[key].contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter)
    parser.add_argument("configs", nargs="*", default=list(CONFIGS), help="which configs")
    opts = parser.parse_args()
    if unknown := [name for name in opts.configs if name not in CONFIGS]:
        parser.error(f"unknown configs {unknown}; known: {' '.join(CONFIGS)}")
    for name in opts.configs:
        print(name, checksum(name), flush=True)
