"""docs/hacking.md's worked examples: each diff applies to a copy of ppg_procgen.py, the copy trains the tiny
configuration in this process, and the change shows (its new term is logged, or the code it replaces never runs).
The new head, behind its flag, leaves a run without the flag bit-identical to the unpatched script's."""

import importlib.util
import math
import re
import shutil
import subprocess

import pytest
import torch

from conftest import ROOT, TINY_FLAGS, load_script, main_in_process, read_scalars

DIFFS = re.findall(r"```diff\n(.*?)```", (ROOT / "docs" / "hacking.md").read_text(), re.S)


def patched_script(diff: str, tmp_path):
    shutil.copy(ROOT / "ppg_procgen.py", tmp_path / "ppg_procgen.py")
    patch = ["patch", "-p1", "--forward", "--fuzz=0"]  # fuzz 0: a stale context line fails, as with `git apply`
    done = subprocess.run(patch, input=diff, cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr  # the guide's diff no longer applies: update it
    spec = importlib.util.spec_from_file_location("hacked_ppg_procgen", tmp_path / "ppg_procgen.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def final_parameters(script, flags, cwd, monkeypatch) -> dict:
    main_in_process(script, [*flags, "--exp-name", "final"], cwd, monkeypatch)
    (checkpoint,) = cwd.glob("runs/*/checkpoint.pt")  # the weights after the last phase
    return torch.load(checkpoint, weights_only=True)["agent"]


def test_the_guide_has_three_examples_that_apply_and_import(tmp_path):
    assert len(DIFFS) == 3
    for example, diff in enumerate(DIFFS):
        (tmp_path / str(example)).mkdir()
        patched_script(diff, tmp_path / str(example))


# Training the second and third examples is slow (4 s each): the test above applies all three
EXAMPLES = [pytest.param(0, id="aux-target")]
EXAMPLES += [
    pytest.param(i, id=name, marks=pytest.mark.slow) for i, name in ((1, "clone-divergence"), (2, "monte-carlo"))
]


@pytest.mark.parametrize("example", EXAMPLES)
def test_each_example_applies_and_trains(example, tmp_path, monkeypatch):
    script = patched_script(DIFFS[example], tmp_path)
    flags = list(TINY_FLAGS["ppg_procgen.py"])
    flags += [["--reward-coef", "1.0"], ["--clone-divergence", "reverse"], []][example]
    if example == 2:  # GAE must be out of the loop: a call to it fails the run
        monkeypatch.setattr(script, "compute_gae", lambda *a: pytest.fail("compute_gae still called"))
    main_in_process(script, flags, tmp_path, monkeypatch)
    scalars = read_scalars(tmp_path)
    assert all(
        math.isfinite(v) for tag, values in scalars.items() if tag.startswith(("losses/", "aux_phase/")) for v in values
    )
    if example == 0:
        assert "reward_sign" in script.buffer_fields(15) and len(scalars["aux_phase/reward_loss"]) >= 1
    if example == 1:  # the reverse divergence, logged as clone_kl after the aux phase's updates
        assert len(scalars["aux_phase/clone_kl"]) == 1 and scalars["aux_phase/clone_kl"][0] > 0
    if example == 2:
        assert len(scalars["losses/value_loss"]) == 3


def test_the_new_head_without_its_flag_trains_bit_for_bit_as_the_unpatched_script(tmp_path, monkeypatch):
    """A head drawn from the global random stream would shift every later draw and change every seeded run: the
    guide's head is built only with its flag, so the patched script without the flag ends on the same parameters."""
    for folder in ("patched", "a", "b"):
        (tmp_path / folder).mkdir()
    patched = patched_script(DIFFS[0], tmp_path / "patched")
    flags = [*TINY_FLAGS["ppg_procgen.py"], "--precision", "fp32"]
    ours = final_parameters(load_script("ppg_procgen.py"), flags, tmp_path / "a", monkeypatch)
    theirs = final_parameters(patched, flags, tmp_path / "b", monkeypatch)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
