"""Where the authors' released code (openai/phasic-policy-gradient) is on this machine, and the one command that puts
it there: tools/report.py's released columns and the tests' comparisons (tests/released_shims.py) look it up here."""

import os
import pathlib
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[1]
ENV_VAR = "PPG_RELEASED_CODE"
# The released commit every comparison was measured against, and the one command that puts it beside the checkout
COMMIT = "7295473f0185c82f9eb9c1e17a373135edd8aacc"
CLONE_COMMAND = (
    "git clone https://github.com/openai/phasic-policy-gradient ../phasic-policy-gradient"
    f" && git -C ../phasic-policy-gradient checkout {COMMIT[:7]}"
)
# Where to look when $PPG_RELEASED_CODE is unset: a clone beside the checkout (CLONE_COMMAND's), then the
# read-only copy that CI uses (.ci/run)
BESIDE = [ROOT.parent / "phasic-policy-gradient", ROOT.parent / "shared" / "reference" / "phasic-policy-gradient"]


def _holds_released_code(path: pathlib.Path) -> bool:
    return (path / "phasic_policy_gradient" / "ppg.py").is_file()


def released_root():
    """(folder of the released repository or None, why not)."""
    given = os.environ.get(ENV_VAR)
    if given:
        path = pathlib.Path(given)
        if _holds_released_code(path):
            return path, ""
        return None, f"{ENV_VAR}={given} holds no phasic_policy_gradient/ppg.py"
    for path in BESIDE:
        if _holds_released_code(path):
            return path, ""
    return None, (
        f"the authors' released code is not beside the checkout (../phasic-policy-gradient) and {ENV_VAR} is unset"
    )


def released_commit(path: pathlib.Path):
    """The commit of a git clone of the released code, or None where the folder is not the top of a clone (a plain
    copy, such as CI's, whose SNAPSHOT.md names its commit; a copy inside another repository is no clone of it)."""
    command = ["git", "-C", str(path), "rev-parse", "--show-toplevel", "HEAD"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = done.stdout.split()
    if done.returncode != 0 or len(lines) != 2 or pathlib.Path(lines[0]).resolve() != path.resolve():
        return None
    return lines[1]
