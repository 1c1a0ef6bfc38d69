"""--track: the run logged to Weights & Biases, offline (WANDB_MODE=offline, no network, no key), read back from
the run file W&B writes. W&B patches TensorBoard for the whole process, so the runs are subprocesses."""

import fcntl
import glob
import json
import os
import pathlib
import shutil
import struct
import subprocess
import sys
import types

import pytest
import torch

from conftest import PATIENCE_S, ROOT, SCRIPTS, TINY_FLAGS, load_script, main_in_process

SCRIPT = "ppg_atari.py"  # the other script's three flags and their code are the same lines (test_tracking_flags)


def wandb_records(path: str) -> list:
    """The protobuf records of a W&B run file (.wandb): a 7-byte header, then 32 KiB blocks of records, each a
    7-byte header (crc, length, type: 1 whole, 2 first, 3 middle, 4 last part) and its bytes."""
    from wandb.proto import wandb_internal_pb2

    data, records, part, pos = open(path, "rb").read(), [], b"", 7
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        part, pos = part + data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(part)
            records.append(record)
            part = b""
    return records


def tracked_run(cwd, *flags):
    env = dict(os.environ, WANDB_MODE="offline", WANDB_DIR=str(cwd), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    argv = [sys.executable, str(ROOT / SCRIPT), *flags, "--track", "--wandb-project-name", "ppg-test"]
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=PATIENCE_S)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def read_offline_run(folder) -> dict:
    (path,) = glob.glob(f"{folder}/run-*.wandb")
    runs, history = [], []
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            runs.append(record.run)
        elif kind == "history":
            history.append(
                {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            )
    (run,) = runs
    return dict(run=run, config={u.key: json.loads(u.value_json) for u in run.config.update}, history=history)


@pytest.mark.slow  # 17 s of offline W&B; --track is opt-in, and the tests below check its flags and its start
def test_track_logs_every_tensorboard_scalar_offline_and_resume_continues_the_same_wandb_run(tmp_path, monkeypatch):
    tracked_run(tmp_path, *TINY_FLAGS[SCRIPT])
    (first,) = glob.glob(f"{tmp_path}/wandb/offline-run-*")
    logged = read_offline_run(first)
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert logged["run"].display_name == run_dir.name and logged["run"].project == "ppg-test"
    config = logged["config"]
    assert config["env_id"] == "BreakoutNoFrameskip-v4" and config["num_steps"] == 32 and config["track"] is True
    tags = {key for row in logged["history"] for key in row}
    for tag in (
        "charts/episodic_return",
        "charts/SPS",
        "losses/policy_loss",
        "losses/value_loss",
        "aux_phase/clone_kl",
    ):
        assert tag in tags, tag  # each namespace the TensorBoard logger writes reaches W&B
    # every row carries its TensorBoard step: env steps (the one aux phase's at 128)
    assert [row["global_step"] for row in logged["history"] if "aux_phase/clone_kl" in row] == [128]
    assert max(row["global_step"] for row in logged["history"]) == 192

    # --resume (one more rollout, in this process, W&B a recording stand-in): the checkpoint keeps the W&B id and
    # hands it back to wandb.init, which continues that run (this test's earlier form resumed a real offline W&B run
    # and read the same id back; that second W&B start cost the suite 12 s)
    calls, fake = [], types.SimpleNamespace(run=None, save=lambda *args, **kwargs: None)
    (tmp_path / "files").mkdir()

    def init(**kwargs):  # as wandb.init: the run, also wandb.run
        calls.append(kwargs)
        fake.run = types.SimpleNamespace(id=kwargs["id"], dir=str(tmp_path / "files"))
        return fake.run

    fake.init = init
    monkeypatch.setitem(sys.modules, "wandb", fake)
    script = load_script(SCRIPT)
    main_in_process(script, ["--resume", str(run_dir), "--total-timesteps", "256"], tmp_path, monkeypatch)
    (resumed,) = calls
    assert (resumed["id"], resumed["resume"], resumed["sync_tensorboard"]) == (logged["run"].run_id, "allow", True)
    assert resumed["name"] == run_dir.name and resumed["config"]["total_timesteps"] == 256
    assert torch.load(run_dir / "checkpoint.pt", weights_only=True)["global_step"] == 256

    for fd in os.listdir("/proc/self/fd"):  # the run's lock, as the end of the process that trained it drops it
        if os.path.realpath(f"/proc/self/fd/{fd}") == str(run_dir / "lock"):
            os.close(int(fd))
    # a stretch resumed with --no-track (W&B never imported: an import would fail) keeps the id for a later --track
    monkeypatch.setitem(sys.modules, "wandb", None)
    flags = ["--resume", str(run_dir), "--total-timesteps", "320", "--no-track"]  # --no-track given, so kept
    main_in_process(script, flags, tmp_path, monkeypatch)
    state = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    assert state["global_step"] == 320 and not state["args"]["track"] and state["wandb_id"] == logged["run"].run_id


def stop(script, flags, cwd, monkeypatch) -> str:
    """What --track stops with, in one line, leaving no run folder (the empty runs/ may stay)."""
    with pytest.raises(SystemExit) as stopped:
        main_in_process(script, flags, cwd, monkeypatch)
    assert not list(cwd.glob("runs/*")), list(cwd.glob("runs/*"))
    message = str(stopped.value.code)
    assert message.startswith("error: ") and "\n" not in message, message
    return message


@pytest.mark.parametrize("name", SCRIPTS)
def test_tracking_flags_and_track_without_wandb_stops_in_one_line(name, tmp_path, monkeypatch):
    """Without wandb installed, or when W&B refuses to start (no login), --track stops in one line that names the fix
    for that case, before any env, buffer or log exists."""
    script = load_script(name)
    args = script.Args()
    assert (args.track, args.wandb_project_name, args.wandb_entity) == (False, "ppg", None)
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError, as where it is not installed
    message = stop(script, [*TINY_FLAGS[name], "--track"], tmp_path, monkeypatch)
    assert message.startswith("error: --track: ModuleNotFoundError") and "(pip install wandb; " in message
    monkeypatch.setitem(
        sys.modules, "wandb", types.SimpleNamespace(init=lambda **k: (_ for _ in ()).throw(ValueError("no API key")))
    )
    message = stop(script, [*TINY_FLAGS[name], "--track"], tmp_path, monkeypatch)
    # installed but not started: the error says why (no login here)
    assert message.startswith("error: --track: ValueError('no API key')") and "wandb login" in message


def test_track_starts_wandb_only_after_the_run_folder_is_claimed(tmp_path, monkeypatch):
    """A start refused because another process holds its run folder (a run with the same name began the same second,
    here this test) leaves no W&B run behind: wandb.init comes after the folder's lock is taken."""
    script = load_script(SCRIPT)
    monkeypatch.setattr(script, "time", types.SimpleNamespace(time=lambda: 1_000_000.0))
    run_dir = tmp_path / "runs" / "BreakoutNoFrameskip-v4__ppg_atari__1__1000000"
    run_dir.mkdir(parents=True)
    calls = []
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=lambda **kwargs: calls.append(kwargs)))
    with open(run_dir / "lock", "w") as held, pytest.raises(SystemExit) as stopped:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        main_in_process(script, [*TINY_FLAGS[SCRIPT], "--track"], tmp_path, monkeypatch)
    assert str(stopped.value.code).startswith(f"error: runs/{run_dir.name} is being trained") and calls == []
    assert [p.name for p in run_dir.iterdir()] == ["lock"]


def test_track_copies_the_script_into_the_wandb_run_and_saves_it(tmp_path, monkeypatch):
    """--track copies the file that trains (a hacked copy's own) into the W&B run's folder and saves that copy at once,
    not a link to a file that may change later (with W&B itself: the slow test below)."""
    script = load_script(SCRIPT)
    files, saved = tmp_path / "wandb-files", []
    files.mkdir()
    fake = types.SimpleNamespace(
        init=lambda **kwargs: types.SimpleNamespace(id="abc"),
        run=types.SimpleNamespace(dir=str(files)),
        save=lambda path, base_path, policy: saved.append((path, base_path, policy)),
    )
    monkeypatch.setitem(sys.modules, "wandb", fake)
    main_in_process(script, [*TINY_FLAGS[SCRIPT], "--track"], tmp_path, monkeypatch)
    kept = files / SCRIPT
    assert kept.read_bytes() == (ROOT / SCRIPT).read_bytes() and not kept.is_symlink()
    assert saved == [(str(kept), str(files), "now")]


@pytest.mark.slow  # 14 s of offline W&B: the test above checks the copy and the save call with a stand-in
def test_track_keeps_the_script_that_ran_with_the_wandb_run(tmp_path):
    """--track keeps the file that trained (here a copy under another name, as a hack is kept) with the W&B run: a copy
    of it among the offline run's files, as it was when the run started, and a files record that uploads it at once."""
    copy = tmp_path / "ppg_procgen_vlam.py"
    shutil.copy(ROOT / "ppg_procgen.py", copy)
    env = dict(os.environ, WANDB_MODE="offline", WANDB_DIR=str(tmp_path), OMP_NUM_THREADS="1")
    flags = ["--env-id", "dodgeball", "--num-envs", "2", "--num-steps", "16", "--n-pi", "1", "--total-timesteps", "32"]
    argv = [sys.executable, str(copy), *flags, "--e-aux", "0", "--num-minibatches", "1", "--track"]
    done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=PATIENCE_S)
    assert done.returncode == 0, done.stderr[-3000:]
    (run,) = glob.glob(f"{tmp_path}/wandb/offline-run-*")
    kept = pathlib.Path(run, "files", copy.name)
    assert not kept.is_symlink() and kept.read_bytes() == copy.read_bytes()
    (path,) = glob.glob(f"{run}/run-*.wandb")
    files = [f.path for r in wandb_records(path) if r.WhichOneof("record_type") == "files" for f in r.files.files]
    assert copy.name in files, files
