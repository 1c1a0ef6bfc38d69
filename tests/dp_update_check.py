"""Launched by test_distributed.py as `torchrun --nproc-per-node 2 dp_update_check.py OUT_DIR SCRIPT...`:
for each script, each of the two workers takes half of one batch and runs the script's own update
functions (one policy-phase minibatch, one auxiliary minibatch, with SGD), global_moments and gather;
each writes what it got to OUT_DIR/<script stem>.rank{r}.pt for the test to compare with one process
on the whole batch. One launch serves both scripts: a launch costs two interpreters and torch imports."""

import pathlib
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from conftest import aux_buffers, dp_check_setup, load_script  # noqa: E402

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
for name in sys.argv[2:]:
    script = load_script(name)
    agent, args, batch, obs_buffer, returns_buffer, values = dp_check_setup(script, workers=world)
    rows, states = slice(rank * 2, rank * 2 + 2), slice(rank * 16, rank * 16 + 16)  # this worker's half
    stats = script.policy_phase_update(
        agent,
        torch.optim.SGD(agent.parameters(), lr=0.1),
        {k: v[states] for k, v in batch.items()},
        args,
        script.make_plan(args, world),
    )
    aux = script.auxiliary_phase(
        agent,
        torch.optim.SGD(agent.parameters(), lr=0.1),
        aux_buffers(script, obs_buffer[rows], returns_buffer[rows]),
        args,
    )
    torch.save(
        dict(
            params=[p.detach() for p in agent.parameters()],
            stats=stats,
            aux=aux,
            moments=script.global_moments(values[states]),
            gathered=script.gather([rank, f"worker {rank}"]),
            means=script.mean_over_workers({"clone_kl": [torch.tensor(0.01 + 0.02 * rank)] * 2}),
        ),
        pathlib.Path(sys.argv[1]) / f"{pathlib.Path(name).stem}.rank{rank}.pt",
    )
dist.destroy_process_group()
