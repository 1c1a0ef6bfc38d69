"""tools/evaluate.py on real files: a tiny run of each script, as a user starts it, writes a checkpoint and a
--save-model file; the tool rebuilds the policy and envs from each and reports whole episodes' returns."""

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

from conftest import ROOT, SCRIPTS, TINY_FLAGS, run_script


def evaluate(path, *flags: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, str(ROOT / "tools" / "evaluate.py"), str(path), *flags],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("name", SCRIPTS)
def test_evaluate_checkpoint_and_saved_model(tmp_path, name):
    trained = run_script(name, *TINY_FLAGS[name], "--save-model", cwd=tmp_path)
    assert trained.returncode == 0, trained.stderr
    (run_dir,) = (tmp_path / "runs").iterdir()
    saved_model = run_dir / f"{pathlib.Path(name).stem}.pt"

    for path in (run_dir / "checkpoint.pt", saved_model):
        video = ["--capture-video"] if path == saved_model else []
        done = evaluate(path, "--episodes", "4", "--cpu", *video)
        assert done.returncode == 0, done.stderr
        # dodgeball's tiny run trains on all levels (--num-levels 0): one evaluation set; Atari: whole games
        (line,) = [line for line in done.stdout.splitlines() if "mean return" in line]
        assert line.startswith("training distribution = all levels" if name == "ppg_procgen.py" else "whole games")
        assert "over 4 episodes" in line
        report = json.loads(path.with_suffix(".eval.json").read_text())
        assert report["script"] == name and report["episodes"] == 4
        assert report["global_step"] == (192 if path.name == "checkpoint.pt" else None)
        (result,) = report["sets"].values()
        assert result["n"] == len(result["returns"]) == 4 and math.isfinite(result["mean"])
        assert ("normalised_mean" in result) == (name == "ppg_procgen.py")
    # --capture-video: an mp4 of each of env 0's counted episodes (4 episodes over 4 envs: one)
    (video,) = run_dir.glob("videos-eval/*/episode-0.mp4")
    assert video.stat().st_size > 1000

    # a truncated checkpoint: one line saying so, not a traceback
    data = (run_dir / "checkpoint.pt").read_bytes()
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(data[: len(data) // 2])
    done = evaluate(truncated)
    assert done.returncode != 0
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("error") and "truncated" in line and "Traceback" not in done.stderr
