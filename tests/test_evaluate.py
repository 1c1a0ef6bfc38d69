"""tools/evaluate.py on real files: the shared tiny run of each script (conftest's tiny_run) wrote a checkpoint, and
an older version's --save-model file is made from it; the tool rebuilds the policy and envs from each and reports
whole episodes' returns."""

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest
import torch

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


def run_tool(monkeypatch, capsys, *argv: str, levels=None) -> str:
    """tools/evaluate.py's main() in this process with this command line; returns what it printed. With a list as
    `levels`, each Procgen env set it builds appends (its num_levels and start_level, the level seeds it played), read
    from Procgen's own info at each step."""
    spec = importlib.util.spec_from_file_location("evaluate_tool", ROOT / "tools" / "evaluate.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    if levels is not None:
        load_script = tool.load_script

        def load_recording(name):
            module = load_script(name)

            class RecordingEnv(module.ProcgenVecEnv):
                def __init__(self, *a, **k):
                    super().__init__(*a, **k)
                    played, step = set(), self.env.step
                    levels.append(((k["num_levels"], k["start_level"]), played))

                    def recorded_step(actions):
                        result = step(actions)
                        played.update(info[key] for info in result[3] for key in ("prev_level_seed", "level_seed"))
                        return result

                    self.env.step = recorded_step

            module.ProcgenVecEnv = RecordingEnv
            return module

        monkeypatch.setattr(tool, "load_script", load_recording)
    monkeypatch.setattr(sys, "argv", ["evaluate.py", *argv])
    capsys.readouterr()
    tool.main()
    return capsys.readouterr().out


@pytest.mark.parametrize("name", SCRIPTS)
def test_evaluate_checkpoint_and_saved_model(tmp_path, name, tiny_run, monkeypatch, capsys):
    run_dir = copy_run(tiny_run(name), tmp_path)  # the tool writes its reports beside the file
    # an older version's --save-model file: the weights and the flags (--save-model among them), no step
    state = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    saved_model, args = run_dir / f"{name[:-3]}.pt", dict(state["args"], save_model=True)
    torch.save(dict(script=name, run_name=state["run_name"], args=args, agent=state["agent"]), saved_model)
    # the shared Procgen run trained on levels 0..9: a set of those and one of unseen levels; Atari: whole games
    expected = (
        ["training levels 0..9", "full distribution (unseen levels)"] if name == "ppg_procgen.py" else ["whole games"]
    )
    for path in (run_dir / "checkpoint.pt", saved_model):
        video = ["--capture-video"] if path == saved_model else []
        if path == saved_model or name == "ppg_procgen.py":  # in this process; Atari's checkpoint as a user runs it
            levels = [] if name == "ppg_procgen.py" else None
            out = run_tool(monkeypatch, capsys, str(path), "--episodes", "4", "--cpu", *video, levels=levels)
            if levels is not None:  # what each set really played, by Procgen's level seeds
                (training, played_training), (unseen, played_unseen) = levels
                assert training == (10, 0) and played_training <= set(range(10)) and len(played_training) >= 4
                assert unseen == (0, 0) and len(played_unseen) >= 4  # the full distribution: random 31-bit levels
                assert min(played_unseen) >= 10_000 and max(played_unseen) >= 2**20, played_unseen
        else:
            done = evaluate(path, "--episodes", "4", "--cpu", *video)
            assert done.returncode == 0, done.stderr
            out = done.stdout
        lines = [line for line in out.splitlines() if "mean return" in line]
        assert [line.split(":")[0] for line in lines] == expected
        assert all("over 4 episodes" in line for line in lines)
        step = "step192-" if path.name == "checkpoint.pt" else ""  # a checkpoint's step; a model file has none
        report = json.loads((run_dir / f"{path.stem}.eval-{step}4ep-seed0.json").read_text())
        assert report["script"] == name and report["episodes"] == 4
        assert report["global_step"] == (192 if path.name == "checkpoint.pt" else None)
        assert len(report["sets"]) == len(expected)
        for result in report["sets"].values():
            assert result["n"] == len(result["returns"]) == 4 and math.isfinite(result["mean"])
            assert ("normalised_mean" in result) == (name == "ppg_procgen.py")
    # --capture-video: an mp4 of each of env 0's counted episodes (4 episodes over 4 envs: one a set)
    videos = list(run_dir.glob(f"{saved_model.stem}.videos-4ep-seed0/*/episode-0.mp4"))
    assert len(videos) == len(expected) and all(v.stat().st_size > 1000 for v in videos)


def test_an_evaluation_never_replaces_another(tmp_path, tiny_run, monkeypatch, capsys):
    """Each report is named by what it depends on: other --episodes or --seed write another file beside it; the same
    file at the same step and settings is refused in one line, before any env is built, and the report stays."""
    path = copy_run(tiny_run("ppg_atari.py"), tmp_path) / "checkpoint.pt"
    run_tool(monkeypatch, capsys, str(path), "--episodes", "2", "--cpu")
    first = path.parent / "checkpoint.eval-step192-2ep-seed0.json"
    before = first.read_bytes()
    out = run_tool(monkeypatch, capsys, str(path), "--episodes", "1", "--cpu")
    assert "written to " + str(path.parent / "checkpoint.eval-step192-1ep-seed0.json") in out
    with pytest.raises(SystemExit) as stopped:
        run_tool(monkeypatch, capsys, str(path), "--episodes", "2", "--cpu", "--capture-video")
    line = str(stopped.value.code)
    assert line == (
        f"error: {first} exists: evaluated before at this --episodes and --seed (remove it to evaluate again)"
    )
    assert first.read_bytes() == before and not list(path.parent.glob("*.videos-*"))


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
    for seed, precision in enumerate(("tf32", "fp32")):  # a seed each: an evaluation never replaces another
        state = torch.load(path, weights_only=True)
        torch.save(dict(state, args=dict(state["args"], precision=precision)), path)
        out = run_tool(monkeypatch, capsys, str(path), "--episodes", "1", "--cpu", "--seed", str(seed))
        assert torch.backends.cudnn.allow_tf32 == (precision == "tf32") == torch.backends.cuda.matmul.allow_tf32
        assert "on cpu" in out
