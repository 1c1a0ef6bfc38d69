"""The test command's line about the comparisons with the released code (conftest.py's pytest_terminal_summary): it
says how many ran and passed, or, when they skipped, why and the one command that enables them."""

import os
import subprocess
import sys

import pytest

import released
import released_shims as rs
from conftest import PATIENCE_S, ROOT

ONE_FAST_COMPARISON = ["tests/test_released_code.py", "-k", "test_forward and dual"]


def suite_lines(*argv: str, **env) -> list:
    """The output lines of `python -m pytest -q argv...` from the repository root, with env over this environment."""
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *argv]
    done = subprocess.run(
        command, cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=PATIENCE_S
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout.splitlines()


def test_summary_says_how_many_comparisons_passed():
    root, why = rs.released_root()
    if root is None:
        pytest.skip(why)
    lines = suite_lines(*ONE_FAST_COMPARISON)
    (line,) = [line for line in lines if line.startswith("released code:")]
    assert line.startswith("released code: 1 of 1 comparisons passed (test_released_code.py, test_whole_run.py;")
    assert lines[-1].startswith("1 passed"), lines[-3:]  # the line comes just before pytest's own last line


def test_summary_says_why_the_comparisons_skipped_and_how_to_run_them(tmp_path):
    lines = suite_lines(*ONE_FAST_COMPARISON, PPG_RELEASED_CODE=str(tmp_path))
    (line,) = [line for line in lines if line.startswith("released code:")]
    assert line.startswith(f"released code: all 1 comparisons skipped: PPG_RELEASED_CODE={tmp_path} holds no ")
    assert line.endswith(rs.CLONE_COMMAND)
    assert rs.COMMIT.startswith("7295473") and rs.CLONE_COMMAND.endswith("checkout 7295473")


def test_no_summary_line_without_the_comparisons():
    lines = suite_lines("tests/test_citation.py")
    assert not [line for line in lines if line.startswith("released code:")]


def test_released_code_is_found_where_the_clone_command_puts_it(tmp_path, monkeypatch):
    # The command clones into ../phasic-policy-gradient from the repository root: the first folder looked at
    assert (ROOT / rs.CLONE_COMMAND.split()[3]).resolve() == rs.BESIDE[0].resolve()
    clone = tmp_path / "phasic-policy-gradient"
    (clone / "phasic_policy_gradient").mkdir(parents=True)
    (clone / "phasic_policy_gradient" / "ppg.py").write_text("")
    monkeypatch.delenv(rs.ENV_VAR, raising=False)
    monkeypatch.setattr(released, "BESIDE", [clone, tmp_path / "absent"])
    assert rs.released_root() == (clone, "")
    monkeypatch.setattr(released, "BESIDE", [tmp_path / "absent", clone])  # CI's copy, second, is found as well
    assert rs.released_root() == (clone, "")
    monkeypatch.setattr(released, "BESIDE", [tmp_path / "absent"])
    assert rs.released_root()[0] is None
    monkeypatch.setenv(rs.ENV_VAR, str(clone))  # $PPG_RELEASED_CODE comes first
    assert rs.released_root() == (clone, "")
