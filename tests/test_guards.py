"""What stops a user's run from going wrong quietly: one live process a run (a second is refused in one line); --resume
of a finished run, or of a run stopped before its first checkpoint, says so and writes nothing; L_KL's flags are
refused in one line where they make no sense; a run's aux phases reach TensorBoard on the env-step axis; and the memory check counts the update's activations beside B, choosing a
GPU's chunk size from the free memory."""

import fcntl
import pathlib

import pytest

from conftest import SCRIPTS, TINY_FLAGS, copy_run, load_script, main_in_process, refusal


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_run_folder_held_by_a_live_process_is_refused_in_one_line(name, tiny_run, tmp_path, monkeypatch):
    """One live process a run: while another holds a run's lock (here this test, as process 4242), a new run of the
    same name (started the same second) and a --resume of it each stop in one line naming that process, and write
    nothing. The lock is the kernel's (flock), so it ends with its process, however it ends (tests/test_checkpoint.py
    resumes a run killed by SIGKILL)."""
    script = load_script(name)
    monkeypatch.setattr(script.time, "time", lambda: 1_000_000.0)  # both runs start in the same second
    env_id = TINY_FLAGS[name][TINY_FLAGS[name].index("--env-id") + 1]
    first = tmp_path / "runs" / f"{env_id}__twin__1__1000000"
    first.mkdir(parents=True)
    (first / "checkpoint.pt").write_bytes((tiny_run(name).run_dir / "checkpoint.pt").read_bytes())
    new_run = [*TINY_FLAGS[name], "--exp-name", "twin"]
    resume = ["--resume", str(first), "--total-timesteps", "256"]
    with open(first / "lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.write("4242")
        held.flush()
        for flags, folder in ((new_run, first.relative_to(tmp_path)), (resume, first)):
            with pytest.raises(SystemExit) as stopped:
                main_in_process(script, flags, tmp_path, monkeypatch)
            assert str(stopped.value.code) == f"error: {folder} is being trained by process 4242"
    assert sorted(p.name for p in first.iterdir()) == ["checkpoint.pt", "lock"]  # no log, no new checkpoint


@pytest.mark.parametrize("name", SCRIPTS)
def test_resume_of_a_finished_run_does_nothing_and_writes_nothing(name, tiny_run, tmp_path, monkeypatch, capsys):
    run_dir = copy_run(tiny_run(name), tmp_path)
    before = sorted((p.name, p.stat().st_mtime_ns) for p in run_dir.iterdir())
    main_in_process(load_script(name), ["--resume", str(run_dir)], tmp_path, monkeypatch)
    out = capsys.readouterr().out
    assert "is trained to step 192: nothing to do" in out and "phases:" not in out  # no plan printed
    assert sorted((p.name, p.stat().st_mtime_ns) for p in run_dir.iterdir()) == before  # no new event file


@pytest.mark.parametrize("name", SCRIPTS)
def test_resume_of_a_run_without_a_checkpoint_says_to_start_again(name, tmp_path, monkeypatch):
    folder = tmp_path / "stopped"
    folder.mkdir()
    (folder / "events.out.tfevents.1.vm.1.0").write_bytes(b"")  # a run stopped in its first phase leaves only this
    message = refusal(load_script(name), ["--resume", str(folder)], tmp_path, monkeypatch)
    assert message == f"error: --resume {folder}: no checkpoint (stopped before its first phase ended)"


@pytest.mark.parametrize("name", SCRIPTS)
def test_lkl_flags_are_checked(name, tmp_path, monkeypatch):
    script = load_script(name)
    assert "--kl-penalty 1" in refusal(script, ["--clip-coef", "0"], tmp_path, monkeypatch)
    assert (
        refusal(script, ["--kl-penalty", "-1"], tmp_path, monkeypatch)
        == "error: --kl-penalty must be a finite number >= 0 (got -1.0)"
    )
    assert (
        refusal(script, ["--clip-coef", "-0.1"], tmp_path, monkeypatch)
        == "error: --clip-coef must be a finite number >= 0 (got -0.1)"
    )
    script.make_plan(script.Args(clip_coef=0.0, kl_penalty=1.0))  # L_KL, the paper's
    script.make_plan(script.Args(clip_coef=0.2, kl_penalty=1.0))  # both, as the released code allows


@pytest.mark.parametrize("name", SCRIPTS)
def test_the_aux_phase_on_env_steps(name, tiny_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tiny_run(name)
    # the one aux phase (after rollout 2 of 2 envs x 32 steps): its last epoch's statistics at env step 128
    for tag in ("aux_phase/aux_value_loss", "aux_phase/clone_kl", "aux_phase/value_loss"):
        assert len(run.scalars[tag]) == 1, tag
    steps = EventAccumulator(str(run.run_dir), size_guidance={"scalars": 0})
    steps.Reload()
    assert [e.step for e in steps.Scalars("aux_phase/clone_kl")] == [128]


GIB = 2**30


def test_the_memory_check_counts_activations_and_fits_a_gpus_chunk():
    """At the paper's batch (256 envs x 256 steps, N_pi 32, aux minibatches of 16 trajectories) B holds 26.0 GB; a
    state's activations in a dual update are 2 x 1.525 MB (ACTIVATION_BYTES, both trunks), so whole 8,192-state
    minibatches need 25 GB more: 80 GB fits them, 40 GB takes chunks of 4,096, 27 GB of 256, 25 GB stops the run."""
    script = load_script("ppg_procgen.py")
    args = script.Args(num_envs=256, aux_mb_trajectories=16, distribution_mode="hard")
    rows = (32 * 256, 256)
    per_state = 2 * script.ACTIVATION_BYTES
    chunk, b, activations = script.memory_plan(args, rows, 80e9, on_gpu=True)
    assert (chunk, round(b / 1e9, 1), activations) == (0, 26.0, 8192 * per_state)  # whole minibatches
    assert script.memory_plan(args, rows, 40e9, on_gpu=True)[:1] == (4096,)
    assert script.memory_plan(args, rows, 27e9, on_gpu=True)[:1] == (256,)
    assert script.memory_plan(args, rows, 80e9, on_gpu=False)[:1] == (256,)  # a CPU: 256, the fastest measured
    # one network's update (`shared`) halves a state's activations: 40 GB then fits 8,192 states whole
    assert script.memory_plan(script.Args(**{**vars(args), "arch": "shared"}), rows, 40e9, on_gpu=True)[:1] == (0,)
    with pytest.raises(SystemExit, match=r"^error: B 24\.2 GiB.*over 23\.3 GiB free: lower --n-pi"):
        script.memory_plan(args, rows, 25e9, on_gpu=True)
    # a chunk the user chose is checked, not replaced
    with pytest.raises(SystemExit, match="chunks of 8192 states"):
        script.memory_plan(script.Args(**{**vars(args), "micro_batch_size": 0}), rows, 40e9, on_gpu=True)


@pytest.mark.parametrize("name", SCRIPTS)
def test_the_memory_check_refuses_before_any_env_or_buffer(name, tmp_path, monkeypatch):
    script = load_script(name)
    monkeypatch.setattr(script, "ACTIVATION_BYTES", 10**15)  # no chunk fits any machine
    message = refusal(script, TINY_FLAGS[name], tmp_path, monkeypatch)
    assert "GiB free: lower --n-pi, --num-envs or --micro-batch-size" in message
    assert not pathlib.Path(tmp_path, "runs").exists()
