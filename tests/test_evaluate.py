"""tools/evaluate.py on real files: the shared tiny run of each script (conftest's tiny_run) wrote a checkpoint and
a --save-model file; the tool rebuilds the policy and envs from each and reports whole episodes' returns."""

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest

from conftest import PATIENCE_S, ROOT, SCRIPTS, copy_run


def evaluate(path, *flags: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, str(ROOT / "tools" / "evaluate.py"), str(path), *flags],
        env=env,
        capture_output=True,
        text=True,
        timeout=PATIENCE_S,
    )


def run_tool(monkeypatch, capsys, *argv: str) -> str:
    """tools/evaluate.py's main() in this process with this command line; returns what it printed."""
    spec = importlib.util.spec_from_file_location("evaluate_tool", ROOT / "tools" / "evaluate.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    monkeypatch.setattr(sys, "argv", ["evaluate.py", *argv])
    capsys.readouterr()
    tool.main()
    return capsys.readouterr().out


@pytest.mark.parametrize("name", SCRIPTS)
def test_evaluate_checkpoint_and_saved_model(tmp_path, name, tiny_run, monkeypatch, capsys):
    run_dir = copy_run(tiny_run(name), tmp_path)  # the tool writes its reports beside the file
    saved_model = run_dir / f"{name[:-3]}.pt"
    # the shared Procgen run trained on levels 0..9: a set of those and one of unseen levels; Atari: whole games
    expected = (
        ["training levels 0..9", "full distribution (unseen levels)"] if name == "ppg_procgen.py" else ["whole games"]
    )
    for path in (run_dir / "checkpoint.pt", saved_model):
        video = ["--capture-video"] if path == saved_model else []
        if path == saved_model or name == "ppg_procgen.py":  # in this process; Atari's checkpoint as a user runs it
            out = run_tool(monkeypatch, capsys, str(path), "--episodes", "4", "--cpu", *video)
        else:
            done = evaluate(path, "--episodes", "4", "--cpu", *video)
            assert done.returncode == 0, done.stderr
            out = done.stdout
        lines = [line for line in out.splitlines() if "mean return" in line]
        assert [line.split(":")[0] for line in lines] == expected
        assert all("over 4 episodes" in line for line in lines)
        report = json.loads(path.with_suffix(".eval.json").read_text())
        assert report["script"] == name and report["episodes"] == 4
        assert report["global_step"] == (192 if path.name == "checkpoint.pt" else None)
        assert len(report["sets"]) == len(expected)
        for result in report["sets"].values():
            assert result["n"] == len(result["returns"]) == 4 and math.isfinite(result["mean"])
            assert ("normalised_mean" in result) == (name == "ppg_procgen.py")
    # --capture-video: an mp4 of each of env 0's counted episodes (4 episodes over 4 envs: one a set)
    videos = list(run_dir.glob("videos-eval/*/episode-0.mp4"))
    assert len(videos) == len(expected) and all(v.stat().st_size > 1000 for v in videos)


def test_a_truncated_checkpoint_gets_one_line(tmp_path, tiny_run, monkeypatch, capsys):
    """In this process, as the command line would stop: one line saying so, not a traceback."""
    data = (tiny_run("ppg_atari.py").run_dir / "checkpoint.pt").read_bytes()
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(SystemExit) as stopped:
        run_tool(monkeypatch, capsys, str(truncated))
    line = str(stopped.value.code)
    assert line.startswith("error") and "truncated" in line and "\n" not in line


def test_evaluate_takes_the_tf32_setting_from_the_run(tmp_path, tiny_run, monkeypatch, capsys):
    """The policy is evaluated at the run's --precision, as the scripts set it: TF32 off unless the run asked for it
    (PyTorch's own default runs cuDNN convolutions in TF32)."""
    import torch

    run_dir = copy_run(tiny_run("ppg_atari.py"), tmp_path)
    path = run_dir / "checkpoint.pt"
    for precision in ("tf32", "fp32"):
        state = torch.load(path, weights_only=True)
        torch.save(dict(state, args=dict(state["args"], precision=precision)), path)
        out = run_tool(monkeypatch, capsys, str(path), "--episodes", "1", "--cpu")
        assert torch.backends.cudnn.allow_tf32 == (precision == "tf32") == torch.backends.cuda.matmul.allow_tf32
        assert "on cpu" in out
