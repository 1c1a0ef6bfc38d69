"""The seven experiments that the released code's README reproduces, as ppg_procgen.py runs them. Each is a set of
variants (a name and the flags that make it), the runs of each variant, and the released results folders of the same
runs (phasic_policy_gradient/results/<folder>/progress-<game>.csv). tools/sweep.py --experiment runs one;
tools/report.py --experiment puts it beside the released curves.

The released commands (mpiexec -np 4 python -m phasic_policy_gradient.train ...) and ours:
    PPG                 (no flag)                                   ours: (no flag)
    PPO                 --n_epoch_pi 3 --n_epoch_vf 3 --n_aux_epochs 0 --arch shared
                                                                    ours: --e-pi 3 --e-v 3 --e-aux 0 --arch shared
    E_pi = N            --n_epoch_pi N                              ours: --e-pi N
    E_aux = N           --n_aux_epochs N                            ours: --e-aux N
    N_pi = N            --n_pi N                                    ours: --n-pi N
    L_KL                --clip_param 0 --kl_penalty 1               ours: --clip-coef 0 --kl-penalty 1
    single network      --arch detach                               ours: --arch detach
Every run has the paper's protocol: the 16 games in hard mode, 100M env steps, and the released code's batch in one
process (4 workers x 64 envs: --num-envs 256; 4 workers x 4 aux trajectories: --aux-mb-trajectories 16).

generalization (not the paper's: openai/train-procgen's protocol, which later Procgen papers follow) trains PPG and
the paper's PPO on levels 0 to 199 of easy mode for 25M env steps with 64 envs (train-procgen's one training worker of
64 envs; 4 aux trajectories, as the paper's 16 per 256 envs), while the script's test envs play the full level
distribution (as many as the script's default); tools/report.py reports its train and test returns beside
train-procgen's PPO (tools/scores.py).
"""

PAPER_PROTOCOL = "--distribution-mode hard --num-envs 256 --aux-mb-trajectories 16 --total-timesteps 100000000"
GENERALIZATION_PROTOCOL = (
    "--distribution-mode easy --num-levels 200 --start-level 0 --num-envs 64 --aux-mb-trajectories 4"
    " --total-timesteps 25000000"
)
THREE_SEEDS, ONE_SEED = (1, 2, 3), (1,)  # the released runs: 3 of PPG, PPO, L_KL and single network; 1 of each value


def experiment(
    variants: dict, seeds: tuple, released: dict, protocol: str = PAPER_PROTOCOL, named="the paper's"
) -> dict:
    """variants: name -> flags; released: name -> the released results folders of that variant's runs ({}: none);
    protocol: the flags of every run, which `named` names in messages ("the paper's protocol")."""
    return dict(variants=variants, seeds=seeds, released=released, protocol=protocol, named=named)


# The released seven (tests/test_sweep.py checks them against the released README; tools/report.py reads their
# released runs), then generalization, which has no released runs. A method of your own over the same games and seeds
# needs no entry here: tools/sweep.py --games all --seeds 1 2 3 --method NAME="FLAGS" --methods NAME -- <the flags of
# PAPER_PROTOCOL> (docs/sweeps.md).
EXPERIMENTS = {
    "ppg": experiment({"ppg": ""}, THREE_SEEDS, {"ppg": ["ppg-run0", "ppg-run1", "ppg-run2"]}),
    "ppo": experiment(
        {"ppo": "--arch shared --e-aux 0 --e-pi 3 --e-v 3"}, THREE_SEEDS, {"ppo": ["ppo-run0", "ppo-run1", "ppo-run2"]}
    ),
    "ppgkl": experiment(
        {"ppgkl": "--clip-coef 0 --kl-penalty 1"}, THREE_SEEDS, {"ppgkl": ["ppgkl-run0", "ppgkl-run1", "ppgkl-run2"]}
    ),
    "ppg-single-network": experiment(
        {"ppgsingle": "--arch detach"},
        THREE_SEEDS,
        {"ppgsingle": ["ppgsingle-run0", "ppgsingle-run1", "ppgsingle-run2"]},
    ),
    "e-pi": experiment(
        {f"e-pi-{n}": f"--e-pi {n}" for n in (1, 2, 3, 4, 5, 6)},
        ONE_SEED,
        {f"e-pi-{n}": [f"e-pi-{n}"] for n in (1, 2, 3, 4, 5, 6)},
    ),
    "e-aux": experiment(
        {f"e-aux-{n}": f"--e-aux {n}" for n in (1, 2, 3, 6, 9)},
        ONE_SEED,
        {f"e-aux-{n}": [f"e-aux-{n}"] for n in (1, 2, 3, 6, 9)},
    ),
    "n-pi": experiment(
        {f"n-pi-{n}": f"--n-pi {n}" for n in (2, 4, 8, 16, 32)},
        ONE_SEED,
        {f"n-pi-{n}": [f"n-pi-{n}"] for n in (2, 4, 8, 16, 32)},
    ),
}
EXPERIMENTS["generalization"] = experiment(
    {"ppg": "", "ppo": EXPERIMENTS["ppo"]["variants"]["ppo"]},
    THREE_SEEDS,
    {},
    GENERALIZATION_PROTOCOL,
    "train-procgen's",
)
# The experiments with released runs: the seven of the released README
RELEASED_EXPERIMENTS = {name: exp for name, exp in EXPERIMENTS.items() if exp["released"]}
